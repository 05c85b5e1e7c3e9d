//! The gate's part of the control socket: its status (`valvectl gate status`) and its decision
//! trace (`valvectl gate trace`), as the daemon sends them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A summary of latency samples, in microseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50_us: f64,
    /// 90th percentile.
    pub p90_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// Largest sample.
    pub max_us: f64,
    /// Arithmetic mean.
    pub mean_us: f64,
}

/// The online processes' probed calls (their uprobes on libcuda's launch and synchronising
/// calls), counted in BPF.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeHits {
    /// Kernel launches (every variant).
    pub kernel_launches: u64,
    /// Graph launches.
    pub graph_launches: u64,
    /// Synchronising calls.
    pub syncs: u64,
}

impl std::ops::AddAssign for ProbeHits {
    fn add_assign(&mut self, o: ProbeHits) {
        self.kernel_launches += o.kernel_launches;
        self.graph_launches += o.graph_launches;
        self.syncs += o.syncs;
    }
}

/// What the gate has done, as `valvectl gate status` shows it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateStatus {
    /// The gate thread is running.
    pub running: bool,
    /// Offline is preempted now.
    pub preempted: bool,
    /// Held preempted by an explicit "busy" signal.
    pub pinned: bool,
    /// Preemptions so far: times offline channels went from running to disabled by this gate
    /// (a decision to preempt while offline has no channels yet is none).
    pub preemptions: u64,
    /// Resumes so far.
    pub resumes: u64,
    /// Idle->busy launch edges of online processes received.
    pub edges: u64,
    /// Of them, edges written while offline was held: they did not wake the gate (the wake-up
    /// would have been taken inside online's launch call) and came within the poll period.
    #[serde(default)]
    pub quiet_edges: u64,
    /// Arrival edges (request data on an online port after idling) received.
    pub arrivals: u64,
    /// Of them, arrivals after online had been idle past the learned cooldown (counted with a
    /// hold only): the ones a hold could catch. Online's activity is read from the launch
    /// counters where offline was frozen (a request in flight then sends the gate no edge).
    #[serde(default)]
    pub arrivals_idle: u64,
    /// Of those, the arrivals that found offline frozen already: the hold (`--hold-budget`)
    /// caught them.
    pub arrivals_held: u64,
    /// Online processes watched.
    pub online_pids: Vec<u32>,
    /// Whether each online process's probes are in: the gate sees its launches only once they
    /// are "attached" (attaching one takes seconds beside busy libcuda users).
    pub online_probes: BTreeMap<u32, ProbeState>,
    /// Every online process's probes are attached.
    pub online_probes_attached: bool,
    /// Online ports whose request arrivals preempt.
    pub online_ports: Vec<u16>,
    /// Offline processes gated.
    pub offline_pids: Vec<u32>,
    /// Their channels, over all GPUs.
    pub offline_channels: usize,
    /// GPUs they use.
    pub offline_gpus: usize,
    /// The cooldown in force now (the hold included).
    pub cooldown_us: f64,
    /// The part of it that holds offline for arrivals likely soon (`--hold-budget`; 0 without).
    pub hold_us: f64,
    /// The share of online's idle time the hold may cost (`--hold-budget`).
    pub hold_budget_pct: Option<f64>,
    /// The gaps between requests the hold was chosen over.
    pub hold_gaps: usize,
    /// How long an arrival holds offline while no launch follows it.
    pub arrival_hold_us: f64,
    /// How the offline GPUs are issued: "serial", "parallel", or "serial (calibrating)".
    pub issue: String,
    /// How the threads an edge crosses are scheduled: the gate thread, then each watcher's poll
    /// thread ("gate SCHED_FIFO 10, launch-watch SCHED_FIFO 10, ...").
    pub scheduling: String,
    /// Every one of those threads preempts a busy CPU when woken (`SCHED_FIFO`, or a short
    /// slice where that was refused); false: an edge can wait for a CPU's slice.
    pub fast_wakeups: bool,
    /// The trace's latest sequence number (`valvectl gate trace --since`).
    pub trace_head: u64,
    /// Total time offline spent preempted by the gate.
    pub preempted_s: f64,
    /// Disable calls (all GPUs at once), wall time.
    pub disable_us: LatencySummary,
    /// Enable calls, wall time.
    pub enable_us: LatencySummary,
    /// From the online launch (uprobe timestamp) to the disable call's start.
    pub reaction_us: LatencySummary,
    /// From the online launch to the disable call's return (the offline GPUs are stopped).
    pub edge_to_disable_us: LatencySummary,
    /// From the request's arrival (BPF timestamp) to the disable call's return.
    pub arrival_to_disable_us: LatencySummary,
    /// The online processes' probed calls so far (of the processes watched now; read at most
    /// every 100 ms).
    pub online_probe_hits: ProbeHits,
    /// Failed disables/enables (each is retried process by process).
    pub errors: u64,
    /// The latest failure.
    pub last_error: Option<String>,
    /// The label online processes were named by (`gate start --online-label`).
    #[serde(default)]
    pub online_label: Option<String>,
    /// The label offline processes were named by (`gate start --offline-label`).
    #[serde(default)]
    pub offline_label: Option<String>,
    /// Whether request arrivals on the online ports preempt (`gate start --arrivals`).
    #[serde(default)]
    pub arrivals_on: bool,
    /// What `gate start` had to say about the gate it started (processes it could not gate yet).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Where an online process's probes are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProbeState {
    /// Asked for, not applied yet: the process's launches are not seen.
    Attaching,
    /// In: its launches are seen.
    Attached,
    /// Attaching them failed (the gate's `last_error` says why): its launches are not seen.
    Failed,
}

