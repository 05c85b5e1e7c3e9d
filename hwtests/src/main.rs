//! `valve-hwtest`: Valve's hardware test. On a GPU host it starts real CUDA workloads, learns
//! their RM handles, preempts them through the `valve` library and reports measured latencies.
//!
//! Run through `scripts/hwtest.sh`, which builds the CUDA workloads first. Without an NVIDIA
//! driver it prints a skip message and exits 0.

mod clock;
mod ctx;
mod daemon;
mod discovery;
mod experiments;
mod gate;
mod heartbeat;
mod hog;
mod ioctl_log;
mod launch;

use std::fmt::Write as _;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Parser;
use serde_json::{json, Value};
use valve::stats::{summarize_us, Summary};
use valve::{Controller, DriverInfo, GpuInfo};

use experiments::{cycle, plan, stats, Cycle, CycleStats, LibPreempter, Preempter, RawPreempter};
use hog::{run_online, Bins, ChannelSet, Hog, Poller};

/// Valve hardware test: preemption latency, frozen checks, online interference, the gate
/// benchmark, channel subsets, multi-GPU serial vs parallel, and (alone) context creation.
#[derive(Parser, Debug)]
struct Args {
    /// Directory with hog, online, serving and libvalve_ioctl_log.so (from hwtests/cuda/build.sh).
    #[arg(long)]
    bins: PathBuf,
    /// valvectl binary, to exercise the CLI against a live hog.
    #[arg(long)]
    valvectl: Option<PathBuf>,
    /// Where to write report.md and report.json.
    #[arg(long)]
    out: PathBuf,
    /// Date for the report header (YYYY-MM-DD).
    #[arg(long, default_value = "unknown-date")]
    date: String,
    /// Preempt/resume cycles per path (library and bare ioctl) in the main experiment.
    #[arg(long, default_value_t = 300)]
    cycles: usize,
    /// Hold of each main-experiment cycle, ms.
    #[arg(long, default_value_t = 10)]
    hold_ms: u64,
    /// Cycles per (workload, channel set) in the subset experiment.
    #[arg(long, default_value_t = 30)]
    subset_cycles: usize,
    /// Cycles per GPU count and path in the multi-GPU experiment.
    #[arg(long, default_value_t = 50)]
    multi_cycles: usize,
    /// Skip the channel-subset experiment.
    #[arg(long)]
    skip_subsets: bool,
    /// Skip the multi-GPU experiment.
    #[arg(long)]
    skip_multi: bool,
    /// Skip the discovery (daemon) experiment.
    #[arg(long)]
    skip_discovery: bool,
    /// Run only the discovery experiment.
    #[arg(long)]
    only_discovery: bool,
    /// Run only the launch-detection (uprobe) experiment.
    #[arg(long)]
    only_launch: bool,
    /// Skip the gate benchmark (online serving next to an offline hog under `valvectl gate`).
    #[arg(long)]
    skip_gate: bool,
    /// Run only the gate benchmark.
    #[arg(long)]
    only_gate: bool,
    /// Run only what the daemon costs a new CUDA process's context creation: no daemon, just
    /// started, settled, settled without eBPF probes, interleaved; 40 samples each, under
    /// 2 minutes (needs --valvectl and root).
    #[arg(long, conflicts_with_all = ["only_gate", "only_launch", "only_discovery"])]
    only_ctx: bool,
}

impl Args {
    /// Hold of each main-experiment cycle.
    fn hold(&self) -> Duration {
        Duration::from_millis(self.hold_ms)
    }
}

/// Pause between the main experiment's cycles (the hog runs during it).
const CYCLE_GAP: Duration = Duration::from_millis(5);

pub(crate) struct Report {
    md: String,
    pub(crate) json: serde_json::Map<String, Value>,
    checks: Vec<(String, bool, String)>,
}

impl Report {
    pub(crate) fn check(&mut self, name: &str, pass: bool, detail: String) {
        println!("[{}] {name}: {detail}", if pass { "PASS" } else { "FAIL" });
        self.checks.push((name.into(), pass, detail));
    }
    pub(crate) fn line(&mut self, s: &str) {
        println!("{s}");
        self.md.push_str(s);
        self.md.push('\n');
    }
}

fn us(x: f64) -> String {
    format!("{x:.0}")
}

fn stats_row(label: &str, s: &CycleStats) -> String {
    format!(
        "| {label} | {} | {}/{}/{} | {}/{}/{} | {}/{}/{} | {}/{}/{} | {} | {} |",
        s.cycles,
        us(s.disable_ioctl.p50_us),
        us(s.disable_ioctl.p99_us),
        us(s.disable_ioctl.max_us),
        us(s.stop.p50_us),
        us(s.stop.p99_us),
        us(s.stop.max_us),
        us(s.enable_ioctl.p50_us),
        us(s.enable_ioctl.p99_us),
        us(s.enable_ioctl.max_us),
        us(s.resume.p50_us),
        us(s.resume.p99_us),
        us(s.resume.max_us),
        s.not_frozen,
        s.not_resumed
    )
}

