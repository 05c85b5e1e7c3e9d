//! Prints NVIDIA RM object allocations, frees and RM users' exits live, a per-process summary
//! of GPUs, TSGs and channels every 5 s, and a last one after `--seconds N` (Ctrl-C just stops).
//!
//! Usage (root): `rm-watch [--major 195] [--seconds N] [--quiet]`

use std::time::{Duration, Instant};

use valve_ebpf::{Registry, RmEventKind, WatchConfig, Watcher, NVIDIA_MAJOR};

fn main() -> anyhow::Result<()> {
    let mut major = NVIDIA_MAJOR;
    let mut seconds: Option<u64> = None;
    let mut quiet = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--major" => major = args.next().unwrap_or_default().parse()?,
            "--seconds" => seconds = Some(args.next().unwrap_or_default().parse()?),
            "--quiet" => quiet = true,
            other => anyhow::bail!(
                "unknown argument {other}; usage: rm-watch [--major N] [--seconds N] [--quiet]"
            ),
        }
    }
    let watcher = Watcher::start(WatchConfig {
        device_major: major,
        ..WatchConfig::default()
    })?;
    eprintln!("rm-watch: watching RM allocs/frees on major {major}");
    let mut registry = Registry::default();
    let start = Instant::now();
    let mut last_summary = Instant::now();
    loop {
        if let Some(ev) = watcher.poll(Duration::from_millis(200)) {
            // Every process exit on the machine is reported; show those of RM users only.
            let relevant = ev.kind != RmEventKind::Exit || registry.processes().contains(&ev.pid);
            if !quiet && relevant {
                println!("{:>14.6} {ev}", ev.ts_ns as f64 / 1e9);
            }
            registry.apply(&ev);
        }
        if last_summary.elapsed() > Duration::from_secs(5) {
            last_summary = Instant::now();
            print!("{}", registry.summary());
        }
        if seconds.is_some_and(|s| start.elapsed() >= Duration::from_secs(s)) {
            break;
        }
    }
    print!("{}", registry.summary());
    let stats = watcher.stats();
    println!("stats: {stats:?}");
    Ok(())
}
