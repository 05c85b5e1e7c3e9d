//! The gate's decision trace: every edge (arrival or launch), signal, cooldown decision, disable
//! and enable with its timestamps, in a preallocated ring that the gate thread writes lock-free.
//!
//! The gate thread only stores integers into fixed slots (no allocation, no lock, no I/O);
//! readers ([`TraceRing::since`], `valvectl gate trace`) copy the slots out and serialise them.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;
use valve_protocol::gate::{TraceEntry, TraceEvent};

/// What a trace record is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceKind {
    /// Request data reached a watched port: `id` the port, `t_ns` when (BPF), `a` when the gate
    /// thread got it, `b` the port's idle time before it, `c` when the watcher's thread read it
    /// from the ring buffer (JSON `read_ns`; 0: not stamped).
    Arrival,
    /// An online process launched after idling: `id` the pid, `t_ns` the launch (uprobe), `a`
    /// when the gate thread got it, `b` the idle gap before it (JSON `"after_resume": false`).
    Launch,
    /// As [`TraceKind::Launch`], for a launch that was an edge only because it was the
    /// process's first since the gate resumed offline: a thread was waiting, or the gap since
    /// its last activity was below the edge gap. JSON: event `launch`, `"after_resume": true`.
    LaunchAfterResume,
    /// `valvectl gate busy`: `t_ns` when the gate thread got it.
    Busy,
    /// `valvectl gate idle`: `t_ns` when the gate thread got it.
    Idle,
    /// Offline channels disabled: `t_ns` issue start, `a` return, `b` 0 ok / 1 failed, `id` the
    /// offline pid (0: all offline processes in one call).
    Disable,
    /// Offline channels enabled: as [`TraceKind::Disable`].
    Enable,
    /// The gate decided to resume: `t_ns` the decision, `a` the last online activity, `b` the
    /// cooldown (or arrival hold) that ran out, ns; `id` 1 when an online thread was still
    /// waiting for GPU work and the stuck-wait bound let the gate resume anyway.
    Cooldown,
}

impl TraceKind {
    const ALL: [TraceKind; 8] = [
        TraceKind::Arrival,
        TraceKind::Launch,
        TraceKind::LaunchAfterResume,
        TraceKind::Busy,
        TraceKind::Idle,
        TraceKind::Disable,
        TraceKind::Enable,
        TraceKind::Cooldown,
    ];

    fn code(self) -> u64 {
        Self::ALL.iter().position(|&k| k == self).expect("listed") as u64
    }

    fn from_code(c: u64) -> Option<TraceKind> {
        Self::ALL.get(c as usize).copied()
    }
}

/// One record, as readers get it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TraceRecord {
    /// Position in the trace (1, 2, ...); gaps mean records were overwritten before being read.
    pub seq: u64,
    /// What happened.
    pub kind: TraceKind,
    /// The main timestamp (CLOCK_MONOTONIC ns).
    pub t_ns: u64,
    /// A pid or port (see [`TraceKind`]).
    pub id: u32,
    /// Second field (see [`TraceKind`]).
    pub a: u64,
    /// Third field (see [`TraceKind`]).
    pub b: u64,
    /// Fourth field (see [`TraceKind`]; 0 where a kind has none).
    pub c: u64,
}

impl TraceRecord {
    /// The record with its fields named (one line of `valvectl gate trace`).
    pub fn entry(&self) -> TraceEntry {
        let event = match self.kind {
            TraceKind::Arrival => TraceEvent::Arrival {
                port: self.id,
                recv_ns: self.a,
                idle_ns: self.b,
                read_ns: self.c,
            },
            TraceKind::Launch | TraceKind::LaunchAfterResume => TraceEvent::Launch {
                pid: self.id,
                recv_ns: self.a,
                idle_ns: self.b,
                after_resume: self.kind == TraceKind::LaunchAfterResume,
            },
            TraceKind::Busy => TraceEvent::Busy,
            TraceKind::Idle => TraceEvent::Idle,
            TraceKind::Disable => TraceEvent::Disable {
                pid: self.id,
                end_ns: self.a,
                ok: self.b == 0,
            },
            TraceKind::Enable => TraceEvent::Enable {
                pid: self.id,
                end_ns: self.a,
                ok: self.b == 0,
            },
            TraceKind::Cooldown => TraceEvent::Cooldown {
                last_activity_ns: self.a,
                cooldown_ns: self.b,
                waits_ignored: self.id == 1,
            },
        };
        TraceEntry {
            seq: self.seq,
            t_ns: self.t_ns,
            event,
        }
    }
}

/// One slot: `seq` is 0 while being written, then the record's sequence number.
#[derive(Default)]
struct Slot {
    seq: AtomicU64,
    t: AtomicU64,
    kind_id: AtomicU64,
    a: AtomicU64,
    b: AtomicU64,
    c: AtomicU64,
}

/// A fixed-size ring of trace records with one writer (the gate thread) and any number of
/// readers. Old records are overwritten.
pub struct TraceRing {
    slots: Box<[Slot]>,
    head: AtomicU64,
}

/// Records kept by the gate's trace (each 48 bytes).
pub const TRACE_CAPACITY: usize = 1 << 16;

impl TraceRing {
    /// A ring of `capacity` records (at least 1).
    pub fn new(capacity: usize) -> TraceRing {
        TraceRing {
            slots: (0..capacity.max(1)).map(|_| Slot::default()).collect(),
            head: AtomicU64::new(0),
        }
    }

