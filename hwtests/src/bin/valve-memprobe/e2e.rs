//! `valve-memprobe e2e`: the whole memory path on a GPU host. It starts `valvectl daemon --pool`
//! (capped at offline's size, so every online grow is a reclaim), an offline and an online child
//! linked with `valve-client`, times online's grows into offline's memory, checks offline's
//! untouched memory, then the faults: offline killed, daemon killed and restarted, everything
//! stopped; NVML's used memory is read at each step.

use std::path::{Path, PathBuf};
use std::process::{Child as Process, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use valve_vmm::wire;

use crate::child::{nvml_used, summary_of, Child};

/// The arguments of `valve-memprobe e2e`.
#[derive(clap::Args)]
pub struct E2eArgs {
    /// memstream.ptx.
    #[arg(long)]
    pub ptx: PathBuf,
    /// The valvectl binary.
    #[arg(long)]
    pub valvectl: PathBuf,
    /// Where e2e.json goes.
    #[arg(long)]
    pub out: PathBuf,
    /// Offline's memory (and the pool's cap), GiB.
    #[arg(long, default_value_t = 16)]
    pub offline_gib: u64,
    /// Reclaim sizes, MiB.
    #[arg(long, value_delimiter = ',', default_value = "64,1024,8192")]
    pub reclaim_mib: Vec<u64>,
    /// Grows per size (plus one warm-up).
    #[arg(long, default_value_t = 10)]
    pub reps: usize,
    /// One offline kernel's length.
    #[arg(long, default_value_t = 200.0)]
    pub kernel_ms: f64,
    /// MIAD: seconds of bursty online demand, once without reservation and once with (0: skip).
    #[arg(long, default_value_t = 0.0)]
    pub trace_secs: f64,
    /// MIAD's target, reclaims per minute (the daemon's --pool-target-reclaims-per-min).
    #[arg(long, default_value_t = 30.0)]
    pub target_reclaims_per_min: f64,
    /// Which traces: `none` (online holds exactly its demand), `miad` (what reservation says).
    #[arg(long, value_delimiter = ',', default_value = "none,miad")]
    pub trace_modes: Vec<String>,
    /// Mean time between bursts of the demand trace, seconds.
    #[arg(long, default_value_t = 2.0)]
    pub mean_gap_s: f64,
    /// The soak: this many reclaims of `--soak-mib` after the timed sizes (0: none).
    #[arg(long, default_value_t = 0)]
    pub soak_reclaims: usize,
    /// The soak's reclaim size, MiB.
    #[arg(long, default_value_t = 256)]
    pub soak_mib: u64,
    /// In the soak, a client is SIGKILLed after every this many reclaims (offline and online in
    /// turn) and a new one started in its place.
    #[arg(long, default_value_t = 10)]
    pub soak_kill_every: usize,
}

pub(crate) const HANDLE_MIB: u64 = 64;

fn mib(b: Option<u64>) -> Option<f64> {
    b.map(|b| b as f64 / 1048576.0)
}

pub(crate) struct Daemon {
    proc: Process,
    pub(crate) pool: PathBuf,
}

impl Daemon {
    pub(crate) fn start(a: &E2eArgs, dir: &Path) -> Result<Daemon> {
        let pool = dir.join("pool.sock");
        let log = std::fs::File::create(dir.join("daemon.log"))?;
        let proc = Command::new(&a.valvectl)
            .args(["daemon", "--pool", "--pool-keep-free-mib", "4096"])
            .arg("--socket")
            .arg(dir.join("valve.sock"))
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--pool-socket")
            .arg(&pool)
            .arg("--pool-max-gib")
            .arg(a.offline_gib.to_string())
            .arg("--pool-handle-mib")
            .arg(HANDLE_MIB.to_string())
            .arg("--pool-target-reclaims-per-min")
            .arg(a.target_reclaims_per_min.to_string())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting valvectl daemon --pool")?;
        let d = Daemon { proc, pool };
        let deadline = Instant::now() + Duration::from_secs(20);
        while d.status().is_err() {
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(dir.join("daemon.log")).unwrap_or_default();
                bail!("the daemon's pool never answered; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(d)
    }

    pub(crate) fn status(&self) -> Result<Value> {
        let s = wire::connect(&self.pool)?;
        wire::send(&s, &json!({"op": "status"}), &[])?;
        Ok(wire::recv(&s)?.context("pool closed")?.0)
    }

    fn signal(&mut self, sig: nix::sys::signal::Signal) -> Result<()> {
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(self.proc.id() as i32), sig)?;
        self.proc.wait()?;
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.proc.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.proc.wait();
    }
}

/// Online grows k handles (a reclaim: the pool is full), uses them, lets go; offline refills.
pub(crate) fn cycles(online: &Child, offline: &Child, k: u64, reps: usize) -> Result<Value> {
    let mut grow = Vec::new();
    for rep in 0..=reps {
        let g = online.call(json!({"op": "grow", "count": k}), &[])?;
        if g["got"].as_u64() != Some(k) {
            bail!("online asked for {k} handles and got {}", g["got"]);
        }
        online.call(json!({"op": "use"}), &[])?;
        online.call(json!({"op": "shrink"}), &[])?;
        offline.call(json!({"op": "regrow", "count": k}), &[])?;
        if rep > 0 {
            grow.push(g["grow_us"].as_f64().unwrap_or(0.0));
        }
    }
    let s = summary_of(&grow);
    println!(
        "  {:>5} MiB: online's grow (reclaim from offline included) p50 {:.2} ms, p99 {:.2} ms",
        k * HANDLE_MIB,
        s["p50_us"].as_f64().unwrap_or(0.0) / 1e3,
        s["p99_us"].as_f64().unwrap_or(0.0) / 1e3
    );
    Ok(json!({"reclaim_mib": k * HANDLE_MIB, "handles": k, "grow_us": s, "samples_us": grow}))
}

pub(crate) fn wait_until(what: &str, secs: u64, mut ok: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !ok() {
        if Instant::now() > deadline {
            println!("  timed out waiting for: {what}");
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

fn reclaims(d: &Daemon) -> u64 {
    d.status()
        .map_or(0, |s| s["reclaims"]["reclaims"].as_u64().unwrap_or(0))
}

/// MIAD on the GPU: a fresh offline child takes all free memory back at every step boundary;
/// online follows a bursty demand for `trace_secs`, first holding exactly its demand, then
/// what MIAD reservation says. Reclaims per minute come from the daemon's counter.
fn traces(a: &E2eArgs, daemon: &Daemon, online: &Child) -> Result<Value> {
    let (offline, _) = crate::soak::spawn_offline(a, daemon)?;
    offline.call(json!({"op": "greedy"}), &[])?;
    let mut out = serde_json::Map::new();
    for name in &a.trace_modes {
        let miad = name == "miad";
        let before = reclaims(daemon);
        let req =
            json!({"op": "trace", "secs": a.trace_secs, "miad": miad, "mean_gap_s": a.mean_gap_s});
        let t = online.call(req, &[])?;
        let n = reclaims(daemon) - before;
        let secs = t["secs"].as_f64().unwrap_or(a.trace_secs);
        let per_min = n as f64 * 60.0 / secs;
        let late = t["grows_second_half"].as_f64().unwrap_or(0.0) * 120.0 / secs;
        println!(
            "  demand trace, {name}: {n} reclaims in {secs:.0} s = {per_min:.1}/min, online grows in the second half {late:.1}/min (target {}); online short of its demand in {} of its 10 ms ticks, {:.1} spare handles on average",
            a.target_reclaims_per_min, t["short_ticks"], t["mean_spare_handles"].as_f64().unwrap_or(0.0)
        );
        out.insert(
            name.clone(),
            json!({"reclaims": n, "reclaims_per_min": per_min, "grows_per_min_second_half": late, "online": t}),
        );
    }
    out.insert(
        "offline_end".into(),
        offline.call(json!({"op": "stop"}), &[])?,
    );
    out.insert(
        "target_reclaims_per_min".into(),
        a.target_reclaims_per_min.into(),
    );
    Ok(Value::Object(out))
}

/// After the cycles: offline killed while holding memory, the daemon killed and restarted while
/// online maps memory, then everything stopped. Returns the checks with NVML's readings.
fn faults(
    a: &E2eArgs,
    dir: &Path,
    mut daemon: Daemon,
    offline: Child,
    online: Child,
) -> Result<Value> {
    let used_with_all = mib(nvml_used());
    drop(offline); // SIGKILL, holding most of the pool
    let offline_freed = wait_until("the killed offline's handles back in the pool", 5, || {
        daemon.status().is_ok_and(|s| s["gpus"][0]["offline"] == 0)
    });
    let st = daemon.status()?;
    let miad = if a.trace_secs > 0.0 {
        traces(a, &daemon, &online)?
    } else {
        Value::Null
    };
    let n = a.offline_gib * 1024 / HANDLE_MIB;
    let g = online.call(json!({"op": "grow", "count": n}), &[])?;
    online.call(json!({"op": "use"}), &[])?;
    daemon.signal(nix::sys::signal::Signal::SIGKILL)?;
    let online_after_daemon_kill = online.call(json!({"op": "use"}), &[]).is_ok();
    let used_daemon_dead = mib(nvml_used());
    let daemon = Daemon::start(a, dir)?;
    let restarted = daemon.status()?;
    drop(online);
    drop(daemon); // SIGTERM
    std::thread::sleep(Duration::from_millis(1500));
    let used_end = mib(nvml_used());
    Ok(json!({
        "used_mib_with_both_clients": used_with_all,
        "offline_killed_handles_back": offline_freed,
        "pool_after_offline_kill": st["gpus"][0],
        "online_took_whole_pool": g["got"] == n,
        "online_uses_its_memory_after_daemon_sigkill": online_after_daemon_kill,
        "used_mib_daemon_dead_online_alive": used_daemon_dead,
        "restarted_pool": restarted["gpus"][0],
        "used_mib_after_everything_stopped": used_end,
        "miad_traces": miad,
    }))
}

/// Runs the end-to-end measurement; fails if offline's untouched memory changed, a fault left
/// memory behind, or a client crashed.
pub fn run(a: &E2eArgs) -> Result<()> {
    if !valve_vmm::driver_present() {
        println!("SKIP: no CUDA driver here; run valve-memprobe e2e on a GPU host");
        return Ok(());
    }
    let dir = std::env::temp_dir().join(format!("valve-e2e-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let used_start = mib(nvml_used());
    let daemon = Daemon::start(a, &dir)?;
    let (offline, started) = crate::soak::spawn_offline(a, &daemon)?;
    let online = crate::soak::spawn_online(a, &daemon)?;
    let n = a.offline_gib * 1024 / HANDLE_MIB;
    println!("== e2e: daemon pool capped at {} GiB in {HANDLE_MIB} MiB handles, all lent to offline ({} passes per kernel)",
        a.offline_gib, started["passes"]);
    let mut sizes = Vec::new();
    for k in a
        .reclaim_mib
        .iter()
        .map(|m| m / HANDLE_MIB)
        .filter(|&k| k > 0 && k < n)
    {
        sizes.push(cycles(&online, &offline, k, a.reps)?);
    }
    let (offline, online, soak) = crate::soak::run(a, &daemon, offline, online)?;
    let pool_status = daemon.status()?;
    let end = offline.call(json!({"op": "stop"}), &[])?;
    let offline_ok = end["kernel_error"].is_null()
        && end["bad_words"] == 0
        && end["verified_slots"].as_u64().unwrap_or(0) > 0;
    println!("  offline: {} kernels of {} passes, {} slots invalidated by reclaims, {} untouched slots checked, {} bad words, error {} -> {}",
        end["launches"], end["passes"], end["invalidated_slots"], end["verified_slots"], end["bad_words"], end["kernel_error"],
        if offline_ok { "OK" } else { "FAILED" });
    let f = faults(a, &dir, daemon, offline, online)?;
    let leaked = match (f["used_mib_after_everything_stopped"].as_f64(), used_start) {
        (Some(e), Some(s)) => e - s,
        _ => f64::NAN,
    };
    let checks = json!({
        "offline_outputs_intact": offline_ok,
        "offline_killed_memory_returns": f["offline_killed_handles_back"],
        "online_survives_daemon_sigkill": f["online_uses_its_memory_after_daemon_sigkill"],
        "restarted_pool_starts_empty": f["restarted_pool"]["handles"] == 0,
        "no_gpu_memory_leaked": leaked.abs() < 64.0,
        "soak_no_handle_leaked": soak["leaks"].as_array().is_some_and(|l| l.is_empty()),
    });
    println!("== faults: {f}\n== checks: {checks} (NVML used at start {used_start:?} MiB, at the end {} MiB)", f["used_mib_after_everything_stopped"]);
    let report = json!({"device": valve_vmm::Gpu::open(0)?.name()?, "used_mib_at_start": used_start,
        "offline_start": started, "grows": sizes, "pool_status": pool_status, "offline_end": end,
        "faults": f, "leaked_mib": leaked, "soak": soak, "checks": checks});
    std::fs::create_dir_all(&a.out)?;
    std::fs::write(
        a.out.join("e2e.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    let _ = std::fs::copy(dir.join("daemon.log"), a.out.join("daemon.log"));
    let failed: Vec<&String> = checks
        .as_object()
        .into_iter()
        .flatten()
        .filter(|(_, v)| **v != true)
        .map(|(k, _)| k)
        .collect();
    if !failed.is_empty() {
        bail!("failed checks: {failed:?}");
    }
    Ok(())
}
