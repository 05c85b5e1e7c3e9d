//! What the gate thread shares with the daemon ([`GateShared`]): its status behind a lock, its
//! decision trace, and the claims by which the daemon takes offline processes over.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use valve::state::DisabledRecord;
use valve::stats::summarize_us;
use valve_protocol::gate::LatencySummary;

use super::status::{GateStatus, SharedStatus};
use crate::gate::policy::HoldHistory;
use crate::gate::trace::{TraceRing, TRACE_CAPACITY};

/// What the gate thread shares with the daemon: status and samples behind a lock (written after
/// each decision), and the decision trace (lock-free).
pub struct GateShared {
    pub(super) status: Mutex<SharedStatus>,
    /// Signalled once the runtime has enabled offline on its way out (its `Drop`).
    pub(super) ended: Condvar,
    /// The runtime was dropped by a panic.
    pub(super) panicked: AtomicBool,
    pub(super) trace: TraceRing,
    /// What the gate holds disabled, and the processes the daemon took out of its hands. The
    /// gate thread holds this lock through each disable and enable.
    pub(super) claims: Mutex<Claims>,
    /// Offline sets sent to the gate thread so far
    /// ([`GateInput::Offline`](super::GateInput::Offline)).
    pub(super) offline_sent: AtomicU64,
    /// The hold's gaps between requests as the runtime left them (its `Drop`), for the next gate.
    pub(super) hold_history: Mutex<HoldHistory>,
    /// Arrivals on watched ports the gate thread has taken so far: the daemon looks the
    /// listeners of the `--online-port`s up again when one comes and none of them is known.
    pub(super) arrivals_taken: AtomicU64,
}

/// The hand-over of offline processes from the gate to the daemon (a manual preempt, the memory
/// pool's reclaim), done under one lock instead of a round trip to a thread that may be asleep.
#[derive(Debug, Default)]
pub(super) struct Claims {
    /// Channels the gate thread holds disabled now.
    pub(super) held: ChannelSet,
    /// Processes the daemon took over, each with the number of the first offline set sent
    /// after the claim: until the gate applies that set, it neither enables nor disables them.
    pub(super) taken: BTreeMap<u32, u64>,
}

impl Claims {
    /// Whether the daemon took over any process of `records`.
    pub(super) fn any_taken(&self, records: &[DisabledRecord]) -> bool {
        records.iter().any(|r| self.taken.contains_key(&r.pid))
    }

    /// `records` without the processes the daemon took over (`None`: none of them is).
    pub(super) fn untaken(&self, records: &[DisabledRecord]) -> Option<Vec<DisabledRecord>> {
        self.any_taken(records).then(|| {
            records
                .iter()
                .filter(|r| !self.taken.contains_key(&r.pid))
                .cloned()
                .collect()
        })
    }
}

pub(super) fn lock_claims(shared: &GateShared) -> MutexGuard<'_, Claims> {
    shared.claims.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Channels as (RM device instance, client, channel) triples.
pub type ChannelSet = BTreeSet<(u32, u32, u32)>;

/// The (device instance, client, channel) triples of `records`.
pub(crate) fn channel_set(records: &[DisabledRecord]) -> ChannelSet {
    records
        .iter()
        .flat_map(|r| {
            r.channels
                .iter()
                .map(move |&c| (r.device_instance, r.client, c))
        })
        .collect()
}

impl Default for GateShared {
    fn default() -> Self {
        GateShared {
            status: Mutex::default(),
            ended: Condvar::new(),
            panicked: AtomicBool::new(false),
            trace: TraceRing::new(TRACE_CAPACITY),
            claims: Mutex::default(),
            offline_sent: AtomicU64::new(0),
            hold_history: Mutex::default(),
            arrivals_taken: AtomicU64::new(0),
        }
    }
}

