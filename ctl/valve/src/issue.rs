//! How a disable or enable reaches several GPUs: one after another on the calling thread
//! (serial), or on persistent per-GPU worker threads released together (parallel).
//!
//! Stock drivers take every GPU's lock for the control, so serial issue is the faster one there;
//! with the driver patch parallel issue wins. [`LockProbe`] measures which, once, on real
//! channels ([`crate::Controller::probe_issue`]); the workers are started with the controller,
//! so no preemption ever starts a thread.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

use serde::Serialize;

use crate::error::Error;

/// How the GPUs of one plan are issued.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum IssueMode {
    /// One GPU after another on the calling thread (the stock driver serialises them anyway).
    #[default]
    Serial,
    /// All GPUs at once: the calling thread takes the first, persistent workers the others.
    Parallel,
}

/// The issue mode and where it came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct IssueSetting {
    /// The mode in force.
    pub mode: IssueMode,
    /// The measurement it was chosen from (`None`: forced, or the default).
    pub probe: Option<LockProbe>,
    /// Whether the mode was forced by the caller.
    pub forced: bool,
}

impl IssueSetting {
    /// One line: "serial (measured: ...)", "parallel (forced)", "serial (default, not measured)".
    pub fn describe(&self) -> String {
        let mode = match self.mode {
            IssueMode::Serial => "serial",
            IssueMode::Parallel => "parallel",
        };
        match (&self.probe, self.forced) {
            (_, true) => format!("{mode} (forced)"),
            (Some(p), false) => format!("{mode} (measured: {})", p.describe()),
            (None, false) => format!("{mode} (default, not measured)"),
        }
    }
}

/// One measurement of the same disable issued on one GPU, on all GPUs serially and on all GPUs in
/// parallel (p50 wall times, interleaved cycles).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct LockProbe {
    /// GPUs in the plan.
    pub gpus: usize,
    /// One GPU alone (the plan's first), us.
    pub single_us: f64,
    /// All GPUs one after another, us.
    pub serial_us: f64,
    /// All GPUs at once, us.
    pub parallel_us: f64,
}

impl LockProbe {
    /// What serial issue costs against one GPU (N for a driver that serialises, about N anyway).
    pub fn serial_ratio(&self) -> f64 {
        self.serial_us / self.single_us
    }

    /// What parallel issue costs against one GPU (about 1 with a per-GPU lock).
    pub fn parallel_ratio(&self) -> f64 {
        self.parallel_us / self.single_us
    }

    /// Whether the driver serialises the control across GPUs: parallel issue gains less than a
    /// quarter of what a per-GPU lock would give over serial issue.
    pub fn serialised(&self) -> bool {
        let ideal_gain = self.serial_us - self.single_us;
        ideal_gain <= 0.0 || self.serial_us - self.parallel_us < 0.25 * ideal_gain
    }

    /// The faster mode: parallel only where it is clearly faster (serial is never worse than N
    /// times one GPU, and needs no other thread).
    pub fn best_mode(&self) -> IssueMode {
        if self.parallel_us < 0.9 * self.serial_us {
            IssueMode::Parallel
        } else {
            IssueMode::Serial
        }
    }

    /// "4 GPUs: serial 3190 us (3.92x one GPU), parallel 3479 us (4.27x)".
    pub fn describe(&self) -> String {
        format!(
            "{} GPUs: serial {:.0} us ({:.2}x one GPU), parallel {:.0} us ({:.2}x), one GPU {:.0} us",
            self.gpus,
            self.serial_us,
            self.serial_ratio(),
            self.parallel_us,
            self.parallel_ratio(),
            self.single_us
        )
    }
}

pub(crate) fn encode(mode: IssueMode) -> u8 {
    match mode {
        IssueMode::Serial => 0,
        IssueMode::Parallel => 1,
    }
}

pub(crate) fn decode(v: u8) -> IssueMode {
    if v == 1 {
        IssueMode::Parallel
    } else {
        IssueMode::Serial
    }
}

