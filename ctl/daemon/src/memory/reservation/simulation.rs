//! Simulated online demand against the controller: the traces (synthetic, and the KV use
//! measured on the H100), a pool that maps what the controller asks, and the convergence tests.

use std::sync::OnceLock;
use std::time::Duration;

use super::{ReservationConfig, ReservationController};

/// Simulation step: the pool observes online and maps every 10 ms.
pub(super) const STEP: Duration = Duration::from_millis(10);
pub(super) const STEPS_PER_MIN: u64 = 6_000;
pub(super) const HS: u64 = 64 << 20;

/// Convergence runs: 20 simulated minutes of warm-up, then 120 measured.
const WARMUP: u64 = 20 * STEPS_PER_MIN;
const STEPS: u64 = 140 * STEPS_PER_MIN;
const TARGETS: [f64; 2] = [2.0, 6.0];

pub(super) fn at(step: u64) -> Duration {
    STEP * step as u32
}

pub(super) fn bytes(handles: f64) -> u64 {
    (handles * HS as f64) as u64
}

pub(super) fn cfg() -> ReservationConfig {
    ReservationConfig::default()
}

fn cfg_with_target(target_rate_per_min: f64) -> ReservationConfig {
    ReservationConfig {
        target_rate_per_min,
        ..cfg()
    }
}

/// xorshift64*: a tiny seeded generator, so traces are reproducible without `rand`.
pub(super) struct Rng(u64);

impl Rng {
    pub(super) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub(super) fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in [0, 1).
    pub(super) fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    fn exp(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.unit()).ln()
    }
}

/// What one simulated run saw; averages are over the steps from `warmup` on.
#[derive(Debug, Default)]
struct Run {
    /// Step index of each pressure event.
    events: Vec<u64>,
    warmup: u64,
    measured_steps: u64,
    headroom_sum: f64,
    /// Mapped minus used after mapping, in handles: the memory offline could not use.
    spare_sum: f64,
    interval_min: Duration,
    interval_max: Duration,
    final_interval: Duration,
    final_headroom: u64,
    /// What online held after mapping, in handles, summed over the measured steps.
    mapped_sum: f64,
    /// Online's highest use, in bytes.
    peak_used: u64,
}

impl Run {
    fn events_from(&self, step: u64) -> usize {
        self.events.iter().filter(|&&s| s >= step).count()
    }
    fn measured_rate(&self) -> f64 {
        let n = self.events_from(self.warmup);
        n as f64 * STEPS_PER_MIN as f64 / self.measured_steps as f64
    }
    fn mean_headroom(&self) -> f64 {
        self.headroom_sum / self.measured_steps as f64
    }
    fn mean_spare(&self) -> f64 {
        self.spare_sum / self.measured_steps as f64
    }
    fn mean_mapped(&self) -> f64 {
        self.mapped_sum / self.measured_steps as f64
    }
}

/// Runs `steps` steps of `demand` (bytes online uses at each step) against a pool that maps
/// the controller's target at once. Online starts with its pressure-free base plus the
/// minimum headroom mapped. Pressure is re-derived independently of the controller.
fn simulate(
    cfg: ReservationConfig,
    steps: u64,
    warmup: u64,
    demand: impl FnMut(u64) -> u64,
) -> Run {
    simulate_on_pool(cfg, u64::MAX, steps, warmup, demand)
}

/// [`simulate`] on a pool of `capacity` handles.
fn simulate_on_pool(
    cfg: ReservationConfig,
    capacity: u64,
    steps: u64,
    warmup: u64,
    demand: impl FnMut(u64) -> u64,
) -> Run {
    let mut ctl = ReservationController::new(cfg)
        .expect("valid config")
        .with_capacity(capacity);
    simulate_ctl(&mut ctl, 0, steps, warmup, demand)
}

