//! Every freeze checked: after a disable returns, each disabled channel is read back from RM
//! (its runlist state through a diag object) and the freeze counts as confirmed only then.
//!
//! `valvectl preempt` waits for its check ([`check`], on the loop); the memory pool's and the
//! gate's freezes are checked by the [`FreezeChecker`] thread, off their paths, once they have
//! lasted [`CHECK_AFTER`], and a resume cancels a check not yet done so that it never reads a
//! channel the resume re-enabled.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use valve::controller::{ChannelTarget, Controller};
use valve::driver::RmDriver;

use crate::metrics::Metrics;
use crate::protocol::{FreezeCheck, FreezeCounts, FreezeOutcome};

/// How long the checker thread waits after a disable before it reads the channels back. The
/// reads are RM calls that GSP serves one at a time: read at once, they delayed the memory
/// pool's own RM calls in the reclaim that froze offline (256 MiB reclaims on an H200: p50
/// 3.0 ms without the check, 6.5 ms with it at once). Freezes shorter than this (a reclaim's)
/// end as [`FreezeOutcome::ResumedFirst`].
pub const CHECK_AFTER: std::time::Duration = std::time::Duration::from_millis(20);

/// Checks that `targets` (disabled when `disabled_at`) all read disabled; stops at the first
/// channel RM reports enabled, and gives up with [`FreezeOutcome::ResumedFirst`] once `cancel`
/// is set (the freeze ended).
pub fn check<D: RmDriver>(
    ctl: &Controller<D>,
    targets: &[ChannelTarget],
    disabled_at: Instant,
    cancel: &AtomicBool,
) -> FreezeCheck {
    let mut checked = 0;
    let mut running = Vec::new();
    let mut reason = None;
    for t in targets {
        if cancel.load(Ordering::Acquire) {
            reason = Some(format!(
                "resumed after {checked} of {} channels were read",
                targets.len()
            ));
            break;
        }
        let r = ctl.channel_states(std::slice::from_ref(t), true);
        checked += 1;
        if r.enabled().next().is_some() {
            running.push(format!("{:x}:{:x}", t.client.0, t.channel.0));
            break;
        }
        let unreadable = r.unreadable().next().map(|(_, why)| why.to_string());
        if unreadable.is_some() {
            reason = unreadable;
            break;
        }
    }
    // A resume that raced the last read makes "enabled" no evidence: the channel was meant
    // to run again.
    let resumed = cancel.load(Ordering::Acquire);
    let outcome = match (running.is_empty(), &reason, resumed) {
        (_, _, true) => FreezeOutcome::ResumedFirst,
        (false, _, false) => FreezeOutcome::Running,
        (true, Some(_), false) => FreezeOutcome::Unconfirmed,
        (true, None, false) => FreezeOutcome::Confirmed,
    };
    if outcome == FreezeOutcome::ResumedFirst && reason.is_none() {
        reason = Some("resumed before the check ended".into());
    }
    FreezeCheck {
        outcome,
        after_us: disabled_at.elapsed().as_micros() as u64,
        checked,
        channels: targets.len(),
        running,
        reason,
    }
}

/// Who froze: the metrics' `source` label.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Origin {
    /// `valvectl preempt --pid` (and anything else through the control socket).
    Preempt,
    /// The memory pool's reclaims.
    Pool,
    /// The gate.
    Gate,
}

