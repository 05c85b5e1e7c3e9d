//! What `valvectl top` shows, worked out from successive [`Sample`]s: each GPU's processes with
//! their role and state, rates from the difference of two samples' counters, and the gate's and
//! the pool's totals. [`Snapshot`] is also what `--once --json` prints.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use serde_json::Value;

use super::sample::{Counters, Sample};

/// One frame's data.
#[derive(Clone, Debug, Serialize)]
pub struct Snapshot {
    /// The daemon's control socket.
    pub socket: String,
    /// When the latest sample was taken (Unix time, ms).
    pub unix_ms: u64,
    /// The daemon's uptime, seconds.
    pub uptime_s: f64,
    /// The span the rates are measured over, seconds (`None`: one sample, no rates yet).
    pub interval_s: Option<f64>,
    /// Where the per-GPU counters come from: `metrics` (the daemon's, every freeze) or `gate`
    /// (the gate's status, gate freezes only: the daemon keeps no metrics).
    pub counters: &'static str,
    /// The gate.
    pub gate: GateView,
    /// One entry per GPU, by Valve's index.
    pub gpus: Vec<GpuView>,
    /// The memory pool.
    pub pool: PoolView,
    /// What is missing and why.
    pub notes: Vec<String>,
}

/// The gate's state and totals.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GateView {
    /// A gate runs.
    pub running: bool,
    /// It holds offline frozen now.
    pub offline_frozen: bool,
    /// Held frozen by a framework's `busy` signal.
    pub pinned: bool,
    /// Online processes by label, if so named.
    pub online_label: Option<String>,
    /// Offline processes by label, if so named.
    pub offline_label: Option<String>,
    /// The gate's freezes so far (all GPUs at once count one).
    pub preemptions: u64,
    /// Its releases so far.
    pub resumes: u64,
    /// Freezes per second over the last interval.
    pub preemptions_per_s: Option<f64>,
    /// Releases per second over the last interval.
    pub resumes_per_s: Option<f64>,
    /// The cooldown in force, us.
    pub cooldown_us: Option<f64>,
    /// Offline time gates let run since the daemon started, s (from its metrics; all offline
    /// labels).
    pub harvested_s: Option<f64>,
    /// Offline time spent frozen, s: from the metrics, by gates and by hand (booked when a
    /// hold ends); else the running gate's own total.
    pub frozen_s: Option<f64>,
}

/// One GPU.
#[derive(Clone, Debug, Default, Serialize)]
pub struct GpuView {
    /// Valve's index (PCI order, as nvidia-smi).
    pub index: usize,
    /// The device's name.
    pub name: String,
    /// Its processes (those with channels on it), online first.
    pub processes: Vec<ProcessView>,
    /// Online processes on it.
    pub online: usize,
    /// Offline processes on it.
    pub offline: usize,
    /// Processes frozen on it now.
    pub frozen: usize,
    /// Freezes of this GPU so far.
    pub preemptions: Option<f64>,
    /// Releases so far.
    pub resumes: Option<f64>,
    /// Freezes per second over the last interval.
    pub preemptions_per_s: Option<f64>,
    /// Releases per second over the last interval.
    pub resumes_per_s: Option<f64>,
    /// The latest disable's time, us (the mean of the last interval that had any).
    pub disable_last_us: Option<f64>,
    /// The median disable time since the daemon started, us.
    pub disable_p50_us: Option<f64>,
    /// The share of the harvest profile's shortest window in which offline could run.
    pub offline_could_run: Option<f64>,
    /// That window, s.
    pub harvest_window_s: Option<u64>,
    /// The pool's handles on this GPU, if it pools it.
    pub pool: Option<PoolGpu>,
}

/// A process on one GPU.
#[derive(Clone, Debug, Serialize)]
pub struct ProcessView {
    /// Its pid.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// `online`, `offline` (named offline by the gate, or frozen by hand), or `-`.
    pub role: &'static str,
    /// `running` or `frozen`.
    pub state: &'static str,
    /// Who froze it: `gate` or `preempt` (by hand).
    pub frozen_by: Option<&'static str>,
    /// Its channels on this GPU.
    pub channels: u64,
    /// Pool handles it holds on this GPU.
    pub pool_handles: Option<u64>,
}

