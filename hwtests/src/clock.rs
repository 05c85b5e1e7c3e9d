//! The runner's one clock, `now_ns`: host CLOCK_MONOTONIC since the runner's first call, which the
//! hogs' heartbeat sightings and every experiment's timestamps share.

use std::sync::OnceLock;
use std::time::Instant;

/// Nanoseconds on the host's monotonic clock since the first call: the runner's clock, which the
/// hogs' sightings and every experiment's timestamps use.
pub fn now_ns() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    EPOCH.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn now_ns_never_goes_back() {
        let a = now_ns();
        std::thread::sleep(std::time::Duration::from_millis(1));
        let b = now_ns();
        assert!(b >= a + 1_000_000, "{a} then {b}");
    }
}
