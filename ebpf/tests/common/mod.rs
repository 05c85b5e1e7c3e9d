//! Helpers the BPF integration tests share.

/// CLOCK_MONOTONIC in ns, the clock of `bpf_ktime_get_ns`.
pub fn monotonic_ns() -> u64 {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).unwrap();
    t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64
}