/// The pool's handles on one GPU.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PoolGpu {
    /// Handle size, MiB.
    pub handle_mib: u64,
    /// Free handles.
    pub free: u64,
    /// Handles online holds.
    pub online: u64,
    /// Handles offline holds.
    pub offline: u64,
}

/// The memory pool.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PoolView {
    /// The pool answered.
    pub running: bool,
    /// Why it did not.
    pub error: Option<String>,
    /// Reclaims so far.
    pub reclaims: Option<u64>,
    /// Reclaims per second over the last interval.
    pub reclaims_per_s: Option<f64>,
    /// Handles taken back from offline so far.
    pub handles_reclaimed: Option<u64>,
    /// Offline processes killed for missing a reclaim's deadline.
    pub killed: Option<u64>,
    /// The latest reclaim's time, us.
    pub last_reclaim_us: Option<u64>,
}

/// Turns successive samples into snapshots, keeping what rates need from the one before.
#[derive(Debug, Default)]
pub struct Tracker {
    socket: String,
    prev: Option<Sample>,
    /// The latest disable time per GPU, carried over intervals without a disable.
    last_disable_us: BTreeMap<usize, f64>,
}

impl Tracker {
    /// A tracker for the daemon on `socket` (shown in the header).
    pub fn new(socket: &std::path::Path) -> Self {
        Tracker {
            socket: socket.display().to_string(),
            ..Tracker::default()
        }
    }

    /// The snapshot of `cur`, with rates against the previous sample.
    pub fn update(&mut self, cur: Sample) -> Snapshot {
        let prev_sample = self.prev.take();
        let prev = prev_sample.as_ref();
        let dt = prev
            .map(|p| cur.at.saturating_duration_since(p.at).as_secs_f64())
            .filter(|d| *d > 0.0);
        let mut notes = Vec::new();
        let gate = gate_view(&cur, prev, dt);
        let pool = pool_view(&cur, prev, dt);
        let mut gpus = gpu_views(&cur);
        place_processes(&cur, &mut gpus, &mut notes);
        let counters = match (&cur.metrics, prev.map(|p| &p.metrics)) {
            (Ok(now), before) => {
                let before = before.and_then(|b| b.as_ref().ok());
                for g in &mut gpus {
                    self.gpu_counters(g, now, before, dt);
                }
                "metrics"
            }
            (Err(why), _) => {
                notes.push(format!(
                    "per-GPU counts are the gate's alone, and harvested time is unknown: {why}"
                ));
                for g in gpus.iter_mut().filter(|g| g.offline > 0 && gate.running) {
                    g.preemptions = Some(gate.preemptions as f64);
                    g.resumes = Some(gate.resumes as f64);
                    g.preemptions_per_s = gate.preemptions_per_s;
                    g.resumes_per_s = gate.resumes_per_s;
                    g.disable_p50_us = cur.status["gate"]["disable_us"]["p50_us"]
                        .as_f64()
                        .filter(|_| cur.status["gate"]["disable_us"]["n"].as_u64() > Some(0));
                }
                "gate"
            }
        };
        harvest_shares(&cur, &mut gpus);
        pool_gpus(&cur, &mut gpus);
        if !pool.running {
            if let Some(e) = &pool.error {
                if !e.starts_with("not running") {
                    notes.push(format!("pool: {e}"));
                }
            }
        }
        let snap = Snapshot {
            socket: self.socket.clone(),
            unix_ms: cur.unix_ms,
            uptime_s: cur.status["uptime_s"].as_f64().unwrap_or(0.0),
            interval_s: dt,
            counters,
            gate,
            gpus,
            pool,
            notes,
        };
        self.prev = Some(cur);
        snap
    }

