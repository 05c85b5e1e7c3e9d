//! The control socket: one JSON [`Request`] line per Unix-socket connection, one JSON [`Reply`]
//! line back, each reply's data typed by the request it answers and each error named.
//!
//! The wire form of a request is an object with an `op` (`{"op":"preempt","pid":42}`); a reply
//! is `{"data": ..., "error": null}` or `{"data": null, "error": {"code": 8, "kind":
//! "process", "message": "..."}}`, where `code` is the exit code `valvectl` uses.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::gate::{GateReply, TraceReply};

/// Where the daemon listens by default.
pub const DEFAULT_SOCKET: &str = "/run/valve/valve.sock";
/// Where the daemon keeps its state by default.
pub const DEFAULT_STATE_DIR: &str = "/run/valve";

/// The longest request line the daemon reads (64 KiB; real requests are under 1 KiB). A
/// longer one is refused after this many bytes, unread beyond them.
pub const MAX_REQUEST_BYTES: usize = 64 * 1024;

/// A request to the daemon.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// Says which protocol version the client speaks; answered with a [`Hello`], or with
    /// [`ErrorCode::VersionMismatch`] when the daemon speaks another.
    Hello {
        /// The client's [`crate::PROTOCOL_VERSION`].
        protocol_version: u32,
    },
    /// Processes the daemon knows, with their GPUs and channels; answered with [`PsReply`].
    Ps,
    /// The daemon's own state; answered with [`StatusReply`].
    Status,
    /// Disable all channels of `pid` (on one GPU if `gpu` is given) and keep them disabled;
    /// answered with [`PreemptReply`].
    Preempt {
        /// The process.
        pid: u32,
        /// A GPU selector (index, UUID, PCI address), or all of the process's GPUs.
        gpu: Option<String>,
        /// Resume by itself after this long (capped by the daemon's own maximum).
        max_hold_ms: Option<u64>,
        /// Check the freeze before answering: the reply's `freeze` says whether RM reports every
        /// channel stopped (`valvectl preempt` asks; the memory pool does not wait, its freezes
        /// are checked after the reply).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        confirm: bool,
    },
    /// Enable what the daemon disabled for `pid`; answered with [`ResumeReply`].
    Resume {
        /// The process.
        pid: u32,
    },
    /// Enable everything the daemon disabled; answered with [`ResumeAllReply`].
    ResumeAll,
    /// Start gating: offline runs only while online is idle; answered with [`GateReply`].
    GateStart(Box<GateSpec>),
    /// Stop gating (offline is resumed); the reply is the final [`GateReply`].
    GateStop,
    /// The gate's status, a [`GateReply`] (`running: false` when there is none).
    GateStatus,
    /// From a serving framework: an online request is in flight (preempt now, hold until
    /// idle); answered with [`SignalReply`].
    OnlineBusy,
    /// From a serving framework: no online request is in flight (resume now); answered with
    /// [`SignalReply`].
    OnlineIdle,
    /// The gate's decision trace: records after sequence number `after`, as a [`TraceReply`].
    GateTrace {
        /// Only records after this sequence number (0: from the oldest kept).
        #[serde(default)]
        after: u64,
        /// At most this many records (default 10000).
        #[serde(default)]
        limit: Option<usize>,
    },
    /// The node harvest profile (`valvectl profile`): the latest harvest document (the
    /// `valve-harvest` crate's `NodeHarvest`), as the harvest thread last built it.
    Harvest,
}

impl Request {
    /// Every `op` a [`Request`] may carry.
    pub const OPS: [&'static str; 13] = [
        "hello",
        "ps",
        "status",
        "preempt",
        "resume",
        "resume_all",
        "gate_start",
        "gate_stop",
        "gate_status",
        "online_busy",
        "online_idle",
        "gate_trace",
        "harvest",
    ];
}

/// Read-only requests the socket loop answers itself, beside [`Request`] (which the daemon's
/// core answers); same wire form, one JSON line with an `op`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum LoopRequest {
    /// The daemon's Prometheus metrics as the text `--metrics-addr` serves, in a
    /// [`MetricsReply`]; an error when the daemon keeps no metrics (started without
    /// `--metrics-addr`).
    Metrics,
}