impl GateShared {
    /// The hold's gaps between requests as the gate thread left them (empty while it runs).
    pub fn hold_history(&self) -> HoldHistory {
        self.hold_history
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// How many arrivals on watched ports the gate thread has taken.
    pub fn arrivals_taken(&self) -> u64 {
        self.arrivals_taken.load(Ordering::Relaxed)
    }

    /// The decision trace.
    pub fn trace(&self) -> &TraceRing {
        &self.trace
    }

    /// See [`GateHandle::claim`](super::GateHandle::claim).
    pub(super) fn claim(&self, pid: u32, channels: &ChannelSet) -> bool {
        let mut claims = lock_claims(self);
        let first = self.offline_sent.load(Ordering::SeqCst) + 1;
        claims.taken.insert(pid, first);
        let held = !channels.is_empty() && channels.is_subset(&claims.held);
        claims.held.retain(|c| !channels.contains(c));
        held
    }
}

/// Latency samples (us) summarised as the status carries them.
fn summary(samples: &[f64]) -> LatencySummary {
    let s = summarize_us(samples);
    LatencySummary {
        n: s.n,
        p50_us: s.p50_us,
        p90_us: s.p90_us,
        p99_us: s.p99_us,
        max_us: s.max_us,
        mean_us: s.mean_us,
    }
}

/// A snapshot of `shared` with the latency summaries filled in. Only the copy happens under the
/// lock, so a status request never holds up the gate thread for the sorting.
pub(super) fn snapshot(shared: &GateShared) -> GateStatus {
    let (mut s, samples) = {
        let g = shared.status.lock().unwrap_or_else(PoisonError::into_inner);
        (g.status.clone(), g.samples.clone())
    };
    s.disable_us = summary(&samples.disable);
    s.enable_us = summary(&samples.enable);
    s.reaction_us = summary(&samples.reaction);
    s.edge_to_disable_us = summary(&samples.edge_to_disable);
    s.arrival_to_disable_us = summary(&samples.arrival_to_disable);
    s.trace_head = shared.trace.head();
    s
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gate::runtime::fixtures::*;
    use crate::gate::runtime::GateInput;
    use crate::gate::GateConfig;
    use valve::fake::FakeRm;

    #[test]
    fn a_claim_takes_a_held_process_over_with_no_thread_and_the_gate_leaves_it_frozen() {
        // A manual preempt (the memory pool's reclaim) takes an offline process out of the
        // gate's hands under the claims lock: there is no gate thread here to answer. The gate
        // must then leave it as it is: frozen through its resumes and preempts, even after the
        // offline set without it has come.
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let (recs, me) = offline_with_a_live_process(&rm);
        send_offline(&mut rt, &recs);
        rt.handle(GateInput::Busy, MS);
        assert_eq!(rm.disabled().len(), 60);
        // A set sent before the claim, still naming the process, is applied after it.
        rt.shared.offline_sent.fetch_add(1, Ordering::SeqCst);
        assert!(rt.shared.claim(me, &channel_set(&recs[2..])), "held");
        rt.handle(GateInput::Offline(recs.clone()), 0);
        rt.handle(GateInput::Idle, 2 * MS);
        assert_eq!(rm.disabled().len(), 20, "the claimed process stays frozen");
        let calls = rm.state.lock().unwrap().disable_calls.len();
        rt.handle(GateInput::Busy, 3 * MS);
        let new_calls = rm.state.lock().unwrap().disable_calls[calls..].to_vec();
        assert_eq!(
            new_calls.iter().map(|c| c.2).sum::<usize>(),
            40,
            "the preempt disables the other process only: {new_calls:?}"
        );
        send_offline(&mut rt, &recs[..2]);
        rt.handle(GateInput::Idle, 4 * MS);
        assert_eq!(rm.disabled().len(), 20, "still the daemon's to enable");
        drop(rt);
        assert_eq!(
            rm.disabled().len(),
            20,
            "the gate's exit enables only its own"
        );
    }

    #[test]
    fn a_process_claimed_while_offline_runs_is_never_disabled_by_the_gate() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let (recs, me) = offline_with_a_live_process(&rm);
        send_offline(&mut rt, &recs);
        assert!(
            !rt.shared.claim(me, &channel_set(&recs[2..])),
            "running: the daemon disables it"
        );
        rt.handle(GateInput::Busy, MS);
        assert_eq!(
            rm.disabled().len(),
            40,
            "the gate stops the other process only"
        );
        rt.handle(GateInput::Idle, 2 * MS);
        assert!(rm.disabled().is_empty());
    }

    #[test]
    fn held_channels_whose_process_leaves_unclaimed_are_enabled() {
        // A process that leaves the offline set while the gate holds it (a relabel) is nobody
        // else's: it must not stay frozen. Likewise the channels a claim did not take (a
        // preempt of one GPU only) once the set without the process comes.
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let (mut recs, me) = offline_with_a_live_process(&rm);
        send_offline(&mut rt, &recs);
        rt.handle(GateInput::Busy, MS);
        send_offline(&mut rt, &recs[..2]);
        assert_eq!(rm.disabled().len(), 40, "the process that left runs again");
        rt.handle(GateInput::Idle, 2 * MS);
        assert!(rm.disabled().is_empty());
        // The first process, on two GPUs, is preempted on GPU 0 only.
        recs[0].pid = me;
        recs[1].pid = me;
        send_offline(&mut rt, &recs[..2]);
        rt.handle(GateInput::Busy, 3 * MS);
        assert_eq!(rm.disabled().len(), 40);
        assert!(rt.shared.claim(me, &channel_set(&recs[..1])));
        rt.handle(GateInput::Idle, 4 * MS);
        assert_eq!(
            rm.disabled().len(),
            40,
            "claimed: the gate enables none of it yet"
        );
        send_offline(&mut rt, &[]);
        assert_eq!(
            rm.disabled().len(),
            20,
            "GPU 1's channels, not taken, run again"
        );
    }
}
