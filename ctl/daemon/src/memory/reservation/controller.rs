//! The MIAD reservation controller of one online process ([`ReservationController`]): each
//! observation of online's memory in, how many handles online should have mapped out.

use std::collections::VecDeque;
use std::time::Duration;

use super::config::{ConfigError, ReservationConfig};

/// What the controller decided at one observation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// How many handles online should have mapped now: the pressure-free base for its current use
    /// plus the headroom. The pool maps or gives back handles to reach it, as far as it can.
    pub target_mapped_handles: u64,
    /// Whether this observation was a pressure event.
    pub pressure: bool,
    /// The headroom after this observation, in handles.
    pub headroom_handles: u64,
    /// The interval T after this observation.
    pub interval: Duration,
}

/// The MIAD reservation controller of one online process; the rules are in [the module
/// docs](super).
#[derive(Clone, Debug)]
pub struct ReservationController {
    pub(super) cfg: ReservationConfig,
    pub(super) headroom: u64,
    pub(super) interval: Duration,
    /// The latest timestamp seen; earlier ones are taken as this one.
    pub(super) now: Option<Duration>,
    /// When the headroom next shrinks if no event comes first.
    next_decrease: Duration,
    /// When T last changed (or the first observation).
    last_t_change: Duration,
    /// Events minus target × time, in events, within ± `balance_limit`.
    pub(super) balance: f64,
    /// The headroom at the previous event that reclaimed, before it grew.
    pub(super) prev_event_headroom: Option<u64>,
    /// Used bytes at the previous observation.
    last_used: u64,
    /// The last `target_mapped_handles` returned.
    pub(super) last_target: u64,
    /// What online should hold: set to use + headroom at a pressure event, then down one
    /// handle per T. It does not follow use between events: memory online stops using is kept
    /// (that is the reservation), and use growing into it needs no new memory.
    pub(super) reserved: u64,
    /// Timestamps of the events inside the window, oldest first.
    events: VecDeque<Duration>,
    pub(super) total_events: u64,
    /// The most handles online can ever hold (the pool's size on its GPU).
    pub(super) capacity: u64,
}

impl ReservationController {
    /// A controller at `min_headroom` and `t_initial`, or the config's first problem.
    pub fn new(cfg: ReservationConfig) -> Result<Self, ConfigError> {
        cfg.validate()?;
        Ok(ReservationController {
            cfg,
            headroom: cfg.min_headroom,
            interval: cfg.t_initial,
            now: None,
            next_decrease: Duration::ZERO,
            last_t_change: Duration::ZERO,
            balance: 0.0,
            prev_event_headroom: None,
            last_used: 0,
            last_target: 0,
            reserved: 0,
            events: VecDeque::new(),
            total_events: 0,
            capacity: u64::MAX,
        })
    }

    /// Caps what online is asked to hold, and the headroom, at `handles`: the pool's size on
    /// online's GPU. A reservation above what can be mapped would have to decay below the pool's
    /// size, one handle per T, before a single handle went back to offline.
    pub fn with_capacity(mut self, handles: u64) -> Self {
        self.capacity = handles.max(1);
        self.headroom = self.headroom.min(self.capacity);
        self
    }

    /// Feeds one observation of online's memory; returns what online should have mapped.
    ///
    /// `now` is a monotonic timestamp from any fixed origin; one earlier than the latest seen is
    /// taken as the latest seen. `mapped_bytes` is what the pool has mapped for online now;
    /// pressure is judged against the larger of it and the last target, so while the pool is
    /// still mapping (or cannot map: the GPU is full), the same shortage is not counted again
    /// until use reaches `pressure_fraction` of the last target. Call it whenever online's use
    /// changes and at least every few `t_min`: the headroom shrinks by at most one handle a call.
    ///
    /// Every pressure event counts toward the rate here, as if the pool had no spare memory (each
    /// growth reclaims); [`ReservationController::observe_with_spare`] says otherwise.
    pub fn observe(&mut self, now: Duration, used_bytes: u64, mapped_bytes: u64) -> Decision {
        self.observe_with_spare(now, used_bytes, mapped_bytes, || 0)
    }

