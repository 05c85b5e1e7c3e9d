//! `gate start` without holding the daemon's loop: the request is checked on the loop, the gate
//! thread starts (BPF programs, libcuda uprobes, its RM client: 0.25 s on the H100) on a helper
//! thread, and the loop finishes the start when it is ready, so preempts in between are served.
//! It answers once the gate thread has applied its first sets and the probes of the online
//! processes it starts with are in (up to [`PROBES_WITHIN`](crate::gate::PROBES_WITHIN)): a
//! gate that answered earlier would claim to run while it cannot see online's launches.
//!
//! Until [`DaemonCore::poll_gate_start`] installs the started gate, nothing is recorded or
//! disabled for it: the first offline set is recorded in the state file and then handed to the
//! gate thread on the loop, as for every later set. A second start or a stop meanwhile is
//! refused; busy/idle signals are kept and passed on once the gate runs.

use std::sync::mpsc::{self, Receiver, TryRecvError};
use std::time::{Duration, Instant};

use valve::driver::RmDriver;

use super::DaemonCore;
use crate::gate::supervisor::{ActiveGate, Rescan, SYNC_WITHIN};
use crate::gate::ProbeState;
use crate::protocol::{ErrorCode, GateReply, GateSpec, Reply};
use valve_protocol::control::SignalReply;

/// A `gate start` under way.
pub(crate) enum PendingGate {
    /// The gate thread starts on a helper thread, which sends the gate here.
    Starting {
        rx: Receiver<Result<ActiveGate, Reply>>,
        offline_label: Option<String>,
        /// The last busy (`true`) or idle signal that came meanwhile.
        signal: Option<bool>,
        /// When the helper thread was started.
        began: Instant,
    },
    /// Installed, its first sets sent; waiting for the gate thread to have applied them, so that
    /// the reply shows the sets it works with.
    Syncing { rx: Receiver<()>, until: Instant },
    /// Synced; waiting until the probes of the online processes it started with are in, so that
    /// the reply never claims a gate that cannot see online's launches. Polled from the gate's
    /// status (the loop serves other requests meanwhile); answers anyway at `until`, with a note.
    Probing {
        pids: Vec<u32>,
        since: Instant,
        until: Instant,
    },
}

/// How often a blocking caller ([`DaemonCore::gate_start`], the shutdown) looks at the probes
/// again; the loop looks on each of its turns instead.
const PROBE_POLL: Duration = Duration::from_millis(2);

impl<D: RmDriver> DaemonCore<D> {
    /// `gate start` answered in one call (the daemon's tests; the loop uses
    /// [`Self::begin_gate_start`]): waits for the helper thread.
    pub(super) fn gate_start(&mut self, spec: GateSpec) -> Reply {
        if let Err(reply) = self.begin_gate_start(spec, || {}) {
            return reply;
        }
        loop {
            if let Some(reply) = self.advance_gate_start(true) {
                return reply;
            }
        }
    }

    /// Checks a `gate start` (the error is its reply) and starts the gate thread on a helper
    /// thread, which calls `done` once it has finished (to wake the loop); then
    /// [`Self::poll_gate_start`] completes it.
    pub fn begin_gate_start(
        &mut self,
        mut spec: GateSpec,
        done: impl FnOnce() + Send + 'static,
    ) -> Result<(), Reply> {
        self.fill_gate_defaults(&mut spec);
        if self.gate.is_some() {
            return Err(Reply::fail(
                ErrorCode::Failed,
                "a gate is already running (see `valvectl gate status`); stop it first with \
                 `valvectl gate stop`",
            ));
        }
        if self.gate_pending.is_some() {
            return Err(Reply::fail(
                ErrorCode::Failed,
                "a gate is starting (see `valvectl gate status`); stop it once it has started",
            ));
        }
        let not_discoverable = |pid: u32| {
            self.pre_existing
                .contains(&pid)
                .then(|| self.no_channels_reason(pid))
        };
        let cfg = ActiveGate::check(&spec, not_discoverable)?;
        if let Some(refused) = spec.offline.iter().find_map(|&p| self.mps_refusal(p)) {
            return Err(refused);
        }
        let Some(starter) = self.gate_starter.clone() else {
            return Err(Reply::fail(
                ErrorCode::Failed,
                "this daemon cannot run a gate",
            ));
        };
        let offline_label = spec.offline_label.clone();
        let history = self.kept_hold_history(&spec);
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("valve-gate-start".into())
            .spawn(move || {
                let started = ActiveGate::launch(spec, cfg, &starter);
                if let (Ok(gate), Some(history)) = (&started, history) {
                    gate.seed_hold(history);
                }
                // If the core is gone, the gate goes with the message (its handle's drop stops it).
                let _ = tx.send(started);
                done();
            })
            .map_err(|e| Reply::fail(ErrorCode::Failed, format!("starting the gate: {e}")))?;
        self.gate_pending = Some(PendingGate::Starting {
            rx,
            offline_label,
            signal: None,
            began: Instant::now(),
        });
        Ok(())
    }