    fn gpu_counters(
        &mut self,
        g: &mut GpuView,
        now: &Counters,
        before: Option<&Counters>,
        dt: Option<f64>,
    ) {
        let i = g.index;
        let counter = |c: &BTreeMap<usize, f64>| c.get(&i).copied().unwrap_or(0.0);
        g.preemptions = Some(counter(&now.preemptions));
        g.resumes = Some(counter(&now.resumes));
        if let (Some(b), Some(dt)) = (before, dt) {
            g.preemptions_per_s = rate(counter(&now.preemptions), counter(&b.preemptions), dt);
            g.resumes_per_s = rate(counter(&now.resumes), counter(&b.resumes), dt);
        }
        let Some(h) = now.disable.get(&i) else { return };
        g.disable_p50_us = h.quantile(0.5).map(|s| s * 1e6);
        let (sum0, n0) = before
            .and_then(|b| b.disable.get(&i))
            .map_or((0.0, 0.0), |b| (b.sum, b.count));
        if h.count > n0 && h.sum >= sum0 {
            self.last_disable_us
                .insert(i, (h.sum - sum0) / (h.count - n0) * 1e6);
        }
        g.disable_last_us = self.last_disable_us.get(&i).copied();
    }
}

/// Per second, unless the counter went back (a daemon restart).
fn rate(now: f64, before: f64, dt: f64) -> Option<f64> {
    (now >= before).then(|| (now - before) / dt)
}

fn gate_view(cur: &Sample, prev: Option<&Sample>, dt: Option<f64>) -> GateView {
    let g = &cur.status["gate"];
    let metrics = cur.metrics.as_ref().ok();
    // The metrics keep offline time across gates (and frozen time by hand too). A fold, not
    // `sum`: an empty f64 sum is -0.0.
    let harvested_s = metrics.map(|m| m.harvested_s.values().fold(0.0, |a, b| a + b));
    let frozen_s = metrics.map(|m| m.frozen_s.values().fold(0.0, |a, b| a + b));
    if g["running"] != true {
        return GateView {
            harvested_s,
            frozen_s,
            ..GateView::default()
        };
    }
    let n = |v: &Value, k: &str| v[k].as_u64().unwrap_or(0);
    let before = prev
        .map(|p| &p.status["gate"])
        .filter(|b| b["running"] == true);
    let per_s = |k: &str| {
        before
            .zip(dt)
            .and_then(|(b, dt)| rate(n(g, k) as f64, n(b, k) as f64, dt))
    };
    GateView {
        running: true,
        offline_frozen: g["preempted"] == true,
        pinned: g["pinned"] == true,
        online_label: g["online_label"].as_str().map(String::from),
        offline_label: g["offline_label"].as_str().map(String::from),
        preemptions: n(g, "preemptions"),
        resumes: n(g, "resumes"),
        preemptions_per_s: per_s("preemptions"),
        resumes_per_s: per_s("resumes"),
        cooldown_us: g["cooldown_us"].as_f64(),
        harvested_s,
        frozen_s: frozen_s.or_else(|| g["preempted_s"].as_f64()),
    }
}

fn pool_view(cur: &Sample, prev: Option<&Sample>, dt: Option<f64>) -> PoolView {
    let v = match &cur.pool {
        Ok(v) => v,
        Err(e) => {
            return PoolView {
                error: Some(e.clone()),
                ..PoolView::default()
            }
        }
    };
    let r = &v["reclaims"];
    let reclaims = r["reclaims"].as_u64();
    let before = prev
        .and_then(|p| p.pool.as_ref().ok())
        .and_then(|p| p["reclaims"]["reclaims"].as_u64());
    PoolView {
        running: true,
        error: None,
        reclaims,
        reclaims_per_s: match (reclaims, before, dt) {
            (Some(now), Some(b), Some(dt)) => rate(now as f64, b as f64, dt),
            _ => None,
        },
        handles_reclaimed: r["handles"].as_u64(),
        killed: r["killed"].as_u64(),
        last_reclaim_us: r["last_us"].as_u64(),
    }
}