/// [`simulate`] with a controller built (and maybe started warm) by the caller. Online starts
/// with its pressure-free base plus the minimum headroom mapped, or what the controller asks
/// for before its first observation (a warm start), if more.
fn simulate_ctl(
    ctl: &mut ReservationController,
    t0: u64,
    steps: u64,
    warmup: u64,
    mut demand: impl FnMut(u64) -> u64,
) -> Run {
    let cfg = *ctl.config();
    let mut run = Run {
        warmup,
        interval_min: Duration::MAX,
        ..Run::default()
    };
    let first = demand(0);
    let start = (ctl.base_handles(first) + cfg.min_headroom).max(ctl.target_handles());
    let mut mapped = start * cfg.handle_bytes;
    for i in 0..steps {
        let used = if i == 0 { first } else { demand(i) };
        let d = ctl.observe(at(t0 + i), used, mapped);
        let expected = used > 0 && used as f64 >= 0.9 * mapped as f64;
        assert_eq!(
            d.pressure, expected,
            "step {i}: used {used} mapped {mapped}"
        );
        if d.pressure {
            run.events.push(i);
        }
        mapped = d.target_mapped_handles * cfg.handle_bytes;
        assert!(
            !ctl.is_pressure(used, mapped),
            "the target must relieve pressure"
        );
        run.interval_min = run.interval_min.min(d.interval);
        run.interval_max = run.interval_max.max(d.interval);
        run.peak_used = run.peak_used.max(used);
        if i >= warmup {
            run.measured_steps += 1;
            run.headroom_sum += d.headroom_handles as f64;
            run.spare_sum += (mapped - used) as f64 / cfg.handle_bytes as f64;
            run.mapped_sum += d.target_mapped_handles as f64;
        }
    }
    run.final_interval = ctl.interval();
    run.final_headroom = ctl.headroom_handles();
    run
}

/// A base load of 200 handles plus a burst of 40 handles for 1 s every 5 s.
fn periodic_bursts() -> impl FnMut(u64) -> u64 {
    |i| bytes(200.0 + if i % 500 < 100 { 40.0 } else { 0.0 })
}

/// Online requests arriving as a Poisson process (2/s): 85% with short prompts (0.2-3
/// handles of KV), 15% with long, heavy-tailed ones (Pareto, alpha 1.5, from 6 handles,
/// capped at 150). Each holds its prompt's KV, grows while it decodes and frees everything
/// when it ends (exponential lifetime, mean 8 s). Demand is a base of 100 handles plus that.
struct PoissonRequests {
    rng: Rng,
    next_arrival_s: f64,
    /// (end step, start step, prompt handles) of live requests.
    live: Vec<(u64, u64, f64)>,
}

impl PoissonRequests {
    const ARRIVALS_PER_S: f64 = 2.0;
    const DECODE_HANDLES_PER_STEP: f64 = 0.0005;

    fn new(seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let next_arrival_s = rng.exp(1.0 / Self::ARRIVALS_PER_S);
        PoissonRequests {
            rng,
            next_arrival_s,
            live: Vec::new(),
        }
    }

    fn prompt_handles(&mut self) -> f64 {
        if self.rng.unit() < 0.15 {
            (6.0 * (1.0 - self.rng.unit()).powf(-1.0 / 1.5)).min(150.0)
        } else {
            0.2 + 2.8 * self.rng.unit()
        }
    }

    fn demand(&mut self, i: u64) -> u64 {
        let now_s = at(i).as_secs_f64();
        while self.next_arrival_s <= now_s {
            let life_steps = (self.rng.exp(8.0) * 100.0) as u64 + 1;
            let prompt = self.prompt_handles();
            self.live.push((i + life_steps, i, prompt));
            self.next_arrival_s += self.rng.exp(1.0 / Self::ARRIVALS_PER_S);
        }
        self.live.retain(|&(end, _, _)| end > i);
        let kv: f64 = self
            .live
            .iter()
            .map(|&(_, start, p)| p + (i - start) as f64 * Self::DECODE_HANDLES_PER_STEP)
            .sum();
        bytes(100.0 + kv)
    }
}

/// Bursts of 10-60 handles (uniform) held for 2 s, arriving as a Poisson process (mean gap
/// 5 s), over a base of 150 handles that wanders by up to +-20 handles.
fn poisson_bursts(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = Rng::new(seed);
    let mut next = 0u64;
    let mut live: Vec<(u64, f64)> = Vec::new();
    let mut wander = 0.0f64;
    move |i| {
        while next <= i {
            live.push((next + 200, 10.0 + 50.0 * rng.unit()));
            next += (rng.exp(5.0) * 100.0) as u64 + 1;
        }
        live.retain(|&(end, _)| end > i);
        wander = (wander + 0.6 * (rng.unit() - 0.5)).clamp(-20.0, 20.0);
        bytes(150.0 + wander + live.iter().map(|l| l.1).sum::<f64>())
    }
}

