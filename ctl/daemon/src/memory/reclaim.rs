//! Taking memory back from offline processes: freeze them, ask each for k handles on its callback
//! connection, wait until a deadline, kill those that do not answer, thaw the rest.
//!
//! Freezing goes through a [`Freezer`]; the daemon's is [`DaemonLaneFreezer`], which asks the
//! daemon's loop over its fast lane (never queued behind the control socket or a slow request),
//! so the preemption is recorded in the state file before it happens and is undone by a
//! restarted daemon, exactly like `valvectl preempt --pid`. [`DaemonSocketFreezer`] asks the
//! control socket instead, for a pool outside the daemon's process.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use valve_protocol::control::{PreemptReply, Reply, Request};
use valve_protocol::pool::{Callback, CallbackReply};
use valve_vmm::wire;

use super::ledger::{ClientId, HandleId};
use crate::server::lane::{LaneClient, LaneOp};

/// Where a freeze's time went, as the daemon reports it (zeros where a freezer cannot tell).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreezeReport {
    /// The gate held the process disabled already and handed it over: no disable was issued.
    pub from_gate: bool,
    /// Writing the state file before the disable, us.
    pub record_us: u64,
    /// Taking the process out of the gate's hands (its claim and the new offline set), us.
    pub gate_us: u64,
    /// The disable ioctls, us (0 when handed over).
    pub disable_us: u64,
    /// Folding the RM events that arrived before the request into the registry, us.
    pub drain_us: u64,
    /// From the connection's accept to its request being read, us.
    pub queued_us: u64,
    /// The whole freeze call on the reclaimer's clock (for the daemon's freezer: connecting to
    /// its socket until its reply), us; 0 where not timed.
    pub round_trip_us: u64,
}

impl FreezeReport {
    /// The part of the round trip the daemon's own timings do not cover: waiting for the loop
    /// to pick the call up (busy with another piece of work) and the reply's way back. On the H100 three
    /// reclaims spent 6-9 ms of their freeze there, untimed until this was logged.
    pub fn outside_daemon_us(&self) -> u64 {
        let inside =
            self.queued_us + self.record_us + self.gate_us + self.disable_us + self.drain_us;
        self.round_trip_us.saturating_sub(inside)
    }
}

/// Stops and restarts a process's GPU work.
pub trait Freezer: Send {
    /// Disables every channel of `pid`; when this returns Ok, none of its kernels runs.
    fn freeze(&mut self, pid: u32) -> Result<FreezeReport, String>;
    /// Enables them again.
    fn thaw(&mut self, pid: u32) -> Result<(), String>;
    /// Ends a process that did not give memory back in time (SIGKILL).
    fn kill(&mut self, pid: u32) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid as i32),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
}

/// How long a freeze or thaw waits for the daemon's answer.
const DAEMON_ANSWER_WITHIN: Duration = Duration::from_secs(5);

/// Freezes through the daemon's loop directly: preempt and resume by pid over its fast lane,
/// served between any two of the loop's other pieces of work.
pub struct DaemonLaneFreezer {
    /// The loop's lane.
    pub lane: LaneClient,
    /// The daemon resumes by itself after this long, should the pool thread die mid-reclaim.
    pub max_hold: Duration,
}

impl DaemonLaneFreezer {
    fn call(&self, op: LaneOp) -> Result<Option<PreemptReply>, String> {
        let reply = self.lane.call(op, DAEMON_ANSWER_WITHIN)?;
        match reply.error {
            Some(e) => Err(e.message),
            None => Ok(match reply.data {
                Some(crate::protocol::Data::Preempt(p)) => Some(*p),
                _ => None,
            }),
        }
    }
}

impl Freezer for DaemonLaneFreezer {
    fn freeze(&mut self, pid: u32) -> Result<FreezeReport, String> {
        let max_hold_ms = self.max_hold.as_millis() as u64;
        let reply = self.call(LaneOp::Freeze { pid, max_hold_ms })?;
        Ok(freeze_report(reply.as_ref()))
    }
    fn thaw(&mut self, pid: u32) -> Result<(), String> {
        self.call(LaneOp::Thaw { pid }).map(|_| ())
    }
}

/// Freezes through the daemon's control socket (preempt/resume by pid): for a pool outside the
/// daemon's process. Its requests queue with every other client's.
pub struct DaemonSocketFreezer {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// The daemon resumes by itself after this long, should the pool thread die mid-reclaim.
    pub max_hold: Duration,
}

