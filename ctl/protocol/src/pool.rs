//! The memory pool socket: what client processes send the daemon's pool ([`PoolRequest`]), what
//! it answers (`{"ok": true, ...}` with the request's reply type, or a [`PoolFailure`]), and
//! what the pool asks of offline processes on their callback connection ([`Callback`]).
//!
//! Messages travel as JSON objects with file descriptors beside them (`valve_vmm::wire`); the
//! descriptors of handles go with [`GrowReply`] and [`PoolHandles`].

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// A pool handle's number on its GPU.
pub type HandleId = u32;
/// A registered client process.
pub type ClientId = u64;

/// What a process is to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Latency-critical: may take memory back from offline.
    Online,
    /// Preemptible: gets only free memory, and gives it back on demand.
    Offline,
}

/// A GPU as a client names it: its index, as a number or a string of digits.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum GpuRef {
    /// The index.
    Index(u64),
    /// The index as text (`"0"`), as an environment variable gives it.
    Text(String),
}

impl GpuRef {
    /// The index, if it is one.
    pub fn index(&self) -> Option<usize> {
        match self {
            GpuRef::Index(i) => usize::try_from(*i).ok(),
            GpuRef::Text(s) => s.trim().parse().ok(),
        }
    }
}

/// A message to the pool. The first on a connection is [`PoolRequest::Register`] (a control
/// connection) or [`PoolRequest::Attach`] (a callback connection), or one of the requests that
/// need no registration: status, cap, reclaim.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PoolRequest {
    /// Registers the process: answered with [`RegisterReply`].
    Register {
        /// Online or offline.
        role: Role,
        /// The GPU it uses.
        gpu: GpuRef,
        /// An online process maps the whole pool up front (default: yes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        premap: Option<bool>,
    },
    /// Opens the callback connection of a registered process: answered with [`AttachReply`]
    /// (a premapped online client gets [`PoolHandles`] with every existing handle instead).
    Attach {
        /// The client, from its [`RegisterReply`].
        client: ClientId,
        /// The token, from its [`RegisterReply`].
        token: String,
    },
    /// The pool's state: answered with [`PoolStatus`].
    Status,
    /// Limits what offline may hold on a GPU (root only): answered with [`CapReply`].
    Cap {
        /// The GPU's index.
        gpu: usize,
        /// The limit, MiB (none: lift it).
        #[serde(default)]
        offline_mib: Option<u64>,
    },
    /// Takes memory back from offline on a GPU now and leaves it free (root only): answered
    /// with [`TakeBackReply`].
    Reclaim {
        /// The GPU's index.
        gpu: usize,
        /// How much, MiB.
        mib: u64,
    },
    /// More memory for the caller: answered with [`GrowReply`] and the new handles' descriptors.
    Grow {
        /// Handles wanted.
        count: usize,
    },
    /// Gives handles back: answered with [`ShrinkReply`].
    Shrink {
        /// The handles.
        handles: Vec<HandleId>,
    },
    /// An online process's used bytes: answered with [`UsageReply`] (how much to hold).
    Usage {
        /// Bytes in use now.
        used_bytes: u64,
    },
}

impl PoolRequest {
    /// Every `op` a [`PoolRequest`] may carry.
    pub const OPS: [&'static str; 8] = [
        "register", "attach", "status", "cap", "reclaim", "grow", "shrink", "usage",
    ];

    /// The request's `op`.
    pub fn op(&self) -> &'static str {
        match self {
            PoolRequest::Register { .. } => "register",
            PoolRequest::Attach { .. } => "attach",
            PoolRequest::Status => "status",
            PoolRequest::Cap { .. } => "cap",
            PoolRequest::Reclaim { .. } => "reclaim",
            PoolRequest::Grow { .. } => "grow",
            PoolRequest::Shrink { .. } => "shrink",
            PoolRequest::Usage { .. } => "usage",
        }
    }

    /// The message as JSON, to send.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("pool requests serialise")
    }
}

