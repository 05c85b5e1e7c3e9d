//! Valve's wire protocol as types: what the daemon, `valvectl`, the client library and the
//! Python package send each other, so that every side shares one schema (these types' docs).
//!
//! Two sockets speak it, each one JSON object per message:
//! - the control socket ([`control`]): one [`control::Request`] line per connection, answered
//!   by one [`control::Reply`] line; `valvectl` and serving frameworks use it;
//! - the memory pool socket ([`pool`]): [`pool::PoolRequest`]s from client processes, answered
//!   by the reply types there, with file descriptors beside some replies.
//!
//! A client states the [`PROTOCOL_VERSION`] it speaks in a [`control::Request::Hello`]; a
//! daemon that speaks another answers with [`control::ErrorCode::VersionMismatch`].

pub mod control;
pub mod gate;
pub mod pool;

/// The version of this protocol. It changes when a request, reply or field changes meaning or
/// goes away (adding an optional field or a new request does not change it).
pub const PROTOCOL_VERSION: u32 = 1;

/// The message an operator reads when the two sides speak different protocol versions: it names
/// both and says which side to upgrade.
pub fn version_mismatch_message(daemon: u32, client: u32) -> String {
    let older = if daemon < client {
        "the daemon (then restart it: `sudo systemctl restart valve`)"
    } else {
        "valvectl or the client library"
    };
    format!(
        "protocol version mismatch: the daemon speaks version {daemon}, this client version \
         {client}; upgrade the older side, {older}, so that both come from the same Valve release"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mismatch_message_names_the_older_side() {
        let m = version_mismatch_message(1, 2);
        assert!(m.contains("version 1") && m.contains("version 2"), "{m}");
        assert!(m.contains("upgrade the older side, the daemon"), "{m}");
        let m = version_mismatch_message(3, 2);
        assert!(m.contains("upgrade the older side, valvectl"), "{m}");
    }
}