impl DaemonSocketFreezer {
    fn call(&self, req: &Request) -> Result<Option<PreemptReply>, String> {
        let stream = UnixStream::connect(&self.socket)
            .map_err(|e| format!("daemon socket {}: {e}", self.socket.display()))?;
        let _ = stream.set_read_timeout(Some(DAEMON_ANSWER_WITHIN));
        (&stream)
            .write_all(
                format!(
                    "{}\n",
                    serde_json::to_string(req).map_err(|e| e.to_string())?
                )
                .as_bytes(),
            )
            .map_err(|e| e.to_string())?;
        let mut line = String::new();
        BufReader::new(&stream)
            .read_line(&mut line)
            .map_err(|e| e.to_string())?;
        // A resume's reply is no preempt's: only a preempt's data is read.
        let reply: Reply<serde_json::Value> =
            serde_json::from_str(&line).map_err(|e| format!("daemon reply: {e}"))?;
        match reply.into_result() {
            Err(e) => Err(e.message),
            Ok(data) => Ok(data.and_then(|d| serde_json::from_value(d).ok())),
        }
    }
}

impl Freezer for DaemonSocketFreezer {
    fn freeze(&mut self, pid: u32) -> Result<FreezeReport, String> {
        let reply = self.call(&Request::Preempt {
            pid,
            gpu: None,
            max_hold_ms: Some(self.max_hold.as_millis() as u64),
            confirm: false,
        })?;
        Ok(freeze_report(reply.as_ref()))
    }
    fn thaw(&mut self, pid: u32) -> Result<(), String> {
        self.call(&Request::Resume { pid }).map(|_| ())
    }
}

/// Reads the breakdown out of the daemon's preempt reply (zeros where an older daemon sent no
/// timings).
fn freeze_report(reply: Option<&PreemptReply>) -> FreezeReport {
    let t = reply.and_then(|r| r.timing_us).unwrap_or_default();
    FreezeReport {
        from_gate: reply.is_some_and(|r| r.from_gate),
        record_us: t.record,
        gate_us: t.gate,
        disable_us: t.disable,
        drain_us: t.drain.unwrap_or(0),
        queued_us: t.queued.unwrap_or(0),
        round_trip_us: 0,
    }
}

/// One offline process to take `count` handles from.
pub struct Target {
    /// Its pool client.
    pub client: ClientId,
    /// Its pid.
    pub pid: u32,
    /// Handles wanted.
    pub count: usize,
    /// Its callback connection, if it attached one.
    pub callback: Option<UnixStream>,
}

/// What a reclaim got.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Clients that answered in time with valid handles, and those handles.
    pub returned: Vec<(ClientId, Vec<HandleId>)>,
    /// Clients killed for not answering (their handles may be taken).
    pub killed: Vec<ClientId>,
    /// Clients skipped because they could not be frozen.
    pub not_frozen: Vec<ClientId>,
    /// Pids still frozen: the caller hands the memory over first, then calls
    /// [`Reclaimer::thaw`] (online's wait does not include the enable).
    pub frozen: Vec<u32>,
    /// Time spent freezing the targets (the daemon's disable), us.
    pub freeze_us: u64,
    /// Time from the last freeze to the last answer (the offline libraries' swaps), us.
    pub answer_us: u64,
    /// The slowest freeze's breakdown.
    pub slowest_freeze: FreezeReport,
}

pub use valve_protocol::pool::{KillRecord, ReclaimStats};

/// Runs reclaims.
pub struct Reclaimer {
    freezer: Box<dyn Freezer>,
    deadline: Duration,
    next_rid: u64,
    stats: ReclaimStats,
}

/// Thaws every pid it holds when dropped, so no path out of a reclaim leaves offline frozen.
struct Frozen<'a> {
    freezer: &'a mut dyn Freezer,
    pids: Vec<u32>,
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        for &pid in &self.pids {
            if let Err(e) = self.freezer.thaw(pid) {
                tracing::warn!(pid, "thawing after a reclaim failed: {e}");
            }
        }
    }
}

impl Reclaimer {
    /// A reclaimer that waits `deadline` for offline's answers.
    pub fn new(freezer: Box<dyn Freezer>, deadline: Duration) -> Reclaimer {
        Reclaimer {
            freezer,
            deadline,
            next_rid: 0,
            stats: ReclaimStats::default(),
        }
    }

    /// Resumes what a [`Reclaimer::run`] left frozen.
    pub fn thaw(&mut self, pids: &[u32]) {
        for &pid in pids {
            if let Err(e) = self.freezer.thaw(pid) {
                tracing::warn!(pid, "thawing after a reclaim failed: {e}");
            }
        }
    }