    /// The gaps a stopped gate on the same service left, for a gate with a hold to start from.
    fn kept_hold_history(&self, spec: &GateSpec) -> Option<crate::gate::policy::HoldHistory> {
        spec.hold_budget_pct?;
        let key = ActiveGate::history_key_of(spec);
        let now = crate::memory::server::warm::unix_now();
        let (history, age_s) = self.hold_histories.for_service(&key, now)?;
        tracing::info!(
            gaps = history.gaps.len(),
            stopped_s_ago = age_s,
            service = %key,
            "gate start: the hold starts from the gaps the last gate on this service learned"
        );
        Some(history)
    }

    /// Moves a begun `gate start` on without waiting; its reply once it is finished.
    pub fn poll_gate_start(&mut self) -> Option<Reply> {
        self.advance_gate_start(false)
    }

    /// Whether a `gate start` is under way.
    pub fn gate_starting(&self) -> bool {
        self.gate_pending.is_some()
    }

    /// Waits for a `gate start` under way to finish (at shutdown, before the gate is stopped).
    pub(super) fn finish_gate_start(&mut self) {
        while let Some(p) = &self.gate_pending {
            if matches!(p, PendingGate::Probing { .. }) {
                // The gate runs and is stopped next: its probes are not worth waiting for.
                self.gate_pending = None;
                return;
            }
            let _ = self.advance_gate_start(true);
        }
    }

    /// A busy/idle signal while the gate starts: kept for it (its reply), else `None`.
    pub(super) fn queue_signal(&mut self, busy: bool) -> Option<Reply> {
        match &mut self.gate_pending {
            Some(PendingGate::Starting { signal, .. }) => {
                *signal = Some(busy);
                let which = if busy { "busy" } else { "idle" };
                Some(Reply::ok(SignalReply {
                    signal: which.into(),
                    queued: true,
                }))
            }
            _ => None,
        }
    }

    /// One step of a `gate start` under way (`wait`: block until it can move); the reply once
    /// it is finished.
    fn advance_gate_start(&mut self, wait: bool) -> Option<Reply> {
        match self.gate_pending.take()? {
            PendingGate::Starting {
                rx,
                offline_label,
                signal,
                began,
            } => self.advance_starting(rx, offline_label, signal, began, wait),
            PendingGate::Syncing { rx, until } => {
                let left = until.saturating_duration_since(Instant::now());
                let synced = if wait {
                    rx.recv_timeout(left).is_ok()
                } else {
                    !matches!(rx.try_recv(), Err(TryRecvError::Empty))
                };
                if !synced && !left.is_zero() && !wait {
                    self.gate_pending = Some(PendingGate::Syncing { rx, until });
                    return None;
                }
                let pids = self.gate.as_ref().map(|g| g.online().iter().copied());
                let now = Instant::now();
                self.gate_pending = Some(PendingGate::Probing {
                    pids: pids.into_iter().flatten().collect(),
                    since: now,
                    until: now + self.probes_within,
                });
                self.advance_gate_start(wait)
            }
            PendingGate::Probing { pids, since, until } => {
                while !self.probes_in(&pids, ProbeState::Attaching).is_empty() {
                    if Instant::now() >= until {
                        return Some(self.gate_start_reply(&pids));
                    }
                    if !wait {
                        self.gate_pending = Some(PendingGate::Probing { pids, since, until });
                        return None;
                    }
                    // Only where the caller blocks anyway (tests, shutdown), never on the loop.
                    std::thread::sleep(PROBE_POLL);
                }
                tracing::info!(
                    took_us = since.elapsed().as_micros() as u64,
                    "gate start: the online processes' probes are in"
                );
                Some(self.gate_start_reply(&pids))
            }
        }
    }

