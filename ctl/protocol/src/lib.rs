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

/// The two sides speak different protocol versions (`daemon` 0: a daemon from before the hello,
/// which knows no versions). Its message names both and the side to upgrade.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VersionMismatch {
    /// The daemon's version (0: older than the hello).
    pub daemon: u32,
    /// This client's version.
    pub client: u32,
}

impl std::fmt::Display for VersionMismatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&version_mismatch_message(self.daemon, self.client))
    }
}

impl std::error::Error for VersionMismatch {}

/// The message an operator reads when the two sides speak different protocol versions: it names
/// both and says which side to upgrade.
pub fn version_mismatch_message(daemon: u32, client: u32) -> String {
    let older = if daemon < client {
        "the daemon (then restart it: `sudo systemctl restart valve`)"
    } else {
        "valvectl or the client library"
    };
    let theirs = if daemon == 0 {
        "a version older than the hello".to_string()
    } else {
        format!("version {daemon}")
    };
    format!(
        "protocol version mismatch: the daemon speaks {theirs}, this client version {client}; \
         upgrade the older side, {older}, so that both come from the same Valve release"
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
        let m = VersionMismatch {
            daemon: 0,
            client: 1,
        }
        .to_string();
        assert!(
            m.contains("older than the hello") && m.contains("the daemon (then"),
            "{m}"
        );
    }
}
