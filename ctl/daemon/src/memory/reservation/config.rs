//! The MIAD reservation's tuning ([`ReservationConfig`]): its defaults, the presets for other
//! handle sizes, and the checks that name each field a config gets wrong ([`ConfigError`]).

use std::fmt;
use std::time::Duration;

/// Tuning of the MIAD reservation. [`ReservationController::new`](super::ReservationController::new)
/// validates it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ReservationConfig {
    /// Size of one physical handle in bytes (the pool's granularity); > 0.
    pub handle_bytes: u64,
    /// A pressure event is `used >= pressure_fraction * mapped`; in (0, 1].
    pub pressure_fraction: f64,
    /// Headroom multiplier on a pressure event; finite, > 1.
    pub growth_factor: f64,
    /// Smallest headroom, in handles (also the starting headroom); <= `max_headroom`.
    pub min_headroom: u64,
    /// Largest headroom, in handles; > 0.
    pub max_headroom: u64,
    /// The operator's target: pressure events (reclamations) per minute; finite, > 0.
    pub target_rate_per_min: f64,
    /// Length of the sliding window the reported event rate is counted over; > 0.
    pub window: Duration,
    /// How much history the rate balance keeps: it stays within ± target × `memory` events; > 0.
    pub memory: Duration,
    /// The interval T at start; in [`t_min`, `t_max`].
    ///
    /// [`t_min`]: ReservationConfig::t_min
    /// [`t_max`]: ReservationConfig::t_max
    pub t_initial: Duration,
    /// Shortest T; > 0.
    pub t_min: Duration,
    /// Longest T; >= `t_min`.
    pub t_max: Duration,
    /// T multiplier when events are over the target; finite, > 1.
    pub t_growth: f64,
    /// T decrement when events are at or under the target; > 0.
    pub t_step: Duration,
}

impl Default for ReservationConfig {
    fn default() -> Self {
        ReservationConfig {
            handle_bytes: Self::DEFAULT_HANDLE_BYTES,
            pressure_fraction: 0.9,
            growth_factor: 2.0,
            min_headroom: 1,
            max_headroom: 256,
            target_rate_per_min: 2.0,
            window: Duration::from_secs(60),
            memory: Duration::from_secs(240),
            t_initial: Duration::from_secs(1),
            t_min: Duration::from_millis(50),
            t_max: Duration::from_secs(60),
            t_growth: 2.0,
            t_step: Duration::from_millis(400),
        }
    }
}

/// Why a [`ReservationConfig`] was refused; each names the offending field.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ConfigError {
    /// `handle_bytes` is zero.
    ZeroHandleSize,
    /// `pressure_fraction` is not a finite number in (0, 1].
    PressureFraction(f64),
    /// `growth_factor` is not a finite number > 1.
    GrowthFactor(f64),
    /// `t_growth` is not a finite number > 1.
    TGrowth(f64),
    /// `target_rate_per_min` is not a finite number > 0.
    TargetRate(f64),
    /// `max_headroom` is zero or below `min_headroom`.
    HeadroomBounds {
        /// The configured `min_headroom`.
        min: u64,
        /// The configured `max_headroom`.
        max: u64,
    },
    /// `window` is zero.
    ZeroWindow,
    /// `memory` is zero.
    ZeroMemory,
    /// `t_step` is zero.
    ZeroTStep,
    /// `t_min` is zero, or `t_initial` is not in [`t_min`, `t_max`].
    IntervalBounds {
        /// The configured `t_min`.
        min: Duration,
        /// The configured `t_initial`.
        initial: Duration,
        /// The configured `t_max`.
        max: Duration,
    },
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::ZeroHandleSize => write!(f, "handle_bytes must be > 0"),
            ConfigError::PressureFraction(v) => write!(f, "pressure_fraction {v} not in (0, 1]"),
            ConfigError::GrowthFactor(v) => write!(f, "growth_factor {v} must be finite and > 1"),
            ConfigError::TGrowth(v) => write!(f, "t_growth {v} must be finite and > 1"),
            ConfigError::TargetRate(v) => {
                write!(f, "target_rate_per_min {v} must be finite and > 0")
            }
            ConfigError::HeadroomBounds { min, max } => {
                write!(
                    f,
                    "min_headroom {min}, max_headroom {max}: need 0 < max, min <= max"
                )
            }
            ConfigError::ZeroWindow => write!(f, "window must be > 0"),
            ConfigError::ZeroMemory => write!(f, "memory must be > 0"),
            ConfigError::ZeroTStep => write!(f, "t_step must be > 0"),
            ConfigError::IntervalBounds { min, initial, max } => write!(
                f,
                "t_min {min:?}, t_initial {initial:?}, t_max {max:?}: \
                 need 0 < t_min <= t_initial <= t_max"
            ),
        }
    }
}