/// The memory benchmark's online demand (hwtests/membench, 64 MiB handles of 512 tokens):
/// short requests (0.15/s, one handle for 2 s) over 4 handles, and bursts of 8 long prompts
/// (120-190 handles in all) whose prefill ramps their KV up over 1.2 s; a burst holds it for
/// 3 s more, and the next one comes after max(12.5 s, an exponential gap of mean 25 s).
fn ramped_bursts(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = Rng::new(seed);
    let mut next_short = 0u64;
    let mut next_burst = (rng.unit() * 2000.0) as u64 + 1000;
    let mut shorts: Vec<u64> = Vec::new();
    let mut bursts: Vec<(u64, f64)> = Vec::new();
    move |i| {
        while next_short <= i {
            shorts.push(next_short + 200);
            next_short += (rng.exp(1.0 / 0.15) * 100.0) as u64 + 1;
        }
        while next_burst <= i {
            bursts.push((next_burst, 120.0 + 70.0 * rng.unit()));
            next_burst += (rng.exp(25.0).max(12.5) * 100.0) as u64;
        }
        shorts.retain(|&end| end > i);
        bursts.retain(|&(start, _)| i < start + 420);
        let kv: f64 = bursts
            .iter()
            .map(|&(start, h)| h * ((i - start) as f64 / 120.0).min(1.0))
            .sum();
        bytes(4.0 + shorts.len() as f64 + kv)
    }
}

/// The memory benchmark's trace. From a cold start, as the hardware benchmark runs (2-4
/// minutes after the daemon starts), the rate over the first minutes is far from its long-run
/// value (printed, for docs/memory.md). Over the long run it is within 25% of 6/min, the
/// benchmark's target. At 2/min, fewer than one reclaim per burst, it settles below the target
/// on some seeds (1.38/min on seed 3: T decreases 400 ms per 30 s from several seconds), so
/// there the test asserts only that the rate never exceeds the target by more than 25%.
#[test]
fn converges_to_target_rate_on_ramped_bursts() {
    let mut off = Vec::new();
    for target in TARGETS {
        for seed in 1..4 {
            let run = simulate(cfg_with_target(target), STEPS, WARMUP, ramped_bursts(seed));
            let per_min = |from: u64, to: u64| {
                let n = run.events.iter().filter(|&&s| s >= from && s < to).count();
                n as f64 * STEPS_PER_MIN as f64 / (to - from) as f64
            };
            let rate = run.measured_rate();
            println!(
                "ramped bursts, seed {seed}: target {target}/min; from a cold start \
                 {:.1}/min over 0-2 min, {:.1} over 0-4 min, {:.1} over 0-10 min; \
                 {rate:.2}/min over 120 min after 20 min warm-up",
                per_min(0, 2 * STEPS_PER_MIN),
                per_min(0, 4 * STEPS_PER_MIN),
                per_min(0, 10 * STEPS_PER_MIN),
            );
            off.push((seed, target, rate));
        }
    }
    off.retain(|&(_, target, rate)| {
        rate > 1.25 * target || (target == 6.0 && rate < 0.75 * target)
    });
    assert!(
        off.is_empty(),
        "ramped bursts: (seed, target, rate) off by more than 25%: {off:?}"
    );
}

/// Online's KV use measured in `hwtests/membench` on the H100 (valve-miad, seeds 12 and 13
/// and a 7.8-minute run): `(ms, blocks)` where the 20 ms samples changed.
fn measured_kv(name: &str) -> Vec<(u64, u64)> {
    let text = match name {
        "seed 12" => include_str!("testdata/s20-m12.kv"),
        "seed 13" => include_str!("testdata/s20-m13.kv"),
        "long" => include_str!("testdata/s19-long.kv"),
        _ => unreachable!(),
    };
    let parse = |l: &str| {
        let mut v = l
            .split_whitespace()
            .map(|x| x.parse::<u64>().expect("a number"));
        (v.next().expect("ms"), v.next().expect("blocks"))
    };
    let rows: Vec<_> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .map(parse)
        .collect();
    assert!(
        rows.windows(2).all(|w| w[0].0 <= w[1].0),
        "{name}: time goes forward"
    );
    rows
}