impl LoopRequest {
    /// Every `op` a [`LoopRequest`] may carry.
    pub const OPS: [&'static str; 1] = ["metrics"];
}

/// What the `op` of a request line names, when the line is not a valid request: an op no
/// daemon of this version knows gets [`ErrorCode::UnknownOp`], a known op with bad fields
/// [`ErrorCode::BadRequest`].
pub fn classify_bad_request(line: &[u8], why: &str) -> ErrorReply {
    #[derive(Deserialize)]
    struct OpOnly {
        op: Option<String>,
    }
    match serde_json::from_slice::<OpOnly>(line)
        .ok()
        .and_then(|o| o.op)
    {
        Some(op)
            if !Request::OPS.contains(&op.as_str()) && !LoopRequest::OPS.contains(&op.as_str()) =>
        {
            ErrorReply::new(
                ErrorCode::UnknownOp,
                format!(
                    "unknown op `{op}`: this daemon knows {}, {}; a newer client may need a \
                     newer daemon (upgrade the older side)",
                    Request::OPS.join(", "),
                    LoopRequest::OPS.join(", ")
                ),
            )
        }
        _ => ErrorReply::new(ErrorCode::BadRequest, format!("bad request: {why}")),
    }
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

/// Why a request failed, by name. Each has the exit code `valvectl` uses for it
/// ([`ErrorCode::exit_code`]); codes a newer daemon adds read as [`ErrorCode::Other`] here,
/// and the reply's numeric `code` still gives the exit code.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum ErrorCode {
    /// A failure without a more specific name (exit code 1).
    #[default]
    Failed,
    /// The request line is not a valid request: not JSON, too long, or a known op with bad
    /// fields (exit code 2).
    BadRequest,
    /// The request names an op this daemon does not know (exit code 2).
    UnknownOp,
    /// The caller may not do this: not root nor in the daemon's group, or the config's
    /// `[offline]` rules protect the process (exit code 4).
    Permission,
    /// The driver (RM) refused the disable or enable (exit code 5).
    Rm,
    /// No GPU matches the selector (exit code 6).
    NoSuchGpu,
    /// The daemon is not running (exit code 7; set by clients, never sent).
    NoDaemon,
    /// No such process, no GPU channels, or not discoverable (exit code 8).
    Process,
    /// BPF or the ioctl tracepoints are unavailable (exit code 9).
    Bpf,
    /// The process is a CUDA MPS client or server, whose work Valve cannot freeze (exit code
    /// 10).
    MpsProcess,
    /// Client and daemon speak different protocol versions (exit code 11): upgrade the older.
    VersionMismatch,
    /// A code this side does not know (sent by a newer daemon); see the numeric `code`.
    #[serde(other)]
    Other,
}

impl ErrorCode {
    /// The exit code `valvectl` ends with for this error.
    pub fn exit_code(self) -> i32 {
        match self {
            ErrorCode::Failed | ErrorCode::Other => 1,
            ErrorCode::BadRequest | ErrorCode::UnknownOp => 2,
            ErrorCode::Permission => 4,
            ErrorCode::Rm => EXIT_RM,
            ErrorCode::NoSuchGpu => EXIT_NO_GPU,
            ErrorCode::NoDaemon => EXIT_NO_DAEMON,
            ErrorCode::Process => EXIT_PROCESS,
            ErrorCode::Bpf => EXIT_BPF,
            ErrorCode::MpsProcess => EXIT_MPS,
            ErrorCode::VersionMismatch => EXIT_VERSION,
        }
    }

    /// The name for an exit code, for errors that only carry a number (the daemon's start).
    pub fn of_exit_code(code: i32) -> ErrorCode {
        match code {
            1 => ErrorCode::Failed,
            2 => ErrorCode::BadRequest,
            4 => ErrorCode::Permission,
            EXIT_RM => ErrorCode::Rm,
            EXIT_NO_GPU => ErrorCode::NoSuchGpu,
            EXIT_NO_DAEMON => ErrorCode::NoDaemon,
            EXIT_PROCESS => ErrorCode::Process,
            EXIT_BPF => ErrorCode::Bpf,
            EXIT_MPS => ErrorCode::MpsProcess,
            EXIT_VERSION => ErrorCode::VersionMismatch,
            _ => ErrorCode::Other,
        }
    }
}

/// Exit code: the driver (RM) refused.
pub const EXIT_RM: i32 = 5;
/// Exit code: no GPU matches the selector.
pub const EXIT_NO_GPU: i32 = 6;
/// Exit code: the daemon is not running.
pub const EXIT_NO_DAEMON: i32 = 7;
/// Exit code: no such process, no GPU channels, or not discoverable.
pub const EXIT_PROCESS: i32 = 8;
/// Exit code: BPF or the ioctl tracepoints are unavailable.
pub const EXIT_BPF: i32 = 9;
/// Exit code: the process is a CUDA MPS client or server, whose work Valve cannot freeze.
pub const EXIT_MPS: i32 = 10;
/// Exit code: client and daemon speak different protocol versions.
pub const EXIT_VERSION: i32 = 11;
/// Exit code: the channels were disabled but RM reports some still enabled: not frozen.
pub const EXIT_NOT_FROZEN: i32 = 12;

/// Why a request failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// The exit code `valvectl` uses (see `valvectl --help`); older clients read only this.
    pub code: i32,
    /// The error by name (absent from older daemons: read as [`ErrorCode::Failed`]).
    #[serde(default)]
    pub kind: ErrorCode,
    /// What went wrong and how to fix it.
    pub message: String,
}

