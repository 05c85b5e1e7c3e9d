//! What `valvectl top` shows, worked out from successive [`Sample`]s: each GPU's processes with
//! their role and state, rates from the difference of two samples' counters, and the gate's and
//! the pool's totals. [`Snapshot`] is also what `--once --json` prints.

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;
use valve_daemon::protocol::{GateReply, StatusReply};
use valve_protocol::gate::GateStatus;

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
    /// With a hold for likely arrivals (`--hold-budget`): what it caught.
    pub hold: Option<HoldView>,
    /// Offline time gates let run since the daemon started, s (from its metrics; all offline
    /// labels).
    pub harvested_s: Option<f64>,
    /// Offline time spent frozen, s: from the metrics, by gates and by hand (booked when a
    /// hold ends); else the running gate's own total.
    pub frozen_s: Option<f64>,
}

/// A gate's hold for likely arrivals.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HoldView {
    /// The part of the cooldown that holds offline for arrivals likely soon, us.
    pub hold_us: f64,
    /// Arrivals after online had idled past the learned cooldown.
    pub idle_arrivals: u64,
    /// Of them, those that found offline frozen already.
    pub caught: u64,
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
                    g.disable_p50_us = gate_status(&cur.status)
                        .map(|s| s.disable_us)
                        .filter(|d| d.n > 0)
                        .map(|d| d.p50_us);
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
            uptime_s: cur.status.uptime_s,
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

/// The gate's status in a daemon's `status` reply, if one runs (or has just stopped).
fn gate_status(status: &StatusReply) -> Option<&GateStatus> {
    status.gate.as_ref().and_then(GateReply::status)
}

