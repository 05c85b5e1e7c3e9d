//! The pool's wire format: one JSON object per SOCK_SEQPACKET message, descriptors attached, and
//! messages with more than [`fdpass::MAX_FDS`] descriptors split into numbered parts.
//!
//! Both the daemon's pool and the client library use these functions, so the framing in
//! `docs/memory.md` ("The pool protocol") is implemented once.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use serde_json::Value;

use crate::{fdpass, VmmError};

/// The largest message accepted, in bytes.
pub const MAX_MESSAGE: usize = 64 * 1024;

/// A connected SOCK_SEQPACKET pair (message boundaries kept, descriptors ride along).
pub fn seqpacket_pair() -> crate::Result<(UnixStream, UnixStream)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (a, b) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::SOCK_CLOEXEC,
    )
    .map_err(|e| VmmError::Os {
        op: "socketpair(SOCK_SEQPACKET)",
        source: e.into(),
    })?;
    Ok((UnixStream::from(a), UnixStream::from(b)))
}

fn seqpacket_socket() -> crate::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    socket(
        AddressFamily::Unix,
        SockType::SeqPacket,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| VmmError::Os {
        op: "socket(AF_UNIX, SOCK_SEQPACKET)",
        source: e.into(),
    })
}

/// Listens on a SOCK_SEQPACKET socket at `path` (the pool socket). The caller removes a stale
/// file first and sets the mode.
pub fn listen(path: &std::path::Path) -> crate::Result<std::os::unix::net::UnixListener> {
    use nix::sys::socket::{bind, listen as listen_on, Backlog, UnixAddr};
    let fd = seqpacket_socket()?;
    let addr = UnixAddr::new(path).map_err(|e| VmmError::Os {
        op: "socket path",
        source: e.into(),
    })?;
    bind(fd.as_raw_fd(), &addr).map_err(|e| VmmError::Os {
        op: "binding the pool socket",
        source: e.into(),
    })?;
    listen_on(&fd, Backlog::new(128).unwrap_or(Backlog::MAXCONN)).map_err(|e| VmmError::Os {
        op: "listening on the pool socket",
        source: e.into(),
    })?;
    Ok(std::os::unix::net::UnixListener::from(fd))
}

/// Connects to the SOCK_SEQPACKET socket at `path`.
pub fn connect(path: &std::path::Path) -> crate::Result<UnixStream> {
    use nix::sys::socket::{connect as connect_to, UnixAddr};
    let fd = seqpacket_socket()?;
    let addr = UnixAddr::new(path).map_err(|e| VmmError::Os {
        op: "socket path",
        source: e.into(),
    })?;
    connect_to(fd.as_raw_fd(), &addr).map_err(|e| VmmError::Os {
        op: "connecting to the pool socket",
        source: e.into(),
    })?;
    Ok(UnixStream::from(fd))
}

/// Sends `msg` with `fds`, in as many parts as the descriptors need.
pub fn send(sock: &UnixStream, msg: &Value, fds: &[OwnedFd]) -> crate::Result<()> {
    let borrowed: Vec<BorrowedFd> = fds.iter().map(|f| f.as_fd()).collect();
    send_borrowed(sock, msg, &borrowed)
}

