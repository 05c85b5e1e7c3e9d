//! Why the daemon could not start or had to stop, with the exit code `valvectl daemon` returns
//! (the codes are the CLI's: `valvectl --help`).

/// Failure to start or run the daemon, with its exit code.
#[derive(Debug, thiserror::Error)]
#[error("{message}")]
pub struct DaemonError {
    /// Exit code.
    pub code: i32,
    /// What and how to fix it.
    pub message: String,
}

/// A [`DaemonError`].
pub(crate) fn derr(code: i32, message: impl Into<String>) -> DaemonError {
    DaemonError {
        code,
        message: message.into(),
    }
}