fn gpu_views(cur: &Sample) -> Vec<GpuView> {
    cur.status["gpus"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(k, g)| GpuView {
            index: g["index"].as_u64().map_or(k, |i| i as usize),
            name: g["name"].as_str().unwrap_or("").to_string(),
            ..GpuView::default()
        })
        .collect()
}

fn pid_set(v: &Value) -> BTreeSet<u32> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p.as_u64().map(|p| p as u32))
        .collect()
}

/// Puts each process the daemon knows on the GPUs it has channels on, with its role and state.
fn place_processes(cur: &Sample, gpus: &mut [GpuView], notes: &mut Vec<String>) {
    let gate = &cur.status["gate"];
    let gate_on = gate["running"] == true;
    let online = pid_set(&gate["online_pids"]);
    let offline = pid_set(&gate["offline_pids"]);
    let by_hand = pid_set(&cur.status["preempted"]);
    let gate_frozen = gate_on && gate["preempted"] == true;
    let mut undiscoverable = 0;
    for p in cur.ps["processes"].as_array().into_iter().flatten() {
        let Some(pid) = p["pid"].as_u64().map(|p| p as u32) else {
            continue;
        };
        if p["discoverable"] == false {
            undiscoverable += 1;
            continue;
        }
        let manual = by_hand.contains(&pid) || p["preempted"] == true;
        let (role, state, frozen_by) = if online.contains(&pid) {
            ("online", "running", None)
        } else if manual {
            // Only offline work is ever frozen.
            ("offline", "frozen", Some("preempt"))
        } else if offline.contains(&pid) && gate_frozen {
            ("offline", "frozen", Some("gate"))
        } else if offline.contains(&pid) {
            ("offline", "running", None)
        } else {
            ("-", "running", None)
        };
        for v in p["gpus"].as_array().into_iter().flatten() {
            let Some(i) = v["gpu"].as_u64().map(|i| i as usize) else {
                continue;
            };
            let Some(g) = gpus.iter_mut().find(|g| g.index == i) else {
                continue;
            };
            g.processes.push(ProcessView {
                pid,
                comm: p["comm"].as_str().unwrap_or("?").to_string(),
                role,
                state,
                frozen_by,
                channels: v["channels"].as_u64().unwrap_or(0),
                pool_handles: None,
            });
        }
    }
    for g in gpus.iter_mut() {
        let order = |r: &str| match r {
            "online" => 0,
            "offline" => 1,
            _ => 2,
        };
        g.processes.sort_by_key(|p| (order(p.role), p.pid));
        g.online = g.processes.iter().filter(|p| p.role == "online").count();
        g.offline = g.processes.iter().filter(|p| p.role == "offline").count();
        g.frozen = g.processes.iter().filter(|p| p.state == "frozen").count();
    }
    if undiscoverable > 0 {
        notes.push(format!(
            "{undiscoverable} process(es) started before the daemon are not shown (their \
             channels were never seen; see `valvectl ps`)"
        ));
    }
}

/// The share of the profile's shortest window in which offline could run, per GPU.
fn harvest_shares(cur: &Sample, gpus: &mut [GpuView]) {
    let Some(h) = &cur.harvest else { return };
    for hg in h["gpus"].as_array().into_iter().flatten() {
        let Some(g) = hg["index"]
            .as_u64()
            .and_then(|i| gpus.iter_mut().find(|g| g.index as u64 == i))
        else {
            continue;
        };
        let w = &hg["windows"][0];
        if w["covered_s"].as_f64().unwrap_or(0.0) > 0.0 {
            g.offline_could_run = w["busy_fraction"].as_f64().map(|b| 1.0 - b);
            g.harvest_window_s = w["window_s"].as_u64();
        }
    }
}