/// The mode, readable from any thread without a lock.
#[derive(Default)]
pub(crate) struct ModeCell(AtomicU8);

impl ModeCell {
    pub(crate) fn get(&self) -> IssueMode {
        decode(self.0.load(Ordering::Relaxed))
    }
    pub(crate) fn set(&self, m: IssueMode) {
        self.0.store(encode(m), Ordering::Relaxed);
    }
}

/// A worker's outcome for one GPU: its timing, or how many chunks went through and the error.
pub(crate) type GpuResult<T> = (usize, Result<T, (usize, Error)>);

/// What a worker does with a job for a GPU slot (set once, when the pool starts).
pub(crate) type Handler<J, T> = Arc<dyn Fn(usize, J) -> Result<T, (usize, Error)> + Send + Sync>;

/// Chunks done when a worker panicked: unknown, so a rollback re-enables all of that GPU's.
pub(crate) const UNKNOWN_PROGRESS: usize = usize::MAX;

/// Persistent worker threads; a parallel issue hands each one a job (plain data: nothing is
/// allocated per issue) and collects the results. Dropping the pool ends the threads.
pub(crate) struct WorkerPool<J: Send + 'static, T: Send + 'static> {
    jobs: Vec<SyncSender<(usize, J)>>,
    /// The results channel; its lock also keeps two parallel issues from interleaving.
    results: Mutex<Receiver<GpuResult<T>>>,
    handler: Handler<J, T>,
    threads: Vec<JoinHandle<()>>,
}

impl<J: Send + 'static, T: Send + 'static> WorkerPool<J, T> {
    /// Starts `n` workers (named `valve-issue-<i>`) that run `handler` on their jobs.
    pub(crate) fn start(n: usize, handler: Handler<J, T>) -> std::io::Result<Self> {
        let (rtx, rrx) = mpsc::sync_channel::<GpuResult<T>>(n.max(1));
        let mut jobs = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let (jtx, jrx) = mpsc::sync_channel::<(usize, J)>(1);
            let rtx = rtx.clone();
            let h = handler.clone();
            let t = std::thread::Builder::new()
                .name(format!("valve-issue-{i}"))
                .spawn(move || {
                    for (slot, job) in jrx {
                        let r =
                            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| h(slot, job)))
                                .unwrap_or_else(|_| Err((UNKNOWN_PROGRESS, panicked())));
                        if rtx.send((slot, r)).is_err() {
                            break;
                        }
                    }
                })?;
            jobs.push(jtx);
            threads.push(t);
        }
        Ok(WorkerPool {
            jobs,
            results: Mutex::new(rrx),
            handler,
            threads,
        })
    }

    /// Runs each job on the worker of its slot and `own` on this thread at the same time;
    /// appends `own`'s result first, then the workers' in completion order. A job whose worker
    /// is missing runs here, after `own`.
    pub(crate) fn run(
        &self,
        own: impl FnOnce() -> GpuResult<T>,
        jobs: impl Iterator<Item = (usize, J)>,
        out: &mut Vec<GpuResult<T>>,
    ) {
        let results = self.results.lock().unwrap_or_else(PoisonError::into_inner);
        let mut sent = 0;
        let mut here = None;
        for (slot, job) in jobs {
            let job = match self.jobs.get(slot) {
                Some(tx) => match tx.send((slot, job)) {
                    Ok(()) => {
                        sent += 1;
                        continue;
                    }
                    Err(mpsc::SendError((_, job))) => job,
                },
                None => job,
            };
            here.get_or_insert_with(Vec::new).push((slot, job));
        }
        out.push(own());
        for (slot, job) in here.into_iter().flatten() {
            out.push((slot, (self.handler)(slot, job)));
        }
        for _ in 0..sent {
            match results.recv() {
                Ok(r) => out.push(r),
                Err(_) => break,
            }
        }
    }

    /// Number of workers.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.jobs.len()
    }
}

fn panicked() -> Error {
    Error::Os {
        op: "a GPU issue worker".into(),
        source: std::io::Error::other("it panicked"),
    }
}

