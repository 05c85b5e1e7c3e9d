//! Everything that can go wrong for a framework using the pool, each named with its fix.
//! Daemon refusals keep the protocol's numeric codes; the library's own start at 100.

use std::path::PathBuf;

use valve_vmm::VmmError;

/// Library status codes (the C ABI returns these; the daemon's own codes are below 100).
pub mod code {
    /// A bad argument to a library call.
    pub const INVALID: i32 = 100;
    /// The daemon's socket cannot be reached.
    pub const CONNECT: i32 = 101;
    /// The daemon closed the connection.
    pub const CLOSED: i32 = 102;
    /// The daemon sent something this library does not understand.
    pub const PROTOCOL: i32 = 103;
    /// A CUDA (valve-vmm) call failed.
    pub const CUDA: i32 = 104;
    /// The KV layout does not fit the pool's handles.
    pub const LAYOUT: i32 = 105;
    /// The KV space has no room for what was asked.
    pub const NO_SPACE: i32 = 106;
    /// Called in the wrong order (no KV space yet, or a second one).
    pub const STATE: i32 = 107;
    /// The daemon did not deliver what it promised in time.
    pub const TIMEOUT: i32 = 108;
    /// A panic was caught at the C boundary (a bug in this library).
    pub const PANIC: i32 = 199;
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Nothing listens at the socket path.
    #[error("the Valve daemon's pool socket {} does not exist: start `valvectl daemon --pool ...` (and pass its --pool-socket here if it is not the default)", path.display())]
    NoSocket {
        /// The path tried.
        path: PathBuf,
    },
    /// The socket's mode keeps this user out.
    #[error("not allowed to connect to the Valve daemon's pool socket {}: run as root or as a member of the daemon's socket group (the socket is mode 0660)", path.display())]
    SocketPermission {
        /// The path tried.
        path: PathBuf,
    },
    /// Any other connection failure.
    #[error("connecting to the Valve daemon's pool socket {}: {source} (is `valvectl daemon --pool` running?)", path.display())]
    Connect {
        /// The path tried.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The daemon closed the connection (it exited, restarted, or dropped this client).
    #[error("the Valve daemon closed the pool connection (it exited or restarted, or dropped this client): memory already mapped stays usable but is no longer accounted; connect again")]
    Closed,
    /// A reply or event this library does not understand.
    #[error("the Valve daemon sent something this library does not understand: {0} (are the daemon and the client library from the same Valve version?)")]
    Protocol(String),
    /// Code 2: the daemon found the request malformed.
    #[error("the Valve daemon refused `{op}` as malformed (code 2): {message}")]
    BadRequest {
        /// The request.
        op: String,
        /// The daemon's words.
        message: String,
    },
    /// Code 11: more than the GPU holds.
    #[error("`{op}` asks for more than the GPU holds (code 11): {message}")]
    TooLarge {
        /// The request.
        op: String,
        /// The daemon's words.
        message: String,
    },
    /// Code 12: the pool has nothing free for this client.
    #[error("the pool is exhausted (code 12): {message}")]
    PoolExhausted {
        /// The request.
        op: String,
        /// The daemon's words.
        message: String,
    },
    /// Code 13: not registered, or a wrong token.
    #[error("the Valve daemon does not know this client (code 13) for `{op}`: {message} (did the daemon restart? connect again)")]
    NotRegistered {
        /// The request.
        op: String,
        /// The daemon's words.
        message: String,
    },
    /// Code 14: a handle this client does not hold.
    #[error("`{op}` names a handle this client does not hold (code 14): {message}")]
    NotHeld {
        /// The request.
        op: String,
        /// The daemon's words.
        message: String,
    },
    /// Code 15: the request is not for this role.
    #[error("`{op}` is not for this client's role (code 15): {message}")]
    WrongRole {
        /// The request.
        op: String,
        /// The daemon's words.
        message: String,
    },
    /// Any other refusal.
    #[error("the Valve daemon refused `{op}` (code {code}): {message}")]
    Daemon {
        /// The request.
        op: String,
        /// The daemon's code.
        code: i32,
        /// The daemon's words.
        message: String,
    },
    /// A pool handle does not split into regions of whole GPU pages.
    #[error("a {handle_mib} MiB pool handle split into {regions} regions gives {piece_bytes}-byte pieces, not a multiple of the GPU's {granularity_mib} MiB granularity: start the daemon with `valvectl daemon --pool --pool-handle-mib {need_mib}` (or use fewer regions)")]
    PieceNotAligned {
        /// The pool's handle size in MiB.
        handle_mib: u64,
        /// Regions asked for.
        regions: u32,
        /// Bytes per piece that would give.
        piece_bytes: u64,
        /// The GPU's mapping granularity in MiB.
        granularity_mib: u64,
        /// The smallest handle size at least as large that works.
        need_mib: u64,
    },
    /// CUDA cannot split a handle over several regions.
    #[error("CUDA maps a pool handle only whole (cuMemMap's offset must be 0), so one handle cannot back {regions} regions: ask for one region and lay the framework's tensors out in it side by side, each a strided view (valve_transformers does this)")]
    RegionsNeedSplitHandles {
        /// Regions asked for.
        regions: u32,
    },
    /// KV blocks do not tile a piece.
    #[error("block_bytes {block_bytes} does not divide the {piece_bytes}-byte piece each pool handle gives a region: use a block size that divides it (a power of two up to {piece_bytes}), or a larger handle (`valvectl daemon --pool --pool-handle-mib`)")]
    BlockNotAligned {
        /// Bytes per piece.
        piece_bytes: u64,
        /// Bytes per block asked for.
        block_bytes: u64,
    },
    /// The KV space has fewer empty slots than asked for.
    #[error("the KV space has {empty} empty slot(s) and {asked} were asked for: reserve a larger capacity, or shrink first")]
    NoSpace {
        /// Empty slots.
        empty: u32,
        /// Slots asked for.
        asked: u32,
    },
    /// `grow`, `shrink`, `region_ptr` or a block call before `kv_space`.
    #[error("this client has no KV space yet: call kv_space(regions, capacity, block_bytes) after connect")]
    NoKvSpace,
    /// A second `kv_space`.
    #[error(
        "this client already has a KV space: one client maps one space; connect again for another"
    )]
    KvSpaceExists,
    /// The daemon lent premapped handles but never sent their descriptors.
    #[error("the Valve daemon lent handle(s) {ids:?} but did not send their descriptors (pool_handles) within {ms} ms: is the daemon overloaded or is the handle beyond this space's capacity?")]
    GrantTimeout {
        /// Handles still not mapped.
        ids: Vec<u32>,
        /// How long was waited.
        ms: u64,
    },
    /// A bad argument.
    #[error("{0}")]
    Invalid(String),
    /// A CUDA call (valve-vmm) failed.
    #[error("GPU memory call failed: {0}")]
    Vmm(#[from] VmmError),
}