    /// [`ReservationController::observe`], where the pool can lend `spare_handles()` more without
    /// reclaiming (free or not yet created); asked only at a pressure event, since the pool reads
    /// the device's free memory for it. A pressure event whose growth fits in them still
    /// grows the headroom, but it is no reclamation: it does not count toward the rate, the
    /// balance or T. On the H100, two such events (short requests while the pool had free
    /// handles) each doubled T before a burst, and the burst's reservation then decayed at one
    /// handle per 4.8 s.
    pub fn observe_with_spare(
        &mut self,
        now: Duration,
        used_bytes: u64,
        mapped_bytes: u64,
        spare_handles: impl FnOnce() -> u64,
    ) -> Decision {
        if self.now.is_none() {
            self.last_used = used_bytes; // what online starts with is not a jump to cover
        }
        let now = self.advance_clock(now);
        let asked = self.last_target.saturating_mul(self.cfg.handle_bytes);
        let pressure = self.is_pressure(used_bytes, mapped_bytes.max(asked));
        let growth = used_bytes.saturating_sub(self.last_used);
        self.last_used = used_bytes;
        let base = self.base_handles(used_bytes);
        if pressure {
            let at_event = self.headroom;
            self.headroom = self.grown_headroom(growth.div_ceil(self.cfg.handle_bytes));
            self.reserved = base.saturating_add(self.headroom);
            let need = self
                .reserved
                .min(self.capacity)
                .saturating_sub(mapped_bytes / self.cfg.handle_bytes);
            if need > 0 && need > spare_handles() {
                self.count_event(now, at_event);
            }
            self.next_decrease = now.saturating_add(self.interval);
        } else if self.on_quiet(now) && self.reserved > base.saturating_add(self.cfg.min_headroom) {
            self.reserved -= 1;
        }
        // Never less than use plus the floor headroom, never more than the pool has.
        self.reserved = self
            .reserved
            .max(base.saturating_add(self.cfg.min_headroom))
            .min(self.capacity);
        let target = self.reserved;
        self.last_target = target;
        Decision {
            target_mapped_handles: target,
            pressure,
            headroom_handles: self.headroom,
            interval: self.interval,
        }
    }

    /// The configuration this controller runs with.
    pub fn config(&self) -> &ReservationConfig {
        &self.cfg
    }

    /// The handles online was last asked to hold (0 before the first observation).
    pub fn target_handles(&self) -> u64 {
        self.last_target
    }

    /// The current headroom, in handles.
    pub fn headroom_handles(&self) -> u64 {
        self.headroom
    }

    /// The current interval T.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Pressure events inside the sliding window, as of the latest observation.
    pub fn events_in_window(&self) -> usize {
        self.events.len()
    }

    /// Pressure events per minute over the sliding window, as of the latest observation (the
    /// window's full length is the denominator, also during the first window).
    pub fn event_rate_per_min(&self) -> f64 {
        self.events.len() as f64 * 60.0 / self.cfg.window.as_secs_f64()
    }

    /// The rate balance, in events: positive when events have outrun the target recently.
    pub fn balance_events(&self) -> f64 {
        self.balance
    }

    /// Pressure events since the controller was built.
    pub fn total_events(&self) -> u64 {
        self.total_events
    }

    /// The pressure-free base: the fewest handles whose bytes keep `used_bytes` below
    /// `pressure_fraction` of them (0 for no use; at most `u64::MAX / handle_bytes`).
    pub fn base_handles(&self, used_bytes: u64) -> u64 {
        if used_bytes == 0 {
            return 0;
        }
        let hs = self.cfg.handle_bytes;
        let max_m = u64::MAX / hs; // the most handles whose bytes a u64 can count
        let per_handle = self.cfg.pressure_fraction * hs as f64;
        // The float estimate is off by at most a handle or two; settle it with the predicate.
        let mut m = ((used_bytes as f64 / per_handle) as u64)
            .saturating_add(1)
            .min(max_m);
        while m > 1 && !self.is_pressure(used_bytes, (m - 1) * hs) {
            m -= 1;
        }
        while m < max_m && self.is_pressure(used_bytes, m * hs) {
            m += 1;
        }
        m
    }

