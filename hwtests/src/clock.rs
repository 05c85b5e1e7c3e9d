//! One clock for the floor experiment: the runner's `now_ns` (host CLOCK_MONOTONIC since the
//! runner's first call), onto which CLOCK_MONOTONIC readings of another process and the GPU's
//! `%globaltimer` are mapped.
//!
//! The GPU mapping comes from the hog's heartbeat: slot 0 carries the `%globaltimer` of its last
//! write, and the poller sees each write a little after it happened. So `now - gpu` at each sighting
//! is the true offset plus a delay that is never negative, and the smallest value over a window
//! (thousands of sightings, one every few microseconds) is the offset plus the shortest delay,
//! about a PCIe write (under 1-2 us). The two clocks drift apart by parts per million, so the
//! window is the few milliseconds just before each measurement.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::OnceLock;
use std::time::Instant;

use valve::stats::monotonic_ns;

/// Nanoseconds on the host's monotonic clock since the first call: the runner's clock, which the
/// hogs' sightings and every experiment's timestamps use.
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

/// `now_ns - gpu` for one sighting of a GPU timestamp `gpu` at host time `now`.
pub fn offset_sample(now: u64, gpu: u64) -> i64 {
    (now as i64).wrapping_sub(gpu as i64)
}

/// GPU `%globaltimer` to the runner's `now_ns`: the smallest `offset_sample` of a window.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GpuClock {
    /// `now_ns - globaltimer`, ns.
    pub now_minus_gpu: i64,
}

impl GpuClock {
    /// A GPU time on the runner's clock (ns).
    pub fn to_now(self, gpu: u64) -> i64 {
        (gpu as i64).wrapping_add(self.now_minus_gpu)
    }
}

/// The smallest `offset_sample` since the last reset, shared between the poller's thread (which
/// observes) and the measuring thread (which resets and reads).
#[derive(Debug)]
pub struct ClockWindow(AtomicI64);

impl Default for ClockWindow {
    fn default() -> Self {
        ClockWindow(AtomicI64::new(i64::MAX))
    }
}

impl ClockWindow {
    /// Starts a new window.
    pub fn reset(&self) {
        self.0.store(i64::MAX, Ordering::Relaxed);
    }

    /// One sighting: GPU time `gpu` seen at host time `now` (read after `gpu`).
    pub fn observe(&self, now: u64, gpu: u64) {
        self.0.fetch_min(offset_sample(now, gpu), Ordering::Relaxed);
    }

    /// The clock over the window; `None` before the first sighting.
    pub fn clock(&self) -> Option<GpuClock> {
        let m = self.0.load(Ordering::Relaxed);
        (m != i64::MAX).then_some(GpuClock { now_minus_gpu: m })
    }
}

/// CLOCK_MONOTONIC (what the trigger process records) to the runner's `now_ns`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct HostClock {
    /// `CLOCK_MONOTONIC - now_ns`, ns.
    pub mono_minus_now: i64,
    /// Width of the best bracketing sample (the mapping's uncertainty), ns.
    pub uncertainty_ns: u64,
}

impl HostClock {
    /// From one bracketing sample: CLOCK_MONOTONIC `before`, `now_ns` `now`, CLOCK_MONOTONIC `after`.
    pub fn from_sample(before: u64, now: u64, after: u64) -> HostClock {
        let mid = before / 2 + after / 2 + (before % 2 + after % 2) / 2;
        HostClock {
            mono_minus_now: (mid as i64).wrapping_sub(now as i64),
            uncertainty_ns: after.saturating_sub(before),
        }
    }

    /// The tightest of 32 bracketing samples on this host.
    pub fn calibrate() -> HostClock {
        (0..32)
            .map(|_| {
                let a = monotonic_ns();
                let n = now_ns();
                let b = monotonic_ns();
                HostClock::from_sample(a, n, b)
            })
            .min_by_key(|c| c.uncertainty_ns)
            .expect("32 samples")
    }

    /// A CLOCK_MONOTONIC time on the runner's clock (ns).
    pub fn to_now(self, mono: u64) -> i64 {
        (mono as i64).wrapping_sub(self.mono_minus_now)
    }
}

/// `a - b` in microseconds, both in ns on one clock.
pub fn us_between(a: i64, b: i64) -> f64 {
    a.wrapping_sub(b) as f64 / 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_clock_takes_the_smallest_delay() {
        // True offset: now = gpu - 1_000_000 (the GPU timer is ahead); sightings 0.8-5 us late.
        let gpu0 = 1_700_000_000_000_000_000u64;
        let off = -1_000_000i64;
        let s = [(gpu0, 5_000), (gpu0 + 3_000, 800), (gpu0 + 9_000, 2_000)]
            .map(|(g, late)| ((g as i64 + off + late) as u64, g));
        let w = ClockWindow::default();
        assert!(w.clock().is_none());
        for (now, gpu) in s {
            w.observe(now, gpu);
        }
        let c = w.clock().expect("three sightings");
        assert_eq!(c.now_minus_gpu, off + 800);
        // A kernel start at gpu0 + 100 us lands 100 us after gpu0 on the host clock, 0.8 us late.
        assert_eq!(c.to_now(gpu0 + 100_000) - c.to_now(gpu0), 100_000);
        assert_eq!(c.to_now(gpu0), gpu0 as i64 + off + 800);
        w.reset();
        assert!(w.clock().is_none());
        w.observe(10, 4);
        assert_eq!(w.clock().map(|c| c.now_minus_gpu), Some(6));
    }

    #[test]
    fn host_clock_from_a_sample() {
        let c = HostClock::from_sample(1_000_101, 400, 1_000_301);
        assert_eq!(c.mono_minus_now, 1_000_201 - 400);
        assert_eq!(c.uncertainty_ns, 200);
        assert_eq!(c.to_now(1_000_201), 400);
        // Odd bounds round the midpoint down, never overflow.
        let big = HostClock::from_sample(u64::MAX - 3, 0, u64::MAX - 1);
        assert_eq!(big.uncertainty_ns, 2);
    }

    #[test]
    fn host_clock_calibrates_on_this_host() {
        let c = HostClock::calibrate();
        let (a, n, b) = (monotonic_ns(), now_ns(), monotonic_ns());
        let mapped_a = c.to_now(a);
        let mapped_b = c.to_now(b);
        // `now_ns` read between a and b maps between them, within the calibration's own width
        // (plus slack for a descheduled test thread).
        let slack = c.uncertainty_ns as i64 + 50_000;
        assert!(mapped_a - slack <= n as i64 && n as i64 <= mapped_b + slack);
    }

    #[test]
    fn microseconds_between() {
        assert_eq!(us_between(2_500, 1_000), 1.5);
        assert_eq!(us_between(1_000, 2_500), -1.5);
    }
}