fn gate_view(cur: &Sample, prev: Option<&Sample>, dt: Option<f64>) -> GateView {
    let metrics = cur.metrics.as_ref().ok();
    // The metrics keep offline time across gates (and frozen time by hand too). A fold, not
    // `sum`: an empty f64 sum is -0.0.
    let harvested_s = metrics.map(|m| m.harvested_s.values().fold(0.0, |a, b| a + b));
    let frozen_s = metrics.map(|m| m.frozen_s.values().fold(0.0, |a, b| a + b));
    let Some(g) = gate_status(&cur.status).filter(|g| g.running) else {
        return GateView {
            harvested_s,
            frozen_s,
            ..GateView::default()
        };
    };
    let before = prev
        .and_then(|p| gate_status(&p.status))
        .filter(|b| b.running);
    let per_s = |f: fn(&GateStatus) -> u64| {
        before
            .zip(dt)
            .and_then(|(b, dt)| rate(f(g) as f64, f(b) as f64, dt))
    };
    GateView {
        running: true,
        offline_frozen: g.preempted,
        pinned: g.pinned,
        online_label: g.online_label.clone(),
        offline_label: g.offline_label.clone(),
        preemptions: g.preemptions,
        resumes: g.resumes,
        preemptions_per_s: per_s(|s| s.preemptions),
        resumes_per_s: per_s(|s| s.resumes),
        cooldown_us: Some(g.cooldown_us),
        hold: g.hold_budget_pct.map(|_| HoldView {
            hold_us: g.hold_us,
            idle_arrivals: g.arrivals_idle,
            caught: g.arrivals_held,
        }),
        harvested_s,
        frozen_s: frozen_s.or(Some(g.preempted_s)),
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
    let r = &v.reclaims;
    let before = prev
        .and_then(|p| p.pool.as_ref().ok())
        .map(|p| p.reclaims.reclaims);
    PoolView {
        running: true,
        error: None,
        reclaims: Some(r.reclaims),
        reclaims_per_s: match (before, dt) {
            (Some(b), Some(dt)) => rate(r.reclaims as f64, b as f64, dt),
            _ => None,
        },
        handles_reclaimed: Some(r.handles),
        killed: Some(r.killed),
        last_reclaim_us: Some(r.last_us),
    }
}

fn gpu_views(cur: &Sample) -> Vec<GpuView> {
    cur.status
        .gpus
        .iter()
        .map(|g| GpuView {
            index: g.index,
            name: g.name.clone(),
            ..GpuView::default()
        })
        .collect()
}

/// Puts each process the daemon knows on the GPUs it has channels on, with its role and state.
fn place_processes(cur: &Sample, gpus: &mut [GpuView], notes: &mut Vec<String>) {
    let gate = gate_status(&cur.status).filter(|g| g.running);
    let pids = |f: fn(&GateStatus) -> &Vec<u32>| -> BTreeSet<u32> {
        gate.map(|g| f(g).iter().copied().collect())
            .unwrap_or_default()
    };
    let online = pids(|g| &g.online_pids);
    let offline = pids(|g| &g.offline_pids);
    let by_hand: BTreeSet<u32> = cur.status.preempted.iter().copied().collect();
    let gate_frozen = gate.is_some_and(|g| g.preempted);
    let mut undiscoverable = 0;
    for p in &cur.ps.processes {
        let pid = p.pid;
        if !p.discoverable {
            undiscoverable += 1;
            continue;
        }
        let manual = by_hand.contains(&pid) || p.preempted == Some(true);
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
        for v in &p.gpus {
            let Some(i) = v.gpu else {
                continue;
            };
            let Some(g) = gpus.iter_mut().find(|g| g.index == i) else {
                continue;
            };
            g.processes.push(ProcessView {
                pid,
                comm: p.comm.clone(),
                role,
                state,
                frozen_by,
                channels: v.channels as u64,
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
    for hg in &h.gpus {
        let Some(g) = gpus
            .iter_mut()
            .find(|g| g.index as u64 == u64::from(hg.index))
        else {
            continue;
        };
        let Some(w) = hg.windows.first() else {
            continue;
        };
        if w.covered_s > 0.0 {
            g.offline_could_run = Some(1.0 - w.busy_fraction);
            g.harvest_window_s = Some(u64::from(w.window_s));
        }
    }
}

/// The pool's handles per GPU and per process.
fn pool_gpus(cur: &Sample, gpus: &mut [GpuView]) {
    let Ok(v) = &cur.pool else { return };
    for pg in &v.gpus {
        let Some(g) = gpus.iter_mut().find(|g| g.index == pg.gpu) else {
            continue;
        };
        g.pool = Some(PoolGpu {
            handle_mib: pg.handle_bytes as u64 >> 20,
            free: pg.free as u64,
            online: pg.online as u64,
            offline: pg.offline as u64,
        });
    }
    for c in &v.clients {
        let Some(g) = gpus.iter_mut().find(|g| g.index == c.gpu) else {
            continue;
        };
        if let Some(p) = g.processes.iter_mut().find(|p| p.pid == c.pid) {
            *p.pool_handles.get_or_insert(0) += c.handles as u64;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, Instant};

    use serde_json::json;
    use valve_daemon::protocol::{GpuEntry, ProcessEntry, ProcessGpu, PsReply};
    use valve_protocol::gate::LatencySummary;
    use valve_protocol::pool::{ClientEntry, GpuUsage, PoolStatus, ReclaimStats, Role};

    use super::*;

    /// A two-GPU node: online 100 on GPU 0, offline 200 (gated, frozen now) on both, offline
    /// 300 frozen by hand on GPU 1; the pool on GPU 0; `n` freezes so far on GPU 0.
    pub(crate) fn sample(at: Instant, n: f64, pool_reclaims: u64) -> Sample {
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
        Sample {
            at,
            unix_ms: 1_764_000_000_000,
            status: status_fixture(n),
            ps: ps_fixture(),
            metrics: Ok(Counters::parse(&text)),
            harvest: Some(harvest_fixture()),
            pool: Ok(pool_fixture(pool_reclaims)),
        }
    }

    /// The daemon's status: two GPUs, pid 300 frozen by hand, a gate that froze `n` times.
    fn status_fixture(n: f64) -> StatusReply {
        let gpu_entry = |index: usize| GpuEntry {
            index,
            name: "NVIDIA H100 80GB HBM3".into(),
            ..GpuEntry::default()
        };
        let gate = GateStatus {
            running: true,
            preempted: true,
            preemptions: n as u64,
            resumes: n as u64 - 1,
            online_pids: vec![100],
            offline_pids: vec![200],
            offline_label: Some("batch".into()),
            cooldown_us: 12000.0,
            preempted_s: 4.0,
            disable_us: LatencySummary {
                n: 3,
                p50_us: 700.0,
                ..LatencySummary::default()
            },
            ..GateStatus::default()
        };
        StatusReply {
            uptime_s: 3725.0,
            gpus: vec![gpu_entry(0), gpu_entry(1)],
            preempted: vec![300],
            gate: Some(gate.into()),
            ..StatusReply::default()
        }
    }

    /// Online 100 on GPU 0, offline 200 on both, 300 on GPU 1, 400 undiscoverable.
    fn ps_fixture() -> PsReply {
        let gpu = |i: usize, channels: usize| ProcessGpu {
            gpu: Some(i),
            channels,
            ..ProcessGpu::default()
        };
        let process = |pid: u32, comm: &str, preempted: bool, gpus: Vec<ProcessGpu>| ProcessEntry {
            pid,
            comm: comm.into(),
            discoverable: true,
            preempted: Some(preempted),
            gpus,
            note: None,
            mps: None,
        };
        PsReply {
            processes: vec![
                process(100, "vllm", false, vec![gpu(0, 20)]),
                process(200, "train.py", false, vec![gpu(0, 20), gpu(1, 20)]),
                process(300, "bench", true, vec![gpu(1, 8)]),
                ProcessEntry {
                    pid: 400,
                    comm: "old".into(),
                    ..ProcessEntry::default()
                },
            ],
        }
    }

    /// The pool on GPU 0: online 100 holds 5 handles, offline 200 holds 3.
    fn pool_fixture(pool_reclaims: u64) -> PoolStatus {
        let client = |pid: u32, role: Role, handles: usize| ClientEntry {
            client: u64::from(pid),
            pid,
            role,
            gpu: 0,
            handles,
            reservation: None,
        };
        PoolStatus {
            gpus: vec![GpuUsage {
                gpu: 0,
                handle_bytes: 64 << 20,
                handles: 10,
                free: 2,
                online: 5,
                offline: 3,
                ..GpuUsage::default()
            }],
            clients: vec![client(100, Role::Online, 5), client(200, Role::Offline, 3)],
            reclaims: ReclaimStats {
                reclaims: pool_reclaims,
                handles: 12,
                killed: 0,
                last_us: 1800,
                ..ReclaimStats::default()
            },
        }
    }

    /// A harvest profile in which GPU 0 was busy a quarter of its shortest window.
    fn harvest_fixture() -> valve_harvest::NodeHarvest {
        serde_json::from_value(json!({"version": 1, "node": "n1",
            "generated_unix_ms": 1, "source": "test", "gpus": [{"index": 0,
            "memory_total_bytes": 1, "windows": [
                {"window_s": 60, "covered_s": 60.0, "busy_fraction": 0.25, "offline_memory":
                 {"samples": 0, "mean_bytes": 0, "quantiles_bytes": []}}]}]}))
        .unwrap()
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
        assert!(s.gate.hold.is_none(), "no hold: no hold figures");
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

    #[test]
    fn a_gate_with_a_hold_shows_what_it_caught() {
        let mut smp = sample(Instant::now(), 10.0, 3);
        let mut gate = match smp.status.gate.take() {
            Some(GateReply::Active(g)) => *g,
            _ => panic!("the fixture has a running gate"),
        };
        gate.hold_budget_pct = Some(8.0);
        gate.hold_us = 2_150_000.0;
        (gate.arrivals_idle, gate.arrivals_held) = (35, 20);
        smp.status.gate = Some(gate.into());
        let mut tr = Tracker::new(std::path::Path::new("/run/valve/valve.sock"));
        let h = tr.update(smp).gate.hold.expect("a hold");
        assert_eq!(
            (h.hold_us, h.idle_arrivals, h.caught),
            (2_150_000.0, 35, 20)
        );
    }
}
