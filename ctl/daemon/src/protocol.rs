//! The daemon's protocol: one JSON request line per Unix-socket connection, one JSON reply line,
//! and the exit codes replies carry. `valvectl` sends these (its `client`); `server` answers.

use serde::{Deserialize, Serialize};

/// Where the daemon listens by default.
pub const DEFAULT_SOCKET: &str = "/run/valve/valve.sock";
/// Where the daemon keeps its state by default.
pub const DEFAULT_STATE_DIR: &str = "/run/valve";

/// The longest request line the daemon reads (64 KiB; real requests are under 1 KiB). A
/// longer one is refused after this many bytes, unread beyond them.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// Exit code: the daemon is not running.
pub const EXIT_NO_DAEMON: i32 = 7;
/// Exit code: no such process, no GPU channels, or not discoverable.
pub const EXIT_PROCESS: i32 = 8;
/// Exit code: BPF or the ioctl tracepoints are unavailable.
pub const EXIT_BPF: i32 = 9;
/// Exit code: the process is a CUDA MPS client or server, whose work Valve cannot freeze.
pub const EXIT_MPS: i32 = 10;
/// Exit code: RM refused (as in the CLI).
pub const EXIT_RM: i32 = 5;

/// A request to the daemon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Processes the daemon knows, with their GPUs and channels.
    Ps,
    /// The daemon's own state.
    Status,
    /// Disable all channels of `pid` (on one GPU if `gpu` is given) and keep them disabled.
    Preempt {
        /// The process.
        pid: u32,
        /// A GPU selector (index, UUID, PCI address), or all of the process's GPUs.
        gpu: Option<String>,
        /// Resume by itself after this long (capped by the daemon's own maximum).
        max_hold_ms: Option<u64>,
    },
    /// Enable what the daemon disabled for `pid`.
    Resume {
        /// The process.
        pid: u32,
    },
    /// Enable everything the daemon disabled.
    ResumeAll,
    /// Start gating: offline runs only while online is idle.
    GateStart(Box<GateSpec>),
    /// Stop gating (offline is resumed); the reply is the final status.
    GateStop,
    /// The gate's status (`running: false` when there is none).
    GateStatus,
    /// From a serving framework: an online request is in flight (preempt now, hold until idle).
    OnlineBusy,
    /// From a serving framework: no online request is in flight (resume now).
    OnlineIdle,
    /// The gate's decision trace: records after sequence number `after`.
    GateTrace {
        /// Only records after this sequence number (0: from the oldest kept).
        #[serde(default)]
        after: u64,
        /// At most this many records (default 10000).
        #[serde(default)]
        limit: Option<usize>,
    },
    /// The node harvest profile (`valvectl profile`): the latest `valve_harvest::NodeHarvest`
    /// document, as the harvest thread last built it.
    Harvest,
}

/// Read-only requests the socket loop answers itself, beside [`Request`] (which the daemon's
/// core answers); same wire form, one JSON line with an `op`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LoopRequest {
    /// The daemon's Prometheus metrics as the text `--metrics-addr` serves, in
    /// `{"text": "..."}` (`valvectl top` reads its per-GPU counters there); an error when the
    /// daemon keeps no metrics (started without `--metrics-addr`).
    Metrics,
}

/// What to gate and how, for [`Request::GateStart`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GateSpec {
    /// Online processes by pid.
    #[serde(default)]
    pub online: Vec<u32>,
    /// Online processes by label (`VALVE_LABEL=<label>` in their environment).
    #[serde(default)]
    pub online_label: Option<String>,
    /// Offline processes by pid.
    #[serde(default)]
    pub offline: Vec<u32>,
    /// Offline processes by label.
    #[serde(default)]
    pub offline_label: Option<String>,
    /// Shortest cooldown, us.
    #[serde(default)]
    pub cooldown_floor_us: Option<u64>,
    /// Longest cooldown (and the one used until a first request ended), us.
    #[serde(default)]
    pub cooldown_ceiling_us: Option<u64>,
    /// Cooldown = factor x the longest recent inter-iteration gap.
    #[serde(default)]
    pub gap_factor: Option<f64>,
    /// How long an iteration gap counts as recent, ms.
    #[serde(default)]
    pub gap_memory_ms: Option<u64>,
    /// A fixed cooldown instead of the learned one, us.
    #[serde(default)]
    pub fixed_cooldown_us: Option<u64>,
    /// The share (%) of online's idle time offline may give up to a hold after the cooldown, so
    /// that arrivals find it frozen already (`gate start --hold-budget`).
    #[serde(default)]
    pub hold_budget_pct: Option<f64>,
    /// Online processes by the TCP port they listen on.
    #[serde(default)]
    pub online_ports: Vec<u16>,
    /// Preempt when request data reaches an online port (default: on); launch edges always.
    #[serde(default)]
    pub arrivals: Option<bool>,
    /// How several offline GPUs are issued: "auto" (default: measured once), "serial", "parallel".
    #[serde(default)]
    pub issue: Option<String>,
    /// Online threads waiting for their GPU work keep online busy (default: on).
    #[serde(default)]
    pub waits: Option<bool>,
    /// SCHED_FIFO priority of the gate's threads; 0: normal scheduling (default: 10).
    #[serde(default)]
    pub realtime_priority: Option<u8>,
    /// Spin on the arrival ring buffer while offline runs (default: off).
    #[serde(default)]
    pub arrival_busy_poll: Option<bool>,
}

/// Why a request failed; `code` is the exit code valvectl uses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Exit code (see `valvectl --help`).
    pub code: i32,
    /// What went wrong and how to fix it.
    pub message: String,
}

/// The daemon's answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply {
    /// The request's result, or null on error.
    pub data: serde_json::Value,
    /// Set when the request failed.
    pub error: Option<ErrorReply>,
}

impl Reply {
    /// A success.
    pub fn ok(data: serde_json::Value) -> Self {
        Reply { data, error: None }
    }

    /// A failure.
    pub fn err(code: i32, message: impl Into<String>) -> Self {
        Reply {
            data: serde_json::Value::Null,
            error: Some(ErrorReply {
                code,
                message: message.into(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_have_a_stable_wire_form() {
        let r = Request::Preempt {
            pid: 42,
            gpu: Some("0".into()),
            max_hold_ms: None,
        };
        let s = serde_json::to_string(&r).unwrap();
        assert_eq!(
            s,
            r#"{"op":"preempt","pid":42,"gpu":"0","max_hold_ms":null}"#
        );
        assert_eq!(serde_json::from_str::<Request>(&s).unwrap(), r);
        assert_eq!(
            serde_json::to_string(&Request::ResumeAll).unwrap(),
            r#"{"op":"resume_all"}"#
        );
        // What a serving framework writes to the socket, one line per connection.
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"online_busy"}"#).unwrap(),
            Request::OnlineBusy
        );
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"online_idle"}"#).unwrap(),
            Request::OnlineIdle
        );
        let g: Request =
            serde_json::from_str(r#"{"op":"gate_start","online":[1],"offline_label":"batch"}"#)
                .unwrap();
        assert_eq!(
            serde_json::from_str::<LoopRequest>(r#"{"op":"metrics"}"#).unwrap(),
            LoopRequest::Metrics
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"metrics"}"#).is_err());
        assert_eq!(
            g,
            Request::GateStart(Box::new(GateSpec {
                online: vec![1],
                offline_label: Some("batch".into()),
                ..GateSpec::default()
            }))
        );
    }
}