impl Origin {
    fn as_str(self) -> &'static str {
        match self {
            Origin::Preempt => "preempt",
            Origin::Pool => "pool",
            Origin::Gate => "gate",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CheckLabels {
    source: &'static str,
    outcome: &'static str,
}

/// Where checks end up: counts for `status`, metrics, and an audit line for each freeze that
/// was not confirmed.
pub struct FreezeRecorder {
    counts: [AtomicU64; 4],
    checks: Family<CheckLabels, Counter>,
    seconds: Histogram,
}

impl FreezeRecorder {
    /// A recorder; with `metrics`, its series are registered there.
    pub fn new(metrics: Option<&Metrics>) -> Arc<Self> {
        let r = Arc::new(FreezeRecorder {
            counts: Default::default(),
            checks: Family::default(),
            seconds: Histogram::new([1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1]),
        });
        // Every series from the start, so that a dashboard shows the zeros.
        for origin in [Origin::Preempt, Origin::Pool, Origin::Gate] {
            for outcome in FreezeOutcome::ALL {
                let _ = r.checks.get_or_create(&CheckLabels {
                    source: origin.as_str(),
                    outcome: outcome.as_str(),
                });
            }
        }
        if let Some(m) = metrics {
            m.with_registry(|reg| {
                reg.register(
                    "valve_freeze_checks",
                    "Freezes read back from RM after their disable, by outcome (running: a channel stayed enabled)",
                    r.checks.clone(),
                );
                reg.register(
                    "valve_freeze_check_seconds",
                    "From a disable's return to its check's outcome",
                    r.seconds.clone(),
                );
            });
        }
        r
    }

    /// Books one check of a freeze of `pid` (0: the gate's whole offline set).
    pub fn record(&self, origin: Origin, pid: u32, c: &FreezeCheck) {
        let i = FreezeOutcome::ALL
            .iter()
            .position(|o| *o == c.outcome)
            .expect("every outcome is listed");
        self.counts[i].fetch_add(1, Ordering::Relaxed);
        self.checks
            .get_or_create(&CheckLabels {
                source: origin.as_str(),
                outcome: c.outcome.as_str(),
            })
            .inc();
        self.seconds.observe(c.after_us as f64 / 1e6);
        if matches!(
            c.outcome,
            FreezeOutcome::Running | FreezeOutcome::Unconfirmed
        ) {
            tracing::warn!(
                target: "valve_audit",
                event = "freeze_check",
                source = origin.as_str(),
                pid,
                outcome = c.outcome.as_str(),
                running = %c.running.join(","),
                reason = c.reason.as_deref().unwrap_or(""),
                checked = c.checked,
                channels = c.channels,
                "audit: a freeze was not confirmed"
            );
        }
    }

    /// The counts so far.
    pub fn counts(&self) -> FreezeCounts {
        let n = |i: usize| self.counts[i].load(Ordering::Relaxed);
        FreezeCounts {
            confirmed: n(0),
            running: n(1),
            unconfirmed: n(2),
            resumed_first: n(3),
        }
    }
}

/// One freeze to check off the caller's path.
struct Job {
    origin: Origin,
    pid: u32,
    targets: Arc<[ChannelTarget]>,
    disabled_at: Instant,
    cancel: Arc<AtomicBool>,
}

/// The checking thread's queue: freezes go in with [`FreezeChecker::submit`].
#[derive(Clone)]
pub struct FreezeChecker {
    tx: Sender<Job>,
}

impl FreezeChecker {
    /// Starts the thread on its own controller (its own RM client, so its reads never wait on
    /// a lock the disabling side holds).
    pub fn start<D: RmDriver>(ctl: Controller<D>, recorder: Arc<FreezeRecorder>) -> Self {
        let (tx, rx) = channel::<Job>();
        std::thread::Builder::new()
            .name("valve-freeze-check".into())
            .spawn(move || run(ctl, rx, recorder))
            .expect("spawning the freeze check thread");
        FreezeChecker { tx }
    }

    /// Queues a check of a freeze that ended its disable at `disabled_at`; setting the returned
    /// flag (at the resume) ends the check.
    pub fn submit(
        &self,
        origin: Origin,
        pid: u32,
        targets: Arc<[ChannelTarget]>,
        disabled_at: Instant,
    ) -> Arc<AtomicBool> {
        let cancel = Arc::new(AtomicBool::new(false));
        let _ = self.tx.send(Job {
            origin,
            pid,
            targets,
            disabled_at,
            cancel: cancel.clone(),
        });
        cancel
    }
}

static FOR_GATE: std::sync::OnceLock<FreezeChecker> = std::sync::OnceLock::new();

/// Makes `checker` the one the gate threads submit their freezes to (once per daemon).
pub fn install_for_gate(checker: FreezeChecker) {
    let _ = FOR_GATE.set(checker);
}

/// The gate's freeze of `targets`, disabled at `disabled_at`, queued for a check; `None` where
/// no checker runs (tests, or a daemon whose checker could not start).
pub fn submit_for_gate(
    targets: Arc<[ChannelTarget]>,
    disabled_at: Instant,
) -> Option<Arc<AtomicBool>> {
    FOR_GATE
        .get()
        .map(|c| c.submit(Origin::Gate, 0, targets, disabled_at))
}

fn run<D: RmDriver>(ctl: Controller<D>, rx: Receiver<Job>, recorder: Arc<FreezeRecorder>) {
    for job in rx {
        let start = job.disabled_at + CHECK_AFTER;
        while !job.cancel.load(Ordering::Acquire) {
            match start.checked_duration_since(Instant::now()) {
                Some(wait) => std::thread::sleep(wait.min(std::time::Duration::from_millis(1))),
                None => break,
            }
        }
        let c = check(&ctl, &job.targets, job.disabled_at, &job.cancel);
        recorder.record(job.origin, job.pid, &c);
    }
}

#[cfg(test)]
mod tests;
