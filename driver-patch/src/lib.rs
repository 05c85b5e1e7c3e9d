//! Valve's one-line driver patch, as a library.
//!
//! The patch adds a lock flag to the `FIFO_DISABLE_CHANNELS` (`0x2080110b`) entry of an
//! open-gpu-kernel-modules tree, so RM takes only the target GPU's lock for that control instead of
//! every GPU's. The entry is found by its method id, the flag's bit is read from the same tree's
//! `control.h`, exactly one line changes, and a second run changes nothing. See
//! `docs/driver-patch.md` for why this flag, and why a tree whose entry lacks `API_LOCK_READONLY`
//! (the 525 branch) is refused.
//!
//! - [`plan`] reads a tree and decides (or refuses, with a [`PatchError`] that carries the exit
//!   code); [`Plan::apply`] then writes. [`patch`] and [`check`] do both.
//! - [`emit_patch`] returns the unified diff that `patch --emit-patch FILE` writes.
//! - [`entry_flags`] reads the entry's flags back out of a compiled object or `nvidia.ko`.
//! - [`apt_sources`] builds a private apt list from the machine's own sources (for the CI proof).
//! - [`cli`] has the clap subcommands and their `exec`, shared by the `valve-driver-patch` binary
//!   and `valvectl driver`.
//!
//! Output and exit codes are those of the Python applier this crate replaces, byte for byte
//! (including the emitted diff, which is Python's `difflib.unified_diff`, and so its sha256 in
//! `driver-patch/releases.tsv`).

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

mod applier;
mod apt_sources;
pub mod cli;
mod difflib;
mod entry_flags;
mod flag_value;
mod text;

pub use applier::{check, emit_patch, patch, plan, Plan};
pub use apt_sources::apt_sources;
pub use entry_flags::{entry_flags, entry_flags_in};
pub use flag_value::FlagValue;

/// `NV2080_CTRL_CMD_FIFO_DISABLE_CHANNELS`: the control whose entry gets the flag.
pub const METHOD_ID: u32 = 0x2080_110b;
/// The generated file that holds the subdevice's exported-method table (relative to the tree).
pub const GENERATED: &str = "src/nvidia/generated/g_subdevice_nvoc.c";
/// Where the tree defines the `RMCTRL_FLAGS_*` bits (relative to the tree).
pub const CONTROL_H: &str = "src/nvidia/inc/kernel/rmapi/control.h";
/// The flag without which the default patch would change nothing (525 lacks it).
pub const API_LOCK_READONLY: &str = "RMCTRL_FLAGS_API_LOCK_READONLY";

/// Patched now, already patched, or (`--check`) patched.
pub const EXIT_OK: i32 = 0;
/// An I/O failure (a file that cannot be read or written), or `entry-flags` not finding exactly one
/// entry, or `apt-sources` finding no archive.
pub const EXIT_FAILED: i32 = 1;
/// Usage error, or `--src` is not a directory.
pub const EXIT_USAGE: i32 = 2;
/// A prebuilt or proprietary driver (`*.o_binary`, no generated sources): cannot carry the patch.
pub const EXIT_PROPRIETARY: i32 = 3;
/// A tree this applier does not understand or will not patch; nothing changed.
pub const EXIT_UNSUPPORTED: i32 = 4;
/// `--check` only: the entry lacks the flag; nothing changed.
pub const EXIT_NOT_PATCHED: i32 = 10;

/// The flag the patch adds to the entry.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, clap::ValueEnum)]
pub enum Flag {
    /// RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY: RM locks only the target GPU (the patch).
    #[default]
    GpuLockDeviceOnly,
    /// RMCTRL_FLAGS_ROUTE_TO_PHYSICAL: for experiments only (see docs/driver-patch.md).
    RouteToPhysical,
}

impl Flag {
    /// The `control.h` define that holds the flag's bit.
    pub fn define(self) -> &'static str {
        match self {
            Flag::GpuLockDeviceOnly => "RMCTRL_FLAGS_GPU_LOCK_DEVICE_ONLY",
            Flag::RouteToPhysical => "RMCTRL_FLAGS_ROUTE_TO_PHYSICAL",
        }
    }

    /// The name on the command line (`--flag`).
    pub fn key(self) -> &'static str {
        match self {
            Flag::GpuLockDeviceOnly => "gpu-lock-device-only",
            Flag::RouteToPhysical => "route-to-physical",
        }
    }
}