impl ErrorReply {
    /// An error of `kind`, with its exit code.
    pub fn new(kind: ErrorCode, message: impl Into<String>) -> Self {
        ErrorReply {
            code: kind.exit_code(),
            kind,
            message: message.into(),
        }
    }
}

/// The daemon's answer: `data` on success, `error` on failure. `T` is the reply type of the
/// request (a client reads `Reply<PsReply>` for a [`Request::Ps`]); the daemon builds
/// `Reply<Data>`, which is the same on the wire.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reply<T = Data> {
    /// The request's result, or null on error.
    pub data: Option<T>,
    /// Set when the request failed.
    pub error: Option<ErrorReply>,
}

impl<T> Reply<T> {
    /// A success.
    pub fn ok(data: impl Into<T>) -> Self {
        Reply {
            data: Some(data.into()),
            error: None,
        }
    }

    /// A success without data (`{"data": null, "error": null}`).
    pub fn empty() -> Self {
        Reply {
            data: None,
            error: None,
        }
    }

    /// A failure of `kind`.
    pub fn fail(kind: ErrorCode, message: impl Into<String>) -> Self {
        Reply {
            data: None,
            error: Some(ErrorReply::new(kind, message)),
        }
    }

    /// The data, or the error.
    pub fn into_result(self) -> Result<Option<T>, ErrorReply> {
        match self.error {
            Some(e) => Err(e),
            None => Ok(self.data),
        }
    }
}

impl<T: Serialize> Reply<T> {
    /// The data as JSON (null on error): for audit records and tests.
    pub fn data_json(&self) -> serde_json::Value {
        serde_json::to_value(&self.data).unwrap_or(serde_json::Value::Null)
    }
}

/// Any reply's data, as the daemon sends it. On the wire each is the bare object of its type
/// (no tag): the client knows which it asked for, and reads it as that type (so this one is
/// never read back).
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Data {
    /// For [`Request::Hello`].
    Hello(Hello),
    /// For [`Request::Ps`].
    Ps(PsReply),
    /// For [`Request::Status`].
    Status(Box<StatusReply>),
    /// For [`Request::Preempt`].
    Preempt(Box<PreemptReply>),
    /// For [`Request::Resume`].
    Resume(Box<ResumeReply>),
    /// For [`Request::ResumeAll`].
    ResumeAll(ResumeAllReply),
    /// For the gate's requests (start, stop, status).
    Gate(GateReply),
    /// For [`Request::OnlineBusy`] and [`Request::OnlineIdle`].
    Signal(SignalReply),
    /// For [`Request::GateTrace`].
    Trace(TraceReply),
    /// For [`LoopRequest::Metrics`].
    Metrics(MetricsReply),
    /// For [`Request::Harvest`]: the harvest document (the `valve-harvest` crate's schema,
    /// versioned there).
    Harvest(serde_json::Value),
}

macro_rules! data_from {
    ($($t:ty => $v:ident),* $(,)?) => {
        $(impl From<$t> for Data {
            fn from(x: $t) -> Data {
                Data::$v(x.into())
            }
        })*
    };
}
data_from!(Hello => Hello, PsReply => Ps, StatusReply => Status, PreemptReply => Preempt,
    ResumeReply => Resume, ResumeAllReply => ResumeAll, GateReply => Gate,
    crate::gate::GateStatus => Gate,
    SignalReply => Signal, TraceReply => Trace, MetricsReply => Metrics);

/// The answer to [`Request::Hello`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The daemon's [`crate::PROTOCOL_VERSION`].
    pub protocol_version: u32,
    /// The daemon's release (`valvectl --version` of the daemon's binary).
    pub daemon_version: String,
}

