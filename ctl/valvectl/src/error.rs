//! `valvectl`'s error: every failure with the exit code `valvectl --help` documents for it.
//! Commands return it; `cli::run` prints it and exits with its code.

use nix::sys::signal::Signal;
use valve::error::Error;

/// A CLI failure with its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// From the library.
    #[error(transparent)]
    Valve(#[from] Error),
    /// Bad arguments that clap could not catch.
    #[error("{0}")]
    Usage(String),
    /// Writing output failed.
    #[error("writing output: {0}")]
    Io(#[from] std::io::Error),
    /// A daemon-side failure or a failure reaching it, with its exit code.
    #[error("{1}")]
    Daemon(i32, String),
    /// Interrupted by a signal (after cleaning up).
    #[error("interrupted by {0}; all channels were resumed")]
    Interrupted(Signal),
    /// The command already said what happened (e.g. `driver patch --check`: not patched); only
    /// the exit code remains.
    #[error("exit code {0}")]
    Reported(i32),
}

impl CliError {
    /// The documented exit code.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Interrupted(_) => 130,
            CliError::Io(_) => 1,
            CliError::Valve(e) => e.exit_code(),
            CliError::Daemon(code, _) | CliError::Reported(code) => *code,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_code_mapping() {
        let c = |e: Error| CliError::Valve(e).exit_code();
        assert_eq!(
            c(Error::DriverMissing {
                path: "/dev/nvidiactl".into()
            }),
            3
        );
        assert_eq!(
            c(Error::NotOpenModule {
                version: "x".into()
            }),
            3
        );
        assert_eq!(
            c(Error::Permission {
                path: "/dev/nvidiactl".into()
            }),
            4
        );
        assert_eq!(
            c(Error::rm("x", valve_ioctl_bindings::NV_ERR_INVALID_CLIENT)),
            5
        );
        assert_eq!(CliError::Usage("x".into()).exit_code(), 2);
    }
}
