//! What a reservation learned ([`Learned`]), taken from a running controller and given to a new
//! one after a daemon restart (warm start), checked and clamped against the new config and pool.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::controller::ReservationController;

/// What one online reservation learned: where it stood (what online holds, the headroom, T) and
/// the summary of its recent pressure events that MIAD acts on (the rate balance, the headroom
/// at the last reclaiming event). The pool saves it; a controller started later begins there.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Learned {
    /// Bytes per handle the counts below are in; another handle size starts cold.
    pub handle_bytes: u64,
    /// The target rate T and the balance were learned for, per minute.
    pub target_rate_per_min: f64,
    /// What online was last asked to hold, in handles.
    pub target_handles: u64,
    /// The headroom, in handles.
    pub headroom_handles: u64,
    /// The interval T, in milliseconds.
    pub interval_ms: u64,
    /// Events minus target x time, in events (positive: over the target lately).
    pub balance_events: f64,
    /// The headroom at the last event that reclaimed, before it grew.
    pub prev_event_headroom: Option<u64>,
    /// Events per minute over the sliding window when saved (shown, not restored).
    pub event_rate_per_min: f64,
    /// Pressure events that reclaimed over the saved controller's life (shown, not restored).
    pub events: u64,
}

/// Clamps `v` into `[lo, hi]`, noting in `notes` when it had to.
fn clamp_noted(notes: &mut Vec<String>, name: &str, v: u64, lo: u64, hi: u64) -> u64 {
    let c = v.clamp(lo, hi.max(lo));
    if c != v {
        notes.push(format!("{name} {v} clamped to {c}"));
    }
    c
}

impl ReservationController {
    /// What this controller has learned, for [`ReservationController::warm_from`] after a
    /// restart.
    pub fn learned(&self) -> Learned {
        Learned {
            handle_bytes: self.cfg.handle_bytes,
            target_rate_per_min: self.cfg.target_rate_per_min,
            target_handles: self.last_target,
            headroom_handles: self.headroom,
            interval_ms: self.interval.as_millis().min(u64::MAX as u128) as u64,
            balance_events: self.balance,
            prev_event_headroom: self.prev_event_headroom,
            event_rate_per_min: self.event_rate_per_min(),
            events: self.total_events,
        }
    }

    /// Starts this controller, before its first observation, from what an earlier one learned:
    /// it asks at once for `saved.target_handles` and runs with the saved headroom, T and
    /// balance. Nothing saved is trusted: every value is clamped to this config and this pool
    /// (call [`ReservationController::with_capacity`] first), and each clamp is returned as a
    /// note. Saved with another target rate, only the memory (target and headroom) is taken; T
    /// and the balance start cold, and a note says so. Refused, leaving the controller cold,
    /// after an observation or for another handle size (the counts would mean other bytes).
    pub fn warm_from(&mut self, saved: &Learned) -> Result<Vec<String>, String> {
        if self.now.is_some() {
            return Err("the reservation is already running".into());
        }
        if saved.handle_bytes != self.cfg.handle_bytes {
            return Err(format!(
                "saved with {} MiB handles, the pool now has {} MiB",
                saved.handle_bytes >> 20,
                self.cfg.handle_bytes >> 20
            ));
        }
        let mut notes = Vec::new();
        let cfg = self.cfg;
        let top = cfg.max_headroom.min(self.capacity);
        let (min_h, cap) = (cfg.min_headroom, self.capacity);
        let headroom = clamp_noted(&mut notes, "headroom", saved.headroom_handles, min_h, top);
        let target = clamp_noted(&mut notes, "target", saved.target_handles, 0, cap);
        let same_rate = (saved.target_rate_per_min - cfg.target_rate_per_min).abs()
            <= 1e-9 * cfg.target_rate_per_min;
        if same_rate {
            self.restore_rate_state(saved, top, &mut notes);
        } else {
            notes.push(format!(
                "saved for {}/min, the target is now {}/min: T and the balance start cold",
                saved.target_rate_per_min, cfg.target_rate_per_min
            ));
        }
        self.headroom = headroom;
        self.reserved = target;
        // What the pool is asked for first: an observation before it is mapped is no shortage.
        self.last_target = target;
        Ok(notes)
    }

