//! What one process's launch probes cost to attach and remove: a library exporting libcuda's
//! launch and wait symbols (and `--dummies` other functions, for a symbol table of libcuda's
//! size) is compiled here, `--procs` processes map it and sleep, and a filtered launch watcher
//! probes them one by one. Prints the watcher's start and each attach and detach, in ms.
//!
//!   sudo cargo run --release -p valve-ebpf --example attach-cost -- [--procs 4] [--dummies 3000]
//!   sudo cargo run --release -p valve-ebpf --example attach-cost -- --library /usr/lib/x86_64-linux-gnu/libcuda.so.1
//!
//! With `--library` the given library is probed instead (children map it with dlopen; a real
//! libcuda is fine: nothing is called in it).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use valve_ebpf::launch::{LAUNCH_SYMBOLS, SYNC_SYMBOLS};
use valve_ebpf::{LaunchConfig, LaunchWatcher};

const HOLDER: &str = r#"
#include <dlfcn.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
  if (argc < 2 || !dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) { fprintf(stderr, "dlopen: %s\n", dlerror()); return 1; }
  puts("mapped"); fflush(stdout);
  pause();
  return 0;
}
"#;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn cc(dir: &Path, name: &str, src: &str, extra: &[&str]) -> anyhow::Result<PathBuf> {
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, src)?;
    let out = dir.join(name);
    let ok = Command::new("cc")
        .args(extra)
        .arg("-o")
        .arg(&out)
        .arg(&c)
        .arg("-ldl")
        .status()?;
    anyhow::ensure!(ok.success(), "cc failed for {name}");
    Ok(out)
}

/// C source exporting every probed symbol and `dummies` more.
fn fake_source(dummies: usize) -> String {
    let mut s = String::new();
    let names = LAUNCH_SYMBOLS.iter().map(|(n, _)| *n).chain(SYNC_SYMBOLS);
    for n in names {
        let _ = writeln!(s, "int {n}(void) {{ return 0; }}");
    }
    for i in 0..dummies {
        let _ = writeln!(s, "int cuValveDummy{i}(void) {{ return {i}; }}");
    }
    s
}

fn ms(d: Duration) -> String {
    format!("{:.1}", d.as_secs_f64() * 1e3)
}

fn main() -> anyhow::Result<()> {
    // libbpf's reasons (an unresolved symbol, what the kernel refused) show with RUST_LOG=info.
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().collect();
    let procs: usize = arg(&args, "--procs").map_or(Ok(4), |v| v.parse())?;
    anyhow::ensure!(
        procs >= 2,
        "--procs must be at least 2 (the last one answers for the detaches)"
    );
    let dummies: usize = arg(&args, "--dummies").map_or(Ok(3000), |v| v.parse())?;
    let dir = tempfile::tempdir()?;
    let library = match arg(&args, "--library") {
        Some(p) => PathBuf::from(p),
        None => cc(
            dir.path(),
            "libfakecuda.so",
            &fake_source(dummies),
            &["-shared", "-fPIC", "-O0"],
        )?,
    };
    let holder = cc(dir.path(), "holder", HOLDER, &[])?;
    let mut children: Vec<Child> = Vec::new();
    for _ in 0..procs {
        let mut c = Command::new(&holder)
            .arg(&library)
            .stdout(Stdio::piped())
            .spawn()?;
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(c.stdout.take().unwrap()),
            &mut line,
        )?;
        anyhow::ensure!(
            line.trim() == "mapped",
            "a holder did not map {}",
            library.display()
        );
        children.push(c);
    }
    let result = measure(&library, &children);
    for c in &mut children {
        let _ = c.kill();
        let _ = c.wait();
    }
    result
}

fn measure(library: &Path, children: &[Child]) -> anyhow::Result<()> {
    println!(
        "library {} ({} processes map it)",
        library.display(),
        children.len()
    );
    let t = Instant::now();
    let w = LaunchWatcher::start(LaunchConfig {
        library: library.to_path_buf(),
        pids: Vec::new(),
        filter: true,
        edge_gap: Duration::from_millis(5),
        track_waits: true,
        realtime: None,
        poll_period: valve_ebpf::REQUEST_POLL,
    })?;
    println!(
        "watcher start (symbols resolved on this process, {} probed, uprobe.multi links: {}): {} ms",
        w.attached().len(),
        w.multi_links(),
        ms(t.elapsed())
    );
    for c in children {
        let t = Instant::now();
        w.watch_acked(c.id())?
            .recv_timeout(Duration::from_secs(120))?
            .map_err(anyhow::Error::msg)?;
        println!("attach pid {}: {} ms", c.id(), ms(t.elapsed()));
    }
    // A detach has no answer of its own: the poll thread applies requests in order, so a watch of
    // a process still probed (which registers nothing) answers once the detach before it is done.
    let (last, rest) = children.split_last().expect("--procs is at least 2");
    for c in rest {
        let t = Instant::now();
        w.unwatch(c.id());
        w.watch_acked(last.id())?
            .recv_timeout(Duration::from_secs(120))?
            .map_err(anyhow::Error::msg)?;
        println!("detach pid {}: {} ms", c.id(), ms(t.elapsed()));
    }
    let t = Instant::now();
    drop(w);
    println!("watcher stop: {} ms", ms(t.elapsed()));
    Ok(())
}