impl std::error::Error for ConfigError {}

fn finite_above(v: f64, floor: f64) -> bool {
    v.is_finite() && v > floor
}

impl ReservationConfig {
    /// The handle size of [`Default`]: 64 MiB.
    pub const DEFAULT_HANDLE_BYTES: u64 = 64 << 20;

    /// The defaults for another handle size: the same `min_headroom` and `max_headroom` in bytes
    /// (64 MiB and 16 GiB, at least one handle each), and the
    /// time constants (`t_initial`, `t_min`, `t_max`, `t_step`) scaled in proportion to the
    /// handle size. T is time per handle, and the headroom a demand needs, in handles, is
    /// inversely proportional to the handle size; without this, a larger handle makes T's
    /// additive steps too small to converge quickly and a smaller one makes them too coarse.
    /// `handle_bytes` 0 gives a config that fails `validate`.
    pub fn for_handle_bytes(handle_bytes: u64) -> Self {
        let d = ReservationConfig::default();
        let k = handle_bytes as f64 / Self::DEFAULT_HANDLE_BYTES as f64;
        let scale =
            |t: Duration| Duration::try_from_secs_f64(t.as_secs_f64() * k).unwrap_or(Duration::MAX);
        let in_handles = |h: u64| {
            let bytes = h * Self::DEFAULT_HANDLE_BYTES;
            bytes.checked_div(handle_bytes).unwrap_or(0).max(1)
        };
        ReservationConfig {
            handle_bytes,
            min_headroom: in_handles(d.min_headroom),
            max_headroom: in_handles(d.max_headroom),
            t_initial: scale(d.t_initial),
            t_min: scale(d.t_min),
            t_max: scale(d.t_max),
            t_step: scale(d.t_step),
            ..d
        }
    }