    /// T, the balance and the last event's headroom from `saved`, clamped (notes in `notes`).
    fn restore_rate_state(&mut self, saved: &Learned, top: u64, notes: &mut Vec<String>) {
        let cfg = self.cfg;
        let (lo, hi) = (cfg.t_min.as_millis() as u64, cfg.t_max.as_millis() as u64);
        let ms = clamp_noted(notes, "interval_ms", saved.interval_ms, lo.max(1), hi);
        self.interval = Duration::from_millis(ms).clamp(cfg.t_min, cfg.t_max);
        let limit = cfg.balance_limit();
        let b = saved.balance_events;
        self.balance = if b.is_finite() {
            b.clamp(-limit, limit)
        } else {
            0.0
        };
        if self.balance != b {
            notes.push(format!("balance {b} clamped to {:.2}", self.balance));
        }
        self.prev_event_headroom = saved
            .prev_event_headroom
            .map(|h| clamp_noted(notes, "last event's headroom", h, 0, top));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::reservation::simulation::{at, cfg, HS};

    fn saved() -> Learned {
        Learned {
            handle_bytes: HS,
            target_rate_per_min: cfg().target_rate_per_min,
            target_handles: 150,
            headroom_handles: 40,
            interval_ms: 3_200,
            balance_events: 1.5,
            prev_event_headroom: Some(30),
            event_rate_per_min: 2.0,
            events: 9,
        }
    }

    fn on_pool(capacity: u64) -> ReservationController {
        ReservationController::new(cfg())
            .unwrap()
            .with_capacity(capacity)
    }

    #[test]
    fn what_a_controller_learned_starts_the_next_one_where_it_stood() {
        let mut ctl = on_pool(192);
        assert_eq!(ctl.warm_from(&saved()), Ok(vec![]));
        assert_eq!(
            ctl.learned(),
            Learned {
                events: 0,
                event_rate_per_min: 0.0,
                ..saved()
            }
        );
        let d = ctl.observe(at(0), 10 * HS, 0);
        assert_eq!(
            (
                d.target_mapped_handles,
                d.headroom_handles,
                d.interval,
                d.pressure
            ),
            (150, 40, Duration::from_millis(3_200), false),
            "asks at once for the saved reservation; not mapped yet is no shortage"
        );
        assert_eq!(ctl.balance_events(), 1.5);
    }

    #[test]
    fn out_of_range_values_are_clamped_to_the_config_and_the_pool() {
        let mut ctl = on_pool(100);
        let hostile = Learned {
            target_handles: u64::MAX,
            headroom_handles: u64::MAX,
            interval_ms: u64::MAX,
            balance_events: 1e300,
            prev_event_headroom: Some(u64::MAX),
            ..saved()
        };
        let notes = ctl.warm_from(&hostile).unwrap();
        assert_eq!(notes.len(), 5, "{notes:?}");
        let limit = cfg().balance_limit();
        assert_eq!(
            (ctl.target_handles(), ctl.headroom_handles(), ctl.interval()),
            (100, 100, cfg().t_max),
            "{notes:?}"
        );
        assert_eq!(
            (ctl.balance_events(), ctl.prev_event_headroom),
            (limit, Some(100))
        );
        let mut ctl = on_pool(100);
        let low = Learned {
            headroom_handles: 0,
            interval_ms: 0,
            balance_events: f64::NAN,
            ..saved()
        };
        let notes = ctl.warm_from(&low).unwrap();
        assert_eq!(notes.len(), 4, "the target too: {notes:?}");
        assert_eq!(
            (ctl.headroom_handles(), ctl.interval(), ctl.balance_events()),
            (cfg().min_headroom, cfg().t_min, 0.0)
        );
    }

    #[test]
    fn another_handle_size_or_a_running_controller_stays_cold() {
        let mut ctl = on_pool(192);
        let other = Learned {
            handle_bytes: 2 * HS,
            ..saved()
        };
        let why = ctl.warm_from(&other).unwrap_err();
        assert!(why.contains("128 MiB handles"), "{why}");
        assert_eq!(ctl.learned().target_handles, 0, "still cold");
        ctl.observe(at(0), HS, 2 * HS);
        assert!(ctl.warm_from(&saved()).is_err(), "too late once running");
    }

    #[test]
    fn another_target_rate_keeps_the_memory_and_starts_t_cold() {
        let mut ctl = on_pool(192);
        let other = Learned {
            target_rate_per_min: 6.0,
            ..saved()
        };
        let notes = ctl.warm_from(&other).unwrap();
        assert!(
            notes[0].contains("T and the balance start cold"),
            "{notes:?}"
        );
        assert_eq!((ctl.target_handles(), ctl.headroom_handles()), (150, 40));
        assert_eq!(
            (ctl.interval(), ctl.balance_events()),
            (cfg().t_initial, 0.0)
        );
    }
}
