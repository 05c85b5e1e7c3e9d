//! The fast lane into the daemon's loop: the memory pool's freezes and thaws of offline
//! processes, served between any two pieces of the loop's other work and never behind a socket.
//!
//! The pool thread sends a [`LaneOp`] over a channel and writes a byte to a socket pair whose
//! other end is in the loop's poll set, then waits for the reply. The loop serves the lane at the
//! start of each turn, after its poll, after accepting, and after every socket request, so a
//! freeze waits for at most one other piece of work (one request, one accept batch, one upkeep
//! step), whatever queues on the control socket. Only preempt and resume by pid travel here.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::protocol::{Reply, Request};

/// What the pool may ask of the loop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaneOp {
    /// `preempt --pid` with a hold limit: the daemon resumes by itself after `max_hold_ms`.
    Freeze {
        /// The process.
        pid: u32,
        /// Its hold limit, ms.
        max_hold_ms: u64,
    },
    /// `resume --pid`.
    Thaw {
        /// The process.
        pid: u32,
    },
}

impl LaneOp {
    /// The control-socket request it stands for.
    pub fn request(self) -> Request {
        match self {
            LaneOp::Freeze { pid, max_hold_ms } => Request::Preempt {
                pid,
                gpu: None,
                max_hold_ms: Some(max_hold_ms),
                confirm: false,
            },
            LaneOp::Thaw { pid } => Request::Resume { pid },
        }
    }
}

/// One call on the lane: its op, where the reply goes, when it was sent.
pub(crate) struct LaneCall {
    pub(crate) op: LaneOp,
    pub(crate) reply: mpsc::SyncSender<Reply>,
    pub(crate) sent: Instant,
}

/// Wakes the loop from its poll (a byte on the socket pair); cheap, never blocks.
#[derive(Clone)]
pub struct Waker(Arc<UnixStream>);

impl Waker {
    /// Wakes the loop. A full pair means it is due to wake anyway.
    pub fn wake(&self) {
        let _ = (&*self.0).write(&[1]);
    }
}

/// The pool's end of the lane (cloned freely, sent to any thread).
#[derive(Clone)]
pub struct LaneClient {
    tx: Sender<LaneCall>,
    waker: Waker,
}

impl LaneClient {
    /// Sends `op` to the loop and waits up to `timeout` for its reply. Errors when the loop has
    /// gone (the daemon is stopping) or did not answer in time.
    pub fn call(&self, op: LaneOp, timeout: Duration) -> Result<Reply, String> {
        self.send(op)?.recv_timeout(timeout).map_err(|e| match e {
            mpsc::RecvTimeoutError::Timeout => {
                format!("the daemon's loop did not answer within {timeout:?}")
            }
            mpsc::RecvTimeoutError::Disconnected => "the daemon's loop has stopped".to_string(),
        })
    }

    /// Sends `op` to the loop and wakes it; the reply comes on the receiver.
    pub fn send(&self, op: LaneOp) -> Result<Receiver<Reply>, String> {
        let (tx, rx) = mpsc::sync_channel(1);
        let call = LaneCall {
            op,
            reply: tx,
            sent: Instant::now(),
        };
        self.tx
            .send(call)
            .map_err(|_| "the daemon's loop has stopped".to_string())?;
        self.waker.wake();
        Ok(rx)
    }
}

/// The loop's end of the lane. Dropping it fails every call waiting on it at once.
pub struct Lane {
    rx: Receiver<LaneCall>,
    wake_rx: UnixStream,
    waker: Waker,
}

/// A new lane: the pool's end and the loop's.
pub fn lane() -> std::io::Result<(LaneClient, Lane)> {
    let (wake_tx, wake_rx) = UnixStream::pair()?;
    wake_tx.set_nonblocking(true)?;
    wake_rx.set_nonblocking(true)?;
    let (tx, rx) = mpsc::channel();
    let waker = Waker(Arc::new(wake_tx));
    let client = LaneClient {
        tx,
        waker: waker.clone(),
    };
    Ok((client, Lane { rx, wake_rx, waker }))
}

impl Lane {
    /// What the loop polls for wake-ups.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        self.wake_rx.as_fd()
    }

    /// Reads the wake-up bytes, so that the next poll waits again.
    pub(crate) fn clear_wake(&self) {
        let mut buf = [0u8; 256];
        while matches!((&self.wake_rx).read(&mut buf), Ok(n) if n > 0) {}
    }

    /// The next call waiting, if any (never blocks).
    pub(crate) fn next(&self) -> Option<LaneCall> {
        self.rx.try_recv().ok()
    }

    /// Wakes this lane's loop (for work finished on other threads, such as a gate's start).
    pub(crate) fn waker(&self) -> Waker {
        self.waker.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_fail_at_once_when_the_loop_has_gone() {
        let (client, lane) = lane().unwrap();
        let waiting = client.send(LaneOp::Thaw { pid: 7 }).unwrap();
        drop(lane);
        assert!(waiting.recv().is_err(), "a queued call's reply never comes");
        let e = client
            .call(LaneOp::Thaw { pid: 7 }, Duration::from_secs(3600))
            .unwrap_err();
        assert!(e.contains("stopped"), "not a timeout: {e}");
    }

    #[test]
    fn a_call_wakes_the_loop_and_is_taken_in_order() {
        let (client, lane) = lane().unwrap();
        let freeze = LaneOp::Freeze {
            pid: 7,
            max_hold_ms: 2_000,
        };
        let _a = client.send(freeze).unwrap();
        let _b = client.send(LaneOp::Thaw { pid: 7 }).unwrap();
        let mut b = [0u8; 1];
        assert!(matches!((&lane.wake_rx).read(&mut b), Ok(1)), "woken");
        lane.clear_wake();
        assert!((&lane.wake_rx).read(&mut b).is_err(), "cleared");
        assert_eq!(lane.next().map(|c| c.op), Some(freeze));
        assert_eq!(
            lane.next().map(|c| c.op.request()),
            Some(Request::Resume { pid: 7 })
        );
        assert!(lane.next().is_none());
    }
}