const STATS_HEADER: &str = "| run | cycles | disable ioctl p50/p99/max (us) | GPU stop after issue p50/p99/max | enable ioctl p50/p99/max | resume after enable issue p50/p99/max | not frozen | not resumed |\n|---|---|---|---|---|---|---|---|";

fn online_cell(v: &Value) -> String {
    format!(
        "{} / {} / {}",
        v["p50_us"].as_f64().map(us).unwrap_or("?".into()),
        v["p99_us"].as_f64().map(us).unwrap_or("?".into()),
        v["max_us"].as_f64().map(us).unwrap_or("?".into())
    )
}

fn run_cycles(
    p: &mut dyn Preempter,
    hog: &Hog,
    poller: &Poller,
    n: usize,
    hold: Duration,
    gap: Duration,
) -> Result<Vec<Cycle>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        v.push(cycle(p, &hog.hb, poller, hold)?);
        std::thread::sleep(gap);
    }
    Ok(v)
}

/// Why the test cannot run here (no driver device file), naming what was asked for.
fn skip_reason(args: &Args, nvidiactl: &std::path::Path) -> Option<String> {
    if nvidiactl.exists() {
        return None;
    }
    let what = if args.only_ctx {
        "the context-creation experiment (--only-ctx) needs a GPU host"
    } else {
        "the hardware test needs a GPU host"
    };
    Some(format!(
        "SKIP: no NVIDIA driver on this machine ({} missing); {what}",
        nvidiactl.display()
    ))
}

fn main() {
    let args = Args::parse();
    if let Some(why) = skip_reason(&args, std::path::Path::new("/dev/nvidiactl")) {
        println!("{why}");
        return;
    }
    match run(&args) {
        Ok(all_pass) => std::process::exit(if all_pass { 0 } else { 1 }),
        Err(e) => {
            eprintln!("valve-hwtest: error: {e:#}");
            std::process::exit(2);
        }
    }
}

fn run(args: &Args) -> Result<bool> {
    let t_start = Instant::now();
    std::fs::create_dir_all(&args.out)?;
    let bins = Bins::in_dir(&args.bins)?;
    let driver = DriverInfo::read()?;
    let ctl = Controller::open()?;
    let gpus = ctl.gpus();
    anyhow::ensure!(!gpus.is_empty(), "the driver lists no GPUs");
    let device = gpus[0].name.clone();
    let mut r = Report {
        md: String::new(),
        json: Default::default(),
        checks: vec![],
    };
    r.line(&format!(
        "# Valve hardware test: {} x{} ({})",
        device,
        gpus.len(),
        args.date
    ));
    r.line("");
    r.line(&format!("Driver {} ({}). Measured by `scripts/hwtest.sh` (`valve-hwtest`), all numbers from this run. Host clock: CLOCK_MONOTONIC.", driver.version, if driver.open_module { "open kernel module" } else { "proprietary" }));
    r.line("");
    r.line(
        "## GPUs\n\n| idx | name | PCI | minor | RM instance | UUID |\n|---|---|---|---|---|---|",
    );
    for g in &gpus {
        r.line(&format!(
            "| {} | {} | {} | {} | {} | {} |",
            g.index, g.name, g.pci_bus_id, g.minor, g.device_instance, g.uuid
        ));
    }
    r.json.insert("date".into(), json!(args.date));
    r.json.insert("driver".into(), json!(driver));
    r.json.insert("gpus".into(), json!(gpus));
    let g0 = &gpus[0];

    if args.only_ctx {
        match &args.valvectl {
            Some(vc) => ctx::run(&bins, g0, vc, &args.out, &ctx::Plan::ONLY, &mut r),
            None => r.check(
                "context-creation experiment ran",
                false,
                "no --valvectl".into(),
            ),
        }
        return finish(args, r, t_start);
    }
    let only = args.only_discovery || args.only_launch || args.only_gate;
    if !only {
        main_experiment(args, &ctl, &bins, g0, &device, &mut r)?;
    }
    if !args.only_discovery && !args.only_gate {
        if let Err(e) = launch::run(&bins, g0, &mut r) {
            r.check("launch-detection experiment ran", false, format!("{e:#}"));
        }
    }
    if args.only_launch {
        return finish(args, r, t_start);
    }
    if (!args.skip_gate || args.only_gate) && !args.only_discovery {
        match &args.valvectl {
            Some(vc) => {
                if let Err(e) = gate::run(&bins, g0, vc, &args.out, &mut r) {
                    r.check("gate benchmark ran", false, format!("{e:#}"));
                }
            }
            None => r.line("\nGate benchmark skipped: no --valvectl."),
        }
    }
    if args.only_gate {
        return finish(args, r, t_start);
    }
    if !args.skip_subsets && !only {
        subsets(args, &ctl, &bins, g0, &mut r)?;
    }
    if !args.skip_discovery {
        match &args.valvectl {
            Some(vc) => {
                if let Err(e) = discovery::run(&bins, &gpus, vc, &args.out, &mut r) {
                    r.check("discovery experiment ran", false, format!("{e:#}"));
                }
            }
            None => r.line("\nDiscovery skipped: no --valvectl."),
        }
    }
    if !args.skip_multi && !only && gpus.len() > 1 {
        multi(args, &ctl, &bins, &gpus, &mut r)?;
    }

    finish(args, r, t_start)
}

