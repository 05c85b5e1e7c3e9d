//! The sets the daemon sends the gate thread: online processes, online ports and offline
//! channels, applied to the watchers and to what the gate holds disabled.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Instant;

use valve::controller::PreemptMode;
use valve::driver::RmDriver;
use valve::state::{targets_of, DisabledRecord};
use valve_ebpf::WatchedPort;

use super::input::LaunchSource;
use super::shared::{channel_set, lock_claims, Claims};
use super::state::GateRuntime;
use super::status::ProbeState;
use crate::procfs::alive;

/// Disable/enable rounds of each kind when the gate measures the issue mode.
const PROBE_CYCLES: usize = 5;

impl<D: RmDriver, L: LaunchSource> GateRuntime<D, L> {
    pub(super) fn set_online(&mut self, pids: BTreeSet<u32>) {
        for &p in pids.difference(&self.online) {
            let state = match self.launches.watch(p) {
                Ok(()) => ProbeState::Attaching,
                Err(e) => {
                    self.error(format!("watching online pid {p}: {e}"));
                    ProbeState::Failed
                }
            };
            self.probes.insert(p, state);
        }
        for &p in self.online.difference(&pids) {
            self.launches.unwatch(p);
            self.probes.remove(&p);
        }
        // A pid watched again counts its edges from 0.
        self.quiet_received.retain(|p, _| pids.contains(p));
        self.online = pids;
        self.probe_hits_read_ns.set(0);
        self.poll_probes();
        let online: Vec<u32> = self.online.iter().copied().collect();
        self.update(|s| s.online_pids = online);
        self.publish_probes();
    }

    /// Publishes whether the online processes' probes are in, once any that was attaching is
    /// in or has failed (nothing to ask once every one is settled).
    pub(super) fn refresh_probes(&mut self) {
        if self.poll_probes() {
            self.publish_probes();
        }
    }

    /// Asks the launch source about the probes still attaching; whether any settled.
    fn poll_probes(&mut self) -> bool {
        let mut failed = Vec::new();
        let mut settled = false;
        for (&p, state) in &mut self.probes {
            if *state != ProbeState::Attaching {
                continue;
            }
            *state = match self.launches.probes_attached(p) {
                Ok(false) => continue,
                Ok(true) => ProbeState::Attached,
                Err(e) => {
                    failed.push(format!(
                        "online pid {p}: attaching its probes: {e}; its launches are not seen"
                    ));
                    ProbeState::Failed
                }
            };
            settled = true;
        }
        for e in failed {
            self.error(e);
        }
        settled
    }

    fn publish_probes(&self) {
        let probes = self.probes.clone();
        let all = probes.values().all(|s| *s == ProbeState::Attached);
        self.update(|s| {
            s.online_probes = probes;
            s.online_probes_attached = all;
        });
    }

    pub(super) fn set_ports(&mut self, ports: BTreeSet<WatchedPort>) {
        // One filter entry per port: every namespace if any entry for it says so.
        let effective = |set: &BTreeSet<WatchedPort>| {
            let mut m: BTreeMap<u16, u32> = BTreeMap::new();
            for p in set {
                m.entry(p.port)
                    .and_modify(|n| {
                        if p.netns == 0 || *n != p.netns {
                            *n = 0;
                        }
                    })
                    .or_insert(p.netns);
            }
            m
        };
        let (old, new) = (effective(&self.ports), effective(&ports));
        for (&port, &netns) in &new {
            if old.get(&port) != Some(&netns) {
                if let Err(e) = self.launches.watch_port(WatchedPort { port, netns }) {
                    self.error(format!("watching online port {port}: {e}"));
                }
            }
        }
        for &port in old.keys().filter(|p| !new.contains_key(p)) {
            self.launches.unwatch_port(port);
        }
        self.ports = ports;
        let list: Vec<u16> = new.keys().copied().collect();
        self.update(|s| s.online_ports = list);
    }

    pub(super) fn set_offline(&mut self, records: Vec<DisabledRecord>) {
        let (targets, unknown) = targets_of(&self.ctl, &records);
        for r in &unknown {
            self.error(format!(
                "offline pid {}: no GPU with RM instance {} here",
                r.pid, r.device_instance
            ));
        }
        let plan = if targets.is_empty() {
            None
        } else {
            match self.ctl.plan(&targets, PreemptMode::Preempt) {
                Ok(p) => Some(p),
                Err(e) => {
                    self.error(format!("planning the offline channels: {e}"));
                    return;
                }
            }
        };
        let shared = Arc::clone(&self.shared);
        let mut claims = lock_claims(&shared);
        // Claims made before this set was sent are in it: the set itself leaves those out.
        self.offline_applied += 1;
        let applied = self.offline_applied;
        claims.taken.retain(|_, first| *first > applied);
        self.release_gone(&records, &mut claims);
        // Offline is preempted now: channels that just appeared must stop too, unless they come
        // back disabled from a manual preempt. Offline runs: those come back enabled.
        let added = added_channels(&self.records, &records);
        let (adopted, fresh) = split_adopted(&added, &self.adopt);
        if self.policy.preempted() {
            claims.held.extend(channel_set(&adopted));
            let stopped = !fresh.is_empty() && self.disable_records(&fresh, &mut claims);
            if !added.is_empty() {
                self.preemptions += u64::from(stopped && !self.disabled);
                self.disabled = true;
                self.disabled_since.get_or_insert_with(Instant::now);
            }
        } else if !adopted.is_empty() {
            self.enable_records(&adopted, &mut claims);
        }
        drop(claims);
        let mut pids: Vec<u32> = records.iter().map(|r| r.pid).collect();
        pids.sort();
        pids.dedup();
        let (channels, gpus) = plan
            .as_ref()
            .map(|p| (p.channels(), p.gpus()))
            .unwrap_or((0, 0));
        // The freeze check's targets, kept with the offline set, not made on the disable path.
        self.check_targets = targets.into();
        self.records = records;
        self.plan = plan;
        self.probe_issue();
        let issue = self.ctl.issue_mode().describe();
        self.update(|s| {
            s.offline_pids = pids;
            s.offline_channels = channels;
            s.offline_gpus = gpus;
            s.issue = issue;
        });
    }