    /// Counters so far.
    pub fn stats(&self) -> ReclaimStats {
        self.stats.clone()
    }

    /// Freezes the targets, asks them, collects valid answers (`valid(client, handles)` checks
    /// the handles are the client's), kills the silent, and thaws the others.
    pub fn run(
        &mut self,
        targets: Vec<Target>,
        valid: impl Fn(ClientId, &[HandleId]) -> bool,
    ) -> Outcome {
        let started = Instant::now();
        self.stats.reclaims += 1;
        let mut out = Outcome::default();
        let mut frozen = Frozen {
            freezer: self.freezer.as_mut(),
            pids: Vec::new(),
        };
        let mut asked = Vec::new();
        let mut slowest = Duration::ZERO;
        for t in targets {
            let t0 = Instant::now();
            match frozen.freezer.freeze(t.pid).map(|r| (r, t0.elapsed())) {
                Ok((report, took)) if took >= slowest => {
                    slowest = took;
                    out.slowest_freeze = FreezeReport {
                        round_trip_us: took.as_micros() as u64,
                        ..report
                    };
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(
                        pid = t.pid,
                        "cannot freeze offline process for a reclaim: {e}"
                    );
                    self.stats.freeze_failures += 1;
                    out.not_frozen.push(t.client);
                    continue;
                }
            }
            frozen.pids.push(t.pid);
            self.next_rid += 1;
            let sent = t.callback.as_ref().is_some_and(|s| {
                let ask = Callback::Reclaim {
                    rid: self.next_rid,
                    count: t.count,
                };
                serde_json::to_value(&ask).is_ok_and(|m| wire::send(s, &m, &[]).is_ok())
            });
            asked.push((t, self.next_rid, sent));
        }
        let frozen_at = Instant::now();
        out.freeze_us = frozen_at.duration_since(started).as_micros() as u64;
        // The deadline is the offline library's: a slow freeze (the daemon busy) is not its fault.
        let deadline = frozen_at + self.deadline;
        for (t, rid, sent) in asked {
            let answer = if sent {
                wait_answer(t.callback.as_ref(), rid, deadline)
            } else {
                None
            };
            match answer {
                Some(h) if h.len() == t.count && valid(t.client, &h) => {
                    self.stats.handles += h.len() as u64;
                    out.returned.push((t.client, h));
                }
                _ => {
                    // Where its threads are stuck, read before the kill ends them: the log is
                    // all an operator gets to tell a hung job from a slow one.
                    let read_at = Instant::now();
                    let threads = super::threads::summary(&super::threads::snapshot(t.pid));
                    tracing::error!(
                        pid = t.pid,
                        answered = answer.is_some(),
                        threads_read_us = read_at.elapsed().as_micros() as u64,
                        threads = %threads,
                        "offline process did not give memory back in {:?}: killing it",
                        self.deadline
                    );
                    frozen.freezer.kill(t.pid);
                    self.stats.last_kill = Some(KillRecord {
                        pid: t.pid,
                        unix_s: crate::memory::server::warm::unix_now(),
                        answered: answer.is_some(),
                        threads,
                    });
                    self.stats.killed += 1;
                    out.killed.push(t.client);
                }
            }
        }
        out.answer_us = frozen_at.elapsed().as_micros() as u64;
        self.stats.last_us = started.elapsed().as_micros() as u64;
        // Left frozen on purpose; if the caller never thaws (it panicked), the daemon's own hold
        // limit (DaemonSocketFreezer::max_hold) resumes them.
        out.frozen = std::mem::take(&mut frozen.pids);
        out
    }
}

