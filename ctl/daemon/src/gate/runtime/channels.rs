//! Disabling and enabling the offline channels: all GPUs in one call, record by record where
//! that fails or where the daemon has taken some processes over; with the latency samples.

use std::sync::Arc;
use std::time::{Duration, Instant};

use valve::controller::PreemptMode;
use valve::driver::RmDriver;
use valve::state::{reenable, targets_of, DisabledRecord};
use valve::stats::monotonic_ns;

use super::input::LaunchSource;
use super::shared::{channel_set, lock_claims, Claims};
use super::state::GateRuntime;
use super::status::push;
use crate::gate::trace::TraceKind;
use crate::procfs::alive;

/// What started a preemption, for its latency samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Cause {
    /// A launch edge at this CLOCK_MONOTONIC ns.
    Launch(u64),
    /// An arrival edge at this CLOCK_MONOTONIC ns.
    Arrival(u64),
    /// A busy signal, or channels that appeared while preempted.
    Other,
}

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    /// The policy preempts: disables the offline channels, then tells the launch watcher that
    /// offline is held, so that online's edges until the resume need not wake the gate.
    pub(super) fn disable(&mut self, cause: Cause) {
        self.stop_offline(cause);
        self.launches.hold_edges(monotonic_ns());
    }

    /// Disables the offline channels (all GPUs in one call; record by record where the daemon
    /// has taken some processes over).
    fn stop_offline(&mut self, cause: Cause) {
        if self.plan.is_none() {
            // Nothing to stop yet; the policy still counts as preempted, so channels that appear
            // before the resume are disabled on arrival.
            return;
        }
        let shared = Arc::clone(&self.shared);
        let mut claims = lock_claims(&shared);
        let issue_ns = monotonic_ns();
        let partial = claims.untaken(&self.records);
        let result = match (&partial, &self.plan) {
            (None, Some(plan)) => Some(self.ctl.disable(plan).map(|g| g.keep_disabled())),
            _ => None,
        };
        let mut done_ns = monotonic_ns();
        self.disabled = true;
        self.disabled_since = Some(Instant::now());
        // A preemption is channels stopping, not the attempt (the status counts these).
        let mut stopped_any = matches!(result, Some(Ok(_)));
        if let Some(Ok(_)) = &result {
            claims.held.extend(channel_set(&self.records));
        }
        if let Some(r) = &result {
            let failed = u64::from(r.is_err());
            self.trace(TraceKind::Disable, issue_ns, 0, done_ns, failed);
        }
        let mut stopped = None;
        let wall = match result {
            Some(Ok(report)) => {
                let w = report.wall.as_secs_f64() * 1e6;
                stopped = Some(report);
                Some(w)
            }
            Some(Err(e)) => {
                // The controller rolled back. Most likely an offline process just exited and
                // its handles are gone: go process by process so the others still stop.
                self.error(format!(
                    "disabling offline channels: {e}; retrying per process"
                ));
                let records = self.records.clone();
                stopped_any = self.disable_records(&records, &mut claims);
                done_ns = monotonic_ns();
                None
            }
            None => {
                stopped_any = self.disable_records(&partial.unwrap_or_default(), &mut claims);
                done_ns = monotonic_ns();
                None
            }
        };
        drop(claims);
        self.preemptions += u64::from(stopped_any);
        // Metrics after the claims are released, as the enable does: nothing else waits on them.
        if let Some(report) = &stopped {
            self.count_disable(report, cause, done_ns);
            let targets = Arc::clone(&self.check_targets);
            self.freeze_check = crate::freeze_check::submit_for_gate(targets, Instant::now());
        }
        // The latency samples count the retry too: that is how long online waited.
        let us = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e3;
        self.sample(|s| {
            if let Some(w) = wall {
                push(&mut s.disable, w);
            }
            match cause {
                Cause::Launch(ts) => {
                    push(&mut s.reaction, us(ts, issue_ns));
                    push(&mut s.edge_to_disable, us(ts, done_ns));
                }
                Cause::Arrival(ts) => push(&mut s.arrival_to_disable, us(ts, done_ns)),
                Cause::Other => {}
            }
        });
    }

    /// The disable's metrics, with the edge that caused it.
    fn count_disable(&self, report: &valve::controller::BatchReport, cause: Cause, done_ns: u64) {
        let Some(m) = crate::metrics::for_gate() else {
            return;
        };
        let (kind, ts) = match cause {
            Cause::Launch(ts) => (Some(crate::metrics::EdgeKind::Launch), ts),
            Cause::Arrival(ts) => (Some(crate::metrics::EdgeKind::Arrival), ts),
            Cause::Other => (None, 0),
        };
        let edge = kind.map(|k| (k, Duration::from_nanos(done_ns.saturating_sub(ts))));
        m.gate_disabled(report, edge);
    }

    /// Disables record by record, skipping the ones that fail and the processes the daemon
    /// took over; true if any stopped.
    pub(super) fn disable_records(
        &mut self,
        records: &[DisabledRecord],
        claims: &mut Claims,
    ) -> bool {
        let mut any = false;
        for r in records
            .iter()
            .filter(|r| !claims.taken.contains_key(&r.pid))
        {
            let (targets, _) = targets_of(&self.ctl, std::slice::from_ref(r));
            let t0 = monotonic_ns();
            let res = self
                .ctl
                .plan(&targets, PreemptMode::Preempt)
                .and_then(|p| self.ctl.disable(&p).map(|g| drop(g.keep_disabled())));
            self.trace(
                TraceKind::Disable,
                t0,
                r.pid,
                monotonic_ns(),
                u64::from(res.is_err()),
            );
            match res {
                Ok(()) => {
                    any = true;
                    claims.held.extend(channel_set(std::slice::from_ref(r)))
                }
                Err(e) if alive(r.pid) => {
                    self.error(format!("disabling offline pid {}: {e}", r.pid))
                }
                Err(_) => {}
            }
        }
        any
    }

    /// Enables these channels (record by record, skipping the ones that fail and the processes
    /// the daemon took over).
    pub(super) fn enable_records(&mut self, records: &[DisabledRecord], claims: &mut Claims) {
        for r in records
            .iter()
            .filter(|r| !claims.taken.contains_key(&r.pid))
        {
            let (targets, _) = targets_of(&self.ctl, std::slice::from_ref(r));
            let t0 = monotonic_ns();
            let res = self
                .ctl
                .plan(&targets, PreemptMode::Preempt)
                .and_then(|p| self.ctl.enable(&p));
            for c in channel_set(std::slice::from_ref(r)) {
                claims.held.remove(&c);
            }
            self.trace(
                TraceKind::Enable,
                t0,
                r.pid,
                monotonic_ns(),
                u64::from(res.is_err()),
            );
            if let Err(e) = res {
                if alive(r.pid) {
                    self.error(format!("enabling offline pid {}: {e}", r.pid));
                }
            }
        }
    }

    /// Enables the offline channels; on a failure, record by record so one exited process does
    /// not keep the others frozen. Processes the daemon took over stay as they are.
    pub(super) fn enable(&mut self) {
        // Online's edges wake the gate again from here (the resume's arm already made them).
        self.launches.hold_edges(0);
        if !self.disabled {
            return;
        }
        if let Some(c) = self.freeze_check.take() {
            c.store(true, std::sync::atomic::Ordering::Release);
        }
        let shared = Arc::clone(&self.shared);
        let mut claims = lock_claims(&shared);
        let t0 = Instant::now();
        let start_ns = monotonic_ns();
        // Channels of a process the daemon took over stay in `held` until the offline set
        // without it comes: those it did not take (on another GPU) are enabled then.
        let result = if let Some(rest) = claims.untaken(&self.records) {
            self.enable_records(&rest, &mut claims);
            Ok(None)
        } else {
            claims.held.clear();
            match &self.plan {
                Some(plan) => self.ctl.enable(plan).map(Some),
                None => Ok(None),
            }
        };
        let ok = result.is_ok();
        if let Err(e) = &result {
            let (_, failures) = reenable(&self.ctl, &self.records);
            if !failures.is_empty() {
                self.error(format!(
                    "enabling offline channels: {e}; per process: {}",
                    failures.join("; ")
                ));
            }
        }
        drop(claims);
        self.trace(
            TraceKind::Enable,
            start_ns,
            0,
            monotonic_ns(),
            u64::from(!ok),
        );
        let wall = t0.elapsed().as_secs_f64() * 1e6;
        self.disabled = false;
        let held = self
            .disabled_since
            .take()
            .map(|t| t.elapsed().as_secs_f64())
            .unwrap_or(0.0);
        self.sample(|s| push(&mut s.enable, wall));
        if let Some(m) = crate::metrics::for_gate() {
            m.gate_enabled(
                result.as_ref().ok().and_then(Option::as_ref),
                Duration::from_secs_f64(held),
            );
        }
        self.update(|s| {
            s.resumes += 1;
            s.preempted_s += held;
        });
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::gate::runtime::fixtures::*;
    use crate::gate::runtime::shared::snapshot;
    use crate::gate::runtime::GateInput;
    use crate::gate::GateConfig;
    use valve::fake::FakeRm;

    #[test]
    fn an_exited_offline_process_does_not_keep_the_others_running() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let mut recs: Vec<_> = offline(&rm)
            .into_iter()
            .filter(|r| r.device_instance == 0)
            .collect();
        // A third process whose client RM does not know (it exited): its channels fail.
        recs.insert(
            0,
            DisabledRecord {
                pid: 4_199_999,
                device_instance: 0,
                client: 0xc1d0_0099,
                channels: vec![0x5c00_0001],
            },
        );
        rt.handle(GateInput::Offline(recs), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        rt.handle(edge(ONLINE, MS, 0), MS);
        assert_eq!(rm.disabled().len(), 40, "the live processes are frozen");
        rt.handle(GateInput::Idle, 2 * MS);
        assert!(rm.disabled().is_empty());
        let st = snapshot(&rt.shared);
        assert!(st.errors >= 1 && st.last_error.is_some());
    }

    #[test]
    fn a_disable_that_stops_nothing_is_no_preemption() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        // One offline process whose client RM does not know: every disable of it fails.
        let gone = DisabledRecord {
            pid: 4_199_999,
            device_instance: 0,
            client: 0xc1d0_0099,
            channels: vec![0x5c00_0001],
        };
        rt.handle(GateInput::Offline(vec![gone]), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        rt.handle(edge(ONLINE, MS, 0), MS);
        assert!(rm.disabled().is_empty());
        let st = snapshot(&rt.shared);
        assert_eq!(st.preemptions, 0, "nothing stopped");
        assert!(st.errors >= 1);
    }
}