    /// Once, while offline runs and its plan spans several GPUs: measures serial against
    /// parallel issue on the offline channels and keeps the faster (a few ms of offline pauses;
    /// an online edge that comes meanwhile waits for it, once per gate).
    fn probe_issue(&mut self) {
        if !self.probe_pending || self.policy.preempted() {
            return;
        }
        let Some(plan) = self.plan.as_ref().filter(|p| p.gpus() >= 2) else {
            return;
        };
        // The probe disables and enables the whole plan: not while the daemon owns part of it.
        let claims = lock_claims(&self.shared);
        if claims.any_taken(&self.records) {
            return;
        }
        match self.ctl.probe_issue(plan, PROBE_CYCLES) {
            Ok(p) => {
                self.probe_pending = false;
                tracing::info!("gate: issue mode {}", self.ctl.issue_mode().describe());
                let _ = p;
            }
            Err(e) => self.error(format!(
                "measuring serial against parallel issue: {e}; will try again on the next offline set"
            )),
        }
    }

    /// Channels this gate holds disabled whose process left the offline set unclaimed (its
    /// label changed, or it exited) are enabled: nobody else would. A claimed one is the
    /// daemon's, and was taken out of `held` by the claim.
    fn release_gone(&mut self, records: &[DisabledRecord], claims: &mut Claims) {
        let keep = channel_set(records);
        let gone: Vec<DisabledRecord> = self
            .records
            .iter()
            .filter_map(|r| {
                let chans: Vec<u32> = r
                    .channels
                    .iter()
                    .copied()
                    .filter(|&c| {
                        let t = (r.device_instance, r.client, c);
                        claims.held.contains(&t) && !keep.contains(&t)
                    })
                    .collect();
                (!chans.is_empty()).then(|| DisabledRecord {
                    channels: chans,
                    ..r.clone()
                })
            })
            .collect();
        for c in channel_set(&gone) {
            claims.held.remove(&c);
        }
        let live: Vec<DisabledRecord> = gone.into_iter().filter(|r| alive(r.pid)).collect();
        self.enable_records(&live, claims);
    }
}

/// Splits `added` into the channels handed back disabled (in `adopt`) and the others.
fn split_adopted(
    added: &[DisabledRecord],
    adopt: &BTreeSet<(u32, u32, u32)>,
) -> (Vec<DisabledRecord>, Vec<DisabledRecord>) {
    let pick = |want: bool| -> Vec<DisabledRecord> {
        added
            .iter()
            .filter_map(|r| {
                let chans: Vec<u32> = r
                    .channels
                    .iter()
                    .copied()
                    .filter(|&c| adopt.contains(&(r.device_instance, r.client, c)) == want)
                    .collect();
                (!chans.is_empty()).then(|| DisabledRecord {
                    channels: chans,
                    ..r.clone()
                })
            })
            .collect()
    };
    (pick(true), pick(false))
}