/// The membench pool: 192 handles of 64 MiB, 2 KV blocks each.
const MEMBENCH_POOL: u64 = 192;
const MEMBENCH_BLOCK: u64 = 32 << 20;

/// The measured traces back to back, `first` first, repeated, one value per [`STEP`]. As in
/// the benchmark, online's warm-up used 36 blocks just before the trace.
fn replayed(first: usize) -> impl FnMut(u64) -> u64 {
    let names = ["seed 12", "seed 13", "long"];
    let mut steps: Vec<u64> = vec![0, 36];
    for k in 0..names.len() {
        let rows = measured_kv(names[(first + k) % names.len()]);
        let end = rows.last().expect("rows").0;
        let mut j = 0;
        for ms in (0..end).step_by(STEP.as_millis() as usize) {
            while j + 1 < rows.len() && rows[j + 1].0 <= ms {
                j += 1;
            }
            steps.push(rows[j].1);
        }
    }
    let warm = 2;
    move |i| {
        let i = i as usize;
        let k = if i < warm {
            i
        } else {
            warm + (i - warm) % (steps.len() - warm)
        };
        steps[k] * MEMBENCH_BLOCK
    }
}

/// The benchmark's online KV use as measured on the H100, replayed: each burst ramps use by
/// 120-165 handles in about a second, filling most of the 192-handle pool. The replay of the
/// seed-12 run counts 21 events in its first 2 minutes; on the H100 the daemon counted 16 (it
/// started with what a larger warm-up left reserved), and the pool reclaimed 24 times, as the
/// shim then reclaimed twice for some events. From a cold start the first minutes are far
/// from the target; over the long run the rate is within 25% of it, whichever trace is first.
#[test]
fn converges_to_target_rate_on_the_measured_membench_trace() {
    let mut off = Vec::new();
    for target in TARGETS {
        for first in 0..3 {
            let cfg = cfg_with_target(target);
            let replay = replayed(first);
            let run = simulate_on_pool(cfg, MEMBENCH_POOL, STEPS, WARMUP, replay);
            let per_min = |from: u64, to: u64| {
                let n = run.events.iter().filter(|&&s| s >= from && s < to).count();
                n as f64 * STEPS_PER_MIN as f64 / (to - from) as f64
            };
            let rate = run.measured_rate();
            println!(
                "measured membench trace, starting with trace {first}: target {target}/min; \
                 from a cold start {:.1}/min over 0-2 min, {:.1} over 0-8 min; {rate:.2}/min \
                 over 120 min after 20 min warm-up; mean spare {:.1} handles; T in \
                 [{:?}, {:?}]",
                per_min(0, 2 * STEPS_PER_MIN),
                per_min(0, 8 * STEPS_PER_MIN),
                run.mean_spare(),
                run.interval_min,
                run.interval_max,
            );
            if (rate - target).abs() > 0.25 * target {
                off.push((first, target, rate));
            }
        }
    }
    assert!(
        off.is_empty(),
        "(first trace, target, rate) off by more than 25%: {off:?}"
    );
}

type Runs = Vec<(f64, Run)>;

/// Each convergence trace is simulated once per target and shared by the tests below.
fn runs(which: &str) -> &'static Runs {
    static PERIODIC: OnceLock<Runs> = OnceLock::new();
    static REQUESTS: OnceLock<Runs> = OnceLock::new();
    static BURSTS: OnceLock<Runs> = OnceLock::new();
    let sim =
        |t: f64, d: &mut dyn FnMut(u64) -> u64| simulate(cfg_with_target(t), STEPS, WARMUP, d);
    let all = |f: &dyn Fn(f64) -> Run| TARGETS.iter().map(|&t| (t, f(t))).collect();
    match which {
        "periodic bursts" => PERIODIC.get_or_init(|| all(&|t| sim(t, &mut periodic_bursts()))),
        "poisson requests" => REQUESTS.get_or_init(|| {
            all(&|t| {
                let mut p = PoissonRequests::new(7);
                sim(t, &mut |i| p.demand(i))
            })
        }),
        "poisson bursts" => BURSTS.get_or_init(|| all(&|t| sim(t, &mut poisson_bursts(11)))),
        _ => unreachable!(),
    }
}