/// Why the pool refused, by name; on the wire the number (`code`), which the client library
/// hands on to C and Python callers. Codes a newer daemon adds read as [`PoolErrorCode::Other`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(from = "i32", into = "i32")]
#[non_exhaustive]
pub enum PoolErrorCode {
    /// Not allowed: only root may cap or reclaim (1).
    NotPermitted,
    /// A malformed message, a missing field or an unknown op (2).
    BadRequest,
    /// No such GPU in the pool (6).
    NoSuchGpu,
    /// More than the GPU's pool could ever hold (11).
    TooLarge,
    /// Not enough memory now: the pool is exhausted, capped, or its backing failed (12).
    Exhausted,
    /// The connection is not registered, or an attach named the wrong client or token (13).
    NotRegistered,
    /// The client does not hold those handles (14).
    NotHeld,
    /// The request is for the other role (`usage` is for online clients; offline is asked to
    /// release) (15).
    WrongRole,
    /// A code this side does not know.
    Other(i32),
}

impl From<PoolErrorCode> for i32 {
    fn from(c: PoolErrorCode) -> i32 {
        match c {
            PoolErrorCode::NotPermitted => 1,
            PoolErrorCode::BadRequest => 2,
            PoolErrorCode::NoSuchGpu => 6,
            PoolErrorCode::TooLarge => 11,
            PoolErrorCode::Exhausted => 12,
            PoolErrorCode::NotRegistered => 13,
            PoolErrorCode::NotHeld => 14,
            PoolErrorCode::WrongRole => 15,
            PoolErrorCode::Other(n) => n,
        }
    }
}

impl From<i32> for PoolErrorCode {
    fn from(n: i32) -> PoolErrorCode {
        match n {
            1 => PoolErrorCode::NotPermitted,
            2 => PoolErrorCode::BadRequest,
            6 => PoolErrorCode::NoSuchGpu,
            11 => PoolErrorCode::TooLarge,
            12 => PoolErrorCode::Exhausted,
            13 => PoolErrorCode::NotRegistered,
            14 => PoolErrorCode::NotHeld,
            15 => PoolErrorCode::WrongRole,
            n => PoolErrorCode::Other(n),
        }
    }
}

/// A refusal: `{"ok": false, "code": N, "error": "..."}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolFailure {
    /// Always false.
    pub ok: bool,
    /// Why, by number (see [`PoolErrorCode`]).
    pub code: PoolErrorCode,
    /// What went wrong and how to fix it.
    pub error: String,
}

impl PoolFailure {
    /// A refusal with `code`.
    pub fn new(code: PoolErrorCode, error: impl Into<String>) -> PoolFailure {
        PoolFailure {
            ok: false,
            code,
            error: error.into(),
        }
    }

    /// The refusal as JSON, to send.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).expect("failures serialise")
    }
}

impl std::fmt::Display for PoolFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (code {})", self.error, i32::from(self.code))
    }
}

/// A successful reply: `{"ok": true, ...T's fields}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PoolOk<T> {
    /// Always true.
    pub ok: bool,
    /// The reply's fields.
    #[serde(flatten)]
    pub body: T,
}

/// `{"ok": true, ...body}` as JSON, to send.
pub fn ok_json<T: Serialize>(body: T) -> serde_json::Value {
    serde_json::to_value(PoolOk { ok: true, body }).expect("pool replies serialise")
}

/// Reads a reply: its body when `ok` is true, else the [`PoolFailure`]. A reply that is neither
/// is a failure with [`PoolErrorCode::BadRequest`] saying what did not parse.
pub fn parse_reply<T: DeserializeOwned>(v: serde_json::Value) -> Result<T, PoolFailure> {
    let ok = v.get("ok").and_then(serde_json::Value::as_bool) == Some(true);
    if ok {
        serde_json::from_value::<PoolOk<T>>(v)
            .map(|r| r.body)
            .map_err(|e| PoolFailure::new(PoolErrorCode::BadRequest, format!("bad reply: {e}")))
    } else {
        serde_json::from_value::<PoolFailure>(v.clone())
            .map_err(|e| {
                PoolFailure::new(PoolErrorCode::BadRequest, format!("bad reply ({e}): {v}"))
            })
            .and_then(Err)
    }
}

