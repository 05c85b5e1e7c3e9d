//! SYNTHETIC source trees in the shapes of the 525-595 branches, written here (the real files are
//! NVIDIA's and are never copied into this repository), and helpers to run the tools on them.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

pub const GEN: &str = "src/nvidia/generated/g_subdevice_nvoc.c";

/// Flag bit layouts: 525-550 and 560+ (values as in those branches' control.h).
pub const OLD_BITS: &[(&str, u64)] = &[
    ("NON_PRIVILEGED", 0x10),
    ("GPU_LOCK_DEVICE_ONLY", 0x40),
    ("ROUTE_TO_PHYSICAL", 0x200),
    ("API_LOCK_READONLY", 0x800),
];
pub const NEW_BITS: &[(&str, u64)] = &[
    ("NON_PRIVILEGED", 0x8),
    ("GPU_LOCK_DEVICE_ONLY", 0x10),
    ("ROUTE_TO_PHYSICAL", 0x40),
    ("API_LOCK_READONLY", 0x100),
    ("GSP_PLUGIN_FOR_VGPU_GSP", 0x10000),
];

pub const MACRO: &str = "#define NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG(x)      (0)\n";

/// The `valve-driver-patch` binary cargo built for these tests.
pub fn tool() -> &'static str {
    env!("CARGO_BIN_EXE_valve-driver-patch")
}

/// The repository root.
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("driver-patch/ is in the repository")
        .to_path_buf()
}

pub fn write(path: impl AsRef<Path>, data: impl AsRef<[u8]>) {
    let path = path.as_ref();
    if let Some(dir) = path.parent() {
        fs::create_dir_all(dir).unwrap();
    }
    fs::write(path, data).unwrap();
}

pub fn read(path: impl AsRef<Path>) -> String {
    fs::read_to_string(path).unwrap()
}

pub fn control_h(bits: &[(&str, u64)]) -> String {
    let mut lines = vec![
        "// synthetic control.h for tests".to_string(),
        "#define RMCTRL_FLAGS_NONE                 0x000000000".to_string(),
    ];
    lines.extend(
        bits.iter()
            .map(|(k, v)| format!("#define RMCTRL_FLAGS_{k:<28} 0x{v:09x}")),
    );
    lines.join("\n") + "\n"
}

pub fn entry(index: u32, method_id: u64, flags: u64, func: &str, amp: &str) -> String {
    format!(
        "    {{               /*  [{index}] */
#if NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG({flags:#x}u)
        /*pFunc=*/      (void (*)(void)) NULL,
#else
        /*pFunc=*/      (void (*)(void)) {amp}{func}_IMPL,
#endif // NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG({flags:#x}u)
        /*flags=*/      {flags:#x}u,
        /*accessRight=*/0x0u,
        /*methodId=*/   {method_id:#x}u,
        /*paramSize=*/  sizeof(SYNTHETIC_PARAMS),
        /*pClassInfo=*/ &(__nvoc_class_def_Subdevice.classInfo),
#if NV_PRINTF_STRINGS_ALLOWED
        /*func=*/       \"{func}\"
#endif
    }},
"
    )
}

/// The generated table: the entry between decoys (neighbouring ids, a longer id), and the id in a
/// comment and a similar number outside the table.
pub fn generated(flags: u64, amp: &str, extra: &[String], macro_line: &str) -> String {
    let mut body = format!("// synthetic generated table\n{macro_line}");
    body += "static const struct NVOC_EXPORTED_METHOD_DEF table[] = {\n";
    body += &entry(211, 0x2080110A, 0x10, "subdeviceCtrlCmdDecoyA", amp);
    body += &entry(
        212,
        0x2080110B,
        flags,
        "subdeviceCtrlCmdFifoDisableChannels",
        amp,
    );
    body += &entry(213, 0x20801B0B, 0x10, "subdeviceCtrlCmdDecoyB", amp);
    body += &entry(
        214,
        0x2080110B0,
        0x810,
        "subdeviceCtrlCmdDecoyLongerId",
        amp,
    );
    for e in extra {
        body += e;
    }
    body += "};\n\n// decoys outside the table: a comment naming the id, and a similar id\n";
    body += "    // subdeviceCtrlCmdFifoDisableChannels -- exported (id=0x2080110b)\n";
    body += &format!("#if !NVOC_EXPORTED_METHOD_DISABLED_BY_FLAG({flags:#x}u)\n#endif\n");
    body += "static const unsigned similar = 0x2080110bau; /*methodId=*/ /* 0x2080110b0u */\n";
    body
}

/// How to write a synthetic tree; `Tree::new(version, bits, flags)` then adjust.
pub struct Tree<'a> {
    pub version: &'a str,
    pub bits: &'a [(&'a str, u64)],
    pub flags: u64,
    pub amp: &'a str,
    pub extra: Vec<String>,
    pub control: bool,
    pub macro_line: &'a str,
}

impl<'a> Tree<'a> {
    pub fn new(version: &'a str, bits: &'a [(&'a str, u64)], flags: u64) -> Self {
        Tree {
            version,
            bits,
            flags,
            amp: "",
            extra: Vec::new(),
            control: true,
            macro_line: MACRO,
        }
    }

    pub fn amp(mut self) -> Self {
        self.amp = "&";
        self
    }

    pub fn write(&self, root: &Path) -> PathBuf {
        fs::create_dir_all(root.join("src/nvidia/generated")).unwrap();
        fs::create_dir_all(root.join("src/nvidia/inc/kernel/rmapi")).unwrap();
        write(
            root.join("version.mk"),
            format!("NVIDIA_VERSION = {}\n", self.version),
        );
        if self.control {
            write(
                root.join("src/nvidia/inc/kernel/rmapi/control.h"),
                control_h(self.bits),
            );
        }
        write(
            root.join(GEN),
            generated(self.flags, self.amp, &self.extra, self.macro_line),
        );
        root.to_path_buf()
    }
}

pub fn gen_text(root: &Path) -> String {
    read(root.join(GEN))
}

/// Exit code and stdout + stderr of a command.
pub fn output(cmd: &mut Command) -> (i32, String) {
    let out = cmd.output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    (out.status.code().unwrap_or(-1), text)
}

/// `scripts/patch-driver.sh ARGS` (the interface the docs and CI use), on this test's binary.
pub fn run(args: &[&str]) -> (i32, String) {
    output(
        Command::new("bash")
            .arg(repo().join("scripts/patch-driver.sh"))
            .args(args)
            .env("VALVE_DRIVER_PATCH", tool()),
    )
}

/// `run` with a path argument.
pub fn run_src(root: &Path, args: &[&str]) -> (i32, String) {
    let mut all = vec!["--src", root.to_str().unwrap()];
    all.extend_from_slice(args);
    run(&all)
}