fn assert_converges(which: &str) {
    let cfg = cfg();
    for (target, run) in runs(which) {
        let rate = run.measured_rate();
        let err = (rate - target) / target;
        println!(
            "{which}: target {target:.1}/min, measured {rate:.2}/min ({:+.1}%) over 120 min \
             after 20 min warm-up; mean headroom {:.1}, mean spare {:.1} handles; \
             T in [{:?}, {:?}], {:?} at end",
            err * 100.0,
            run.mean_headroom(),
            run.mean_spare(),
            run.interval_min,
            run.interval_max,
            run.final_interval,
        );
        assert!(
            err.abs() <= 0.25,
            "{which}: target {target}/min, measured {rate:.2}/min"
        );
        assert!(run.interval_min >= cfg.t_min && run.interval_max <= cfg.t_max);
    }
}

fn assert_lower_target_keeps_more_headroom(which: &str) {
    let runs = runs(which);
    let (lo, hi) = (&runs[0], &runs[1]);
    assert!(lo.0 < hi.0);
    println!(
        "{which}: mean spare {:.1} handles at {}/min, {:.1} at {}/min",
        lo.1.mean_spare(),
        lo.0,
        hi.1.mean_spare(),
        hi.0
    );
    assert!(lo.1.mean_headroom() > hi.1.mean_headroom());
    assert!(lo.1.mean_spare() > hi.1.mean_spare());
}

#[test]
fn converges_to_target_rate_on_periodic_bursts() {
    assert_converges("periodic bursts");
}

#[test]
fn converges_to_target_rate_on_poisson_requests() {
    assert_converges("poisson requests");
}

#[test]
fn converges_to_target_rate_on_poisson_bursts() {
    assert_converges("poisson bursts");
}

#[test]
fn lower_target_keeps_more_headroom() {
    for which in ["periodic bursts", "poisson requests", "poisson bursts"] {
        assert_lower_target_keeps_more_headroom(which);
    }
}

/// Slow (110 runs; about 15 s with `--release`): every seed of both Poisson traces and the
/// periodic one, for handle sizes 16 MiB to 256 MiB with
/// [`ReservationConfig::for_handle_bytes`].
#[test]
#[ignore]
fn converges_across_seeds_and_handle_sizes() {
    for mib in [16u64, 32, 64, 128, 256] {
        for target in TARGETS {
            let c = ReservationConfig {
                target_rate_per_min: target,
                ..ReservationConfig::for_handle_bytes(mib << 20)
            };
            let mut rates = vec![simulate(c, STEPS, WARMUP, periodic_bursts()).measured_rate()];
            for seed in 1..7 {
                let mut p = PoissonRequests::new(seed);
                rates.push(simulate(c, STEPS, WARMUP, |i| p.demand(i)).measured_rate());
            }
            for seed in 1..5 {
                rates.push(simulate(c, STEPS, WARMUP, poisson_bursts(seed)).measured_rate());
            }
            println!("{mib} MiB handles, target {target}/min: measured {rates:.2?}");
            for r in rates {
                assert!(
                    (r - target).abs() <= 0.25 * target,
                    "{mib} MiB, {target}: {r}"
                );
            }
        }
    }
}

#[test]
fn steady_demand_never_causes_events_and_stays_at_the_floor() {
    let run = simulate(cfg(), 10 * STEPS_PER_MIN, 0, |_| bytes(100.3));
    assert!(run.events.is_empty(), "{:?}", run.events);
    assert_eq!(run.final_headroom, cfg().min_headroom);
}

#[test]
fn demand_that_grows_slower_than_the_floor_headroom_never_causes_events() {
    // The floor headroom (1 handle) absorbs growth below 0.9 handles per observation.
    let mut rng = Rng::new(5);
    let mut level = 100.0f64;
    let run = simulate(cfg(), 30 * STEPS_PER_MIN, 0, |_| {
        level += 0.89 * (2.0 * rng.unit() - 1.0);
        if rng.unit() < 0.001 {
            level -= 50.0;
        }
        level = level.clamp(20.0, 400.0);
        bytes(level)
    });
    assert!(run.events.is_empty(), "{:?}", run.events);
}

/// The first 90 s after a daemon restart, the window of the H100 target (offline >= 1.5x a
/// static split; MIAD from a cold start made 1.29x there).
const FIRST: u64 = 90 * STEPS_PER_MIN / 60;