/// The answer to [`PoolRequest::Register`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegisterReply {
    /// The client's id (for [`PoolRequest::Attach`]).
    pub client: ClientId,
    /// The secret its callback connection attaches with (a decimal number as text).
    pub token: String,
    /// The GPU's index.
    pub gpu_index: usize,
    /// Whether the client maps the whole pool up front.
    pub premapped: bool,
    /// Bytes per handle.
    pub handle_bytes: usize,
    /// The most handles the GPU's pool may hold.
    pub pool_capacity_handles: usize,
    /// The GPU's PCI address, where known.
    pub gpu_pci: Option<String>,
}

/// The answer to [`PoolRequest::Attach`] (no fields beyond `ok`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachReply {}

/// Handles sent to a premapped online client (their descriptors beside the message): with its
/// attach, and whenever the pool creates new ones on its GPU.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolHandles {
    /// Always `pool_handles`.
    pub event: String,
    /// The handles, in the order of the descriptors.
    pub handles: Vec<HandleId>,
}

impl PoolHandles {
    /// The event's name.
    pub const EVENT: &'static str = "pool_handles";

    /// The event for `handles`.
    pub fn new(handles: Vec<HandleId>) -> PoolHandles {
        PoolHandles {
            event: Self::EVENT.into(),
            handles,
        }
    }
}

/// The answer to [`PoolRequest::Grow`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowReply {
    /// The handles the client holds now from this grow.
    pub handles: Vec<HandleId>,
    /// Those whose descriptors travel with the reply, in order.
    pub fds_for: Vec<HandleId>,
    /// How many were taken back from offline.
    pub reclaimed: usize,
    /// How many of the count asked for could not be served.
    pub short: usize,
    /// The grow's time in the pool, us.
    pub elapsed_us: u64,
}

/// The answer to [`PoolRequest::Shrink`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShrinkReply {
    /// Handles released.
    pub released: usize,
}

/// The answer to [`PoolRequest::Usage`]: the online reservation's decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UsageReply {
    /// How many handles the client should have mapped now.
    pub target_handles: u64,
    /// Whether this report was a pressure event.
    pub pressure: bool,
    /// The headroom, handles.
    pub headroom_handles: u64,
    /// When to report again, ms.
    pub interval_ms: u64,
    /// Pressure events per minute, recently.
    pub event_rate_per_min: f64,
}

/// The answer to [`PoolRequest::Cap`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CapReply {
    /// The GPU.
    pub gpu: usize,
    /// The cap now, handles (none: no cap).
    pub offline_cap_handles: Option<usize>,
    /// The cap now, MiB.
    pub offline_cap_mib: Option<u64>,
}

/// The answer to [`PoolRequest::Reclaim`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TakeBackReply {
    /// The GPU.
    pub gpu: usize,
    /// Handles taken back.
    pub reclaimed: usize,
    /// The same, MiB.
    pub reclaimed_mib: u64,
}

/// One GPU's numbers, in [`PoolStatus`] and the daemon's metrics (a field an older daemon
/// leaves out reads as 0).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct GpuUsage {
    /// GPU index.
    pub gpu: usize,
    /// Bytes per handle.
    pub handle_bytes: usize,
    /// Handles that exist.
    pub handles: usize,
    /// The most that may exist.
    pub max_handles: usize,
    /// Held by nobody.
    pub free: usize,
    /// Held by online processes.
    pub online: usize,
    /// Held by offline processes.
    pub offline: usize,
    /// Not created yet, and creatable now: below the maximum, with device memory free beyond
    /// what the pool keeps free.
    pub creatable: usize,
    /// The most offline may hold (`valvectl pool cap`), if capped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offline_cap: Option<usize>,
    /// Handles taken back from offline since the pool started.
    pub reclaimed_total: u64,
}