impl<J: Send + 'static, T: Send + 'static> Drop for WorkerPool<J, T> {
    fn drop(&mut self) {
        self.jobs.clear();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// p50 wall time of `f` over the cycles where it ran.
pub(crate) fn p50(samples: &mut [f64]) -> f64 {
    samples.sort_by(f64::total_cmp);
    crate::stats::percentile(samples, 0.5)
}

/// Microseconds since `t0`.
pub(crate) fn us_since(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    fn probe(single: f64, serial: f64, parallel: f64) -> LockProbe {
        LockProbe {
            gpus: 4,
            single_us: single,
            serial_us: serial,
            parallel_us: parallel,
        }
    }

    #[test]
    fn a_serialising_driver_is_told_from_a_per_gpu_lock() {
        // The hardware notes' 4x H200, stock driver: serial wins, and the driver serialises.
        let stock = probe(814.0, 3190.0, 3479.0);
        assert!(stock.serialised());
        assert_eq!(stock.best_mode(), IssueMode::Serial);
        assert!((stock.serial_ratio() - 3190.0 / 814.0).abs() < 1e-9);
        // A per-GPU lock: parallel close to one GPU.
        let patched = probe(814.0, 3190.0, 900.0);
        assert!(!patched.serialised());
        assert_eq!(patched.best_mode(), IssueMode::Parallel);
        // Parallel a little faster but nowhere near one GPU: still serialised; serial kept
        // unless parallel is clearly (10%) faster.
        let almost = probe(800.0, 3200.0, 3000.0);
        assert!(almost.serialised());
        assert_eq!(almost.best_mode(), IssueMode::Serial);
        assert!(
            stock.describe().contains("3.92x one GPU"),
            "{}",
            stock.describe()
        );
    }

    #[test]
    fn the_setting_says_where_it_came_from() {
        let s = IssueSetting::default();
        assert_eq!(s.describe(), "serial (default, not measured)");
        let f = IssueSetting {
            mode: IssueMode::Parallel,
            probe: None,
            forced: true,
        };
        assert_eq!(f.describe(), "parallel (forced)");
        let m = IssueSetting {
            mode: IssueMode::Serial,
            probe: Some(probe(1.0, 4.0, 4.0)),
            forced: false,
        };
        assert!(m.describe().starts_with("serial (measured: 4 GPUs"));
    }

    #[test]
    fn workers_run_jobs_together_and_a_panicking_job_is_an_error() {
        let handler: Handler<u32, u32> = Arc::new(|_slot, j| {
            assert!(j != 7, "boom");
            Ok(j * 2)
        });
        let pool = WorkerPool::start(3, handler).unwrap();
        assert_eq!(pool.len(), 3);
        let mut out = Vec::new();
        pool.run(|| (9, Ok(99)), (0..3).map(|w| (w, w as u32 + 10)), &mut out);
        assert!(matches!(out[0], (9, Ok(99))));
        let mut got: Vec<(usize, u32)> = out[1..]
            .iter()
            .map(|r| (r.0, *r.1.as_ref().unwrap()))
            .collect();
        got.sort();
        assert_eq!(got, vec![(0, 20), (1, 22), (2, 24)]);
        // A job that panics comes back as an error, and the pool still works.
        let mut out = Vec::new();
        pool.run(|| (9, Ok(1)), std::iter::once((1, 7)), &mut out);
        assert!(matches!(out[1], (1, Err((UNKNOWN_PROGRESS, _)))));
        let mut out = Vec::new();
        pool.run(|| (9, Ok(1)), std::iter::once((1, 5)), &mut out);
        assert!(matches!(out[1], (1, Ok(10))));
        // A slot the pool has no worker for runs on the calling thread.
        let mut out = Vec::new();
        pool.run(|| (9, Ok(1)), std::iter::once((5, 4)), &mut out);
        assert!(matches!(out[..], [(9, Ok(1)), (5, Ok(8))]));
    }
}