/// Writes the checks, report.md and report.json; returns whether every check passed.
fn finish(args: &Args, mut r: Report, t_start: Instant) -> Result<bool> {
    let all_pass = r.checks.iter().all(|c| c.1);
    r.line(&format!(
        "\n## Checks ({})\n",
        if all_pass {
            "all passed"
        } else {
            "SOME FAILED"
        }
    ));
    let rows: Vec<String> = r
        .checks
        .iter()
        .map(|(n, p, d)| format!("- {} {n}: {d}", if *p { "PASS" } else { "FAIL" }))
        .collect();
    for row in rows {
        let _ = writeln!(r.md, "{row}");
    }
    let _ = writeln!(r.md, "\nRun time {:.0} s.", t_start.elapsed().as_secs_f64());
    r.json.insert("checks".into(), json!(r.checks));
    std::fs::write(args.out.join("report.md"), &r.md).context("writing report.md")?;
    std::fs::write(
        args.out.join("report.json"),
        serde_json::to_string_pretty(&Value::Object(r.json.clone()))?,
    )?;
    println!(
        "\nSUMMARY: {} of {} checks passed; report in {}",
        r.checks.iter().filter(|c| c.1).count(),
        r.checks.len(),
        args.out.display()
    );
    Ok(all_pass)
}

/// GPU 0: online client alone / time-sliced / preempted, library vs bare-ioctl cycles on two
/// contexts, the 1 s hold, the hog's checksum, and valvectl against the live hog.
fn main_experiment(
    args: &Args,
    ctl: &Controller,
    bins: &Bins,
    g0: &GpuInfo,
    device: &str,
    r: &mut Report,
) -> Result<()> {
    // Online client alone, before any hog exists.
    let online_args = ["--count", "2000", "--think-us", "50", "--kernel-us", "20"];
    let online_alone = run_online(bins, g0, &online_args)?;
    println!("online alone: {online_alone}");

    // The main experiment on GPU 0.
    let hog = Hog::start(bins, g0, "persistent", &[])?;
    let poller = Poller::start(hog.hb.clone());
    report_hog_objects(&hog, g0, r);
    let all = hog.targets(ChannelSet::All, g0.device_instance);
    let all_plan = plan(ctl, &all)?;

    // valvectl against the live hog: bench, and a wrong handle that must fail cleanly.
    if let Some(vc) = &args.valvectl {
        valvectl_on_live_hog(vc, &hog, &all, &poller, r)?;
    }

    // Online client next to the running hog, then with the hog preempted.
    let online_with_hog = run_online(
        bins,
        g0,
        &["--count", "1000", "--think-us", "50", "--kernel-us", "20"],
    )?;
    println!("online with hog: {online_with_hog}");
    let online_preempted = {
        let g = ctl.disable(&all_plan)?;
        let v = run_online(bins, g0, &online_args);
        g.enable()?;
        v?
    };
    println!("online with hog preempted: {online_preempted}");

    let full = full_context_cycles(args, ctl, &hog, &poller, &all, &all_plan)?;
    drop(poller);
    let hog_result = hog.finish()?;
    let checksum_ok =
        hog_result["checksum_ok"].as_bool() == Some(true) || hog_result["checksum_ok_shm"] == 1;
    let four = four_blocks_per_sm(args, ctl, bins, g0)?;

    let hogs = HogResults {
        full: &hog_result,
        checksum_ok,
    };
    report_preemption(args, r, &full, &hogs, &four);
    let online = json!({"alone": online_alone, "with_hog": online_with_hog, "hog_preempted": online_preempted});
    report_online(r, &online);
    main_checks(args, r, device, &full, &hogs, &four, &online);
    Ok(())
}

/// The main cycles on the full-occupancy hog: library and bare ioctl, plus one 1 s hold.
struct FullContext {
    /// Channels of the hog's context, all disabled at once.
    channels: usize,
    lib: CycleStats,
    raw: CycleStats,
    long: Cycle,
    /// The library call minus the ioctl inside it, per disable call.
    overhead_disable: Summary,
    /// The same per enable call.
    overhead_enable: Summary,
}

/// The same cycles on a hog with 4 resident blocks per SM (the context the hardware notes
/// measured), and the channel-order experiment on it.
struct FourPerSm {
    lib: CycleStats,
    raw: CycleStats,
    hog: Value,
    orders: Vec<(String, CycleStats)>,
}

/// What the full-occupancy hog reported when it finished.
struct HogResults<'a> {
    full: &'a Value,
    checksum_ok: bool,
}