/// [`send`] for descriptors the caller keeps (the pool sends its exported handles this way).
pub fn send_borrowed(sock: &UnixStream, msg: &Value, fds: &[BorrowedFd<'_>]) -> crate::Result<()> {
    if !msg.is_object() {
        return Err(VmmError::Invalid("a pool message is a JSON object".into()));
    }
    let chunks: Vec<&[BorrowedFd]> = if fds.is_empty() {
        vec![&[]]
    } else {
        fds.chunks(fdpass::MAX_FDS).collect()
    };
    let parts = chunks.len();
    for (i, chunk) in chunks.into_iter().enumerate() {
        let mut m = msg.clone();
        if parts > 1 {
            m["part"] = i.into();
            m["parts"] = parts.into();
        }
        let bytes = m.to_string();
        if bytes.len() > MAX_MESSAGE {
            return Err(VmmError::Invalid(format!(
                "a pool message is at most {MAX_MESSAGE} bytes; this one has {}",
                bytes.len()
            )));
        }
        fdpass::send(sock, bytes.as_bytes(), chunk)?;
    }
    Ok(())
}

/// Receives one message (joining its parts) and its descriptors; `None` when the peer closed.
/// A malformed message is an [`VmmError::Invalid`] naming what is wrong.
pub fn recv(sock: &UnixStream) -> crate::Result<Option<(Value, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; MAX_MESSAGE + 1];
    let mut all = Vec::new();
    let mut expected_part = 0u64;
    loop {
        let (n, fds) = fdpass::recv(sock, &mut buf)?;
        if n == 0 {
            return Ok(None);
        }
        if n > MAX_MESSAGE {
            return Err(VmmError::Invalid(format!(
                "message over {MAX_MESSAGE} bytes refused"
            )));
        }
        let v: Value = serde_json::from_slice(&buf[..n])
            .map_err(|e| VmmError::Invalid(format!("message is not JSON: {e}")))?;
        if !v.is_object() {
            return Err(VmmError::Invalid("a pool message is a JSON object".into()));
        }
        all.extend(fds);
        let part = v.get("part").and_then(Value::as_u64).unwrap_or(0);
        let parts = v.get("parts").and_then(Value::as_u64).unwrap_or(1);
        if part != expected_part || parts == 0 || part >= parts || parts > 1 << 16 {
            return Err(VmmError::Invalid(format!(
                "message part {part} of {parts} arrived, expected part {expected_part}"
            )));
        }
        if part + 1 == parts {
            return Ok(Some((v, all)));
        }
        expected_part += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn null_fds(n: usize) -> Vec<OwnedFd> {
        (0..n)
            .map(|_| OwnedFd::from(std::fs::File::open("/dev/null").unwrap()))
            .collect()
    }

    #[test]
    fn many_descriptors_travel_in_parts_and_arrive_together() {
        let (a, b) = seqpacket_pair().unwrap();
        let fds = null_fds(600);
        let msg = serde_json::json!({"op": "grow", "handles": [1, 2, 3]});
        let sender = std::thread::spawn(move || send(&a, &msg, &fds).map(|_| a));
        let (got, fds) = recv(&b).unwrap().unwrap();
        let _a = sender.join().unwrap().unwrap();
        assert_eq!(got["op"], "grow");
        assert_eq!(got["parts"], 3);
        assert_eq!(fds.len(), 600);
    }

    #[test]
    fn a_listening_socket_keeps_message_boundaries() {
        let dir = std::env::temp_dir().join(format!("valve-wire-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("pool.sock");
        let _ = std::fs::remove_file(&path);
        let l = listen(&path).unwrap();
        let c = connect(&path).unwrap();
        let (s, _) = l.accept().unwrap();
        send(&c, &serde_json::json!({"a": 1}), &[]).unwrap();
        send(&c, &serde_json::json!({"b": 2}), &[]).unwrap();
        assert_eq!(recv(&s).unwrap().unwrap().0["a"], 1);
        assert_eq!(recv(&s).unwrap().unwrap().0["b"], 2);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_small_message_has_no_part_fields() {
        let (a, b) = seqpacket_pair().unwrap();
        send(&a, &serde_json::json!({"op": "status"}), &[]).unwrap();
        let (got, fds) = recv(&b).unwrap().unwrap();
        assert_eq!(got, serde_json::json!({"op": "status"}));
        assert!(fds.is_empty());
    }

    #[test]
    fn hostile_messages_are_named_errors() {
        let (a, b) = seqpacket_pair().unwrap();
        for raw in [&b"not json"[..], b"[1,2]", br#"{"part": 3, "parts": 2}"#] {
            fdpass::send(&a, raw, &[]).unwrap();
            assert!(matches!(recv(&b), Err(VmmError::Invalid(_))), "{raw:?}");
        }
        let big = vec![b' '; MAX_MESSAGE + 10];
        fdpass::send(&a, &big, &[]).unwrap();
        assert!(matches!(recv(&b), Err(VmmError::Invalid(_))));
        assert!(send(&a, &serde_json::json!([1]), &[]).is_err());
        drop(a);
        assert!(recv(&b).unwrap().is_none());
    }
}
