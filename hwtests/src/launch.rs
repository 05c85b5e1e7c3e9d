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
    r.json.insert(
        "launch_detection".into(),
        json!({"library": lib, "attached": w.attached(), "kernel_client": kernels, "graph_client": graphs,
               "baseline": base, "kernel_counts": [ck.kernel_launches, ck.graph_launches, ck.edges],
               "graph_counts": [cg.kernel_launches, cg.graph_launches, cg.edges]}),
    );
    Ok(())
}
