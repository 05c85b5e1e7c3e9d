//! The drift of a running job's own throughput level: on top of its static error against its
//! profile ([`super::jobs::Arrival::error`]), a job's level moves over minutes (on an H100 a
//! continuous-batching job's uninterrupted rate moved 0.7%-13.4%, highest-lowest over mean,
//! within one 4-5 minute profile, and two 80-s phases of one process minutes apart differed by
//! 10%).
//!
//! The ground truth models it as a stationary AR(1) (a discretised Ornstein-Uhlenbeck process)
//! per run: `d` starts from N(0, sd^2) at placement and each minute becomes
//! `rho d + sqrt(1 - rho^2) sd eps` with `rho = exp(-1 / T)`; the run's level that minute is
//! `(1 + error) (1 + d)`, the factor `1 + d` clamped to [`FACTOR_BOUNDS`]. Each run draws from
//! its own generator ([`LevelDrift::rng`]), seeded from the simulation's seed, the job and the
//! run's first minute, so results do not depend on threads or on other runs. No policy, the
//! oracle included, knows `d`.

use super::jobs::normal;

/// `1 + d` is clamped to this range (a job at half or 1.5x its level is as far as it drifts).
pub const FACTOR_BOUNDS: [f64; 2] = [0.5, 1.5];
/// The largest stationary sd `simulate --level-drift-sd` accepts.
pub const MAX_SD: f64 = 0.3;
/// The correlation times `simulate --level-drift-minutes` accepts (minutes).
pub const MINUTES_RANGE: [f64; 2] = [1.0, 1440.0];
/// The default correlation time (minutes).
pub const DEFAULT_MINUTES: f64 = 10.0;

/// The drift process of a run's level: its stationary sd and its lag-1 (one-minute)
/// autocorrelation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LevelDrift {
    /// Stationary standard deviation of `d` (0: no drift, and no random draws).
    pub sd: f64,
    /// Correlation of `d` from one minute to the next: `exp(-1 / T)`.
    pub rho: f64,
}

impl LevelDrift {
    /// No drift.
    pub const OFF: LevelDrift = LevelDrift { sd: 0.0, rho: 0.0 };

    /// The drift of stationary sd `sd` and correlation time `minutes`.
    pub fn new(sd: f64, minutes: f64) -> LevelDrift {
        LevelDrift {
            sd,
            rho: (-1.0 / minutes).exp(),
        }
    }

    /// Whether it is off (sd 0): `d` stays exactly 0 and nothing is drawn.
    pub fn is_off(&self) -> bool {
        self.sd == 0.0
    }

    /// `d` at a run's placement: a draw from the stationary distribution N(0, sd^2).
    pub fn start(&self, rng: &mut fastrand::Rng) -> f64 {
        if self.is_off() {
            return 0.0;
        }
        self.sd * normal(rng)
    }

    /// `d` one minute after `d`.
    pub fn step(&self, d: f64, rng: &mut fastrand::Rng) -> f64 {
        if self.is_off() {
            return 0.0;
        }
        self.rho * d + (1.0 - self.rho * self.rho).sqrt() * self.sd * normal(rng)
    }

    /// The generator of one run's drift: from the simulation's `seed`, the job's `arrival` index
    /// and the run's first minute `start` (a requeued job's next run draws afresh; every
    /// policy that starts a job at the same minute sees the same drift).
    pub fn rng(seed: u64, arrival: u32, start: u32) -> fastrand::Rng {
        let s = mix(mix(mix(seed ^ 0x0D81_F7ED_u64) ^ u64::from(arrival)) ^ u64::from(start));
        fastrand::Rng::with_seed(s)
    }
}

/// A job's `error` (its level relative to its profile, minus 1) this minute, with drift `d`:
/// `(1 + error) (1 + d) - 1`, `1 + d` clamped to [`FACTOR_BOUNDS`]; exactly `error` where `d`
/// is 0.
pub fn with_drift(error: f64, d: f64) -> f64 {
    if d == 0.0 {
        return error;
    }
    (1.0 + error) * (1.0 + d).clamp(FACTOR_BOUNDS[0], FACTOR_BOUNDS[1]) - 1.0
}

