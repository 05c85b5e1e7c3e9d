//! Compiles the BPF programs in `src/bpf/` with clang and generates their libbpf-rs skeletons
//! (`$OUT_DIR/<name>.skel.rs`), included by `src/skel.rs` and `src/launch.rs`.

use std::{env, path::PathBuf};

use libbpf_cargo::SkeletonBuilder;

const PROGRAMS: [&str; 3] = ["rm_watch", "launch_watch", "arrival_watch"];

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    // Debian keeps asm/types.h (needed by linux/types.h) in the multiarch include directory.
    let arch = match env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86_64",
        Ok("aarch64") => "aarch64",
        Ok(other) => panic!("valve-ebpf: no multiarch include directory known for {other}"),
        Err(e) => panic!("valve-ebpf: CARGO_CFG_TARGET_ARCH: {e}"),
    };
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    for name in PROGRAMS {
        let src = format!("src/bpf/{name}.bpf.c");
        if let Err(e) = SkeletonBuilder::new()
            .source(&src)
            .clang_args([multiarch.as_str(), "-Wall", "-Werror"])
            .build_and_generate(out_dir.join(format!("{name}.skel.rs")))
        {
            panic!(
                "valve-ebpf: building {src} failed: {e:#}\n\
                 needs clang (>= 14), linux-libc-dev and libelf-dev/zlib1g-dev: see ebpf/DEPENDENCIES.txt"
            );
        }
        println!("cargo:rerun-if-changed={src}");
    }
}
