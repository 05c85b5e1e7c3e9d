//! One control-socket connection: its request line read without blocking (never past
//! [`MAX_REQUEST_BYTES`]), then its reply written as the socket takes it.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use crate::audit::Caller;
use crate::protocol::{Reply, MAX_REQUEST_BYTES};

/// One client connection: reading its request line, then writing its reply.
pub(super) struct Conn {
    /// Stable for the connection's life (indices change when closed ones go).
    pub(super) id: u64,
    pub(super) stream: UnixStream,
    pub(super) caller: Option<Caller>,
    request: Vec<u8>,
    /// The reply and how much of it is written; set once the request is answered.
    pub(super) reply: Option<(Vec<u8>, usize)>,
    pub(super) since: Instant,
    pub(super) done: bool,
    /// Its request is a `gate start` under way: neither read again nor timed out until the
    /// gate has started and it is answered.
    pub(super) waiting: bool,
}

pub(super) enum ReadOutcome {
    /// No complete line yet.
    Pending,
    /// The line (without its newline; or everything, if the peer closed without one).
    Line(Vec<u8>),
    /// Over [`MAX_REQUEST_BYTES`] without a newline.
    TooLong,
    /// The peer closed without sending anything.
    Closed,
}

impl Conn {
    pub(super) fn new(id: u64, stream: UnixStream, caller: Option<Caller>) -> Conn {
        Conn {
            id,
            stream,
            caller,
            request: Vec::new(),
            reply: None,
            since: Instant::now(),
            done: false,
            waiting: false,
        }
    }

    /// The peer process (-1 when SO_PEERCRED failed): what a turn's fair share is counted by.
    pub(super) fn peer(&self) -> i32 {
        self.caller.map_or(-1, |c| c.pid)
    }

    /// Reads what is there without blocking, never past [`MAX_REQUEST_BYTES`] + 1 bytes.
    pub(super) fn read_request(&mut self) -> ReadOutcome {
        let mut chunk = [0u8; 4096];
        loop {
            let room = (MAX_REQUEST_BYTES + 1 - self.request.len()).min(chunk.len());
            if room == 0 {
                return ReadOutcome::TooLong;
            }
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) if self.request.is_empty() => return ReadOutcome::Closed,
                Ok(0) => return ReadOutcome::Line(std::mem::take(&mut self.request)),
                Ok(n) => {
                    let seen = self.request.len();
                    self.request.extend_from_slice(&chunk[..n]);
                    if let Some(p) = self.request[seen..].iter().position(|&b| b == b'\n') {
                        self.request.truncate(seen + p);
                        return ReadOutcome::Line(std::mem::take(&mut self.request));
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    return ReadOutcome::Pending
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return ReadOutcome::Closed,
            }
        }
    }

    /// Queues `reply` and writes as much of it as the socket takes now.
    pub(super) fn answer(&mut self, reply: &Reply) {
        let mut out = serde_json::to_vec(reply).expect("replies serialise");
        out.push(b'\n');
        self.reply = Some((out, 0));
        self.since = Instant::now();
        self.waiting = false;
        self.write_reply();
    }

    pub(super) fn write_reply(&mut self) {
        let Some((out, written)) = &mut self.reply else {
            return;
        };
        while *written < out.len() {
            match self.stream.write(&out[*written..]) {
                Ok(n) => *written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        self.done = true;
    }
}

/// Whether a request line can be a JSON object at all (its first non-blank byte is `{`): what
/// is not is refused without parsing.
pub(super) fn may_be_request(line: &[u8]) -> bool {
    line.iter()
        .find(|b| !b.is_ascii_whitespace())
        .is_some_and(|&b| b == b'{')
}