/// The channels of `new` that `old` does not have, per record.
fn added_channels(old: &[DisabledRecord], new: &[DisabledRecord]) -> Vec<DisabledRecord> {
    let old = channel_set(old);
    new.iter()
        .filter_map(|r| {
            let chans: Vec<u32> = r
                .channels
                .iter()
                .copied()
                .filter(|&c| !old.contains(&(r.device_instance, r.client, c)))
                .collect();
            (!chans.is_empty()).then(|| DisabledRecord {
                channels: chans,
                ..r.clone()
            })
        })
        .collect()
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
    use valve_ebpf::ArrivalEdge;

    #[test]
    fn a_port_named_twice_is_watched_once_and_unwatched_when_gone() {
        let rm = Arc::new(FakeRm::host(1));
        let (mut rt, launches) = runtime(&rm, GateConfig::default());
        let p = |netns| WatchedPort { port: PORT, netns };
        rt.handle(GateInput::Ports([p(5)].into()), 0);
        rt.handle(GateInput::Ports([p(0), p(5)].into()), 0);
        assert_eq!(snapshot(&rt.shared).online_ports, vec![PORT]);
        // Either namespace's data counts while both are named.
        let mut e = ArrivalEdge {
            port: PORT,
            netns: 9,
            ts_ns: MS,
            idle_ns: 0,
            read_ns: 0,
        };
        assert!(rt.watched_port(&e));
        rt.handle(GateInput::Ports([p(5)].into()), 0);
        assert!(!rt.watched_port(&e), "only namespace 5 now");
        e.netns = 5;
        assert!(rt.watched_port(&e));
        rt.handle(GateInput::Ports(BTreeSet::new()), 0);
        assert!(launches.1.lock().unwrap().is_empty(), "unwatched");
        assert!(snapshot(&rt.shared).online_ports.is_empty());
    }

    /// Probes that attach (or fail) when the test says so: per pid, what `probes_attached`
    /// answers (absent: still attaching).
    #[derive(Clone, Default)]
    struct SlowProbes(Arc<std::sync::Mutex<BTreeMap<u32, Result<bool, String>>>>);

    impl LaunchSource for SlowProbes {
        fn watch(&mut self, _: u32) -> Result<(), String> {
            Ok(())
        }
        fn unwatch(&mut self, _: u32) {}
        fn last_launch_ns(&self, _: u32) -> u64 {
            0
        }
        fn probes_attached(&mut self, pid: u32) -> Result<bool, String> {
            self.0
                .lock()
                .unwrap()
                .get(&pid)
                .cloned()
                .unwrap_or(Ok(false))
        }
    }

    #[test]
    fn the_status_says_which_online_processes_have_their_probes_in() {
        let rm = Arc::new(FakeRm::host(1));
        let probes = SlowProbes::default();
        let shared = Arc::new(crate::gate::GateShared::default());
        let ctl = valve::controller::Controller::with_driver(rm).unwrap();
        let mut rt = GateRuntime::new(ctl, probes.clone(), GateConfig::default(), shared.clone());
        assert!(snapshot(&shared).online_probes_attached, "none online");
        rt.handle(GateInput::Online([1, 2].into()), 0);
        let s = snapshot(&shared);
        assert!(!s.online_probes_attached);
        assert_eq!(s.online_probes[&1], ProbeState::Attaching);
        probes.0.lock().unwrap().insert(1, Ok(true));
        probes.0.lock().unwrap().insert(2, Err("ESRCH".into()));
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.handle(GateInput::Sync(tx), 0);
        rx.try_recv().unwrap();
        let s = snapshot(&shared);
        assert_eq!(s.online_probes[&1], ProbeState::Attached);
        assert_eq!(s.online_probes[&2], ProbeState::Failed);
        assert!(!s.online_probes_attached && s.errors == 1);
        assert!(s.last_error.unwrap().contains("online pid 2"));
        rt.handle(GateInput::Online([1].into()), 0);
        let s = snapshot(&shared);
        assert!(s.online_probes_attached && !s.online_probes.contains_key(&2));
    }

    #[test]
    fn the_issue_mode_is_measured_once_on_a_multi_gpu_offline_set() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        rt.handle(GateInput::Offline(offline(&rm)), 0);
        let s = rt.controller().issue_mode();
        assert!(s.probe.is_some() && !s.forced, "{s:?}");
        assert!(rm.disabled().is_empty(), "the probe left nothing disabled");
        let calls = rm.state.lock().unwrap().disable_calls.len();
        rt.handle(GateInput::Offline(offline(&rm)[..2].to_vec()), 0);
        rt.handle(GateInput::Offline(offline(&rm)), 0);
        assert_eq!(
            rm.state.lock().unwrap().disable_calls.len(),
            calls,
            "only once"
        );
        assert!(snapshot(&rt.shared).issue.contains("measured"));
        // Forced: never measured.
        let rm2 = Arc::new(FakeRm::host(2));
        let forced = GateConfig {
            issue: Some(valve::IssueMode::Parallel),
            ..GateConfig::default()
        };
        let (mut rt2, _) = runtime(&rm2, forced);
        rt2.handle(GateInput::Offline(offline(&rm2)), 0);
        assert!(rm2.state.lock().unwrap().disable_calls.is_empty());
        assert_eq!(snapshot(&rt2.shared).issue, "parallel (forced)");
    }

    #[test]
    fn offline_channels_that_appear_while_preempted_are_frozen_at_once() {
        let rm = Arc::new(FakeRm::host(2));
        let (mut rt, _) = runtime(&rm, GateConfig::default());
        let recs = offline(&rm);
        rt.handle(GateInput::Offline(recs[..1].to_vec()), 0);
        rt.handle(GateInput::Online([ONLINE].into()), 0);
        rt.handle(edge(ONLINE, MS, 0), MS);
        assert_eq!(rm.disabled().len(), 20);
        rt.handle(GateInput::Offline(recs.clone()), 2 * MS);
        assert_eq!(rm.disabled().len(), 60);
        drop(rt);
        assert!(rm.disabled().is_empty(), "drop enables everything");
    }
}