/// The hog's RM objects, as its ioctls showed them.
fn report_hog_objects(hog: &Hog, g0: &GpuInfo, r: &mut Report) {
    let gobj = hog
        .objects
        .gpus
        .iter()
        .find(|g| g.device_instance == g0.device_instance)
        .expect("checked at start")
        .clone();
    r.line("");
    r.line(&format!("## The hog's RM objects (learned from its ioctls)\n\nclient {}, {} channel(s) in {} TSG(s) of sizes {:?}; compute TSG {} ({} channels with compute objects); loose channels {}.",
        hog.objects.client, gobj.all_channels().len(), gobj.tsgs.len(),
        gobj.tsgs.iter().map(|t| t.channels.len()).collect::<Vec<_>>(),
        gobj.compute_tsg().map(|t| t.handle.to_string()).unwrap_or_default(),
        gobj.compute_tsg().map(|t| t.channels.iter().filter(|c| c.1).count()).unwrap_or(0),
        gobj.loose_channels.len()));
    r.json.insert("hog_objects".into(), json!({
        "client": hog.objects.client.0, "tsg_sizes": gobj.tsgs.iter().map(|t| t.channels.len()).collect::<Vec<_>>(),
        "channels": gobj.all_channels().iter().map(|c| c.0).collect::<Vec<_>>()}));
}

/// `valvectl gpus`, `valvectl bench` on the hog's channels, and a wrong channel handle that must
/// fail with exit 5 and leave the hog running.
fn valvectl_on_live_hog(
    vc: &std::path::Path,
    hog: &Hog,
    all: &[valve::ChannelTarget],
    poller: &Poller,
    r: &mut Report,
) -> Result<()> {
    let target = format!(
        "0:{:x}:{}",
        hog.objects.client.0,
        all.iter()
            .map(|t| format!("{:x}", t.channel.0))
            .collect::<Vec<_>>()
            .join(",")
    );
    let gpus_out = Command::new(vc).arg("gpus").output()?;
    r.line("\n## valvectl on this host\n\n```\n$ valvectl gpus");
    r.line(String::from_utf8_lossy(&gpus_out.stdout).trim_end());
    let bench = Command::new(vc)
        .args([
            "bench", "--target", &target, "--cycles", "50", "--hold", "2ms",
        ])
        .output()?;
    r.line(&format!(
        "$ valvectl bench --target 0:<client>:<{} channels> --cycles 50 --hold 2ms",
        all.len()
    ));
    r.line(String::from_utf8_lossy(&bench.stdout).trim_end());
    let bad = Command::new(vc)
        .args([
            "preempt",
            "--gpu",
            "0",
            "--client",
            &format!("{:x}", hog.objects.client.0),
            "--channel",
            "5c00ffff",
            "--for",
            "10ms",
        ])
        .output()?;
    let bad_err = String::from_utf8_lossy(&bad.stderr).trim().to_string();
    r.line("$ valvectl preempt --gpu 0 --client <client> --channel 5c00ffff --for 10ms");
    r.line(&format!(
        "{bad_err}\n(exit code {})\n```",
        bad.status.code().unwrap_or(-1)
    ));
    poller.wait_ticking(Duration::from_secs(2))?;
    r.check(
        "valvectl bench ran",
        bench.status.success(),
        format!("exit {}", bench.status),
    );
    r.check(
        "valvectl rejects a wrong channel with exit 5 and leaves the hog running",
        bad.status.code() == Some(5) && bad_err.contains("NV_ERR_"),
        bad_err.clone(),
    );
    Ok(())
}

/// Main cycles: library and bare ioctl, interleaved in blocks of 10 so drift hits both alike,
/// then one 1 s hold through the library.
fn full_context_cycles(
    args: &Args,
    ctl: &Controller,
    hog: &Hog,
    poller: &Poller,
    all: &[valve::ChannelTarget],
    all_plan: &valve::PreemptPlan,
) -> Result<FullContext> {
    let (hold, gap) = (args.hold(), CYCLE_GAP);
    let mut lib_cycles = Vec::new();
    let mut raw_cycles = Vec::new();
    let mut raw = RawPreempter::new(ctl, all)?;
    while lib_cycles.len() < args.cycles {
        let n = 10.min(args.cycles - lib_cycles.len());
        let mut lib = LibPreempter::new(ctl, all_plan, false);
        lib_cycles.extend(run_cycles(&mut lib, hog, poller, n, hold, gap)?);
        raw_cycles.extend(run_cycles(&mut raw, hog, poller, n, hold, gap)?);
    }
    let long = {
        let mut lib = LibPreempter::new(ctl, all_plan, false);
        cycle(&mut lib, &hog.hb, poller, Duration::from_secs(1))?
    };
    // Library overhead: the library call minus the ioctl inside it, per call.
    let overhead_disable = summarize_us(
        &lib_cycles
            .iter()
            .map(|c| c.disable_call_us - c.disable_ioctl_us)
            .collect::<Vec<_>>(),
    );
    let overhead_enable = summarize_us(
        &lib_cycles
            .iter()
            .map(|c| c.enable_call_us - c.enable_ioctl_us)
            .collect::<Vec<_>>(),
    );
    Ok(FullContext {
        channels: all.len(),
        lib: stats(&lib_cycles),
        raw: stats(&raw_cycles),
        long,
        overhead_disable,
        overhead_enable,
    })
}