    /// The helper thread's part of a start: once it has sent the gate, installs it and syncs.
    fn advance_starting(
        &mut self,
        rx: Receiver<Result<ActiveGate, Reply>>,
        offline_label: Option<String>,
        signal: Option<bool>,
        began: Instant,
        wait: bool,
    ) -> Option<Reply> {
        let started = if wait {
            rx.recv().map_err(|_| TryRecvError::Disconnected)
        } else {
            rx.try_recv()
        };
        let gate = match started {
            Err(TryRecvError::Empty) => {
                self.gate_pending = Some(PendingGate::Starting {
                    rx,
                    offline_label,
                    signal,
                    began,
                });
                return None;
            }
            Err(TryRecvError::Disconnected) => {
                return Some(Reply::fail(
                    ErrorCode::Bpf,
                    "starting the gate: its helper thread died",
                ))
            }
            Ok(Err(reply)) => return Some(reply),
            Ok(Ok(gate)) => gate,
        };
        tracing::info!(
            took_us = began.elapsed().as_micros() as u64,
            "gate start: the gate thread is up, installing it"
        );
        let rx = self.install_gate(gate, offline_label.as_deref(), signal);
        self.gate_pending = Some(PendingGate::Syncing {
            rx,
            until: Instant::now() + SYNC_WITHIN,
        });
        self.advance_gate_start(wait)
    }

    /// Those of `pids` whose probes are in `state` (none once the gate is gone).
    fn probes_in(&self, pids: &[u32], state: ProbeState) -> Vec<u32> {
        self.gate
            .as_ref()
            .map(|g| g.probes_in(pids, state))
            .unwrap_or_default()
    }

    /// Makes a started gate the daemon's: its first sets are recorded in the state file and sent
    /// to its thread, then a signal that came while it started. Returns the receiver that says
    /// when the gate thread has applied them.
    fn install_gate(
        &mut self,
        gate: ActiveGate,
        offline_label: Option<&str>,
        signal: Option<bool>,
    ) -> Receiver<()> {
        self.gate = Some(gate);
        if let Some(m) = &self.metrics {
            m.gate_started(&m.workload_label(offline_label));
        }
        // Labels and ports were looked up on the helper thread just now.
        self.refresh_gate(Instant::now(), Rescan::IfDue);
        if let (Some(g), Some(busy)) = (&self.gate, signal) {
            g.signal(busy);
        }
        self.harvest_gate_changed();
        match &self.gate {
            Some(g) => g.sync_later(),
            // Its thread died at once (the refresh noticed): nothing to wait for.
            None => mpsc::sync_channel(1).1,
        }
    }

    /// The reply to a finished `gate start`: the status with the sets the gate thread works
    /// with, and a note on what it cannot do yet (`pids`: the online processes it started with).
    fn gate_start_reply(&self, pids: &[u32]) -> Reply {
        let mut notes = Vec::new();
        let waiting = self
            .gate
            .as_ref()
            .map(ActiveGate::waiting)
            .unwrap_or_default();
        if !waiting.is_empty() {
            notes.push(format!(
                "offline pid(s) {waiting:?} have no GPU channels yet; they are gated as soon as \
                 they create them"
            ));
        }
        let attaching = self.probes_in(pids, ProbeState::Attaching);
        if !attaching.is_empty() {
            notes.push(format!(
                "the probes of online pid(s) {attaching:?} are not attached yet after {:?}; the \
                 gate cannot see their launches until they are (gate status: online_probes)",
                self.probes_within
            ));
        }
        let failed = self.probes_in(pids, ProbeState::Failed);
        if !failed.is_empty() {
            notes.push(format!(
                "the probes of online pid(s) {failed:?} failed to attach (gate status: \
                 last_error); the gate does not see their launches"
            ));
        }
        let mut data = self.gate_reply();
        if !notes.is_empty() {
            let note = notes.join("; ");
            tracing::warn!("gate start: {note}");
            if let GateReply::Active(s) = &mut data {
                s.note = Some(note);
            }
        }
        Reply::ok(data)
    }

    /// Fills the fields a `gate start` leaves out from the config's `[gate]`.
    fn fill_gate_defaults(&self, spec: &mut GateSpec) {
        let d = &self.gate_defaults;
        spec.cooldown_floor_us = spec.cooldown_floor_us.or(d.cooldown_floor_us);
        spec.cooldown_ceiling_us = spec.cooldown_ceiling_us.or(d.cooldown_ceiling_us);
        spec.gap_factor = spec.gap_factor.or(d.gap_factor);
        spec.gap_memory_ms = spec.gap_memory_ms.or(d.gap_memory_ms);
        spec.fixed_cooldown_us = spec.fixed_cooldown_us.or(d.fixed_cooldown_us);
        if spec.fixed_cooldown_us.is_none() {
            // A fixed cooldown asked for now replaces the learned one the config's hold adds to.
            spec.hold_budget_pct = spec.hold_budget_pct.or(d.hold_budget_pct);
        }
        if spec.online.is_empty() && spec.online_label.is_none() {
            spec.online_label = d.online_label.clone();
        }
        if spec.offline.is_empty() && spec.offline_label.is_none() {
            spec.offline_label = d.offline_label.clone();
        }
    }
}