    /// Appends a record. Only one thread may push (the gate thread); it never blocks.
    pub fn push(&self, kind: TraceKind, t_ns: u64, id: u32, a: u64, b: u64, c: u64) {
        let seq = self.head.load(Ordering::Relaxed) + 1;
        let slot = &self.slots[(seq % self.slots.len() as u64) as usize];
        slot.seq.store(0, Ordering::Relaxed);
        // Readers that see the new fields also see seq = 0 (or the new seq), never the old seq.
        std::sync::atomic::fence(Ordering::Release);
        slot.t.store(t_ns, Ordering::Relaxed);
        slot.kind_id
            .store(kind.code() << 32 | u64::from(id), Ordering::Relaxed);
        slot.a.store(a, Ordering::Relaxed);
        slot.b.store(b, Ordering::Relaxed);
        slot.c.store(c, Ordering::Relaxed);
        slot.seq.store(seq, Ordering::Release);
        self.head.store(seq, Ordering::Release);
    }

    /// The sequence number of the latest record (0: none yet).
    pub fn head(&self) -> u64 {
        self.head.load(Ordering::Acquire)
    }

    /// Records after `after` (at most `limit`, oldest first). Records overwritten meanwhile are
    /// skipped, so `seq` shows where the gaps are.
    pub fn since(&self, after: u64, limit: usize) -> Vec<TraceRecord> {
        let head = self.head();
        let cap = self.slots.len() as u64;
        let first = (after + 1).max(head.saturating_sub(cap - 1)).max(1);
        let mut out = Vec::new();
        for seq in first..=head {
            if out.len() >= limit {
                break;
            }
            if let Some(r) = self.read(seq) {
                out.push(r);
            }
        }
        out
    }

    fn read(&self, seq: u64) -> Option<TraceRecord> {
        let slot = &self.slots[(seq % self.slots.len() as u64) as usize];
        if slot.seq.load(Ordering::Acquire) != seq {
            return None;
        }
        let t_ns = slot.t.load(Ordering::Relaxed);
        let kind_id = slot.kind_id.load(Ordering::Relaxed);
        let a = slot.a.load(Ordering::Relaxed);
        let b = slot.b.load(Ordering::Relaxed);
        let c = slot.c.load(Ordering::Relaxed);
        std::sync::atomic::fence(Ordering::Acquire);
        if slot.seq.load(Ordering::Relaxed) != seq {
            return None;
        }
        Some(TraceRecord {
            seq,
            kind: TraceKind::from_code(kind_id >> 32)?,
            t_ns,
            id: kind_id as u32,
            a,
            b,
            c,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn records_come_back_in_order_and_old_ones_are_overwritten() {
        let r = TraceRing::new(4);
        assert!(r.since(0, 100).is_empty());
        for i in 1..=6u64 {
            r.push(TraceKind::Launch, i * 10, 42, i, 7, 0);
        }
        let all = r.since(0, 100);
        // Capacity 4: the first records are gone; the ones left are whole and in order.
        let seqs: Vec<u64> = all.iter().map(|x| x.seq).collect();
        assert_eq!(seqs, vec![3, 4, 5, 6]);
        assert!(all.iter().all(|x| x.t_ns == x.seq * 10 && x.a == x.seq));
        assert_eq!(r.since(5, 100).len(), 1);
        assert_eq!(r.since(2, 2).len(), 2);
        assert_eq!(r.head(), 6);
        let j = serde_json::to_value(all[0].entry()).unwrap();
        assert_eq!(j["event"], "launch");
        assert_eq!(j["after_resume"], false);
        assert_eq!(
            (j["pid"].as_u64(), j["recv_ns"].as_u64()),
            (Some(42), Some(3))
        );
    }

    #[test]
    fn every_kind_round_trips() {
        let r = TraceRing::new(16);
        for (i, k) in TraceKind::ALL.iter().enumerate() {
            r.push(*k, 1, i as u32, 2, 3, 4);
        }
        let got: Vec<TraceKind> = r.since(0, 100).iter().map(|x| x.kind).collect();
        assert_eq!(got, TraceKind::ALL.to_vec());
        let arrival = serde_json::to_value(r.since(0, 1)[0].entry()).unwrap();
        assert_eq!(
            (arrival["recv_ns"].as_u64(), arrival["read_ns"].as_u64()),
            (Some(2), Some(4)),
            "an arrival carries both hops"
        );
        let after = serde_json::to_value(r.since(2, 1)[0].entry()).unwrap();
        assert_eq!(
            (after["event"].as_str(), after["after_resume"].as_bool()),
            (Some("launch"), Some(true))
        );
        let d = serde_json::to_value(r.since(5, 1)[0].entry()).unwrap();
        assert_eq!(
            (d["event"].as_str(), d["ok"].as_bool()),
            (Some("disable"), Some(false))
        );
    }

    #[test]
    fn a_reader_never_sees_a_torn_record() {
        let r = Arc::new(TraceRing::new(8));
        let w = r.clone();
        let writer = std::thread::spawn(move || {
            for i in 1..=200_000u64 {
                // Every field derives from i: a torn record would mix two i's.
                w.push(TraceKind::Disable, i, i as u32, i * 3, i * 5, i * 7);
            }
        });
        let mut seen = 0;
        while !writer.is_finished() {
            for x in r.since(0, 8) {
                assert_eq!(
                    (x.a, x.b, x.c, u64::from(x.id)),
                    (x.t_ns * 3, x.t_ns * 5, x.t_ns * 7, x.t_ns)
                );
                seen += 1;
            }
        }
        writer.join().unwrap();
        assert!(r.since(0, 8).iter().all(|x| x.seq == x.t_ns));
        assert!(seen > 0 || r.head() == 200_000);
    }
}