/// What [`patch`] does besides planning.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PatchOptions {
    /// The flag to add.
    pub flag: Flag,
    /// Report only; never write the tree (an already patched tree still gets `emit_patch` written).
    pub check: bool,
    /// Also write the change as a unified diff to this file (when the tree is or becomes patched).
    pub emit_patch: Option<PathBuf>,
}

/// What the applier found in a tree it accepts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// `NVIDIA_VERSION` from `version.mk`, else `NV_VERSION_STRING` from `nvVer.h`, else "unknown".
    pub version: String,
    /// 1-based line of the entry's `/*flags=*/` line in [`GENERATED`].
    pub line: usize,
    /// The flag being added.
    pub flag: Flag,
    /// The entry's flags as found.
    pub old: FlagValue,
    /// The entry's flags with the flag's bit set.
    pub new: FlagValue,
    /// The flag's bit, from the tree's `control.h`.
    pub bit: FlagValue,
}

impl Report {
    /// True when the entry already carries the flag.
    pub fn is_patched(&self) -> bool {
        self.old == self.new
    }
}

impl fmt::Display for Report {
    /// The two lines the applier prints before doing anything.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "driver {}: FIFO_DISABLE_CHANNELS entry (methodId {:#x}) at {GENERATED}:{}",
            self.version, METHOD_ID, self.line
        )?;
        writeln!(
            f,
            "old flags {}; {} = {} (from {CONTROL_H}); new flags {}",
            self.old,
            self.flag.define(),
            self.bit,
            self.new
        )
    }
}

/// How a run ended when the tree was accepted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    /// The flag was set now; `sha256` is the hash of the unified diff of the change.
    Patched { sha256: String },
    /// The flag was set already; nothing changed.
    AlreadyPatched,
    /// `--check` only: the flag is not set; nothing changed.
    NotPatched,
}

impl Status {
    /// 0, or 10 for [`Status::NotPatched`].
    pub fn exit_code(&self) -> i32 {
        match self {
            Status::NotPatched => EXIT_NOT_PATCHED,
            Status::Patched { .. } | Status::AlreadyPatched => EXIT_OK,
        }
    }

    /// The line the applier prints after the report (with its newline).
    pub fn line(&self, report: &Report) -> String {
        let (old, new, name) = (&report.old, &report.new, report.flag.define());
        match self {
            Status::AlreadyPatched => format!("already patched ({name} is set); nothing changed\n"),
            Status::NotPatched => format!(
                "not patched: flags {old} lack {name}; run without --check to set it ({old} -> {new})\n"
            ),
            Status::Patched { sha256 } => format!(
                "patched: {GENERATED}:{} flags {old} -> {new} (sha256 of the change: {sha256})\n",
                report.line
            ),
        }
    }
}

/// The result of [`patch`] or [`check`]: what was found and what was done.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outcome {
    pub report: Report,
    pub status: Status,
}

impl Outcome {
    /// The process exit code for this outcome (0 or 10).
    pub fn exit_code(&self) -> i32 {
        self.status.exit_code()
    }
}

impl fmt::Display for Outcome {
    /// Everything the applier prints on stdout for this outcome.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.report, self.status.line(&self.report))
    }
}

/// Why the applier (or one of the helper tools) stopped; nothing in the tree was changed unless the
/// error is [`PatchError::Io`] during the write itself. The message names the problem and the fix.
#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    /// Exit 2: `--src` is not a directory.
    #[error("{0}")]
    Usage(String),
    /// Exit 3: a packaged kernel interface with a prebuilt resource manager.
    #[error("{0}")]
    Proprietary(String),
    /// Exit 4: a tree the applier does not understand or will not patch.
    #[error("{0}")]
    Unsupported(String),
    /// Exit 1: a file could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Exit 1: `apt-sources` found no Debian archive to build a list from.
    #[error("no Debian archive with a 'main' component in this machine's apt sources")]
    NoArchive,
}

impl PatchError {
    /// The process exit code (see the `EXIT_*` constants).
    pub fn exit_code(&self) -> i32 {
        match self {
            PatchError::Usage(_) => EXIT_USAGE,
            PatchError::Proprietary(_) => EXIT_PROPRIETARY,
            PatchError::Unsupported(_) => EXIT_UNSUPPORTED,
            PatchError::Io { .. } | PatchError::NoArchive => EXIT_FAILED,
        }
    }

    /// The word the applier prints before the message: "refused", "unsupported" or "error".
    pub fn word(&self) -> &'static str {
        match self {
            PatchError::Proprietary(_) => "refused",
            PatchError::Unsupported(_) => "unsupported",
            _ => "error",
        }
    }

    pub(crate) fn io(path: &Path, source: io::Error) -> Self {
        PatchError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