/// Waits until `deadline` for `{"rid": rid, "ok": true, "handles": [...]}` on `sock`.
fn wait_answer(sock: Option<&UnixStream>, rid: u64, deadline: Instant) -> Option<Vec<HandleId>> {
    let sock = sock?;
    loop {
        let left = deadline.checked_duration_since(Instant::now())?;
        let mut fds = [nix::poll::PollFd::new(
            sock.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let ms = (left.as_millis() as u16).max(1);
        if nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(ms)).ok()? == 0 {
            return None;
        }
        let (msg, _) = wire::recv(sock).ok()??;
        let Ok(answer) = serde_json::from_value::<CallbackReply>(msg) else {
            continue; // not an answer
        };
        if answer.rid != rid {
            continue; // a stale answer to an earlier, timed-out request
        }
        return answer.ok.then_some(answer.handles);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{ErrorCode, PreemptTiming};
    use serde_json::json;

    fn preempt_reply(line: serde_json::Value) -> Option<PreemptReply> {
        serde_json::from_value::<Reply<PreemptReply>>(line)
            .unwrap()
            .data
    }

    #[test]
    fn a_preempt_reply_gives_the_freeze_breakdown_and_an_old_reply_gives_zeros() {
        let handed = preempt_reply(json!({"data": {"pid": 7, "from_gate": true,
                                     "timing_us": {"record": 40, "gate": 300,
                                                   "disable": 0, "drain": 12, "queued": 80}},
                            "error": null}));
        assert_eq!(
            freeze_report(handed.as_ref()),
            FreezeReport {
                from_gate: true,
                record_us: 40,
                gate_us: 300,
                disable_us: 0,
                drain_us: 12,
                queued_us: 80,
                round_trip_us: 0,
            }
        );
        let old = preempt_reply(json!({"data": {"pid": 7, "channels": 4}, "error": null}));
        assert_eq!(freeze_report(old.as_ref()), FreezeReport::default());
    }

    #[test]
    fn the_lane_freezer_asks_the_loop_and_reads_its_reply() {
        let (client, lane) = crate::server::lane::lane().unwrap();
        let loop_side = std::thread::spawn(move || {
            let mut seen = Vec::new();
            while seen.len() < 3 {
                let Some(call) = lane.next() else {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                };
                seen.push(call.op.request());
                let reply = match seen.len() {
                    1 => crate::protocol::Reply::ok(PreemptReply {
                        pid: 7,
                        from_gate: true,
                        timing_us: Some(PreemptTiming {
                            record: 3,
                            gate: 40,
                            disable: 0,
                            drain: None,
                            queued: Some(9),
                        }),
                        ..PreemptReply::default()
                    }),
                    2 => crate::protocol::Reply::empty(),
                    _ => crate::protocol::Reply::fail(ErrorCode::Process, "no such process: 9"),
                };
                call.reply.send(reply).unwrap();
            }
            seen
        });
        let mut f = DaemonLaneFreezer {
            lane: client,
            max_hold: Duration::from_secs(2),
        };
        let r = f.freeze(7).unwrap();
        assert_eq!((r.from_gate, r.gate_us, r.queued_us), (true, 40, 9));
        f.thaw(7).unwrap();
        assert_eq!(f.freeze(9).unwrap_err(), "no such process: 9");
        let seen = loop_side.join().unwrap();
        assert_eq!(
            seen[..2],
            [
                crate::protocol::Request::Preempt {
                    pid: 7,
                    gpu: None,
                    max_hold_ms: Some(2_000),
                    confirm: false,
                },
                crate::protocol::Request::Resume { pid: 7 },
            ]
        );
    }

    /// Freezes in 5 ms, reporting 1 ms of it as the daemon's; thaws and kills do nothing.
    struct Slow;

    impl Freezer for Slow {
        fn freeze(&mut self, _pid: u32) -> Result<FreezeReport, String> {
            std::thread::sleep(Duration::from_millis(5));
            Ok(FreezeReport {
                gate_us: 1_000,
                ..FreezeReport::default()
            })
        }
        fn thaw(&mut self, _pid: u32) -> Result<(), String> {
            Ok(())
        }
        fn kill(&mut self, _pid: u32) {}
    }

    #[test]
    fn the_slowest_freeze_carries_its_round_trip_on_the_reclaimers_clock() {
        let mut r = Reclaimer::new(Box::new(Slow), Duration::from_millis(1));
        let target = Target {
            client: 1,
            pid: 7,
            count: 1,
            callback: None,
        };
        let out = r.run(vec![target], |_, _| true);
        let f = out.slowest_freeze;
        assert!(f.round_trip_us >= 5_000, "{f:?}");
        assert!(f.outside_daemon_us() >= 4_000, "{f:?}");
    }

    #[test]
    fn the_time_outside_the_daemons_timings_is_the_round_trip_minus_them() {
        let r = FreezeReport {
            record_us: 4,
            gate_us: 200,
            drain_us: 10,
            queued_us: 16,
            round_trip_us: 9_300,
            ..FreezeReport::default()
        };
        assert_eq!(r.outside_daemon_us(), 9_070);
        let untimed = FreezeReport {
            gate_us: 200,
            ..FreezeReport::default()
        };
        assert_eq!(untimed.outside_daemon_us(), 0, "no round trip measured");
    }
}