/// The context the hardware notes measured: 4 resident blocks per SM (528 on an H100); library
/// and bare ioctl interleaved as in the main cycles, then the channel orders.
fn four_blocks_per_sm(
    args: &Args,
    ctl: &Controller,
    bins: &Bins,
    g0: &GpuInfo,
) -> Result<FourPerSm> {
    let (hold, gap) = (args.hold(), CYCLE_GAP);
    let hog4 = Hog::start(bins, g0, "persistent", &["--blocks-per-sm", "4"])?;
    let poller4 = Poller::start(hog4.hb.clone());
    let t4 = hog4.targets(ChannelSet::All, g0.device_instance);
    let p4 = plan(ctl, &t4)?;
    let mut raw4 = RawPreempter::new(ctl, &t4)?;
    let (mut l, mut w) = (Vec::new(), Vec::new());
    while l.len() < args.cycles {
        let n = 10.min(args.cycles - l.len());
        l.extend(run_cycles(
            &mut LibPreempter::new(ctl, &p4, false),
            &hog4,
            &poller4,
            n,
            hold,
            gap,
        )?);
        w.extend(run_cycles(&mut raw4, &hog4, &poller4, n, hold, gap)?);
    }
    drop(raw4);
    let orders = channel_orders(ctl, &hog4, &poller4, g0, hold, gap)?;
    drop(poller4);
    Ok(FourPerSm {
        lib: stats(&l),
        raw: stats(&w),
        hog: hog4.finish()?,
        orders,
    })
}

/// The preemption section of the report: both contexts, the library's overhead, the 1 s hold
/// and the channel orders.
fn report_preemption(
    args: &Args,
    r: &mut Report,
    full: &FullContext,
    hogs: &HogResults,
    four: &FourPerSm,
) {
    let (hog_result, checksum_ok) = (hogs.full, hogs.checksum_ok);
    let (lib_stats, raw_stats, long) = (&full.lib, &full.raw, &full.long);
    let (overhead_disable, overhead_enable) = (&full.overhead_disable, &full.overhead_enable);
    r.line(&format!("\n## Preemption of a full CUDA context ({} channels), GPU 0\n\nPersistent hog; {} cycles per path (library and bare ioctl interleaved in blocks of 10), hold {} ms, 5 ms between cycles; plus one 1 s hold. Two contexts: every SM at full occupancy ({} blocks of 256 threads), and 4 blocks per SM ({} blocks, the context the hardware notes measured).\n",
        full.channels, args.cycles, args.hold_ms, hog_result["slots"], four.hog["slots"]));
    r.line(STATS_HEADER);
    r.line(&stats_row("full occupancy: valve library", lib_stats));
    r.line(&stats_row(
        "full occupancy: bare ioctl (baseline)",
        raw_stats,
    ));
    r.line(&stats_row("4 blocks/SM: valve library", &four.lib));
    r.line(&stats_row("4 blocks/SM: bare ioctl (baseline)", &four.raw));
    r.line(&format!("\nLibrary overhead per call (call time minus the ioctl inside it): disable p50 {:.1} us / p99 {:.1} us, enable p50 {:.1} us / p99 {:.1} us. Library minus bare-ioctl p50 (disable): {:.1} us.",
        overhead_disable.p50_us, overhead_disable.p99_us, overhead_enable.p50_us, overhead_enable.p99_us,
        lib_stats.disable_call.p50_us - raw_stats.disable_ioctl.p50_us));
    r.line(&format!("1 s hold: frozen = {}, GPU stop {:.0} us after issue, resumed {} us after enable issue. Hog checksum after {} preemptions: {}.",
        long.frozen, long.stop_us, long.resume_us.map(us).unwrap_or("NEVER".into()), 2 * args.cycles + 1, if checksum_ok { "correct" } else { "WRONG" }));
    r.line("\nDoes the order of the 20 channels in the disable list matter? Bare ioctl, 4 blocks/SM context, 60 cycles per order, interleaved in blocks of 10:\n\n| order | disable ioctl p50/p99 (us) | GPU stop p50 | enable ioctl p50 | frozen every hold |\n|---|---|---|---|---|");
    for (name, s) in &four.orders {
        r.line(&format!(
            "| {name} | {}/{} | {} | {} | {} |",
            us(s.disable_ioctl.p50_us),
            us(s.disable_ioctl.p99_us),
            us(s.stop.p50_us),
            us(s.enable_ioctl.p50_us),
            if s.not_frozen == 0 { "yes" } else { "NO" }
        ));
    }
    r.json.insert("channel_orders".into(), json!(four.orders));
    r.json.insert(
        "main_4_blocks_per_sm".into(),
        json!({"library": four.lib, "raw_ioctl": four.raw, "hog": four.hog}),
    );
    r.json.insert("main".into(), json!({"library": lib_stats, "raw_ioctl": raw_stats, "overhead_disable": overhead_disable, "overhead_enable": overhead_enable, "long_hold": long, "hog": hog_result}));
}