impl Error {
    /// The status code: the daemon's protocol code for its refusals, [`code`] for the rest.
    pub fn code(&self) -> i32 {
        match self {
            Error::BadRequest { .. } => 2,
            Error::TooLarge { .. } => 11,
            Error::PoolExhausted { .. } => 12,
            Error::NotRegistered { .. } => 13,
            Error::NotHeld { .. } => 14,
            Error::WrongRole { .. } => 15,
            Error::Daemon { code, .. } => *code,
            Error::NoSocket { .. } | Error::SocketPermission { .. } | Error::Connect { .. } => {
                code::CONNECT
            }
            Error::Closed => code::CLOSED,
            Error::Protocol(_) => code::PROTOCOL,
            Error::PieceNotAligned { .. }
            | Error::BlockNotAligned { .. }
            | Error::RegionsNeedSplitHandles { .. } => code::LAYOUT,
            Error::NoSpace { .. } => code::NO_SPACE,
            Error::NoKvSpace | Error::KvSpaceExists => code::STATE,
            Error::GrantTimeout { .. } => code::TIMEOUT,
            Error::Invalid(_) => code::INVALID,
            Error::Vmm(_) => code::CUDA,
        }
    }

    /// The error for a `{"ok": false, "code", "error"}` reply to `op`.
    pub(crate) fn refusal(op: &str, code: i32, message: String) -> Error {
        let op = op.to_string();
        match code {
            2 => Error::BadRequest { op, message },
            11 => Error::TooLarge { op, message },
            12 => Error::PoolExhausted { op, message },
            13 => Error::NotRegistered { op, message },
            14 => Error::NotHeld { op, message },
            15 => Error::WrongRole { op, message },
            code => Error::Daemon { op, code, message },
        }
    }

    /// A socket-level failure while talking to the daemon: a gone peer reads as [`Error::Closed`].
    pub(crate) fn from_wire(e: VmmError) -> Error {
        match e {
            VmmError::Os { ref source, .. }
                if matches!(
                    source.raw_os_error(),
                    Some(libc::EPIPE | libc::ECONNRESET | libc::ENOTCONN | libc::ESHUTDOWN)
                ) =>
            {
                Error::Closed
            }
            VmmError::Invalid(m) => Error::Protocol(m),
            other => Error::Vmm(other),
        }
    }
}
