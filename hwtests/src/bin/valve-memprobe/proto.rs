//! The probe's messages between the pool (parent) and its offline/online children: one JSON
//! object per SOCK_SEQPACKET message, handles attached as descriptors, strictly request/reply.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;

use anyhow::{bail, Context, Result};
use serde_json::Value;
use valve_vmm::fdpass;

/// A connected SOCK_SEQPACKET pair (message boundaries kept, descriptors ride along).
pub fn seqpacket_pair() -> Result<(UnixStream, UnixStream)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (a, b) = socketpair(
        AddressFamily::Unix,
        SockType::SeqPacket,
        None,
        SockFlag::empty(),
    )
    .context("socketpair(SOCK_SEQPACKET)")?;
    Ok((UnixStream::from(a), UnixStream::from(b)))
}

/// Sends one message with descriptors (any number: split into several messages of at most
/// `fdpass::MAX_FDS`, each marked with its part).
pub fn send(sock: &UnixStream, msg: &Value, fds: &[OwnedFd]) -> Result<()> {
    let chunks: Vec<&[OwnedFd]> = if fds.is_empty() {
        vec![&[]]
    } else {
        fds.chunks(fdpass::MAX_FDS).collect()
    };
    let parts = chunks.len();
    for (i, chunk) in chunks.into_iter().enumerate() {
        let mut m = msg.clone();
        m["part"] = i.into();
        m["parts"] = parts.into();
        let borrowed: Vec<BorrowedFd> = chunk.iter().map(|f| f.as_fd()).collect();
        fdpass::send(sock, m.to_string().as_bytes(), &borrowed)?;
    }
    Ok(())
}

/// Receives one message (joining its parts) and its descriptors. `None`: the peer closed.
pub fn recv(sock: &UnixStream) -> Result<Option<(Value, Vec<OwnedFd>)>> {
    let mut buf = vec![0u8; 1 << 20];
    let mut all = Vec::new();
    loop {
        let (n, fds) = fdpass::recv(sock, &mut buf)?;
        if n == 0 {
            return Ok(None);
        }
        let v: Value = serde_json::from_slice(&buf[..n]).context("bad probe message")?;
        all.extend(fds);
        let (part, parts) = (
            v["part"].as_u64().unwrap_or(0),
            v["parts"].as_u64().unwrap_or(1),
        );
        if part + 1 >= parts {
            return Ok(Some((v, all)));
        }
    }
}

/// Sends a request and waits for its reply; a reply with `"error"` becomes an error.
pub fn call(sock: &UnixStream, msg: &Value, fds: &[OwnedFd]) -> Result<Value> {
    send(sock, msg, fds)?;
    reply(sock)
}

/// Waits for the reply to a request already sent.
pub fn reply(sock: &UnixStream) -> Result<Value> {
    let Some((v, _)) = recv(sock)? else {
        bail!("the child closed its socket (it crashed? its stderr is above)");
    };
    if let Some(e) = v.get("error") {
        bail!("child: {}", e.as_str().unwrap_or("unknown error"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn many_descriptors_travel_in_parts_and_arrive_together() {
        let (a, b) = seqpacket_pair().unwrap();
        let files: Vec<OwnedFd> = (0..600)
            .map(|_| OwnedFd::from(std::fs::File::open("/dev/null").unwrap()))
            .collect();
        let msg = serde_json::json!({"op": "map", "first": 3});
        let sender = std::thread::spawn(move || send(&a, &msg, &files).map(|_| a));
        let (got, fds) = recv(&b).unwrap().unwrap();
        let _a = sender.join().unwrap().unwrap();
        assert_eq!(got["op"], "map");
        assert_eq!(got["first"], 3);
        assert_eq!(got["parts"], 3);
        assert_eq!(fds.len(), 600);
    }

    #[test]
    fn an_error_reply_or_a_closed_child_is_an_error() {
        let (a, b) = seqpacket_pair().unwrap();
        send(&b, &serde_json::json!({"error": "no memory"}), &[]).unwrap();
        let e = reply(&a).unwrap_err().to_string();
        assert!(e.contains("no memory"), "{e}");
        drop(b);
        assert!(reply(&a).unwrap_err().to_string().contains("closed"));
    }
}
