//! The command line's errors and exit codes: an error that carries its exit code, and the codes.

/// Exit codes (also in `--help`).
pub mod exit {
    /// Bad arguments or input files.
    pub const USAGE: u8 = 2;
    /// The cluster engine (Slurm) could not be reached or refused a command.
    pub const ENGINE: u8 = 3;
    /// A benchmark or simulation missed a target it was asked to check.
    pub const TARGET: u8 = 4;
    /// Another scheduler holds the state file (`run --state`).
    pub const BUSY: u8 = 5;
}

/// An error with its exit code.
#[derive(Debug)]
pub struct Fail {
    /// The exit code.
    pub code: u8,
    /// The message.
    pub msg: String,
}

impl std::fmt::Display for Fail {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.msg)
    }
}

impl std::error::Error for Fail {}

/// An error of bad arguments or input.
pub fn usage(msg: impl Into<String>) -> anyhow::Error {
    Fail {
        code: exit::USAGE,
        msg: msg.into(),
    }
    .into()
}
