//! The gate's decision trace folded into busy intervals: when offline could not run (the gate
//! held it frozen, on every GPU) and when each online process was busy (on its GPUs).
//!
//! Fields used ([`crate::gate::trace::TraceKind`]): a successful `Disable` (`b` = 0) starts a
//! blocked interval at its return (`a`), and counts as a preemption when it disables all offline
//! (`id` = 0); the next `Enable` of all offline (`id` = 0) ends it at its issue (`t_ns`). A `Launch`/`LaunchAfterResume` edge of pid `id` at `t_ns` after an
//! idle gap `b` ends that pid's busy interval at `t_ns - b` and opens the next at `t_ns`; a
//! `Cooldown` ends every open one at the online processes' last activity (`a`). Records lost to
//! overwriting are counted; the time they covered is left out, unless the records after them
//! show that offline was held through it.

use std::collections::BTreeMap;

use valve_harvest::Recorder;

use crate::gate::trace::{TraceKind, TraceRecord, TraceRing};

/// Online pid -> the recorder's positions of its GPUs.
pub type Positions = BTreeMap<u32, Vec<usize>>;

/// Records read from the ring at a time.
const BATCH: usize = 4096;
/// Online processes tracked at most (the gate's online set is far smaller).
const MAX_PIDS: usize = 4096;
/// Busy intervals kept per process while its GPUs are not known yet.
const MAX_PENDING: usize = 1024;
/// How long a process that the daemon's view never named is kept (its GPUs come within a
/// second of the gate watching it).
const UNMAPPED_GRACE_NS: u64 = 10_000_000_000;

/// One online process's busy periods.
#[derive(Debug, Default)]
struct PidBusy {
    /// The start of the busy period going on.
    open: Option<u64>,
    /// The recorder's positions of its GPUs.
    gpus: Vec<usize>,
    /// Whether the daemon's view has named it (and so its GPUs).
    mapped: bool,
    /// Its first record (trace time), for the grace of an unmapped process.
    first_ns: u64,
    /// Closed intervals waiting for its GPUs to be known.
    pending: Vec<(u64, u64)>,
}

impl PidBusy {
    /// Books `[start, end)` on its GPUs (or keeps it until they are known).
    fn close(&mut self, start: u64, end: u64, rec: &mut Recorder) {
        if end <= start {
            return;
        }
        if !self.mapped {
            if self.pending.len() < MAX_PENDING {
                self.pending.push((start, end));
            }
            return;
        }
        for &g in &self.gpus {
            rec.online.insert(g, start, end);
        }
    }

    /// Takes `gpus` as its GPUs and books what waited for them.
    fn map(&mut self, gpus: &[usize], rec: &mut Recorder) {
        self.gpus = gpus.to_vec();
        self.mapped = true;
        for (s, e) in std::mem::take(&mut self.pending) {
            self.close(s, e, rec);
        }
    }
}

/// Where the reader is in one gate's trace, and the intervals still open.
#[derive(Debug, Default)]
pub struct TraceFolder {
    /// The latest sequence number folded (0: none of this gate's yet).
    last_seq: u64,
    /// The latest time a folded record names.
    last_ns: u64,
    /// After lost records: the first time read after them, until a disable or an enable tells
    /// whether offline was held meanwhile.
    unsure_since: Option<u64>,
    pids: BTreeMap<u32, PidBusy>,
    lost: u64,
}

impl TraceFolder {
    /// Records lost to overwriting so far.
    pub fn lost(&self) -> u64 {
        self.lost
    }

    /// Folds every record `ring` holds after the last one folded.
    pub fn read(&mut self, ring: &TraceRing, rec: &mut Recorder, online: &Positions) {
        loop {
            let batch = ring.since(self.last_seq, BATCH);
            self.fold(&batch, rec, online);
            if batch.len() < BATCH {
                return;
            }
        }
    }

    /// Folds records of one gate's trace, oldest first.
    pub fn fold(&mut self, records: &[TraceRecord], rec: &mut Recorder, online: &Positions) {
        let gpus = rec.gpus().len();
        for r in records {
            if r.seq <= self.last_seq {
                continue;
            }
            if r.seq > self.last_seq + 1 {
                self.records_lost(r.seq - self.last_seq - 1, r.t_ns, rec);
            }
            self.last_seq = r.seq;
            match r.kind {
                TraceKind::Disable if r.b == 0 => {
                    // A disable of all offline (`id` 0) is a preemption; one process's (a
                    // process joining the set while it is held) is part of the same hold.
                    let preemption = u64::from(r.id == 0);
                    for g in 0..gpus {
                        rec.blocked.start(g, r.a);
                        rec.preemptions.add(g, r.a, preemption);
                    }
                    self.unsure_since = None;
                }
                // Per-process enables (a process leaving the offline set) leave the gate's hold
                // as it is; the enable of all offline (`id` 0) ends it.
                TraceKind::Enable if r.id == 0 => {
                    for g in 0..gpus {
                        if let Some(s) = self.unsure_since {
                            rec.blocked.insert(g, s, r.t_ns);
                        }
                        rec.blocked.end(g, r.t_ns);
                    }
                    self.unsure_since = None;
                }
                TraceKind::Launch | TraceKind::LaunchAfterResume => {
                    self.edge(r.id, r.t_ns, r.b, rec, online);
                }
                TraceKind::Cooldown => self.all_idle_at(r.a, rec),
                _ => {}
            }
            self.last_ns = self.last_ns.max(r.t_ns);
            if matches!(r.kind, TraceKind::Disable | TraceKind::Enable) {
                self.last_ns = self.last_ns.max(r.a);
            }
        }
    }