/// The online client's round trips alone, next to the hog, and with the hog preempted.
fn report_online(r: &mut Report, online: &Value) {
    r.line("\n## Online client (20 us kernels, 50 us think time), GPU 0\n\n| condition | round trip p50 / p99 / max (us) |\n|---|---|");
    r.line(&format!("| alone | {} |", online_cell(&online["alone"])));
    r.line(&format!(
        "| with the hog, default time-slicing | {} |",
        online_cell(&online["with_hog"])
    ));
    r.line(&format!(
        "| with the hog preempted by Valve | {} |",
        online_cell(&online["hog_preempted"])
    ));
    r.json.insert("online".into(), online.clone());
}

/// The main experiment's pass/fail checks; `online` holds the online client's three runs.
fn main_checks(
    args: &Args,
    r: &mut Report,
    device: &str,
    full: &FullContext,
    hogs: &HogResults,
    four: &FourPerSm,
    online: &Value,
) {
    let (lib_stats, raw_stats, long) = (&full.lib, &full.raw, &full.long);
    let (ref_lib, ref_raw) = (&four.lib, &four.raw);
    r.check(
        "every hold froze the hog (all slots and copies)",
        lib_stats.not_frozen + raw_stats.not_frozen == 0 && long.frozen,
        format!(
            "{} + {} of {} cycles not frozen; 1 s hold frozen = {}",
            lib_stats.not_frozen,
            raw_stats.not_frozen,
            2 * args.cycles,
            long.frozen
        ),
    );
    r.check(
        "the hog resumed after every enable",
        lib_stats.not_resumed + raw_stats.not_resumed == 0 && long.resume_us.is_some(),
        format!(
            "{} not resumed",
            lib_stats.not_resumed + raw_stats.not_resumed
        ),
    );
    r.check(
        "hog checksum equals the unpreempted result",
        hogs.checksum_ok,
        hogs.full.to_string(),
    );
    r.check(
        "library overhead <= 5 us per call",
        full.overhead_disable.p50_us <= 5.0 && full.overhead_enable.p50_us <= 5.0,
        format!(
            "disable {:.2} us, enable {:.2} us (p50)",
            full.overhead_disable.p50_us, full.overhead_enable.p50_us
        ),
    );
    r.check(
        &format!(
            "full-context ({} channels) disable ioctl p50 <= 650 us, context of the notes (4 blocks/SM)",
            full.channels
        ),
        ref_lib.disable_ioctl.p50_us <= 650.0,
        format!(
            "{:.0} us on {device} (full occupancy: {:.0} us, reported, not the target's context)",
            ref_lib.disable_ioctl.p50_us, lib_stats.disable_ioctl.p50_us
        ),
    );
    let ref_ok = four.hog["checksum_ok"].as_bool() == Some(true);
    r.check(
        "4 blocks/SM hog: every hold frozen, checksum correct",
        ref_lib.not_frozen + ref_raw.not_frozen == 0 && ref_ok,
        four.hog.to_string(),
    );
    let p99_alone = online["alone"]["p99_us"].as_f64().unwrap_or(f64::NAN);
    let p99_pre = online["hog_preempted"]["p99_us"]
        .as_f64()
        .unwrap_or(f64::NAN);
    r.check(
        "online p99 with the hog preempted <= 1.5x alone",
        p99_pre <= 1.5 * p99_alone,
        format!("{p99_pre:.0} us vs {p99_alone:.0} us alone"),
    );
}

/// The same 20 channels in four orders (the library sorts by handle), bare ioctl: does GSP's
/// cost depend on whether the running (compute) TSG comes first or last?
fn channel_orders(
    ctl: &Controller,
    hog: &Hog,
    poller: &Poller,
    g0: &GpuInfo,
    hold: Duration,
    gap: Duration,
) -> Result<Vec<(String, CycleStats)>> {
    let Some(g) = hog
        .objects
        .gpus
        .iter()
        .find(|g| g.device_instance == g0.device_instance)
    else {
        return Ok(Vec::new());
    };
    let target = |c: &valve::bindings::ChannelHandle| valve::ChannelTarget {
        gpu: g0.index,
        client: hog.objects.client,
        channel: *c,
    };
    let mut sorted: Vec<_> = g.all_channels().iter().map(target).collect();
    sorted.sort();
    let compute: Vec<_> = g
        .compute_tsg()
        .map(|t| t.channels.iter().map(|c| target(&c.0)).collect())
        .unwrap_or_default();
    let rest: Vec<_> = sorted
        .iter()
        .copied()
        .filter(|t| !compute.contains(t))
        .collect();
    let orders: Vec<(String, Vec<valve::ChannelTarget>)> = vec![
        (
            "sorted by handle (the library's order)".into(),
            sorted.clone(),
        ),
        ("reversed".into(), sorted.iter().rev().copied().collect()),
        (
            "compute TSG first".into(),
            [compute.clone(), rest.clone()].concat(),
        ),
        ("compute TSG last".into(), [rest, compute].concat()),
    ];
    let mut preempters = orders
        .iter()
        .map(|(_, t)| RawPreempter::new(ctl, t))
        .collect::<Result<Vec<_>>>()?;
    let mut cycles: Vec<Vec<Cycle>> = vec![Vec::new(); orders.len()];
    for _ in 0..6 {
        for (i, p) in preempters.iter_mut().enumerate() {
            cycles[i].extend(run_cycles(p, hog, poller, 10, hold, gap)?);
        }
    }
    Ok(orders
        .into_iter()
        .zip(cycles)
        .map(|((name, _), c)| (name, stats(&c)))
        .collect())
}

