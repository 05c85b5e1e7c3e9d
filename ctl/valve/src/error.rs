//! The library's error type: every failure names what went wrong and, where there is one, the fix.
//! RM status codes stay typed ([`RmStatus`]) so callers can match on them.

use std::path::PathBuf;

use valve_ioctl_bindings::RmStatus;

/// Errors of the control library.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No NVIDIA device files: the driver is not loaded (or this is a container without them).
    #[error(
        "{path} not found: the NVIDIA kernel driver is not loaded or its device files are not \
         visible here (load the driver, or pass the devices into the container)"
    )]
    DriverMissing {
        /// The missing path.
        path: PathBuf,
    },
    /// The loaded driver is NVIDIA's proprietary module, whose RM ABI Valve does not target.
    #[error(
        "the loaded NVIDIA driver is the proprietary module ({version}); Valve needs the open \
         kernel module (nvidia-open / open-gpu-kernel-modules, same version numbers)"
    )]
    NotOpenModule {
        /// The version line the driver reports.
        version: String,
    },
    /// A device file could not be opened for lack of permission.
    #[error(
        "permission denied opening {path}: run as root or as a member of the group that owns \
         the NVIDIA device files"
    )]
    Permission {
        /// The device file.
        path: PathBuf,
    },
    /// A system call failed.
    #[error("{op} failed: {source}")]
    Os {
        /// What was being done.
        op: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// RM refused a call; `status` says why.
    #[error("{op}: the driver answered {status}: {meaning}")]
    Rm {
        /// What was being done.
        op: String,
        /// RM's status code.
        status: RmStatus,
        /// What that code usually means.
        meaning: &'static str,
    },
    /// A GPU selector matched no GPU.
    #[error("no GPU matches '{selector}': this node has {count} GPU(s); see `valvectl gpus`")]
    UnknownGpu {
        /// What the user asked for.
        selector: String,
        /// How many GPUs there are.
        count: usize,
    },
    /// Nothing to do: an empty channel list.
    #[error("no channels given: name at least one (client, channel) pair")]
    NoChannels,
    /// Disabling failed on one GPU; everything disabled by the same call was enabled again.
    #[error("disabling channels on GPU {gpu} failed ({cause}); {rollback}")]
    PreemptFailed {
        /// Valve's index of the GPU that failed.
        gpu: usize,
        /// The failure.
        cause: Box<Error>,
        /// What happened to the GPUs that had succeeded.
        rollback: String,
    },
}

impl Error {
    /// Builds [`Error::Rm`] with the status's operator-facing meaning.
    pub fn rm(op: impl Into<String>, status: RmStatus) -> Self {
        let meaning = status
            .info()
            .map(|s| s.meaning)
            .unwrap_or("an RM status Valve has no description for; check dmesg for NVRM lines");
        Error::Rm {
            op: op.into(),
            status,
            meaning,
        }
    }

    /// The exit code `valvectl` documents for this failure (`valvectl --help`); the daemon
    /// answers with the same codes.
    pub fn exit_code(&self) -> i32 {
        match self {
            Error::DriverMissing { .. } | Error::NotOpenModule { .. } => 3,
            Error::Permission { .. } => 4,
            Error::Rm { .. } | Error::PreemptFailed { .. } => 5,
            Error::UnknownGpu { .. } => 6,
            Error::NoChannels => 2,
            Error::Os { .. } => 1,
        }
    }

    /// The RM status behind this error, looking through [`Error::PreemptFailed`].
    pub fn rm_status(&self) -> Option<RmStatus> {
        match self {
            Error::Rm { status, .. } => Some(*status),
            Error::PreemptFailed { cause, .. } => cause.rm_status(),
            _ => None,
        }
    }
}

/// Result with the library's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
