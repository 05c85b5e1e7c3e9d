//! Compiles `src/bpf/rm_watch.bpf.c` with clang and generates its libbpf-rs skeleton
//! (`$OUT_DIR/rm_watch.skel.rs`), included by `src/skel.rs`.

use std::{env, path::PathBuf};

use libbpf_cargo::SkeletonBuilder;

const SRC: &str = "src/bpf/rm_watch.bpf.c";

fn main() {
    let out =
        PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("rm_watch.skel.rs");
    // Debian keeps asm/types.h (needed by linux/types.h) in the multiarch include directory.
    let arch = match env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86_64",
        Ok("aarch64") => "aarch64",
        Ok(other) => panic!("valve-ebpf: no multiarch include directory known for {other}"),
        Err(e) => panic!("valve-ebpf: CARGO_CFG_TARGET_ARCH: {e}"),
    };
    let multiarch = format!("-I/usr/include/{arch}-linux-gnu");
    if let Err(e) = SkeletonBuilder::new()
        .source(SRC)
        .clang_args([multiarch.as_str(), "-Wall", "-Werror"])
        .build_and_generate(&out)
    {
        panic!(
            "valve-ebpf: building the BPF program failed: {e:#}\n\
             needs clang (>= 14), linux-libc-dev and libelf-dev/zlib1g-dev: see ebpf/DEPENDENCIES.txt"
        );
    }
    println!("cargo:rerun-if-changed={SRC}");
}