    /// Checks every field; returns the first problem found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let frac = self.pressure_fraction;
        if self.handle_bytes == 0 {
            return Err(ConfigError::ZeroHandleSize);
        }
        if !(finite_above(frac, 0.0) && frac <= 1.0) {
            return Err(ConfigError::PressureFraction(frac));
        }
        if !finite_above(self.growth_factor, 1.0) {
            return Err(ConfigError::GrowthFactor(self.growth_factor));
        }
        if !finite_above(self.t_growth, 1.0) {
            return Err(ConfigError::TGrowth(self.t_growth));
        }
        if !finite_above(self.target_rate_per_min, 0.0) {
            return Err(ConfigError::TargetRate(self.target_rate_per_min));
        }
        if self.max_headroom == 0 || self.min_headroom > self.max_headroom {
            let (min, max) = (self.min_headroom, self.max_headroom);
            return Err(ConfigError::HeadroomBounds { min, max });
        }
        if self.window.is_zero() {
            return Err(ConfigError::ZeroWindow);
        }
        if self.memory.is_zero() {
            return Err(ConfigError::ZeroMemory);
        }
        if self.t_step.is_zero() {
            return Err(ConfigError::ZeroTStep);
        }
        let (min, initial, max) = (self.t_min, self.t_initial, self.t_max);
        if min.is_zero() || min > initial || initial > max {
            return Err(ConfigError::IntervalBounds { min, initial, max });
        }
        Ok(())
    }

    /// The target's mean time between events (60 s / target), the cadence of T's decrease.
    pub fn target_gap(&self) -> Duration {
        Duration::try_from_secs_f64(60.0 / self.target_rate_per_min).unwrap_or(Duration::MAX)
    }

    /// The bound on the balance's magnitude, in events.
    pub(super) fn balance_limit(&self) -> f64 {
        self.target_rate_per_min * self.memory.as_secs_f64() / 60.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::reservation::simulation::cfg;
    use crate::memory::reservation::ReservationController;

    fn rejects(c: ReservationConfig, expected: impl Fn(&ConfigError) -> bool) {
        let err = c.validate().expect_err("config should be refused");
        assert!(expected(&err), "unexpected error {err:?}");
        assert!(ReservationController::new(c).is_err());
    }

    #[test]
    fn validate_names_each_bad_number() {
        use ConfigError as E;
        let ok = cfg();
        assert_eq!(ok.validate(), Ok(()));
        assert!(ReservationConfig {
            pressure_fraction: 1.0,
            ..ok
        }
        .validate()
        .is_ok());
        rejects(
            ReservationConfig {
                handle_bytes: 0,
                ..ok
            },
            |e| *e == E::ZeroHandleSize,
        );
        for v in [0.0, -0.1, 1.01, f64::NAN, f64::INFINITY] {
            let c = ReservationConfig {
                pressure_fraction: v,
                ..ok
            };
            rejects(c, |e| matches!(e, E::PressureFraction(_)));
        }
        for v in [1.0, 0.5, f64::NAN, f64::INFINITY] {
            let c = ReservationConfig {
                growth_factor: v,
                ..ok
            };
            rejects(c, |e| matches!(e, E::GrowthFactor(_)));
            rejects(ReservationConfig { t_growth: v, ..ok }, |e| {
                matches!(e, E::TGrowth(_))
            });
        }
        for v in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let c = ReservationConfig {
                target_rate_per_min: v,
                ..ok
            };
            rejects(c, |e| matches!(e, E::TargetRate(_)));
        }
    }

    #[test]
    fn validate_names_each_bad_bound() {
        use ConfigError as E;
        let ok = cfg();
        let c = ReservationConfig {
            min_headroom: 10,
            max_headroom: 5,
            ..ok
        };
        rejects(c, |e| *e == E::HeadroomBounds { min: 10, max: 5 });
        let c = ReservationConfig {
            min_headroom: 0,
            max_headroom: 0,
            ..ok
        };
        rejects(c, |e| *e == E::HeadroomBounds { min: 0, max: 0 });
        rejects(
            ReservationConfig {
                window: Duration::ZERO,
                ..ok
            },
            |e| *e == E::ZeroWindow,
        );
        rejects(
            ReservationConfig {
                memory: Duration::ZERO,
                ..ok
            },
            |e| *e == E::ZeroMemory,
        );
        rejects(
            ReservationConfig {
                t_step: Duration::ZERO,
                ..ok
            },
            |e| *e == E::ZeroTStep,
        );
        let secs = Duration::from_secs;
        for (min, initial, max) in [(0, 1, 2), (2, 1, 3), (1, 3, 2)] {
            let (t_min, t_initial, t_max) = (secs(min), secs(initial), secs(max));
            let c = ReservationConfig {
                t_min,
                t_initial,
                t_max,
                ..ok
            };
            rejects(c, |e| matches!(e, E::IntervalBounds { .. }));
        }
        let bad = ReservationConfig::for_handle_bytes(0);
        assert_eq!(bad.validate(), Err(E::ZeroHandleSize));
    }

    #[test]
    fn presets_for_other_handle_sizes_are_valid_and_scaled() {
        for bytes in [
            1u64,
            2 << 20,
            32 << 20,
            64 << 20,
            1 << 30,
            8 << 30,
            u64::MAX,
        ] {
            let c = ReservationConfig::for_handle_bytes(bytes);
            assert_eq!(c.validate(), Ok(()), "{bytes}");
        }
        assert_eq!(ReservationConfig::for_handle_bytes(64 << 20), cfg());
        let c = ReservationConfig::for_handle_bytes(128 << 20);
        assert_eq!((c.min_headroom, c.max_headroom), (1, 128));
        assert_eq!(c.t_step, 2 * cfg().t_step);
        let c = ReservationConfig::for_handle_bytes(16 << 20);
        assert_eq!((c.min_headroom, c.max_headroom), (4, 1024));
        assert_eq!(c.t_min * 4, cfg().t_min);
    }
}
