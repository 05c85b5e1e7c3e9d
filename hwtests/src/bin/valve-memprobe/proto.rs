//! The probe's request/reply helpers over the pool wire format (`valve_vmm::wire`): the pool
//! (parent) sends a request, the offline or online child answers exactly once.

use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use anyhow::{bail, Result};
use serde_json::Value;
pub use valve_vmm::wire::{recv, send, seqpacket_pair};

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
    fn an_error_reply_or_a_closed_child_is_an_error() {
        let (a, b) = seqpacket_pair().unwrap();
        send(&b, &serde_json::json!({"error": "no memory"}), &[]).unwrap();
        let e = reply(&a).unwrap_err().to_string();
        assert!(e.contains("no memory"), "{e}");
        drop(b);
        assert!(reply(&a).unwrap_err().to_string().contains("closed"));
    }
}
