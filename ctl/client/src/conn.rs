//! The SOCK_SEQPACKET connections to the daemon's pool socket, and the control connection's rule:
//! one reply per request, `{"ok": true, ...}` or `{"ok": false, "code", "error"}`.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;

use serde_json::Value;
use valve_protocol::pool::PoolRequest;
use valve_vmm::{wire, VmmError};

use crate::{Error, Result};

/// Opens a connection to the pool socket at `path`.
pub(crate) fn connect(path: &Path) -> Result<UnixStream> {
    wire::connect(path).map_err(|e| {
        let source = match e {
            VmmError::Os { source, .. } => source,
            other => std::io::Error::other(other.to_string()),
        };
        match source.raw_os_error() {
            Some(libc::ENOENT) => Error::NoSocket { path: path.into() },
            Some(libc::EACCES | libc::EPERM) => Error::SocketPermission { path: path.into() },
            _ => Error::Connect {
                path: path.into(),
                source,
            },
        }
    })
}

/// Sends `req` and waits for its reply. A refusal becomes the matching [`Error`]; a closed
/// connection is [`Error::Closed`].
pub(crate) fn call(sock: &UnixStream, req: &PoolRequest) -> Result<(Value, Vec<OwnedFd>)> {
    let op = req.op();
    wire::send(sock, &req.to_json(), &[]).map_err(Error::from_wire)?;
    let (reply, fds) = wire::recv(sock)
        .map_err(Error::from_wire)?
        .ok_or(Error::Closed)?;
    check_reply(op, &reply)?;
    Ok((reply, fds))
}

/// `Ok` for `{"ok": true}`, the daemon's refusal as an [`Error`] otherwise.
pub(crate) fn check_reply(op: &str, reply: &Value) -> Result<()> {
    match reply.get("ok").and_then(Value::as_bool) {
        Some(true) => Ok(()),
        Some(false) => {
            let code = reply.get("code").and_then(Value::as_i64).unwrap_or(0);
            let message = reply
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("(no message)")
                .to_string();
            Err(Error::refusal(op, code as i32, message))
        }
        None => Err(Error::Protocol(format!(
            "the reply to `{op}` has no boolean `ok`: {reply}"
        ))),
    }
}

/// A required unsigned field of a reply.
pub(crate) fn u64_field(op: &str, v: &Value, name: &str) -> Result<u64> {
    v.get(name).and_then(Value::as_u64).ok_or_else(|| {
        Error::Protocol(format!(
            "the reply to `{op}` lacks the unsigned field `{name}`: {v}"
        ))
    })
}

/// A list of handle ids (`"handles": [..]`).
pub(crate) fn handle_ids(op: &str, v: &Value) -> Result<Vec<u32>> {
    id_list(op, v, "handles")
}

/// A list of handle ids in field `field`.
pub(crate) fn id_list(op: &str, v: &Value, field: &str) -> Result<Vec<u32>> {
    let bad = || {
        Error::Protocol(format!(
            "`{op}` carries no list of handle ids in `{field}`: {v}"
        ))
    };
    v.get(field)
        .and_then(Value::as_array)
        .ok_or_else(bad)?
        .iter()
        .map(|h| {
            h.as_u64()
                .and_then(|h| u32::try_from(h).ok())
                .ok_or_else(bad)
        })
        .collect()
}