/// The answer to [`Request::Ps`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PsReply {
    /// Every GPU process the daemon knows, then the live ones it cannot discover.
    pub processes: Vec<ProcessEntry>,
}

/// One process in [`PsReply`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessEntry {
    /// Its pid.
    pub pid: u32,
    /// Its command name (`/proc/PID/comm`).
    pub comm: String,
    /// Whether the daemon saw it create its channels (false: it started before the daemon).
    pub discoverable: bool,
    /// Whether this daemon holds it preempted (absent for undiscoverable processes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preempted: Option<bool>,
    /// Its channels per GPU (empty for undiscoverable processes).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpus: Vec<ProcessGpu>,
    /// Why it is listed without channels.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// Its part in CUDA MPS, if any (null when none): such a process cannot be frozen.
    #[serde(default)]
    pub mps: Option<MpsRole>,
}

/// How a process takes part in CUDA MPS, in [`ProcessEntry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MpsRole {
    /// An MPS server or control daemon.
    Server,
    /// A client of an MPS server.
    Client,
}

/// A process's channels on one GPU, in [`ProcessEntry`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProcessGpu {
    /// The GPU's index (absent when its RM instance matches no GPU the daemon opened).
    pub gpu: Option<usize>,
    /// The RM device instance (absent until the process's device allocation was seen).
    pub device_instance: Option<u32>,
    /// The process's RM client handle (hex).
    pub client: String,
    /// Its channel groups.
    pub tsgs: Vec<TsgEntry>,
    /// Its channels in all.
    pub channels: usize,
}

/// A channel group (TSG) in [`ProcessGpu`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TsgEntry {
    /// The TSG's handle (hex).
    pub handle: String,
    /// Its channels' handles (hex).
    pub channels: Vec<String>,
    /// Whether it has a compute channel.
    pub compute: bool,
}

/// One GPU the daemon opened, in [`StatusReply`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuEntry {
    /// Index in the order the driver lists them.
    pub index: usize,
    /// The RM's GPU id.
    pub gpu_id: u32,
    /// The RM device instance.
    pub device_instance: u32,
    /// The device minor (`/dev/nvidiaN`).
    pub minor: u32,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// PCI device id.
    pub pci_device_id: u16,
    /// The GPU's UUID.
    pub uuid: String,
    /// The GPU's name.
    pub name: String,
}

/// The answer to [`Request::Status`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StatusReply {
    /// Seconds since the daemon started.
    pub uptime_s: f64,
    /// RM events seen.
    pub events: u64,
    /// Whether the eBPF watcher feeds the registry (false: `--no-discovery`).
    pub discovery: bool,
    /// GPU processes known.
    pub processes: usize,
    /// Pids this daemon holds preempted.
    pub preempted: Vec<u32>,
    /// The daemon's longest hold, ms (none: unlimited).
    pub max_hold_ms: Option<u64>,
    /// Where it records what it disabled.
    pub state_file: PathBuf,
    /// Channels a previous run left disabled and this one re-enabled at start.
    pub recovered_at_start: usize,
    /// Records of the previous run that could not be re-enabled.
    pub recovery_failures: Vec<String>,
    /// Processes restored from the journal at start.
    pub restored_from_journal: Vec<u32>,
    /// Where the state file went when it did not parse at start.
    pub state_file_moved_aside: Option<PathBuf>,
    /// The GPUs the daemon opened.
    pub gpus: Vec<GpuEntry>,
    /// The gate, as [`Request::GateStatus`] answers.
    pub gate: Option<GateReply>,
    /// Every freeze's check so far, by outcome.
    #[serde(default)]
    pub freeze_checks: FreezeCounts,
}

/// How long each step of a preempt took, us.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PreemptTiming {
    /// Writing the state file's record.
    pub record: u64,
    /// Handing over to, or checking with, the gate.
    pub gate: u64,
    /// The disable itself.
    pub disable: u64,
    /// Folding RM events that came before the request into the registry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub drain: Option<u64>,
    /// Waiting before the daemon's loop read the request.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queued: Option<u64>,
}

/// A disable or enable of channels on several GPUs, as timed.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct BatchTiming {
    /// Per GPU.
    pub gpus: Vec<GpuBatchTiming>,
    /// The whole batch, wall time, us.
    pub wall: f64,
}

