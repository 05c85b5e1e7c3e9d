//! Online activity detection on a GPU host: uprobes on the real libcuda must count exactly the
//! online client's kernel launches (made through the CUDA runtime) and graph launches, and what
//! a probe costs per launch is measured against the same client without probes.

use std::time::Duration;

use anyhow::Result;
use serde_json::json;
use valve::GpuInfo;
use valve_ebpf::{find_libcuda, LaunchConfig, LaunchWatcher};

use crate::hog::{run_online, Bins};
use crate::Report;

/// Runs the experiment.
pub fn run(bins: &Bins, g0: &GpuInfo, r: &mut Report) -> Result<()> {
    r.line("\n## Online activity detection: uprobes on libcuda's launch entry points\n");
    if !nix::unistd::geteuid().is_root() {
        r.line("Skipped: uprobes need root.");
        return Ok(());
    }
    let Some(lib) = find_libcuda() else {
        r.check(
            "libcuda.so.1 found",
            false,
            "not in ldconfig or the usual directories".into(),
        );
        return Ok(());
    };
    let args = ["--count", "2000", "--think-us", "50", "--kernel-us", "20"];
    let base = run_online(bins, g0, &args)?;
    let w = LaunchWatcher::start(LaunchConfig {
        library: lib.clone(),
        pids: Vec::new(),
        filter: false,
        edge_gap: Duration::from_millis(1),
        track_waits: false,
        realtime: None,
        poll_period: valve_ebpf::REQUEST_POLL,
    })?;
    r.line(&format!(
        "{}: probes on {}.",
        lib.display(),
        w.attached().join(", ")
    ));
    let kernels = run_online(bins, g0, &args)?;
    let mut graph_args = args.to_vec();
    graph_args.extend(["--graph", "1"]);
    let graphs = run_online(bins, g0, &graph_args)?;
    let pid = |v: &serde_json::Value| v["pid"].as_u64().unwrap_or(0) as u32;
    let (ck, cg) = (w.counts(pid(&kernels)), w.counts(pid(&graphs)));
    let expected = 2000 + 50; // measured + warm-up launches
    r.line(&format!(
        "Kernel client (CUDA runtime `<<<>>>`): {} kernel / {} graph launches counted, {} edge(s). Graph client: {} kernel (the capture) / {} graph launches, {} edge(s). Expected {expected} launches each.",
        ck.kernel_launches, ck.graph_launches, ck.edges, cg.kernel_launches, cg.graph_launches, cg.edges
    ));
    r.check(
        "uprobes count every kernel launch made through the CUDA runtime",
        ck.kernel_launches == expected && ck.graph_launches == 0,
        format!("{} of {expected}", ck.kernel_launches),
    );
    r.check(
        "uprobes count every CUDA graph launch",
        cg.graph_launches == expected && cg.kernel_launches <= 2,
        format!(
            "{} of {expected} graph launches ({} kernel launches while capturing)",
            cg.graph_launches, cg.kernel_launches
        ),
    );
    let cost =
        |k: &str| kernels[k].as_f64().unwrap_or(f64::NAN) - base[k].as_f64().unwrap_or(f64::NAN);
    r.line(&format!(
        "Cost per launch, online round trip with the probes minus without (same host, one run each): p50 {:+.1} us, mean {:+.1} us (round trip p50 {:.1} us without probes).",
        cost("p50_us"),
        cost("mean_us"),
        base["p50_us"].as_f64().unwrap_or(f64::NAN)
    ));
    let attached = w.attached().to_vec();
    drop(w);
    let per_call = price_waits_and_edges(bins, g0, &lib, &args, &kernels, &base, r)?;
    r.json.insert(
        "launch_detection".into(),
        json!({"library": lib, "attached": attached, "kernel_client": kernels, "graph_client": graphs,
               "baseline": base, "kernel_counts": [ck.kernel_launches, ck.graph_launches, ck.edges],
               "graph_counts": [cg.kernel_launches, cg.graph_launches, cg.edges], "per_call": per_call}),
    );
    Ok(())
}

/// What the gate adds to each online call beyond a probed launch: the probes on a synchronising
/// call (a trap at entry and one at return), and an edge (a ring-buffer record that wakes the
/// watcher's thread on another CPU). The same client runs under a watcher that tracks waits, then
/// under one whose edge gap is shorter than the client's think time (every launch an edge), then
/// bare again (the host's drift over the runs). Each is priced against the launch-probed run.
fn price_waits_and_edges(
    bins: &Bins,
    g0: &GpuInfo,
    lib: &std::path::Path,
    args: &[&str],
    launches: &serde_json::Value,
    base: &serde_json::Value,
    r: &mut Report,
) -> Result<serde_json::Value> {
    let watcher = |edge_gap, track_waits| {
        LaunchWatcher::start(LaunchConfig {
            library: lib.to_path_buf(),
            pids: Vec::new(),
            filter: false,
            edge_gap,
            track_waits,
            realtime: None,
            poll_period: valve_ebpf::REQUEST_POLL,
        })
    };
    let pid = |v: &serde_json::Value| v["pid"].as_u64().unwrap_or(0) as u32;
    let w = watcher(Duration::from_millis(1), true)?;
    let waits = run_online(bins, g0, args)?;
    let wc = w.counts(pid(&waits));
    drop(w);
    let w = watcher(Duration::from_micros(10), false)?;
    let edges = run_online(bins, g0, args)?;
    let ec = w.counts(pid(&edges));
    drop(w);
    let base_again = run_online(bins, g0, args)?;
    let p50 = |v: &serde_json::Value| v["p50_us"].as_f64().unwrap_or(f64::NAN);
    let launch_p50 = p50(launches);
    let per_sync =
        (p50(&waits) - launch_p50) / (wc.syncs as f64 / wc.kernel_launches.max(1) as f64);
    let per_edge =
        (p50(&edges) - launch_p50) / (ec.edges as f64 / ec.kernel_launches.max(1) as f64);
    r.line(&format!(
        "Probes on synchronising calls as well ({} syncs for {} launches): round trip p50 {:.1} us, {:+.1} us per synchronising call against launch probes alone. Every launch an edge ({} edges for {} launches, each waking the watcher's thread): p50 {:.1} us, {:+.1} us per edge. Without probes again, after these runs: p50 {:.1} us ({:+.1} us against the first run without: the host's drift).",
        wc.syncs, wc.kernel_launches, p50(&waits), per_sync, ec.edges, ec.kernel_launches,
        p50(&edges), per_edge, p50(&base_again), p50(&base_again) - p50(base)
    ));
    r.check(
        "every launch after a gap longer than the edge gap is reported as an edge",
        ec.edges + 2 >= ec.kernel_launches && ec.kernel_launches > 0,
        format!("{} edges for {} launches", ec.edges, ec.kernel_launches),
    );
    Ok(
        json!({"waits_client": waits, "wait_counts": [wc.kernel_launches, wc.syncs, wc.edges],
              "edges_client": edges, "edge_counts": [ec.kernel_launches, ec.edges],
              "baseline_again": base_again, "per_sync_us": per_sync, "per_edge_us": per_edge}),
    )
}