/// One daemon restart on the measured membench trace, at a target of 6/min: the first daemon
/// ran the trace for `saved_after` minutes from a cold start and saved what it learned; online
/// then restarts and plays the trace from its start for [`FIRST`] steps against a new daemon,
/// cold or warm, or against the first daemon's controller, which never stopped. Returns the
/// runs (cold, warm, continuing).
fn restart_after(saved_after: u64) -> (Run, Run, Run) {
    let cfg = cfg_with_target(6.0);
    let new = || {
        ReservationController::new(cfg)
            .expect("valid config")
            .with_capacity(MEMBENCH_POOL)
    };
    let mut before = new();
    let stopped = saved_after * STEPS_PER_MIN;
    simulate_ctl(&mut before, 0, stopped, 0, replayed(0));
    let saved = before.learned();
    let cold = simulate_ctl(&mut new(), 0, FIRST, 0, replayed(0));
    let mut warm = new();
    let notes = warm.warm_from(&saved).expect("same handle size");
    assert!(notes.is_empty(), "nothing to clamp: {notes:?}");
    let first = warm.clone().observe(at(0), replayed(0)(0), 0);
    assert_eq!(
        (first.target_mapped_handles, first.interval, first.pressure),
        (
            saved.target_handles,
            Duration::from_millis(saved.interval_ms),
            false
        ),
        "a warm start asks at once for the saved reservation, with the saved T"
    );
    let warm = simulate_ctl(&mut warm, 0, FIRST, 0, replayed(0));
    let continuing = simulate_ctl(&mut before, stopped, FIRST, 0, replayed(0));
    (cold, warm, continuing)
}

/// Warm against cold start over the first 90 s after a restart, on the measured trace, with the
/// state saved at each minute from 2 to 40 of the previous run (a reservation is anywhere in its
/// cycle when the daemon stops). A warm start resumes the reservation that never stopped: its
/// reclaims and offline's memory (the pool less what online holds) stay close to those of the
/// controller that kept running, where a cold start's do not. Printed for docs/memory.md.
#[test]
fn a_warm_start_resumes_the_reservation_that_never_stopped() {
    let (mut sums, mut gaps) = ([0.0f64; 6], [0.0f64; 4]);
    let offline = |r: &Run| MEMBENCH_POOL as f64 - r.mean_mapped();
    let points = 2..=40u64;
    let n = points.clone().count() as f64;
    let mut static_offline = 0;
    for saved_after in points {
        let (cold, warm, cont) = restart_after(saved_after);
        static_offline = MEMBENCH_POOL - cold.peak_used.div_ceil(HS) - 1;
        let ev = |r: &Run| r.events.len() as f64;
        let row = [
            ev(&cold),
            ev(&warm),
            ev(&cont),
            offline(&cold),
            offline(&warm),
        ];
        for (s, v) in sums.iter_mut().zip(row.into_iter().chain([offline(&cont)])) {
            *s += v / n;
        }
        gaps[0] += (ev(&warm) - ev(&cont)).abs() / n;
        gaps[1] += (ev(&cold) - ev(&cont)).abs() / n;
        gaps[2] += (offline(&warm) - offline(&cont)).abs() / n;
        gaps[3] += (offline(&cold) - offline(&cont)).abs() / n;
    }
    let [cold_ev, warm_ev, cont_ev, cold_off, warm_off, cont_off] = sums;
    let s = static_offline as f64;
    println!(
        "first 90 s after a restart, target 6/min, mean of {n} save points: reclaims cold \
         {cold_ev:.1}, warm {warm_ev:.1}, never stopped {cont_ev:.1} (|warm - never stopped| \
         {:.2}, |cold - never stopped| {:.2}); offline's memory in handles cold {cold_off:.1} \
         ({:.2}x static {static_offline}), warm {warm_off:.1} ({:.2}x), never stopped \
         {cont_off:.1} ({:.2}x) (|warm - never stopped| {:.1}, |cold - never stopped| {:.1})",
        gaps[0],
        gaps[1],
        cold_off / s,
        warm_off / s,
        cont_off / s,
        gaps[2],
        gaps[3],
    );
    assert!(gaps[0] < gaps[1] / 4.0, "reclaims: {gaps:?}");
    assert!(gaps[2] < gaps[3] / 4.0, "offline's memory: {gaps:?}");
}
