//! The daemon's client: sends one typed request over the daemon's socket (or one message to its
//! memory pool's) and turns the reply, or the failure to get one, into the request's reply type
//! or a [`CliError`] with its exit code.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use valve_daemon::protocol::{ErrorCode, Hello, Reply, Request, PROTOCOL_VERSION};
use valve_daemon::EXIT_NO_DAEMON;
use valve_protocol::pool::{parse_reply, PoolRequest};
use valve_protocol::VersionMismatch;

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
/// for the reply, its data left as JSON.
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

/// Sends one request to the daemon on `socket` and reads its reply as `T`, the request's reply
/// type; a failure carries the exit code to use.
pub fn daemon_call<T: DeserializeOwned>(socket: &Path, req: &Request) -> Result<T, CliError> {
    daemon_call_within(socket, req, Duration::from_secs(10))
}

/// [`daemon_call`] with a reply timeout of its own (`valvectl top` must not hang on a stuck
/// daemon). A refusal of the op, or a reply that does not read as `T`, is checked with a hello:
/// when the daemon speaks another protocol version, the error says so and which side to upgrade.
pub fn daemon_call_within<T: DeserializeOwned>(
    socket: &Path,
    req: &impl serde::Serialize,
    timeout: Duration,
) -> Result<T, CliError> {
    let data = match raw_call(socket, req, timeout) {
        Err(CliError::Daemon(2, m)) => {
            hello(socket, timeout)?;
            return Err(CliError::Daemon(2, m));
        }
        other => other?,
    };
    match serde_json::from_value(data.unwrap_or_default()) {
        Ok(t) => Ok(t),
        Err(e) => {
            hello(socket, timeout)?;
            Err(CliError::Daemon(
                1,
                format!("the daemon's reply did not read as this valvectl expects: {e}"),
            ))
        }
    }
}

/// Sends `req` and returns the reply's data, or its error as a [`CliError`].
fn raw_call(
    socket: &Path,
    req: &impl serde::Serialize,
    timeout: Duration,
) -> Result<Option<serde_json::Value>, CliError> {
    let reply = call(socket, req, timeout).map_err(ipc_error)?;
    reply
        .into_result()
        .map_err(|e| CliError::Daemon(e.code, e.message))
}

/// A failure to reach the daemon, with its exit code.
fn ipc_error(e: IpcError) -> CliError {
    let code = match e {
        IpcError::NotRunning(_) => EXIT_NO_DAEMON,
        IpcError::Permission(_) => 4,
        IpcError::Io { .. } => 1,
    };
    CliError::Daemon(code, e.to_string())
}

/// Checks that the daemon speaks this valvectl's protocol version: its hello reply, its
/// mismatch error, or (a daemon from before the hello) its refusal of the op.
fn hello(socket: &Path, timeout: Duration) -> Result<(), CliError> {
    let req = Request::Hello {
        protocol_version: PROTOCOL_VERSION,
    };
    let mismatch = |daemon: u32| {
        let e = VersionMismatch {
            daemon,
            client: PROTOCOL_VERSION,
        };
        CliError::Daemon(ErrorCode::VersionMismatch.exit_code(), e.to_string())
    };
    let reply = call(socket, &req, timeout).map_err(ipc_error)?;
    match reply.into_result() {
        Ok(data) => match data.and_then(|d| serde_json::from_value::<Hello>(d).ok()) {
            Some(h) if h.protocol_version == PROTOCOL_VERSION => Ok(()),
            Some(h) => Err(mismatch(h.protocol_version)),
            None => Err(mismatch(0)),
        },
        Err(e) if e.kind == ErrorCode::VersionMismatch => Err(CliError::Daemon(e.code, e.message)),
        // An older daemon refuses the op it does not know.
        Err(e) if e.code == 2 => Err(mismatch(0)),
        Err(e) => Err(CliError::Daemon(e.code, e.message)),
    }
}

/// Sends one message to the memory pool on `socket` (`valvectl daemon --pool`) and reads its
/// reply as `T`; exit code 7, naming the command that starts one, when no pool answers.
pub fn pool_call<T: DeserializeOwned>(socket: &Path, msg: &PoolRequest) -> Result<T, CliError> {
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
    wire::send(&s, &msg.to_json(), &[]).map_err(not_running)?;
    match wire::recv(&s).map_err(not_running)? {
        Some((v, _)) => parse_reply(v).map_err(|f| CliError::Daemon(1, format!("pool: {f}"))),
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

    /// A daemon on a fresh socket that answers each connection's line with the next of
    /// `replies`, and returns the lines it got.
    fn fake_daemon(
        replies: Vec<String>,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::thread::JoinHandle<Vec<String>>,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("valve.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let mut got = Vec::new();
            for reply in replies {
                let (mut s, _) = listener.accept().unwrap();
                let mut line = String::new();
                BufReader::new(&s).read_line(&mut line).unwrap();
                got.push(line.trim().to_string());
                s.write_all(format!("{reply}\n").as_bytes()).unwrap();
            }
            got
        });
        (dir, path, server)
    }

    #[test]
    fn an_older_daemon_that_refuses_the_op_gets_the_version_mismatch() {
        let refusal =
            r#"{"data":null,"error":{"code":2,"message":"bad request: unknown variant"}}"#;
        let (_dir, path, server) = fake_daemon(vec![refusal.into(), refusal.into()]);
        let e = daemon_call::<Hello>(&path, &Request::GateStatus).unwrap_err();
        let got = server.join().unwrap();
        assert_eq!(
            got[1],
            format!(r#"{{"op":"hello","protocol_version":{PROTOCOL_VERSION}}}"#)
        );
        assert_eq!(e.exit_code(), 11, "{e}");
        assert!(
            e.to_string().contains("upgrade the older side, the daemon"),
            "{e}"
        );
    }

    #[test]
    fn a_reply_of_another_shape_from_the_same_version_is_its_own_error() {
        let odd = r#"{"data":{"unexpected":true},"error":null}"#.to_string();
        let hello = format!(
            r#"{{"data":{{"protocol_version":{PROTOCOL_VERSION},"daemon_version":"x"}},"error":null}}"#
        );
        let (_dir, path, server) = fake_daemon(vec![odd, hello]);
        let e = daemon_call::<Hello>(&path, &Request::Status).unwrap_err();
        server.join().unwrap();
        assert_eq!(e.exit_code(), 1, "{e}");
        assert!(
            e.to_string()
                .contains("did not read as this valvectl expects"),
            "{e}"
        );
    }
}