    pub(super) fn is_pressure(&self, used_bytes: u64, mapped_bytes: u64) -> bool {
        used_bytes > 0 && used_bytes as f64 >= self.cfg.pressure_fraction * mapped_bytes as f64
    }

    /// Moves the clock to `now` (never backwards): drains the balance and expires old events.
    fn advance_clock(&mut self, now: Duration) -> Duration {
        let Some(prev) = self.now else {
            self.now = Some(now);
            self.next_decrease = now.saturating_add(self.interval);
            self.last_t_change = now;
            return now;
        };
        let now = now.max(prev);
        self.now = Some(now);
        let drained = (now - prev).as_secs_f64() * self.cfg.target_rate_per_min / 60.0;
        self.balance = (self.balance - drained).max(-self.cfg.balance_limit());
        while let Some(&t) = self.events.front() {
            if now - t < self.cfg.window {
                break;
            }
            self.events.pop_front();
        }
        now
    }

    /// A pressure event that reclaims, found with `at_event` handles of headroom: it counts
    /// toward the rate, and T grows if events are over the target and the headroom had decayed
    /// to at most where it stood at the previous reclaiming event (the decrease ate all of that
    /// growth). Events spare memory served are left out of that comparison: on the H100 such an
    /// event often came first in a burst, grew the headroom a little, and then every reclaim of
    /// the burst found more headroom than it, so T grew at 2 of about 9 bursts over the target.
    fn count_event(&mut self, now: Duration, at_event: u64) {
        let decayed = self
            .prev_event_headroom
            .is_some_and(|prev| at_event <= prev);
        self.prev_event_headroom = Some(at_event);
        self.events.push_back(now);
        self.total_events += 1;
        self.balance = (self.balance + 1.0).min(self.cfg.balance_limit());
        if decayed && self.balance > 0.0 {
            let longer = self.interval.as_secs_f64() * self.cfg.t_growth;
            let longer = Duration::try_from_secs_f64(longer).unwrap_or(self.cfg.t_max);
            self.interval = longer.min(self.cfg.t_max);
            self.last_t_change = now;
        }
    }

    fn grown_headroom(&self, growth_handles: u64) -> u64 {
        let max = self.cfg.max_headroom;
        let scaled = (self.headroom as f64 * self.cfg.growth_factor).ceil();
        let scaled = if scaled >= max as f64 {
            max
        } else {
            scaled as u64
        };
        let at_least = self.headroom.saturating_add(1).max(growth_handles);
        scaled.max(at_least).min(max).min(self.capacity)
    }

    /// No pressure: the headroom shrinks one handle per T (true when it did now), and T may
    /// shorten.
    fn on_quiet(&mut self, now: Duration) -> bool {
        let tick = now >= self.next_decrease;
        if tick {
            self.headroom = self.headroom.saturating_sub(1).max(self.cfg.min_headroom);
            self.next_decrease = now.saturating_add(self.interval);
        }
        let gap_passed = now - self.last_t_change >= self.cfg.target_gap();
        if gap_passed && self.balance <= 0.0 && self.interval > self.cfg.t_min {
            let shorter = self.interval.saturating_sub(self.cfg.t_step);
            self.interval = shorter.max(self.cfg.t_min);
            self.last_t_change = now;
        }
        tick
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::reservation::simulation::{at, bytes, cfg, Rng, HS, STEP, STEPS_PER_MIN};

    #[test]
    fn base_is_the_fewest_handles_without_pressure() {
        let c = ReservationConfig {
            handle_bytes: 1000,
            pressure_fraction: 0.75,
            ..cfg()
        };
        let ctl = ReservationController::new(c).unwrap();
        for (used, base) in [(0, 0), (1, 1), (749, 1), (750, 2), (1499, 2), (1500, 3)] {
            assert_eq!(ctl.base_handles(used), base, "used {used}");
        }
        let ctl = ReservationController::new(cfg()).unwrap();
        let mut rng = Rng::new(3);
        for _ in 0..10_000 {
            let used = (rng.next_u64() >> 1) >> (rng.next_u64() % 63);
            let base = ctl.base_handles(used);
            assert!(
                !ctl.is_pressure(used, base.saturating_mul(HS)),
                "used {used}"
            );
            assert!(
                base <= 1 || ctl.is_pressure(used, (base - 1) * HS),
                "used {used}"
            );
        }
        assert_eq!(ctl.base_handles(u64::MAX), u64::MAX / HS, "saturates");
    }

    #[test]
    fn pressure_is_used_reaching_ninety_percent_of_mapped() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        assert!(
            !ctl.observe(at(0), 0, 0).pressure,
            "no use is never pressure"
        );
        let mut ctl2 = ctl.clone();
        assert!(!ctl.observe(at(1), 9 * HS - 1, 10 * HS).pressure);
        assert!(ctl2.observe(at(1), 9 * HS, 10 * HS).pressure);
    }

