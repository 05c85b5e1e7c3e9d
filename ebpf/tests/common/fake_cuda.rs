//! A library exporting libcuda's launch and wait symbols, compiled by the test with `cc`, and
//! the calls into it: real uprobes attach to it as to libcuda. Shared by the BPF and gate tests.
// Each test that includes it uses a part.
#![allow(dead_code)]

use std::path::PathBuf;

const FAKE_LIBCUDA: &str = r#"
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned smem, void *stream, void **params, void **extra)
{ (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)smem;
  (void)stream; (void)params; (void)extra; return 0; }
int cuGraphLaunch(void *exec, void *stream) { (void)exec; (void)stream; return 0; }
/* The "stream" is the number of microseconds to wait, as if for GPU work. */
int usleep(unsigned);
int cuStreamSynchronize(void *stream) { if (stream) usleep((unsigned)(unsigned long)stream); return 0; }
"#;

pub type Launch = unsafe extern "C" fn(
    *mut u8,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    u32,
    *mut u8,
    *mut *mut u8,
    *mut *mut u8,
) -> i32;
pub type GraphLaunch = unsafe extern "C" fn(*mut u8, *mut u8) -> i32;
pub type Sync = unsafe extern "C" fn(usize) -> i32;

pub struct FakeCuda {
    pub path: PathBuf,
    pub launch: Launch,
    pub graph: GraphLaunch,
    pub sync: Sync,
    _dir: tempfile::TempDir,
}

pub fn fake_cuda() -> FakeCuda {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("fake.c");
    std::fs::write(&src, FAKE_LIBCUDA).unwrap();
    let path = dir.path().join("libfakecuda.so");
    let ok = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-O0", "-o"])
        .arg(&path)
        .arg(&src)
        .status()
        .expect("cc runs");
    assert!(ok.success());
    let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
    // SAFETY: dlopen/dlsym on a library built just above; the symbols have the C signatures the
    // function pointer types declare.
    unsafe {
        let h = libc::dlopen(c.as_ptr(), libc::RTLD_NOW);
        assert!(!h.is_null());
        let launch = libc::dlsym(h, c"cuLaunchKernel".as_ptr());
        let graph = libc::dlsym(h, c"cuGraphLaunch".as_ptr());
        let sync = libc::dlsym(h, c"cuStreamSynchronize".as_ptr());
        assert!(!launch.is_null() && !graph.is_null() && !sync.is_null());
        FakeCuda {
            path,
            launch: std::mem::transmute::<*mut libc::c_void, Launch>(launch),
            graph: std::mem::transmute::<*mut libc::c_void, GraphLaunch>(graph),
            sync: std::mem::transmute::<*mut libc::c_void, Sync>(sync),
            _dir: dir,
        }
    }
}

pub fn call(f: &FakeCuda, kernels: u32, graphs: u32) {
    let null = std::ptr::null_mut();
    for _ in 0..kernels {
        // SAFETY: the fake ignores its arguments.
        unsafe {
            (f.launch)(
                null,
                1,
                1,
                1,
                32,
                1,
                1,
                0,
                null,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            )
        };
    }
    for _ in 0..graphs {
        // SAFETY: as above.
        unsafe { (f.graph)(null, null) };
    }
}