    /// `n` records before the one at `next_ns` were overwritten unread: what was open ends at the
    /// last time known, and whether offline was held is unknown until the next disable or enable.
    fn records_lost(&mut self, n: u64, next_ns: u64, rec: &mut Recorder) {
        self.lost += n;
        tracing::warn!(
            "harvest: {n} gate trace record(s) were overwritten before they were read; the \
             time they cover is left out of the busy intervals"
        );
        let at = self.last_ns;
        for g in 0..rec.gpus().len() {
            rec.blocked.end(g, at);
        }
        for p in self.pids.values_mut() {
            if let Some(s) = p.open.take() {
                p.close(s, at.max(s), rec);
            }
        }
        self.unsure_since = Some(next_ns.max(at));
    }

    /// An idle->busy edge of `pid` at `t_ns` after `gap_ns` without a launch.
    fn edge(&mut self, pid: u32, t_ns: u64, gap_ns: u64, rec: &mut Recorder, online: &Positions) {
        if !self.pids.contains_key(&pid) && self.pids.len() >= MAX_PIDS {
            return;
        }
        let p = self.pids.entry(pid).or_insert_with(|| PidBusy {
            first_ns: t_ns,
            ..PidBusy::default()
        });
        if let Some(gpus) = online.get(&pid) {
            p.map(gpus, rec);
        }
        if let Some(s) = p.open.take() {
            p.close(s, t_ns.saturating_sub(gap_ns).max(s), rec);
        }
        p.open = Some(t_ns);
    }

    /// The gate resumed offline: online was last active at `last_ns`.
    fn all_idle_at(&mut self, last_ns: u64, rec: &mut Recorder) {
        for p in self.pids.values_mut() {
            if let Some(s) = p.open.take() {
                p.close(s, last_ns.max(s), rec);
            }
        }
    }

    /// The gate whose trace this was has stopped (its trace is read to the end): a hold whose
    /// enable was never read ends now, busy periods at the last time the trace named, and the
    /// next gate's trace starts from its first record.
    pub fn gate_ended(&mut self, rec: &mut Recorder, now_ns: u64) {
        for g in 0..rec.gpus().len() {
            rec.blocked.end(g, now_ns);
        }
        let at = self.last_ns;
        for p in self.pids.values_mut() {
            if let Some(s) = p.open.take() {
                p.close(s, at.max(s), rec);
            }
        }
        self.last_seq = 0;
        self.unsure_since = None;
    }

    /// Takes the GPUs the daemon's view names for each process, and forgets processes that
    /// left the online set (their open period ends at the last time the trace named) or that
    /// the view never named within the grace.
    pub fn update(&mut self, rec: &mut Recorder, online: &Positions, now_ns: u64) {
        let at = self.last_ns;
        self.pids.retain(|pid, p| {
            if let Some(gpus) = online.get(pid) {
                if !p.mapped || p.gpus != *gpus {
                    p.map(gpus, rec);
                }
                return true;
            }
            if p.mapped {
                if let Some(s) = p.open.take() {
                    p.close(s, at.max(s), rec);
                }
                return false;
            }
            now_ns.saturating_sub(p.first_ns) < UNMAPPED_GRACE_NS
        });
    }

    /// Per GPU position, the earliest start of a busy period going on there (for a document:
    /// such a period counts up to the document's time).
    pub fn open_starts(&self, gpus: usize) -> Vec<Option<u64>> {
        let mut out = vec![None; gpus];
        for p in self.pids.values().filter(|p| p.mapped) {
            if let Some(s) = p.open {
                for &g in &p.gpus {
                    if let Some(o) = out.get_mut(g) {
                        *o = Some(o.map_or(s, |x: u64| x.min(s)));
                    }
                }
            }
        }
        out
    }

    /// Online processes tracked now.
    pub fn tracked(&self) -> usize {
        self.pids.len()
    }
}