/// The pool's handles per GPU and per process.
fn pool_gpus(cur: &Sample, gpus: &mut [GpuView]) {
    let Ok(v) = &cur.pool else { return };
    for pg in v["gpus"].as_array().into_iter().flatten() {
        let Some(g) = pg["gpu"]
            .as_u64()
            .and_then(|i| gpus.iter_mut().find(|g| g.index as u64 == i))
        else {
            continue;
        };
        let n = |k: &str| pg[k].as_u64().unwrap_or(0);
        g.pool = Some(PoolGpu {
            handle_mib: n("handle_bytes") >> 20,
            free: n("free"),
            online: n("online"),
            offline: n("offline"),
        });
    }
    for c in v["clients"].as_array().into_iter().flatten() {
        let (Some(pid), Some(gpu)) = (c["pid"].as_u64(), c["gpu"].as_u64()) else {
            continue;
        };
        let handles = c["handles"].as_u64().unwrap_or(0);
        let Some(g) = gpus.iter_mut().find(|g| g.index as u64 == gpu) else {
            continue;
        };
        if let Some(p) = g.processes.iter_mut().find(|p| p.pid as u64 == pid) {
            *p.pool_handles.get_or_insert(0) += handles;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, Instant};

    use serde_json::json;

    use super::*;

    /// A two-GPU node: online 100 on GPU 0, offline 200 (gated, frozen now) on both, offline
    /// 300 frozen by hand on GPU 1; the pool on GPU 0; `n` freezes so far on GPU 0.
    pub(crate) fn sample(at: Instant, n: f64, pool_reclaims: u64) -> Sample {
        let status = json!({
            "uptime_s": 3725.0,
            "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3"}, {"index": 1, "name": "NVIDIA H100 80GB HBM3"}],
            "preempted": [300],
            "gate": {"running": true, "preempted": true, "pinned": false, "preemptions": n as u64,
                     "resumes": n as u64 - 1, "online_pids": [100], "offline_pids": [200],
                     "online_label": null, "offline_label": "batch", "cooldown_us": 12000.0,
                     "preempted_s": 4.0, "disable_us": {"n": 3, "p50_us": 700.0}},
        });
        let gpu = |i: u32, ch: u32| json!({"gpu": i, "channels": ch});
        let ps = json!({"processes": [
            {"pid": 100, "comm": "vllm", "discoverable": true, "preempted": false, "gpus": [gpu(0, 20)]},
            {"pid": 200, "comm": "train.py", "discoverable": true, "preempted": false, "gpus": [gpu(0, 20), gpu(1, 20)]},
            {"pid": 300, "comm": "bench", "discoverable": true, "preempted": true, "gpus": [gpu(1, 8)]},
            {"pid": 400, "comm": "old", "discoverable": false},
        ]});
        let text = format!(
            "valve_preemptions_total{{gpu=\"0\",label=\"batch\",source=\"gate\"}} {n}\n\
             valve_resumes_total{{gpu=\"0\",label=\"batch\",source=\"gate\"}} {}\n\
             valve_disable_seconds_sum{{gpu=\"0\"}} {}\n\
             valve_disable_seconds_count{{gpu=\"0\"}} {n}\n\
             valve_disable_seconds_bucket{{le=\"0.00064\",gpu=\"0\"}} 0\n\
             valve_disable_seconds_bucket{{le=\"0.00128\",gpu=\"0\"}} {n}\n\
             valve_offline_harvested_seconds_total{{label=\"batch\"}} 812.25\n\
             valve_offline_frozen_seconds_total{{label=\"batch\",source=\"gate\"}} 45.5\n",
            n - 1.0,
            n * 0.0007
        );
        let pool = json!({"ok": true,
            "gpus": [{"gpu": 0, "handle_bytes": 64u64 << 20, "handles": 10, "free": 2, "online": 5, "offline": 3}],
            "clients": [{"pid": 100, "role": "online", "gpu": 0, "handles": 5},
                        {"pid": 200, "role": "offline", "gpu": 0, "handles": 3}],
            "reclaims": {"reclaims": pool_reclaims, "handles": 12, "killed": 0, "last_us": 1800}});
        Sample {
            at,
            unix_ms: 1_764_000_000_000,
            status,
            ps,
            metrics: Ok(Counters::parse(&text)),
            harvest: Some(json!({"gpus": [{"index": 0, "windows": [
                {"window_s": 60, "covered_s": 60.0, "busy_fraction": 0.25}]}]})),
            pool: Ok(pool),
        }
    }

    #[test]
    fn rates_come_from_two_samples_and_roles_from_the_gate() {
        let t0 = Instant::now();
        let mut tr = Tracker::new(std::path::Path::new("/run/valve/valve.sock"));
        let first = tr.update(sample(t0, 10.0, 3));
        assert_eq!(first.interval_s, None);
        assert_eq!(first.gpus[0].preemptions_per_s, None, "one sample: no rate");
        let s = tr.update(sample(t0 + Duration::from_secs(2), 16.0, 4));
        assert_eq!(s.interval_s, Some(2.0));
        let g0 = &s.gpus[0];
        assert_eq!(g0.preemptions, Some(16.0));
        assert_eq!(g0.preemptions_per_s, Some(3.0));
        assert_eq!(g0.resumes_per_s, Some(3.0));
        // Six disables of 0.7 ms in the interval.
        assert!((g0.disable_last_us.unwrap() - 700.0).abs() < 1e-6);
        assert!(g0.disable_p50_us.unwrap() > 640.0);
        assert_eq!(s.gate.preemptions_per_s, Some(3.0));
        assert_eq!(s.pool.reclaims_per_s, Some(0.5));
        assert_eq!(s.gate.harvested_s, Some(812.25));
        assert_eq!(s.gate.frozen_s, Some(45.5));
        assert_eq!(g0.offline_could_run, Some(0.75));
        // GPU 1 had no disable recorded: nothing made up.
        assert_eq!(s.gpus[1].disable_last_us, None);
        assert_eq!(s.gpus[1].preemptions_per_s, Some(0.0));
        // Roles and states.
        let on0: Vec<_> = g0
            .processes
            .iter()
            .map(|p| (p.pid, p.role, p.state, p.pool_handles))
            .collect();
        assert_eq!(
            on0,
            vec![
                (100, "online", "running", Some(5)),
                (200, "offline", "frozen", Some(3))
            ]
        );
        let by_hand = s.gpus[1].processes.iter().find(|p| p.pid == 300).unwrap();
        assert_eq!(
            (by_hand.state, by_hand.frozen_by),
            ("frozen", Some("preempt"))
        );
        assert_eq!((s.gpus[1].offline, s.gpus[1].frozen), (2, 2));
        assert!(s
            .notes
            .iter()
            .any(|n| n.contains("1 process(es) started before")));
    }

    #[test]
    fn a_counter_that_went_back_gives_no_rate() {
        let t0 = Instant::now();
        let mut tr = Tracker::new(std::path::Path::new("/s"));
        tr.update(sample(t0, 10.0, 3));
        let s = tr.update(sample(t0 + Duration::from_secs(1), 2.0, 3));
        assert_eq!(s.gpus[0].preemptions_per_s, None);
    }

    #[test]
    fn without_metrics_the_gate_counts_for_its_offline_gpus() {
        let t0 = Instant::now();
        let mut tr = Tracker::new(std::path::Path::new("/s"));
        let mut a = sample(t0, 10.0, 3);
        a.metrics = Err("this daemon keeps no metrics".into());
        tr.update(a);
        let mut b = sample(t0 + Duration::from_secs(1), 12.0, 3);
        b.metrics = Err("this daemon keeps no metrics".into());
        let s = tr.update(b);
        assert_eq!(s.counters, "gate");
        assert_eq!(s.gpus[0].preemptions_per_s, Some(2.0));
        assert_eq!(s.gpus[0].disable_p50_us, Some(700.0));
        assert_eq!(s.gate.harvested_s, None);
        assert_eq!(s.gate.frozen_s, Some(4.0));
        assert!(s.notes.iter().any(|n| n.contains("no metrics")));
    }
}