/// One GPU's part of a [`BatchTiming`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct GpuBatchTiming {
    /// The GPU's index.
    pub gpu: usize,
    /// Channels disabled or enabled on it.
    pub channels: usize,
    /// When its first ioctl was issued after the batch's start, us.
    pub start_offset: f64,
    /// Time inside its ioctls, us.
    pub ioctl: f64,
}

/// The answer to [`Request::Preempt`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PreemptReply {
    /// The process.
    pub pid: u32,
    /// It was preempted already: nothing was done (the other fields are absent).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub already_preempted: bool,
    /// Its channels disabled, over all GPUs.
    #[serde(default)]
    pub channels: usize,
    /// GPUs they are on.
    #[serde(default)]
    pub gpus: usize,
    /// The disable's timing (none: the gate held the channels disabled already).
    #[serde(default)]
    pub disable: Option<BatchTiming>,
    /// Whether the gate handed the process over, already disabled.
    #[serde(default)]
    pub from_gate: bool,
    /// The hold's limit in force, ms (none: unlimited).
    #[serde(default)]
    pub max_hold_ms: Option<u64>,
    /// Where the preempt's time went.
    #[serde(default)]
    pub timing_us: Option<PreemptTiming>,
    /// The freeze's check, when the request asked for it (`confirm`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub freeze: Option<FreezeCheck>,
}

/// Whether a freeze took hold, read back from RM after the disable returned: each disabled
/// channel's runlist state (`NV208F_CTRL_CMD_FIFO_GET_CHANNEL_STATE`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FreezeCheck {
    /// What the check found.
    pub outcome: FreezeOutcome,
    /// From the disable's return to the outcome, us.
    pub after_us: u64,
    /// Channels read back.
    pub checked: usize,
    /// Channels the freeze covers.
    pub channels: usize,
    /// Channels RM reported still enabled, `CLIENT:CHANNEL` in hex.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub running: Vec<String>,
    /// Why the freeze could not be confirmed (`unconfirmed`, `resumed_first`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// A [`FreezeCheck`]'s finding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FreezeOutcome {
    /// RM reports every channel of the freeze disabled.
    Confirmed,
    /// RM reports a channel still enabled: its work keeps running; not frozen.
    Running,
    /// RM could not say (no diag object, a read failed): the channels were disabled, the freeze
    /// is not confirmed.
    Unconfirmed,
    /// The freeze ended before its check did (a gate that resumed within the check).
    ResumedFirst,
}

impl FreezeOutcome {
    /// Every outcome, for metrics.
    pub const ALL: [FreezeOutcome; 4] = [
        FreezeOutcome::Confirmed,
        FreezeOutcome::Running,
        FreezeOutcome::Unconfirmed,
        FreezeOutcome::ResumedFirst,
    ];

    /// Its wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            FreezeOutcome::Confirmed => "confirmed",
            FreezeOutcome::Running => "running",
            FreezeOutcome::Unconfirmed => "unconfirmed",
            FreezeOutcome::ResumedFirst => "resumed_first",
        }
    }
}

/// Freeze checks since the daemon started, by outcome ([`StatusReply::freeze_checks`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FreezeCounts {
    /// RM reported every channel disabled.
    pub confirmed: u64,
    /// A channel was still enabled: a freeze that did not happen.
    pub running: u64,
    /// RM could not say.
    pub unconfirmed: u64,
    /// Resumed before the check finished.
    pub resumed_first: u64,
}

/// The answer to [`Request::Resume`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ResumeReply {
    /// The process.
    pub pid: u32,
    /// The enable's timing (none: handed to the gate, or the process had exited).
    #[serde(default)]
    pub enable: Option<BatchTiming>,
    /// Whether the gate took the process over still disabled (it enables it when online idles).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub to_gate: bool,
    /// How long it was held, ms (absent when it had exited).
    #[serde(default)]
    pub held_ms: Option<f64>,
    /// Set when there was nothing to enable (the process exited).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// The answer to [`Request::ResumeAll`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeAllReply {
    /// The pids resumed.
    pub resumed: Vec<u32>,
}

/// The answer to [`Request::OnlineBusy`] and [`Request::OnlineIdle`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SignalReply {
    /// `busy` or `idle`: the signal the gate got.
    pub signal: String,
    /// Set when the gate was still starting: the signal waits for it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub queued: bool,
}

/// The answer to [`LoopRequest::Metrics`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetricsReply {
    /// The Prometheus text exposition, as `--metrics-addr` serves it.
    pub text: String,
}

#[cfg(test)]
mod tests;