impl GpuUsage {
    /// Memory left to offline now: free handles, handles the pool may still create and those
    /// offline holds (online may take any of them back), within the offline cap.
    pub fn offline_available_bytes(&self) -> u64 {
        let handles =
            (self.free + self.creatable + self.offline).min(self.offline_cap.unwrap_or(usize::MAX));
        handles as u64 * self.handle_bytes as u64
    }
}

/// Reclaim counters, in [`PoolStatus`] (a field an older daemon leaves out reads as 0).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReclaimStats {
    /// Reclaims run.
    pub reclaims: u64,
    /// Handles taken from offline.
    pub handles: u64,
    /// Offline processes killed for missing the deadline.
    pub killed: u64,
    /// Freeze failures.
    pub freeze_failures: u64,
    /// Time from the start of a reclaim to the handles being transferable, last reclaim, us.
    pub last_us: u64,
    /// The last process killed for missing the deadline, and where its threads were.
    pub last_kill: Option<KillRecord>,
}

/// An offline process the pool killed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KillRecord {
    /// Its pid.
    pub pid: u32,
    /// When (seconds since the Unix epoch).
    pub unix_s: u64,
    /// Whether it answered at all (late, or with handles it did not hold).
    pub answered: bool,
    /// Each thread's name, state, wait channel and system call just before the kill.
    pub threads: String,
}

/// The answer to [`PoolRequest::Status`].
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// Per GPU.
    pub gpus: Vec<GpuUsage>,
    /// Registered processes.
    pub clients: Vec<ClientEntry>,
    /// Reclaims so far.
    pub reclaims: ReclaimStats,
}

/// One registered process, in [`PoolStatus`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClientEntry {
    /// Its id.
    pub client: ClientId,
    /// Its pid.
    pub pid: u32,
    /// Online or offline.
    pub role: Role,
    /// Its GPU.
    pub gpu: usize,
    /// Handles it holds.
    pub handles: usize,
    /// An online client's reservation, once it has reported its usage.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reservation: Option<ReservationState>,
}

/// An online client's reservation (MIAD), in [`ClientEntry`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReservationState {
    /// What it is asked to hold, handles.
    pub target_handles: u64,
    /// Its headroom, handles.
    pub headroom_handles: u64,
    /// The interval T, ms.
    pub interval_ms: u64,
    /// Pressure events per minute, recently.
    pub event_rate_per_min: f64,
    /// How its pressure events compare with the target (positive: over it).
    pub balance_events: f64,
    /// Pressure events in all.
    pub events: u64,
    /// The target rate of pressure events per minute.
    pub target_rate_per_min: f64,
    /// The name its reservation is saved under.
    pub online: String,
    /// The GPU's name in the saved reservations.
    #[serde(default)]
    pub gpu_name: String,
    /// Whether it started warm, and from what.
    pub start: ReservationStart,
}

/// How an online reservation started, in [`ReservationState`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReservationStart {
    /// Whether it started from a saved reservation.
    pub warm: bool,
    /// The file it started from (warm only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from: Option<String>,
    /// How old the saved reservation was, s (warm only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_s_ago: Option<u64>,
    /// What was adjusted in it (warm only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adjusted: Option<Vec<String>>,
    /// Why it started cold (cold only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// What the pool asks of an offline process on its callback connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Callback {
    /// Release `count` handles now (the process is frozen meanwhile and answers once thawed
    /// enough to run its handler): answered with a [`CallbackReply`].
    Reclaim {
        /// The request's id, repeated in the answer.
        rid: u64,
        /// Handles wanted.
        count: usize,
    },
}

/// An offline process's answer to a [`Callback`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallbackReply {
    /// The request's id.
    pub rid: u64,
    /// Whether it released what was asked.
    pub ok: bool,
    /// The handles it released.
    #[serde(default)]
    pub handles: Vec<HandleId>,
    /// Why not, by number (see [`PoolErrorCode`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<PoolErrorCode>,
    /// Why not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[cfg(test)]
mod tests;
