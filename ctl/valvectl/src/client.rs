//! The daemon's client: sends one request over the daemon's socket (or one message to its memory
//! pool's) and turns the reply, or the failure to get one, into data or a [`CliError`] with its
//! exit code.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use valve_daemon::protocol::{Reply, Request};
use valve_daemon::EXIT_NO_DAEMON;

use crate::error::CliError;

/// Failures of talking to the daemon.
#[derive(Debug, thiserror::Error)]
pub enum IpcError {
    /// Nothing listens on the socket.
    #[error(
        "the Valve daemon is not running (no one listens on {0}): start it with \
         `sudo valvectl daemon` or `sudo systemctl start valve`"
    )]
    NotRunning(String),
    /// The socket exists but this user may not use it.
    #[error(
        "permission denied on {0}: run as root or as a member of the group the daemon was \
         started with (--group)"
    )]
    Permission(String),
    /// Anything else.
    #[error("talking to the daemon on {socket}: {source}")]
    Io {
        /// The socket.
        socket: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// Sends one request (a [`Request`], or a `LoopRequest` the daemon's loop answers) and waits
/// for the reply.
pub fn call(
    socket: &Path,
    req: &impl serde::Serialize,
    timeout: Duration,
) -> Result<Reply<serde_json::Value>, IpcError> {
    let name = socket.display().to_string();
    let io = |source: std::io::Error| IpcError::Io {
        socket: name.clone(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
            IpcError::NotRunning(name.clone())
        }
        std::io::ErrorKind::PermissionDenied => IpcError::Permission(name.clone()),
        _ => io(e),
    })?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    let mut line = serde_json::to_string(req).expect("requests serialise");
    line.push('\n');
    stream.write_all(line.as_bytes()).map_err(io)?;
    let mut reply = String::new();
    BufReader::new(stream).read_line(&mut reply).map_err(io)?;
    serde_json::from_str(&reply)
        .map_err(|e| io(std::io::Error::new(std::io::ErrorKind::InvalidData, e)))
}

/// Sends one request to the daemon on `socket`; a failure carries the exit code to use.
pub fn daemon_call(socket: &Path, req: &Request) -> Result<serde_json::Value, CliError> {
    daemon_call_within(socket, req, Duration::from_secs(10))
}

/// [`daemon_call`] with a reply timeout of its own (`valvectl top` must not hang on a stuck
/// daemon).
pub fn daemon_call_within(
    socket: &Path,
    req: &impl serde::Serialize,
    timeout: Duration,
) -> Result<serde_json::Value, CliError> {
    let reply = call(socket, req, timeout).map_err(|e| {
        let code = match e {
            IpcError::NotRunning(_) => EXIT_NO_DAEMON,
            IpcError::Permission(_) => 4,
            IpcError::Io { .. } => 1,
        };
        CliError::Daemon(code, e.to_string())
    })?;
    match reply.error {
        Some(e) => Err(CliError::Daemon(e.code, e.message)),
        None => Ok(reply.data.unwrap_or_default()),
    }
}

/// Sends one message to the memory pool on `socket` (`valvectl daemon --pool`) and returns its
/// reply; exit code 7, naming the command that starts one, when no pool answers.
pub fn pool_call(socket: &Path, msg: &serde_json::Value) -> Result<serde_json::Value, CliError> {
    use valve_vmm::wire;
    let not_running = |e: valve_vmm::VmmError| {
        CliError::Daemon(
            EXIT_NO_DAEMON,
            format!(
                "no memory pool answers on {}: start it with `sudo valvectl daemon --pool` ({e})",
                socket.display()
            ),
        )
    };
    let s = wire::connect(socket).map_err(not_running)?;
    wire::send(&s, msg, &[]).map_err(not_running)?;
    match wire::recv(&s).map_err(not_running)? {
        Some((v, _)) if v["ok"] == true => Ok(v),
        Some((v, _)) => Err(CliError::Daemon(1, format!("pool: {}", v["error"]))),
        None => Err(CliError::Daemon(1, "the pool closed the connection".into())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_daemon_is_a_named_error() {
        let dir = tempfile::tempdir().unwrap();
        let err = call(
            &dir.path().join("none.sock"),
            &Request::Ps,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(matches!(err, IpcError::NotRunning(_)));
        assert!(err.to_string().contains("sudo valvectl daemon"));
    }
}