/// Which channel sets freeze which workloads, and what each costs.
fn subsets(args: &Args, ctl: &Controller, bins: &Bins, g0: &GpuInfo, r: &mut Report) -> Result<()> {
    let workloads: [Workload; 6] = [
        ("persistent", "persistent", &[]),
        (
            "persistent, every block polling host memory (--sysmem-poll)",
            "persistent",
            &["--sysmem-poll", "1"],
        ),
        ("4 streams", "streams", &["--streams", "4"]),
        ("kernel + copy engine", "copy", &[]),
        ("CUDA graph", "graph", &[]),
        (
            "heavy context (200 KB smem/block)",
            "persistent",
            &["--smem-kb", "200"],
        ),
    ];
    r.line(&format!(
        "\n## Which channels must be named? ({} cycles x 20 ms hold + one 300 ms hold per cell)\n",
        args.subset_cycles
    ));
    r.line("| workload | channel set | channels | frozen every hold | checksum | disable ioctl p50/p99 | stop p50/p99 | enable ioctl p50 | resume p50/p99 |\n|---|---|---|---|---|---|---|---|---|");
    let mut sufficient = std::collections::BTreeMap::<String, bool>::new();
    let mut rows = Vec::new();
    for workload in workloads {
        let label = workload.0;
        let Some((cells, ok)) = subset_cells(args, ctl, bins, g0, workload, r)? else {
            continue;
        };
        for (set, n, s) in cells {
            let frozen = s.not_frozen == 0 && s.not_resumed == 0;
            *sufficient.entry(format!("{set:?}")).or_insert(true) &= frozen && ok;
            let row = format!(
                "| {label} | {set:?} | {n} | {} | {} | {}/{} | {}/{} | {} | {}/{} |",
                if frozen {
                    "yes".to_string()
                } else {
                    format!("NO ({} of {})", s.not_frozen, s.cycles)
                },
                if ok { "ok" } else { "WRONG" },
                us(s.disable_ioctl.p50_us),
                us(s.disable_ioctl.p99_us),
                us(s.stop.p50_us),
                us(s.stop.p99_us),
                us(s.enable_ioctl.p50_us),
                us(s.resume.p50_us),
                us(s.resume.p99_us)
            );
            r.line(&row);
            rows.push(json!({"workload": label, "set": set, "channels": n, "frozen": frozen, "checksum_ok": ok, "stats": s}));
        }
    }
    r.line(&format!(
        "\nSufficient in every workload above: {}.",
        sufficient
            .iter()
            .map(|(k, v)| format!("{k} = {}", if *v { "yes" } else { "no" }))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    r.json.insert(
        "subsets".into(),
        json!({"rows": rows, "sufficient": sufficient}),
    );
    Ok(())
}

/// A subset-experiment workload: its label, the hog's mode and extra arguments.
type Workload<'a> = (&'a str, &'a str, &'a [&'a str]);

/// Per channel set: the channels named and the cycles' statistics; and whether the hog's
/// checksum was right.
type SubsetCells = (Vec<(ChannelSet, usize, CycleStats)>, bool);

/// Starts one workload (retrying once) and runs every channel set against it. `None` if it did
/// not start (a failed check says so).
fn subset_cells(
    args: &Args,
    ctl: &Controller,
    bins: &Bins,
    g0: &GpuInfo,
    (label, mode, extra): Workload,
    r: &mut Report,
) -> Result<Option<SubsetCells>> {
    let hog = match Hog::start(bins, g0, mode, extra).or_else(|e| {
        println!("retrying once after: {e:#}");
        Hog::start(bins, g0, mode, extra)
    }) {
        Ok(h) => h,
        Err(e) => {
            r.check(
                &format!("workload '{label}' starts"),
                false,
                format!("{e:#}"),
            );
            return Ok(None);
        }
    };
    let poller = Poller::start(hog.hb.clone());
    let mut cells = Vec::new();
    for set in ChannelSet::ALL {
        let targets = hog.targets(set, g0.device_instance);
        if targets.is_empty() {
            continue;
        }
        let p = plan(ctl, &targets)?;
        let mut lib = LibPreempter::new(ctl, &p, false);
        let mut cs = run_cycles(
            &mut lib,
            &hog,
            &poller,
            args.subset_cycles,
            Duration::from_millis(20),
            Duration::from_millis(5),
        )?;
        cs.push(cycle(
            &mut lib,
            &hog.hb,
            &poller,
            Duration::from_millis(300),
        )?);
        cells.push((set, targets.len(), stats(&cs)));
    }
    drop(poller);
    let res = hog.finish()?;
    let ok = res["checksum_ok"].as_bool() == Some(true);
    Ok(Some((cells, ok)))
}

/// Serial vs one-thread-per-GPU preemption of 1..N GPUs.
fn multi(
    args: &Args,
    ctl: &Controller,
    bins: &Bins,
    gpus: &[GpuInfo],
    r: &mut Report,
) -> Result<()> {
    let mut hogs = Vec::new();
    for g in gpus {
        hogs.push(Hog::start(bins, g, "persistent", &[])?);
    }
    r.line(&format!("\n## Several GPUs: serial vs one thread per GPU (full contexts, {} cycles each, hold 5 ms)\n", args.multi_cycles));
    r.line("| GPUs | channels | serial wall p50/p99 (us) | parallel wall p50/p99 (us) | parallel: slowest GPU's ioctl p50 | all frozen |\n|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for k in 1..=gpus.len() {
        let targets: Vec<_> = hogs[..k]
            .iter()
            .zip(gpus)
            .flat_map(|(h, g)| h.targets(ChannelSet::All, g.device_instance))
            .collect();
        let p = plan(ctl, &targets)?;
        let mut walls = [Vec::new(), Vec::new()];
        let mut slowest = Vec::new();
        let mut frozen = true;
        for _ in 0..args.multi_cycles {
            for (i, serial) in [true, false].into_iter().enumerate() {
                let t0 = clock::now_ns();
                let g = if serial {
                    ctl.disable_serial(&p)?
                } else {
                    ctl.disable_parallel(&p)?
                };
                walls[i].push((clock::now_ns() - t0) as f64 / 1e3);
                if !serial {
                    slowest.push(
                        g.disable_report()
                            .gpus
                            .iter()
                            .map(|t| t.ioctl.as_secs_f64() * 1e6)
                            .fold(0.0, f64::max),
                    );
                }
                std::thread::sleep(Duration::from_millis(2));
                let before: Vec<_> = hogs[..k].iter().map(|h| h.hb.snapshot()).collect();
                std::thread::sleep(Duration::from_millis(3));
                let after: Vec<_> = hogs[..k].iter().map(|h| h.hb.snapshot()).collect();
                frozen &= before == after;
                g.enable()?;
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        let (s, pa, sl) = (
            summarize_us(&walls[0]),
            summarize_us(&walls[1]),
            summarize_us(&slowest),
        );
        r.line(&format!(
            "| {k} | {} | {}/{} | {}/{} | {} | {} |",
            targets.len(),
            us(s.p50_us),
            us(s.p99_us),
            us(pa.p50_us),
            us(pa.p99_us),
            us(sl.p50_us),
            if frozen { "yes" } else { "NO" }
        ));
        rows.push(json!({"gpus": k, "channels": targets.len(), "serial": s, "parallel": pa, "parallel_slowest_gpu_ioctl": sl, "frozen": frozen}));
        r.check(
            &format!("{k} GPU(s): every hog frozen during holds"),
            frozen,
            String::new(),
        );
    }
    let mut ok = true;
    for h in hogs {
        let res = h.finish()?;
        ok &= res["checksum_ok"].as_bool() == Some(true);
    }
    r.check("multi-GPU hogs' checksums correct", ok, String::new());
    r.json.insert("multi_gpu".into(), json!(rows));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(extra: &[&str]) -> Args {
        let base = ["valve-hwtest", "--bins", "/b", "--out", "/o"];
        Args::try_parse_from(base.iter().chain(extra)).expect("parses")
    }

    #[test]
    fn only_ctx_flag_stands_alone() {
        assert!(!parse(&[]).only_ctx);
        let a = parse(&["--only-ctx", "--valvectl", "/v"]);
        assert!(a.only_ctx && !a.only_discovery);
        let base = ["valve-hwtest", "--bins", "/b", "--out", "/o", "--only-ctx"];
        assert!(Args::try_parse_from(base.iter().chain(&["--only-launch"])).is_err());
        assert!(Args::try_parse_from(base.iter().chain(&["--only-gate"])).is_err());
        let missing = std::path::Path::new("/nonexistent/nvidiactl");
        let why = skip_reason(&parse(&["--only-ctx"]), missing).expect("skips");
        assert!(why.contains("--only-ctx"), "{why}");
    }

    #[test]
    fn skips_cleanly_without_the_driver() {
        let missing = std::path::Path::new("/nonexistent/nvidiactl");
        let why = skip_reason(&parse(&["--only-ctx"]), missing).expect("skips");
        assert!(why.starts_with("SKIP: no NVIDIA driver"), "{why}");
        assert!(why.contains("--only-ctx") && why.contains("/nonexistent/nvidiactl"));
        let why = skip_reason(&parse(&[]), missing).expect("skips");
        assert!(!why.contains("--only-ctx"));
        // A file that exists stands for a present driver.
        assert!(skip_reason(&parse(&[]), std::path::Path::new("/")).is_none());
    }
}