/// Refuses a drift sd or correlation time out of range, naming the option and the fix.
pub fn check(sd: f64, minutes: f64) -> Result<(), String> {
    if !(0.0..=MAX_SD).contains(&sd) {
        return Err(format!(
            "--level-drift-sd {sd}: give a standard deviation in [0, {MAX_SD}] (0: no drift)"
        ));
    }
    if !(MINUTES_RANGE[0]..=MINUTES_RANGE[1]).contains(&minutes) {
        return Err(format!(
            "--level-drift-minutes {minutes}: give a correlation time in [{}, {}] minutes",
            MINUTES_RANGE[0], MINUTES_RANGE[1]
        ));
    }
    Ok(())
}

/// SplitMix64's finaliser: spreads nearby seeds over the whole range.
fn mix(z: u64) -> u64 {
    let z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `n` steps of `drift` from its stationary start: (sd, lag-1 autocorrelation).
    fn sample(drift: LevelDrift, n: usize, seed: u64) -> (f64, f64) {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut d = drift.start(&mut rng);
        let xs: Vec<f64> = (0..n)
            .map(|_| {
                d = drift.step(d, &mut rng);
                d
            })
            .collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        let cov = xs
            .windows(2)
            .map(|w| (w[0] - mean) * (w[1] - mean))
            .sum::<f64>()
            / (n - 1) as f64;
        (var.sqrt(), cov / var)
    }

    #[test]
    fn the_drift_has_the_asked_sd_and_correlation() {
        for (sd, minutes, seed) in [(0.1, 10.0, 1), (0.05, 3.0, 2), (0.3, 20.0, 3)] {
            let drift = LevelDrift::new(sd, minutes);
            let (got_sd, rho) = sample(drift, 200_000, seed);
            assert!(
                (got_sd / sd - 1.0).abs() < 0.03,
                "sd {sd}, T {minutes}: {got_sd}"
            );
            assert!(
                (rho - drift.rho).abs() < 0.01,
                "sd {sd}, T {minutes}: rho {rho} vs {}",
                drift.rho
            );
        }
        assert!((LevelDrift::new(0.1, 10.0).rho - (-0.1f64).exp()).abs() < 1e-15);
    }

    #[test]
    fn without_spread_the_drift_stays_zero_and_draws_nothing() {
        let drift = LevelDrift::new(0.0, 10.0);
        let mut rng = fastrand::Rng::with_seed(7);
        let mut d = drift.start(&mut rng);
        for _ in 0..1000 {
            d = drift.step(d, &mut rng);
            assert_eq!(d, 0.0);
        }
        assert_eq!(
            rng.u64(..),
            fastrand::Rng::with_seed(7).u64(..),
            "nothing drawn"
        );
        assert!(LevelDrift::OFF.is_off());
        for e in [-0.9, -0.37, 0.0, 0.1, 0.03, 1.0] {
            assert_eq!(with_drift(e, 0.0).to_bits(), e.to_bits(), "{e}");
        }
    }

    #[test]
    fn drift_multiplies_the_level_and_is_clamped() {
        assert!((with_drift(0.1, 0.2) - (1.1 * 1.2 - 1.0)).abs() < 1e-12);
        assert!((with_drift(0.0, -0.8) - (0.5 - 1.0)).abs() < 1e-12);
        assert!((with_drift(-0.5, 2.0) - (0.5 * 1.5 - 1.0)).abs() < 1e-12);
    }

    #[test]
    fn each_run_has_its_own_repeatable_generator() {
        let draw = |seed, arrival, start| LevelDrift::rng(seed, arrival, start).u64(..);
        assert_eq!(draw(1, 5, 100), draw(1, 5, 100));
        assert_ne!(
            draw(1, 5, 100),
            draw(1, 5, 105),
            "a requeued job's next run"
        );
        assert_ne!(draw(1, 5, 100), draw(1, 6, 100), "another job");
        assert_ne!(draw(1, 5, 100), draw(2, 5, 100), "another seed");
    }

    #[test]
    fn out_of_range_settings_are_refused_by_name() {
        assert!(check(0.0, 10.0).is_ok() && check(0.3, 1.0).is_ok() && check(0.1, 1440.0).is_ok());
        for sd in [-0.01, 0.31, f64::NAN] {
            let e = check(sd, 10.0).unwrap_err();
            assert!(
                e.contains("--level-drift-sd") && e.contains("[0, 0.3]"),
                "{e}"
            );
        }
        for minutes in [0.5, 1441.0, f64::NAN] {
            let e = check(0.1, minutes).unwrap_err();
            assert!(
                e.contains("--level-drift-minutes") && e.contains("[1, 1440]"),
                "{e}"
            );
        }
    }
}