/// The answer to the gate's requests: a gate's status, or that there is none. Read through
/// [`serde_json::Value`] rather than `#[serde(untagged)]`: an untagged enum cannot read
/// [`GateStatus::online_probes`]' numeric map keys, and would take every running gate for idle.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum GateReply {
    /// A gate runs, or the one that just stopped (its final status, `running: false`).
    Active(Box<GateStatus>),
    /// No gate: `{"running": false}`, with `starting: true` while one attaches its programs.
    Idle {
        /// Always false.
        running: bool,
        /// A `gate start` is attaching the gate's programs.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        starting: bool,
    },
}

impl GateReply {
    /// No gate (`starting`: one is being started).
    pub fn idle(starting: bool) -> GateReply {
        GateReply::Idle {
            running: false,
            starting,
        }
    }

    /// The status, if a gate runs or has just stopped.
    pub fn status(&self) -> Option<&GateStatus> {
        match self {
            GateReply::Active(s) => Some(s),
            GateReply::Idle { .. } => None,
        }
    }
}

impl<'de> Deserialize<'de> for GateReply {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        struct Idle {
            running: bool,
            #[serde(default)]
            starting: bool,
        }
        let v = serde_json::Value::deserialize(d)?;
        let status = match GateStatus::deserialize(&v) {
            Ok(s) => return Ok(GateReply::Active(Box::new(s))),
            Err(e) => e,
        };
        match Idle::deserialize(&v) {
            Ok(Idle {
                running: false,
                starting,
            }) => Ok(GateReply::idle(starting)),
            // A running gate's status that does not read: say why, not "idle".
            _ => Err(serde::de::Error::custom(format!("gate status: {status}"))),
        }
    }
}

impl From<GateStatus> for GateReply {
    fn from(s: GateStatus) -> GateReply {
        GateReply::Active(Box::new(s))
    }
}

/// The answer to a `gate_trace` request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceReply {
    /// The trace's latest sequence number (ask again with `after` set to it).
    pub head: u64,
    /// The records, oldest first.
    pub records: Vec<TraceEntry>,
}

/// One record of the gate's decision trace (one line of `valvectl gate trace`). Times are
/// CLOCK_MONOTONIC ns.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Position in the trace (1, 2, ...); gaps mean records were overwritten before being read.
    pub seq: u64,
    /// The main timestamp.
    pub t_ns: u64,
    /// What happened, with its fields.
    #[serde(flatten)]
    pub event: TraceEvent,
}

/// What a [`TraceEntry`] is about (its `event`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum TraceEvent {
    /// Request data reached a watched port at `t_ns` (BPF).
    Arrival {
        /// The port.
        port: u32,
        /// When the gate thread got it.
        recv_ns: u64,
        /// The port's idle time before it.
        idle_ns: u64,
        /// When the watcher's thread read it from the ring buffer (0: not stamped).
        read_ns: u64,
    },
    /// An online process launched after idling, at `t_ns` (uprobe).
    Launch {
        /// The process.
        pid: u32,
        /// When the gate thread got it.
        recv_ns: u64,
        /// The idle gap before it.
        idle_ns: u64,
        /// An edge only because it was the process's first launch since the gate resumed
        /// offline (a thread was waiting, or the gap was below the edge gap).
        after_resume: bool,
    },
    /// `valvectl gate busy`, got by the gate thread at `t_ns`.
    Busy,
    /// `valvectl gate idle`, got by the gate thread at `t_ns`.
    Idle,
    /// Offline channels disabled, issued at `t_ns`.
    Disable {
        /// The offline pid (0: all offline processes in one call).
        pid: u32,
        /// When the call returned.
        end_ns: u64,
        /// Whether it succeeded.
        ok: bool,
    },
    /// Offline channels enabled, issued at `t_ns`.
    Enable {
        /// The offline pid (0: all offline processes in one call).
        pid: u32,
        /// When the call returned.
        end_ns: u64,
        /// Whether it succeeded.
        ok: bool,
    },
    /// The gate decided to resume at `t_ns`.
    Cooldown {
        /// The last online activity.
        last_activity_ns: u64,
        /// The cooldown (or arrival hold) that ran out, ns.
        cooldown_ns: u64,
        /// An online thread was still waiting for GPU work and the stuck-wait bound let the
        /// gate resume anyway.
        waits_ignored: bool,
    },
}

#[cfg(test)]
mod tests;