    #[test]
    fn growth_multiplies_by_at_least_one_handle_and_caps() {
        let c = ReservationConfig {
            growth_factor: 1.5,
            max_headroom: 10,
            ..cfg()
        };
        let mut ctl = ReservationController::new(c).unwrap();
        for (from, to) in [(1, 2), (2, 3), (3, 5), (5, 8), (8, 10), (10, 10)] {
            ctl.headroom = from;
            assert_eq!(ctl.grown_headroom(0), to, "from {from}");
        }
        ctl.headroom = 2;
        assert_eq!(ctl.grown_headroom(7), 7, "at least the growth in use");
        assert_eq!(ctl.grown_headroom(70), 10, "capped");
    }

    #[test]
    fn an_event_makes_the_headroom_cover_the_jump_that_caused_it() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let d = ctl.observe(at(0), 10 * HS, 12 * HS);
        assert!(!d.pressure);
        let d = ctl.observe(at(1), 50 * HS, d.target_mapped_handles * HS);
        assert!(d.pressure);
        assert_eq!(d.headroom_handles, 40);
        assert_eq!(d.target_mapped_handles, ctl.base_handles(50 * HS) + 40);
        // What online uses at its first observation is not a jump.
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let d = ctl.observe(at(0), 50 * HS, 0);
        assert!(d.pressure);
        assert_eq!(d.headroom_handles, 2);
    }

    /// The reservation is memory, not a margin over current use: when a burst ends, what online
    /// held stays (shrinking one handle per T), so the next burst of the same size needs none.
    #[test]
    fn memory_freed_by_a_burst_is_kept_for_the_next_one() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let mut mapped = 0;
        let mut now = Duration::ZERO;
        let mut step = |ctl: &mut ReservationController, used: u64| {
            now += STEP;
            let d = ctl.observe(now, used * HS, mapped);
            mapped = d.target_mapped_handles * HS;
            d
        };
        step(&mut ctl, 10);
        let burst = step(&mut ctl, 50);
        assert!(burst.pressure, "the first burst is a pressure event");
        let held = burst.target_mapped_handles;
        for _ in 0..50 {
            let d = step(&mut ctl, 10); // the burst is over for half a second
            assert!(
                d.target_mapped_handles >= held - 1,
                "memory kept: {} of {held}",
                d.target_mapped_handles
            );
        }
        let again = step(&mut ctl, 50);
        assert!(
            !again.pressure,
            "the same burst again fits in what was kept"
        );
    }

    /// One observation every [`STEP`], the pool mapping what the last one asked for.
    struct Feed {
        now: Duration,
        mapped: u64,
    }

    impl Feed {
        fn new() -> Self {
            Feed {
                now: Duration::ZERO,
                mapped: 0,
            }
        }

        fn step(&mut self, ctl: &mut ReservationController, used_handles: u64) -> Decision {
            self.now += STEP;
            let d = ctl.observe(self.now, used_handles * HS, self.mapped);
            self.mapped = d.target_mapped_handles * HS;
            d
        }
    }

    #[test]
    fn a_burst_that_fills_the_pool_gives_handles_back_from_the_first_quiet_interval() {
        // The membench trace on the H100: online jumps to 165 of a 192-handle pool. Uncapped, the
        // reservation climbed above 192 and had to decay there, one handle a second, before
        // offline got anything back: online held the whole pool, idle, for 30 s.
        let capacity = 192;
        let burst = [1, 8, 25, 60, 120, 165];
        let mut ctl = ReservationController::new(cfg())
            .unwrap()
            .with_capacity(capacity);
        let mut feed = Feed::new();
        for used in burst {
            let d = feed.step(&mut ctl, used);
            assert!(d.target_mapped_handles <= capacity, "{d:?}");
            assert!(d.headroom_handles <= capacity, "{d:?}");
        }
        assert_eq!(feed.mapped / HS, capacity, "the burst took the whole pool");
        // The burst ends; one interval T (1 s) later a handle goes back, and one per T after.
        let held: Vec<u64> = (0..300)
            .map(|_| feed.step(&mut ctl, 0).target_mapped_handles)
            .collect();
        let first = held.iter().position(|&h| h < capacity);
        assert!(first.is_some_and(|i| i < 100), "{:?}", &held[90..110]);
        assert_eq!(held[299], capacity - 3, "one per T");
        // Uncapped, the same burst leaves a reservation far above the pool.
        let mut uncapped = ReservationController::new(cfg()).unwrap();
        let mut feed = Feed::new();
        for used in burst {
            feed.step(&mut uncapped, used);
        }
        assert!(feed.mapped / HS > capacity, "{}", feed.mapped / HS);
    }

    #[test]
    fn pressure_served_from_spare_memory_grows_the_headroom_but_is_no_reclamation() {
        // run 10 of the fourth H100 session: short requests at the floor reservation, with free
        // handles in the pool. Counted as reclamations, two of them doubled T before a burst.
        let events = |spare: u64| {
            let mut ctl = ReservationController::new(cfg())
                .unwrap()
                .with_capacity(192);
            let (mut now, mut mapped) = (Duration::ZERO, 0);
            ctl.observe_with_spare(now, 0, 0, || spare);
            for _ in 0..4 {
                now += Duration::from_secs(3);
                // A request that uses all online holds: pressure.
                let d = ctl.observe_with_spare(now, mapped.max(1) * HS, mapped * HS, || spare);
                assert!(d.pressure, "{d:?}");
                assert!(
                    d.headroom_handles >= 2,
                    "pressure grows the headroom: {d:?}"
                );
                mapped = d.target_mapped_handles;
                // Online's requests end: use and the reservation decay back to the floor.
                for _ in 0..300 {
                    now += STEP;
                    mapped = ctl
                        .observe_with_spare(now, 0, mapped * HS, || spare)
                        .target_mapped_handles;
                }
            }
            ctl
        };
        let spare = events(100);
        assert_eq!((spare.total_events(), spare.events_in_window()), (0, 0));
        assert_eq!(spare.interval(), cfg().t_initial, "no reclamation: T stays");
        assert!(spare.balance_events() <= 0.0);
        let none = events(0);
        assert_eq!(
            none.total_events(),
            4,
            "with nothing spare each event reclaims"
        );
        assert!(none.interval() > cfg().t_initial, "and T grows");
        // An event whose growth does not fit in what is spare reclaims, and counts.
        let mut ctl = events(100);
        let d = ctl.observe_with_spare(Duration::from_secs(100), 40 * HS, 2 * HS, || 10);
        assert!(d.pressure && d.target_mapped_handles > 12, "{d:?}");
        assert_eq!(ctl.total_events(), 1);
    }

    #[test]
    fn headroom_shrinks_one_handle_per_interval_down_to_the_floor() {
        let one = Duration::from_secs(1);
        let c = ReservationConfig {
            t_min: one,
            t_initial: one,
            t_max: one,
            ..cfg()
        };
        let mut ctl = ReservationController::new(c).unwrap();
        let used = 100 * HS;
        ctl.headroom = 5;
        ctl.reserved = ctl.base_handles(used) + 5; // as a pressure event at this use leaves it
        let mut mapped = (ctl.base_handles(used) + 5) * HS;
        let mut seen = Vec::new();
        for i in 0..=600u64 {
            let d = ctl.observe(at(i), used, mapped);
            mapped = d.target_mapped_handles * HS;
            assert!(!d.pressure);
            assert_eq!(
                d.target_mapped_handles,
                ctl.base_handles(used) + d.headroom_handles
            );
            if i % 100 == 99 || i % 100 == 0 {
                seen.push((i, d.headroom_handles));
            }
        }
        let expect = [
            (0, 5),
            (99, 5),
            (100, 4),
            (199, 4),
            (200, 3),
            (299, 3),
            (300, 2),
        ];
        assert_eq!(&seen[..7], &expect);
        assert_eq!(
            &seen[7..],
            &[(399, 2), (400, 1), (499, 1), (500, 1), (599, 1), (600, 1)]
        );
    }

    #[test]
    fn an_observation_while_the_pool_is_still_mapping_is_not_a_second_event() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let d = ctl.observe(at(0), 10 * HS, 12 * HS);
        let stale = d.target_mapped_handles * HS;
        assert!(ctl.observe(at(1), 40 * HS, stale).pressure);
        assert!(
            !ctl.observe(at(2), 40 * HS, stale).pressure,
            "pool has not mapped yet"
        );
        assert_eq!(ctl.total_events(), 1);
    }

    #[test]
    fn a_clock_going_backwards_is_taken_as_the_latest_time() {
        let one = Duration::from_secs(1);
        let c = ReservationConfig {
            t_min: one,
            t_initial: one,
            t_max: one,
            ..cfg()
        };
        let mut ctl = ReservationController::new(c).unwrap();
        ctl.headroom = 5;
        ctl.observe(Duration::from_secs(10), HS, 2 * HS);
        let d = ctl.observe(Duration::from_secs(5), HS, 2 * HS);
        assert_eq!(d.headroom_handles, 5);
        let d = ctl.observe(Duration::from_millis(10_990), HS, 2 * HS);
        assert_eq!(
            d.headroom_handles, 5,
            "the first decrease is due 1 s after 10 s"
        );
        let d = ctl.observe(Duration::from_secs(11), HS, 2 * HS);
        assert_eq!(d.headroom_handles, 4);
    }

    /// Observes online using all it was last given: a pressure event whose growth in use is only
    /// the headroom, so the growth rule is the plain multiplication.
    fn use_everything(ctl: &mut ReservationController, now: Duration) -> Decision {
        let used = ctl.last_target * HS;
        let d = ctl.observe(now, used, used);
        assert!(d.pressure);
        d
    }

    /// Steady use at the last level for `secs` seconds, observed every 10 ms.
    fn quiet(ctl: &mut ReservationController, from: Duration, secs: u64) -> Duration {
        let used = ctl.last_used;
        let mut now = from;
        for _ in 0..secs * 100 {
            now += STEP;
            let mapped = ctl.last_target * HS;
            assert!(!ctl.observe(now, used, mapped).pressure);
        }
        now
    }

    #[test]
    fn t_grows_only_for_events_after_the_headroom_decayed_with_events_over_target() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let t0 = cfg().t_initial;
        ctl.observe(at(0), 0, 0);
        // A ramp: each event finds more headroom than the last one did.
        for (i, h) in [(1, 1), (2, 2), (3, 4)] {
            assert_eq!(ctl.headroom_handles(), h);
            let d = use_everything(&mut ctl, at(i));
            assert_eq!(
                (d.headroom_handles, d.interval),
                (2 * h, t0),
                "ramp events keep T"
            );
        }
        assert!(ctl.balance_events() > 2.0);
        // The headroom decays from 8 to 4 in 4 s (T = 1 s); the next event is the decay's.
        let now = quiet(&mut ctl, at(3), 4);
        assert_eq!(ctl.headroom_handles(), 4);
        let d = use_everything(&mut ctl, now + STEP);
        assert_eq!(d.interval, 2 * t0, "balance > 0 and decayed: T doubles");
        // Ten quiet minutes: the balance goes negative and T shrinks to the floor.
        let now = quiet(&mut ctl, now + STEP, 600);
        assert!(ctl.balance_events() < 0.0);
        assert_eq!(ctl.interval(), cfg().t_min);
        let d = use_everything(&mut ctl, now + STEP);
        assert_eq!(
            d.interval,
            cfg().t_min,
            "under target: an event leaves T alone"
        );
    }

    #[test]
    fn an_event_spare_memory_served_does_not_hide_the_decay_from_the_next_reclaim() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let t0 = cfg().t_initial;
        ctl.observe(at(0), 0, 0);
        for i in 1..=4 {
            use_everything(&mut ctl, at(i)); // a burst: the last reclaim found 8 handles
        }
        let now = quiet(&mut ctl, at(4), 20);
        assert_eq!(
            ctl.headroom_handles(),
            cfg().min_headroom,
            "decayed to the floor"
        );
        assert!(ctl.balance_events() > 0.0);
        // The next burst: its first event is served from spare memory, and grows the headroom.
        let used = ctl.last_target * HS;
        let d = ctl.observe_with_spare(now + STEP, used, used, || 1_000);
        assert!(d.pressure);
        assert_eq!((ctl.total_events(), d.interval), (4, t0), "not a reclaim");
        // Its first reclaim finds 2 handles of headroom, less than the 8 of the last reclaim.
        let d = use_everything(&mut ctl, now + 2 * STEP);
        assert_eq!(ctl.total_events(), 5);
        assert_eq!(
            d.interval,
            2 * t0,
            "over target, decayed since the last reclaim: T doubles"
        );
    }

    #[test]
    fn t_shrinks_by_one_step_per_target_gap_while_under_target() {
        // Target 2/min: one step of 400 ms every 30 s, from 1 s down to the 50 ms floor.
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let mut ts = Vec::new();
        for i in 0..=12_000u64 {
            let d = ctl.observe(at(i), 10 * HS, 12 * HS);
            if [2_999, 3_000, 5_999, 6_000, 8_999, 9_000, 12_000].contains(&i) {
                ts.push(d.interval.as_millis());
            }
        }
        assert_eq!(ts, [1000, 600, 600, 200, 200, 50, 50]);
    }

    #[test]
    fn window_metrics_count_recent_events() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        ctl.observe(at(0), 0, 0);
        for s in [1u64, 10, 50] {
            use_everything(&mut ctl, Duration::from_secs(s));
        }
        assert!(!ctl.observe(Duration::from_secs(55), 0, 0).pressure);
        assert_eq!((ctl.events_in_window(), ctl.event_rate_per_min()), (3, 3.0));
        ctl.observe(Duration::from_millis(61_500), 0, 0);
        assert_eq!(
            ctl.events_in_window(),
            2,
            "the event at 1 s left the 60 s window"
        );
        ctl.observe(Duration::from_secs(111), 0, 0);
        assert_eq!((ctl.events_in_window(), ctl.total_events()), (0, 3));
    }

    #[test]
    fn a_step_up_grows_the_headroom_once_then_it_decays_to_the_floor() {
        let mut ctl = ReservationController::new(cfg()).unwrap();
        let mut mapped = 0;
        let mut events = Vec::new();
        let mut after_step = 0;
        for i in 0..11 * STEPS_PER_MIN {
            let used = bytes(if i < STEPS_PER_MIN { 50.0 } else { 90.0 });
            let d = ctl.observe(at(i), used, mapped);
            assert!(used <= mapped || i == 0 || i == STEPS_PER_MIN, "step {i}");
            mapped = d.target_mapped_handles * HS;
            if d.pressure {
                events.push(i);
            }
            if i == STEPS_PER_MIN {
                after_step = d.headroom_handles;
            }
        }
        assert_eq!(
            events,
            [0, STEPS_PER_MIN],
            "one event at start-up, one at the step"
        );
        assert!(
            after_step >= 40,
            "the headroom covers the 40-handle step: {after_step}"
        );
        assert_eq!(ctl.headroom_handles(), cfg().min_headroom);
    }
}
