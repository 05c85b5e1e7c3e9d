//! The gate's decision logic: preempt offline work when an online request arrives or online
//! launches after idling; resume it once online has been idle for 2x its longest recent gap.
//!
//! "Recent" is a span of time ([`GateConfig::gap_memory`], a minute), not a number of gaps: a
//! server's rare long host pause (4-7 ms beside 3 ms steps on the H100's cb server) must keep the
//! cooldown above it for as long as such pauses recur. Counted over 512 gaps, it was forgotten
//! after under 2 s of decoding (three gaps a step), and the next pause resumed offline
//! mid-request: a second preemption for about 2% of requests at 70% load.
//!
//! Pure and clock-free, so one online request is provably preempted against at most once: it is
//! fed arrival and launch edges, explicit busy/idle signals and ticks, and answers with actions.
//! [`super::runtime`] drives it from the BPF watchers inside the daemon.
//!
//! An arrival (request data reached the online port) preempts at once and counts as online
//! activity. Until a launch follows, offline is held for the arrival hold: 2x the longest recent
//! arrival -> first launch delay (the ceiling until one has been seen), so a request whose
//! server takes a while to parse and schedule it is not resumed against, and a request that
//! never launches anything (a health check) releases offline after the hold. An arrival whose
//! first launch comes after its hold ran out still teaches its delay, so the hold grows to cover
//! a server that is slow to start a request, instead of resuming against such requests forever.

use std::collections::VecDeque;
use std::time::Duration;

use valve::IssueMode;

/// Tuning of the gate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GateConfig {
    /// The shortest cooldown.
    pub cooldown_floor: Duration,
    /// The longest cooldown, and the one used until a first request has been seen to end (before
    /// that, only prefill gaps are known and a short cooldown would resume mid-request). Gaps at
    /// or above it count as "between requests", not iterations.
    pub cooldown_ceiling: Duration,
    /// Cooldown = factor x the longest recent inter-iteration gap (2 in the paper).
    pub gap_factor: f64,
    /// How long an iteration gap counts as recent, before the latest online activity (so the
    /// cooldown can shrink again once long gaps stop).
    pub gap_memory: Duration,
    /// How many recent arrival -> first launch delays the arrival hold is taken over.
    pub delay_window: usize,
    /// A fixed cooldown instead of the learned one (`Some(0)`: resume as soon as a tick finds
    /// online idle, i.e. preempt on every burst of launches and resume at once).
    pub fixed_cooldown: Option<Duration>,
    /// The share of online's idle time (after the learned cooldown) that offline may give up so
    /// that arrivals find it frozen already: the gate holds offline for the longest extra time
    /// that would have cost at most this share over the recent gaps between requests (see
    /// [`hold_within_budget`]). `None`: no hold.
    pub hold_budget: Option<f64>,
    /// Request arrivals on the online ports preempt (launch edges always do).
    pub arrivals: bool,
    /// How several offline GPUs are issued (`None`: measured once on the offline channels).
    pub issue: Option<IssueMode>,
    /// A host thread of an online process waiting for its GPU work keeps online busy.
    pub waits: bool,
    /// The gate thread and the watchers' poll threads run under `SCHED_FIFO` at this priority
    /// (`None`: normal scheduling). See `valve_ebpf::realtime` for why.
    pub realtime: Option<u8>,
    /// The gate thread spins on its inputs and the online ports' arrival counters while
    /// offline runs, instead of sleeping (one CPU then; for hosts where waking an idle CPU
    /// takes milliseconds, as in VMs).
    pub arrival_busy_poll: bool,
}

impl Default for GateConfig {
    fn default() -> Self {
        GateConfig {
            cooldown_floor: Duration::from_millis(1),
            cooldown_ceiling: Duration::from_millis(200),
            gap_factor: 2.0,
            gap_memory: Duration::from_secs(60),
            delay_window: 512,
            fixed_cooldown: None,
            hold_budget: None,
            arrivals: true,
            issue: None,
            waits: true,
            realtime: Some(valve_ebpf::realtime::DEFAULT_PRIORITY),
            arrival_busy_poll: false,
        }
    }
}

/// The largest of the values seen within a span of time: a deque of (time, value) in which
/// each value is larger than every later one, so the front is the maximum of what has not
/// expired. Pushes and expiry are amortised O(1), however many values the span holds.
#[derive(Clone, Debug, Default)]
struct RecentMax {
    entries: VecDeque<(u64, u64)>,
}

/// The most entries a [`RecentMax`] keeps (a strictly falling series of gaps is all kept; past
/// this its oldest, largest, entries go first).
const RECENT_MAX_ENTRIES: usize = 4096;

impl RecentMax {
    /// Records `value` at `ts_ns` and forgets what came before `since_ns`.
    fn push(&mut self, ts_ns: u64, value: u64, since_ns: u64) {
        while self.entries.back().is_some_and(|&(_, v)| v <= value) {
            self.entries.pop_back();
        }
        self.entries.push_back((ts_ns, value));
        while self.entries.len() > RECENT_MAX_ENTRIES
            || self.entries.front().is_some_and(|&(t, _)| t < since_ns)
        {
            self.entries.pop_front();
        }
    }

    /// The largest value recorded at or after `since_ns`.
    fn max_since(&self, since_ns: u64) -> Option<u64> {
        self.entries
            .iter()
            .find(|&&(t, _)| t >= since_ns)
            .map(|&(_, v)| v)
    }

    /// The largest value kept, however old (what the last push left).
    fn largest(&self) -> Option<u64> {
        self.entries.front().map(|&(_, v)| v)
    }

    #[cfg(test)]
    fn clear(&mut self) {
        self.entries.clear();
    }
}

/// How many recent gaps between requests the hold is chosen over.
pub const HOLD_GAPS: usize = 256;
/// Fewer gaps than this: no hold yet (a share of a handful of gaps says little).
pub const HOLD_MIN_GAPS: usize = 8;
/// The longest hold, whatever the gaps say.
pub const HOLD_MAX: Duration = Duration::from_secs(10);

/// The longest extra time `c` that offline could have been held after each of `gaps` (idle
/// times, ns, after the learned cooldown) while giving up at most `budget` of their sum:
/// the largest `c` with `sum(min(g, c)) <= budget * sum(g)`. An arrival whose gap was shorter
/// than `c` would have found offline frozen. With Poisson arrivals the share caught equals the
/// budget; where arrivals cluster, many gaps are short and a small budget catches most of them.
pub fn hold_within_budget(gaps: &[u64], budget: f64) -> u64 {
    let mut sorted = gaps.to_vec();
    sorted.sort_unstable();
    hold_within_budget_sorted(&sorted, budget)
}

/// [`hold_within_budget`] of gaps sorted ascending (the gate sorts into a buffer it keeps, so
/// that its thread never allocates for it).
fn hold_within_budget_sorted(sorted: &[u64], budget: f64) -> u64 {
    if sorted.is_empty() || budget <= 0.0 {
        return 0;
    }
    let total: f64 = sorted.iter().map(|&g| g as f64).sum();
    let allowed = budget.min(1.0) * total;
    let n = sorted.len();
    let mut below = 0.0; // the sum of the gaps shorter than the candidate c
    for (k, &g) in sorted.iter().enumerate() {
        // For c in [previous gap, g]: sum(min(gi, c)) = below + (n - k) * c.
        let c = (allowed - below) / (n - k) as f64;
        if c <= g as f64 {
            return c.max(0.0) as u64;
        }
        below += g as f64;
    }
    sorted[n - 1]
}

/// Online's activity before an arrival, where the gate's own clock may be behind it: while
/// offline is frozen only edges reach the gate, not the launches of a request in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchesBefore {
    /// What the gate has heard is all there was (offline ran: each launch since the resume
    /// was an edge).
    Heard,
    /// The launch counters: online's last activity before the arrival was at this time (0: none).
    Last(u64),
    /// The launch counters: online was active at the arrival, or whether it was cannot be told
    /// (no gap ended; never taken for idle time).
    Busy,
}

/// What the gate wants done now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Disable the offline processes' channels.
    Preempt,
    /// Enable them again.
    Resume,
}

/// What a gate's hold has learned, handed from a stopped gate to the next one on the same
/// online service ([`GatePolicy::seed_hold_history`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HoldHistory {
    /// Gaps between requests past the cooldown (ns), oldest first.
    pub gaps: Vec<u64>,
    /// Online's last activity under the stopped gate (CLOCK_MONOTONIC ns): the gap that spans the
    /// restart is measured from it. Long lulls are the likeliest to span one, and they are most of
    /// the idle time a hold's budget is a share of.
    pub last_activity_ns: Option<u64>,
}

/// The gate's state.
#[derive(Clone, Debug)]
pub struct GatePolicy {
    cfg: GateConfig,
    preempted: bool,
    last_launch_ns: Option<u64>,
    gaps: RecentMax,
    preemptions: u64,
    /// Whether a request has been seen to end (a resume happened): gaps are trusted from then on.
    learned: bool,
    /// A resume happened since the last launch: the gap now ending lies between requests.
    resumed_in_gap: bool,
    /// The serving framework said "busy" and has not said "idle" yet: no resume on ticks.
    pinned: bool,
    /// The earliest arrival not yet followed by a launch.
    pending_arrival_ns: Option<u64>,
    /// Recent arrival -> first launch delays.
    arrival_delays: VecDeque<u64>,
    /// An arrival whose hold ran out before any launch: the next launch edge, if no other
    /// arrival comes first, is taken to be its first one and its delay is learned.
    expired_arrival_ns: Option<u64>,
    /// An arrival whose hold a launch ended before its edge came (while offline is held, edges
    /// come up to the watcher's poll period late): that edge, if it is the arrival's first
    /// launch, teaches the delay.
    launched_arrival_ns: Option<u64>,
    /// An arrival happened since the last launch: the gap now ending lies between requests.
    arrival_in_gap: bool,
    /// Arrival edges seen.
    arrivals: u64,
    /// The first launch of an arrived request whose host has not yet waited for GPU work since:
    /// the prefill's kernels may still be queued on the GPU, however long the host is quiet.
    first_wait_pending: Option<u64>,
    /// Recent gaps between requests past the learned cooldown (ns), for the hold.
    idle_gaps: VecDeque<u64>,
    /// The hold chosen over them (ns), and whether a gap came since it was chosen: it is chosen
    /// again on the next tick, off the arrival's path to the disable.
    hold_ns: u64,
    hold_stale: bool,
    /// The learned cooldown as the last tick read it (ns). The arrival and edge paths compare
    /// with it for the hold, so that nothing before the disable scans the gap memory.
    hold_cooldown_ns: u64,
    /// An earlier gate's last online activity, until this gate's first request gap is noted.
    carried_activity_ns: Option<u64>,
    /// The gaps sorted, when the hold is chosen again (allocated once, as `idle_gaps`).
    hold_sorted: Vec<u64>,
}

impl GatePolicy {
    /// A gate that starts with offline running.
    pub fn new(cfg: GateConfig) -> Self {
        GatePolicy {
            cfg,
            preempted: false,
            last_launch_ns: None,
            gaps: RecentMax::default(),
            preemptions: 0,
            learned: false,
            resumed_in_gap: false,
            pinned: false,
            pending_arrival_ns: None,
            arrival_delays: VecDeque::new(),
            expired_arrival_ns: None,
            launched_arrival_ns: None,
            arrival_in_gap: false,
            arrivals: 0,
            first_wait_pending: None,
            // Never grows past this: nothing allocates on the arrival's path.
            idle_gaps: VecDeque::with_capacity(HOLD_GAPS + 1),
            hold_ns: 0,
            hold_stale: false,
            hold_cooldown_ns: cfg.cooldown_ceiling.as_nanos() as u64,
            carried_activity_ns: None,
            hold_sorted: Vec::with_capacity(HOLD_GAPS),
        }
    }

    /// The cooldown ceiling (also the longest an arrival or a wait can hold offline unanswered).
    pub fn ceiling(&self) -> Duration {
        self.cfg.cooldown_ceiling
    }

    /// Arrival edges seen.
    pub fn arrivals(&self) -> u64 {
        self.arrivals
    }

    /// How long an arrival holds offline preempted while no launch follows it: the gap factor x
    /// the longest recent arrival -> first launch delay, clamped like the cooldown (the ceiling
    /// until a delay has been seen).
    pub fn arrival_hold(&self) -> Duration {
        match self.arrival_delays.iter().copied().max() {
            None => self.cfg.cooldown_ceiling,
            Some(longest) => {
                let ns = (longest as f64 * self.cfg.gap_factor) as u64;
                Duration::from_nanos(ns).clamp(self.cfg.cooldown_floor, self.cfg.cooldown_ceiling)
            }
        }
    }

    /// The first launch of an arrived request that no wait for GPU work has followed yet.
    pub fn first_wait_pending(&self) -> Option<u64> {
        self.first_wait_pending
    }

    /// The arrival still waiting for its first launch, if any.
    pub fn pending_arrival_ns(&self) -> Option<u64> {
        self.pending_arrival_ns
    }

    /// Whether offline is currently preempted.
    pub fn preempted(&self) -> bool {
        self.preempted
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// The current cooldown: the learned one plus the hold (see [`GateConfig::hold_budget`]).
    pub fn cooldown(&self) -> Duration {
        self.learned_cooldown() + self.hold()
    }

    /// The hold chosen for [`GateConfig::hold_budget`] (zero without one, or before
    /// [`HOLD_MIN_GAPS`] gaps between requests).
    pub fn hold(&self) -> Duration {
        Duration::from_nanos(self.hold_ns)
    }

    /// Whether an arrival at `ts_ns` finds offline frozen only because of the hold: a hold is
    /// on, online has been idle past the learned cooldown, and no busy signal pins it.
    pub fn held_at(&self, ts_ns: u64, before: LaunchesBefore) -> bool {
        self.preempted && !self.pinned && self.idle_at(ts_ns, before)
    }

    /// Whether an arrival at `ts_ns` comes after online has been idle past the learned cooldown,
    /// as far as the hold reckons it (false without a hold).
    pub fn idle_at(&self, ts_ns: u64, before: LaunchesBefore) -> bool {
        self.cfg.hold_budget.is_some()
            && self
                .activity_before(ts_ns, before)
                .is_some_and(|last| ts_ns.saturating_sub(last) > self.hold_cooldown_ns)
    }

    /// Online's last activity before `ts_ns`: the gate's own clock where it has heard
    /// everything, else the later of the counters' launch and the gate's own activity before it.
    fn activity_before(&self, ts_ns: u64, before: LaunchesBefore) -> Option<u64> {
        match before {
            LaunchesBefore::Heard => self.last_launch_ns,
            LaunchesBefore::Busy => Some(ts_ns),
            LaunchesBefore::Last(t) => {
                let own = self.last_launch_ns.filter(|&l| l <= ts_ns);
                own.max((t > 0).then_some(t.min(ts_ns)))
            }
        }
    }

    /// Recent gaps between requests the hold is chosen over.
    pub fn idle_gaps(&self) -> usize {
        self.idle_gaps.len()
    }

    /// What the hold has learned: the daemon keeps it when the gate stops, for the next gate on
    /// the same online service.
    pub fn hold_history(&self) -> HoldHistory {
        HoldHistory {
            gaps: self.idle_gaps.iter().copied().collect(),
            last_activity_ns: self.last_launch_ns,
        }
    }

    /// Starts the hold from what an earlier gate learned ([`Self::hold_history`]), as if this gate
    /// had seen it before its own: the newest [`HOLD_GAPS`] gaps are kept, zeros dropped, the hold
    /// is chosen again at the next tick, and the gap from the earlier gate's last activity to this
    /// gate's first request is noted too. A hold needs a long history (docs/gate.md: about 20
    /// minutes of a bursty trace), which a restarted gate would otherwise start without.
    pub fn seed_hold_history(&mut self, history: &HoldHistory) {
        if self.last_launch_ns.is_none() {
            self.carried_activity_ns = history.last_activity_ns;
        }
        // Rebuilt in place: the deque keeps the capacity it was made with, so noting a gap on
        // an arrival's path to the disable never allocates.
        let own: Vec<u64> = self.idle_gaps.drain(..).collect();
        let all: Vec<u64> = history
            .gaps
            .iter()
            .copied()
            .filter(|&g| g > 0)
            .chain(own)
            .collect();
        self.idle_gaps
            .extend(&all[all.len().saturating_sub(HOLD_GAPS)..]);
        self.hold_stale = true;
    }

    /// A request's first activity at `ts_ns`, online's last activity before it at `before`: the
    /// gap, past the learned cooldown, is idle time offline ran in (or would have). Kept for the
    /// hold.
    fn note_request_gap(&mut self, ts_ns: u64, before: Option<u64>) {
        if self.cfg.hold_budget.is_none() {
            return;
        }
        // This gate's first request: the gap since the earlier gate's last activity, if any.
        let carried = self.carried_activity_ns.take();
        let last = match (self.learned, before) {
            (true, last) => last,
            (false, None) => carried.filter(|&c| c <= ts_ns),
            (false, Some(_)) => None,
        };
        let Some(last) = last else {
            return;
        };
        let idle = ts_ns
            .saturating_sub(last)
            .saturating_sub(self.hold_cooldown_ns);
        if idle > 0 {
            self.idle_gaps.push_back(idle);
            if self.idle_gaps.len() > HOLD_GAPS {
                self.idle_gaps.pop_front();
            }
            self.hold_stale = true;
        }
    }

    /// Chooses the hold again where a gap came since. The runtime calls it before it reads the
    /// due time on each tick (sorting the gaps stays off the arrival's path to the disable).
    pub fn refresh_hold(&mut self) {
        let Some(budget) = self.cfg.hold_budget else {
            return;
        };
        self.hold_cooldown_ns = self.learned_cooldown().as_nanos() as u64;
        if !std::mem::take(&mut self.hold_stale) {
            return;
        }
        self.hold_ns = if self.idle_gaps.len() < HOLD_MIN_GAPS {
            0
        } else {
            self.hold_sorted.clear();
            self.hold_sorted.extend(self.idle_gaps.iter().copied());
            self.hold_sorted.sort_unstable();
            hold_within_budget_sorted(&self.hold_sorted, budget).min(HOLD_MAX.as_nanos() as u64)
        };
    }

    /// The learned cooldown: factor x the longest recent inter-iteration gap, clamped.
    pub fn learned_cooldown(&self) -> Duration {
        if let Some(fixed) = self.cfg.fixed_cooldown {
            return fixed;
        }
        if !self.learned {
            return self.cfg.cooldown_ceiling;
        }
        let since = self
            .last_launch_ns
            .unwrap_or(0)
            .saturating_sub(self.cfg.gap_memory.as_nanos() as u64);
        // After a lull longer than the memory, the last gaps known still stand until the next
        // request teaches new ones (the floor would resume against its first decode step).
        let longest = self
            .gaps
            .max_since(since)
            .or_else(|| self.gaps.largest())
            .unwrap_or(0);
        let ns = (longest as f64 * self.cfg.gap_factor) as u64;
        Duration::from_nanos(ns).clamp(self.cfg.cooldown_floor, self.cfg.cooldown_ceiling)
    }

    /// Whether an explicit "busy" signal holds offline preempted.
    pub fn pinned(&self) -> bool {
        self.pinned
    }

    /// The latest online launch seen, if any.
    pub fn last_launch_ns(&self) -> Option<u64> {
        self.last_launch_ns
    }

    /// When a tick would resume offline (`None`: not preempted, pinned, or no activity yet).
    pub fn resume_due_ns(&self) -> Option<u64> {
        if !self.preempted || self.pinned {
            return None;
        }
        let last = self.last_launch_ns?;
        let mut due = last.saturating_add(self.cooldown().as_nanos() as u64);
        if let Some(a) = self.pending_arrival_ns {
            due = due.max(a.saturating_add(self.arrival_hold().as_nanos() as u64));
        }
        Some(due)
    }

    /// Request data reached the online service at `ts_ns` (an arrival edge): preempt now, before
    /// its first kernel, and count it as online activity. Returns [`Action::Preempt`] when
    /// offline is running.
    pub fn on_arrival(&mut self, ts_ns: u64) -> Option<Action> {
        self.on_arrival_after(ts_ns, LaunchesBefore::Heard)
    }

    /// [`Self::on_arrival`], with what the launch counters say of online's activity before it
    /// (a request in flight while offline was frozen sent the gate no edge: its launches would
    /// otherwise look like idle time, and the hold would learn gaps that never were).
    pub fn on_arrival_after(&mut self, ts_ns: u64, before: LaunchesBefore) -> Option<Action> {
        let last = self.activity_before(ts_ns, before);
        self.arrivals += 1;
        // A newer arrival: an expired one launched nothing (a health check), so it teaches nothing.
        self.expired_arrival_ns = None;
        self.launched_arrival_ns = None;
        self.pending_arrival_ns.get_or_insert(ts_ns);
        // Any arrival past the cooldown (a health check that launched nothing too: the request
        // after it is noted from it).
        self.note_request_gap(ts_ns, last);
        self.arrival_in_gap = true;
        self.saw_activity(ts_ns);
        self.preempt()
    }

    /// An online launch at `ts_ns`, the gap measured from the previous launch seen here.
    /// Returns [`Action::Preempt`] on the idle->busy edge.
    pub fn on_launch(&mut self, ts_ns: u64) -> Option<Action> {
        // The gap runs from the last activity of any kind (an arrival too), so it says nothing
        // about when online last launched: no launch is inferred from it.
        let idle = self.last_launch_ns.map(|last| ts_ns.saturating_sub(last));
        self.edge(ts_ns, idle)
    }

    /// An online launch at `ts_ns` after `idle_ns` without one (as the launch watcher reports
    /// idle->busy edges; `None` for a process's first launch). Returns [`Action::Preempt`] when
    /// offline is running.
    pub fn on_edge(&mut self, ts_ns: u64, idle_ns: Option<u64>) -> Option<Action> {
        if let Some(previous) = idle_ns.map(|gap| ts_ns.saturating_sub(gap)) {
            // The launch before this edge. If it came after an arrival (a request in flight
            // kept online busy), that arrival's first launch came then, not now. Taking this
            // edge as its first launch taught holds of 20-112 ms on the H100, where no idle
            // arrival took more than 15 ms to its first kernel.
            self.saw_launch(previous);
            if self.launched_arrival_ns.is_some_and(|a| previous > a) {
                self.launched_arrival_ns = None;
            }
        }
        self.edge(ts_ns, idle_ns)
    }

    /// An idle->busy edge at `ts_ns` after `idle_ns` without online activity.
    fn edge(&mut self, ts_ns: u64, idle_ns: Option<u64>) -> Option<Action> {
        let ceiling = self.cfg.cooldown_ceiling.as_nanos() as u64;
        if let Some(a) = self.pending_arrival_ns.take() {
            self.await_first_wait(ts_ns);
            self.learn_arrival_delay(ts_ns.saturating_sub(a));
        } else if let Some(a) = self.expired_arrival_ns.take() {
            // The first launch of a request resumed against because its hold ran out: learned,
            // so the next request that slow is held through (this one already paid for it).
            self.learn_arrival_delay(ts_ns.saturating_sub(a));
        } else if let Some(a) = self.launched_arrival_ns.take().filter(|&a| ts_ns > a) {
            // Its hold already ended (and its first wait is awaited) from the counters.
            self.learn_arrival_delay(ts_ns - a);
        }
        if let Some(gap) = idle_ns.filter(|&g| g > 0) {
            // A gap a request arrived in lies between requests, not between iterations. Without
            // arrivals a gap the gate resumed in is taken to be one too (with launch times alone
            // an iteration gap longer than the cooldown looks the same). Once arrivals are seen,
            // a resumed gap without one was inside a request: it is learned, or the cooldown
            // would never grow past it and every such gap would cost a preemption.
            // With a hold, a gap between requests may end with offline still held (no resume):
            // one past the learned cooldown is taken to be between requests all the same, or
            // the cooldown would learn it and grow to the ceiling.
            let held = self.cfg.hold_budget.is_some() && gap > self.hold_cooldown_ns;
            let launches_only = self.arrivals == 0;
            let between = self.arrival_in_gap || ((self.resumed_in_gap || held) && launches_only);
            if !between && gap < ceiling {
                let memory = self.cfg.gap_memory.as_nanos() as u64;
                self.gaps.push(ts_ns, gap, ts_ns.saturating_sub(memory));
            }
            if between && launches_only {
                // Without arrivals, a request's first launch ends the gap between requests.
                self.note_request_gap(ts_ns, self.last_launch_ns);
            }
        }
        self.resumed_in_gap = false;
        self.arrival_in_gap = false;
        self.saw_activity(ts_ns);
        self.preempt()
    }

    /// Remembers an arrival -> first launch delay (one at or past the ceiling is not a delay but
    /// an arrival that launched nothing).
    fn learn_arrival_delay(&mut self, delay_ns: u64) {
        if delay_ns < self.cfg.cooldown_ceiling.as_nanos() as u64 {
            self.arrival_delays.push_back(delay_ns);
            if self.arrival_delays.len() > self.cfg.delay_window {
                self.arrival_delays.pop_front();
            }
        }
    }

    /// A launch read from the watcher's counters (not an edge, or an edge not yet delivered):
    /// moves the idle clock forward, and ends the hold of an arrival it follows (its delay is
    /// learned only if the edge of its first launch comes later).
    pub fn saw_launch(&mut self, ts_ns: u64) {
        if self.pending_arrival_ns.is_some_and(|a| ts_ns > a) {
            self.launched_arrival_ns = self.pending_arrival_ns.take();
            self.await_first_wait(ts_ns);
        }
        if self.expired_arrival_ns.is_some_and(|a| ts_ns > a) {
            // Its first launch happened at a time not known: nothing to learn.
            self.expired_arrival_ns = None;
        }
        self.saw_activity(ts_ns);
    }

    /// A request's first launch at `ts_ns`: with waits tracked, hold offline until the host has
    /// waited for GPU work once (its first token comes back that way), or for the ceiling.
    /// A prefill queues milliseconds of kernels; a host that then goes quiet for longer than the
    /// cooldown (measured: 12-20 ms, once in ~100 requests) left them to time-slice with
    /// resumed offline work, which cost the request as long again.
    fn await_first_wait(&mut self, ts_ns: u64) {
        if self.cfg.waits {
            self.first_wait_pending = Some(ts_ns);
        }
    }

    /// A thread of an online process returned from waiting for its GPU work at `ts_ns`: a
    /// request's first launch before it is done, so the request's hold ends.
    pub fn saw_wait_end(&mut self, ts_ns: u64) {
        if self.first_wait_pending.is_some_and(|first| ts_ns > first) {
            self.first_wait_pending = None;
        }
    }

    /// Whether a request's wait for its first token holds offline at `now_ns` (for at most
    /// the ceiling after its first launch). While it does, online counts as active now, as
    /// while one of its threads waits: the resume is put off by one cooldown, and the gate
    /// looks again (for the wait's end) then.
    pub fn hold_for_first_wait(&mut self, now_ns: u64) -> bool {
        let ceiling = self.cfg.cooldown_ceiling.as_nanos() as u64;
        match self.first_wait_pending {
            Some(first) if now_ns < first.saturating_add(ceiling) => {
                self.saw_activity(now_ns);
                true
            }
            Some(_) => {
                self.first_wait_pending = None;
                false
            }
            None => false,
        }
    }

    /// Online activity at `ts_ns` (a launch, an arrival, a busy signal): the idle clock restarts.
    pub fn saw_activity(&mut self, ts_ns: u64) {
        self.last_launch_ns = Some(ts_ns.max(self.last_launch_ns.unwrap_or(0)));
    }

    /// The serving framework says a request is in flight: preempt now and stay preempted until
    /// [`Self::on_idle`], whatever the launch gaps look like.
    pub fn on_busy(&mut self, now_ns: u64) -> Option<Action> {
        self.pinned = true;
        self.saw_activity(now_ns);
        self.preempt()
    }

    /// The serving framework says no request is in flight: resume at once (no cooldown needed,
    /// it knows). The gap now starting lies between requests.
    pub fn on_idle(&mut self) -> Option<Action> {
        self.pinned = false;
        self.preempted.then(|| self.resume())
    }

    /// Offline resumes: a request has been seen to end, and the gap now running lies between
    /// requests (not learned as an iteration gap).
    fn resume(&mut self) -> Action {
        self.preempted = false;
        // An arrival that launched nothing within its hold is over (but its delay may still be
        // learned from the launch that follows), and so is a request's wait for its first
        // token past the ceiling.
        if let Some(a) = self.pending_arrival_ns.take() {
            self.expired_arrival_ns = Some(a);
        }
        self.first_wait_pending = None;
        self.learned = true;
        self.resumed_in_gap = true;
        Action::Resume
    }

    fn preempt(&mut self) -> Option<Action> {
        if self.preempted {
            None
        } else {
            self.preempted = true;
            self.preemptions += 1;
            Some(Action::Preempt)
        }
    }

    /// Time passes (`now_ns`). Returns [`Action::Resume`] once online has been idle for the cooldown.
    pub fn on_tick(&mut self, now_ns: u64) -> Option<Action> {
        self.refresh_hold();
        let due = self.resume_due_ns()?;
        (now_ns >= due && !self.hold_for_first_wait(now_ns)).then(|| self.resume())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;
    const US: u64 = 1_000;

    /// Drives the gate through one request: a prefill burst, then `decode` iterations of a few
    /// launches each separated by `gap`, ticking every 100 us. Returns the actions in order.
    fn request(
        g: &mut GatePolicy,
        start: u64,
        decode: usize,
        gap: u64,
    ) -> (Vec<(u64, Action)>, u64) {
        let mut t = start;
        let mut out = Vec::new();
        let launch = |g: &mut GatePolicy, t: u64, out: &mut Vec<(u64, Action)>| {
            if let Some(a) = g.on_launch(t) {
                out.push((t, a));
            }
        };
        for _ in 0..20 {
            launch(g, t, &mut out);
            t += 5 * US;
        }
        for _ in 0..decode {
            let until = t + gap;
            while t < until {
                if let Some(a) = g.on_tick(t) {
                    out.push((t, a));
                }
                t += 100 * US;
            }
            for _ in 0..4 {
                launch(g, t, &mut out);
                t += 10 * US;
            }
        }
        (out, t)
    }

    #[test]
    fn one_preemption_per_request_and_resume_after_the_cooldown() {
        let mut g = GatePolicy::new(GateConfig::default());
        // First request: nothing learned, so the cooldown is the ceiling (200 ms); one preemption.
        let start = 10 * MS;
        let (actions, end) = request(&mut g, start, 30, 2 * MS);
        assert_eq!(actions, vec![(start, Action::Preempt)], "{actions:?}");
        assert_eq!(g.cooldown(), Duration::from_millis(200));
        assert_eq!(g.on_tick(end + 100 * MS), None);
        assert_eq!(g.on_tick(end + 200 * MS), Some(Action::Resume));
        let mut t = end + 250 * MS;
        for _ in 0..5 {
            let (actions, end) = request(&mut g, t, 30, 2 * MS);
            // Exactly one preemption, at the request's first launch, and no resume inside it.
            assert_eq!(actions, vec![(t, Action::Preempt)], "{actions:?}");
            assert!(g.preempted());
            // The cooldown learned from the 2 ms decode gaps: about 4 ms.
            let cd = g.cooldown();
            assert!(
                cd >= Duration::from_millis(4) && cd < Duration::from_micros(4300),
                "{cd:?}"
            );
            // Idle after the request: resumed once the cooldown has passed, not before.
            assert_eq!(g.on_tick(end + 3 * MS), None);
            assert_eq!(g.on_tick(end + 5 * MS), Some(Action::Resume));
            assert_eq!(g.on_tick(end + 6 * MS), None);
            t = end + 50 * MS;
        }
        assert_eq!(g.preemptions(), 6);
    }

    /// A gate that has seen one request end (so it trusts learned gaps).
    fn learned(cfg: GateConfig) -> GatePolicy {
        let mut g = GatePolicy::new(cfg);
        g.on_launch(0);
        assert_eq!(
            g.on_tick(cfg.cooldown_ceiling.as_nanos() as u64),
            Some(Action::Resume)
        );
        g.last_launch_ns = None;
        g.gaps.clear();
        g.resumed_in_gap = false;
        g
    }

    /// A learned gate after one request that arrived at 0 and launched `delay` later (hold:
    /// 2 x `delay`), resumed once it ended.
    fn after_a_request_with_delay(delay: u64) -> GatePolicy {
        let mut g = learned(GateConfig::default());
        g.on_arrival(0);
        g.on_edge(delay, None);
        g.saw_wait_end(delay + MS);
        assert_eq!(g.on_tick(delay + 6 * MS), Some(Action::Resume));
        g
    }

    #[test]
    fn cooldown_starts_at_the_ceiling_and_is_clamped() {
        let cfg = GateConfig {
            cooldown_floor: Duration::from_millis(1),
            cooldown_ceiling: Duration::from_millis(10),
            ..GateConfig::default()
        };
        assert_eq!(GatePolicy::new(cfg).cooldown(), Duration::from_millis(10));
        let mut g = learned(cfg);
        assert_eq!(g.cooldown(), Duration::from_millis(1));
        g.on_launch(0);
        g.on_launch(100 * US); // 2 x 0.1 ms is below the floor
        assert_eq!(g.cooldown(), Duration::from_millis(1));
        g.on_launch(100 * US + 8 * MS); // 2 x 8 ms is above the ceiling
        assert_eq!(g.cooldown(), Duration::from_millis(10));
        // A gap at or above the ceiling is between requests: not learned.
        let mut h = learned(cfg);
        h.on_launch(0);
        h.on_launch(50 * MS);
        assert_eq!(h.cooldown(), Duration::from_millis(1));
    }

    #[test]
    fn the_memory_lets_the_cooldown_shrink_again() {
        let cfg = GateConfig {
            gap_memory: Duration::from_millis(100),
            ..GateConfig::default()
        };
        let mut g = learned(cfg);
        let mut t = 0;
        g.on_launch(t);
        t += 20 * MS;
        g.on_launch(t); // one long iteration gap
        assert_eq!(g.cooldown(), Duration::from_millis(40));
        for _ in 0..100 {
            t += MS;
            g.on_launch(t);
        }
        assert_eq!(
            g.cooldown(),
            Duration::from_millis(40),
            "100 ms later it is still recent"
        );
        t += MS;
        g.on_launch(t);
        assert_eq!(
            g.cooldown(),
            Duration::from_millis(2),
            "101 ms later it is not"
        );
    }

    /// The cb server on the H100 decodes in ~9.6 ms steps with three gaps each (0.5, 1.3 and
    /// ~3 ms of host time), and now and then a host pause twice as long. A 512-gap window forgot
    /// such a pause within 2 s; the next one then outlasted the cooldown mid-request.
    #[test]
    fn a_rare_long_pause_keeps_the_cooldown_above_it_for_the_whole_memory() {
        let mut g = learned(GateConfig::default());
        let mut t = 0;
        g.on_launch(t);
        let preemptions = g.preemptions();
        let step = |g: &mut GatePolicy, t: &mut u64, host_gap: u64| {
            for gap in [500 * US, 1_300 * US, host_gap] {
                *t += gap;
                assert_eq!(g.on_launch(*t), None, "online is busy: no decision");
                assert_eq!(g.on_tick(*t + gap / 2), None, "no resume inside a step");
            }
        };
        step(&mut g, &mut t, 6_600 * US); // a pause
        for _ in 0..2_000 {
            step(&mut g, &mut t, 3 * MS); // 6000 ordinary gaps over ~10 s
        }
        assert_eq!(g.cooldown(), Duration::from_micros(13_200));
        // The next pause, as long as the first, does not resume offline.
        assert_eq!(g.on_tick(t + 6_600 * US), None);
        assert_eq!(g.preemptions(), preemptions);
    }

    #[test]
    fn recent_max_keeps_the_largest_unexpired_value() {
        let mut m = RecentMax::default();
        m.push(0, 5, 0);
        m.push(10, 3, 0);
        m.push(20, 4, 0);
        assert_eq!(m.max_since(0), Some(5));
        assert_eq!(m.max_since(1), Some(4));
        assert_eq!(m.max_since(21), None);
        m.push(30, 1, 15); // forgets what came before 15
        assert_eq!(m.max_since(0), Some(4));
        assert_eq!(
            m.entries.len(),
            2,
            "3 was dropped when 4 came: it can never be the max"
        );
        for i in 0..(RECENT_MAX_ENTRIES as u64 + 10) {
            m.push(100 + i, u64::MAX - i, 0); // strictly falling: every one is kept, up to the cap
        }
        assert_eq!(m.entries.len(), RECENT_MAX_ENTRIES);
    }

    #[test]
    fn ticks_before_any_launch_do_nothing() {
        let mut g = GatePolicy::new(GateConfig::default());
        assert_eq!(g.on_tick(123 * MS), None);
        assert!(!g.preempted());
    }

    #[test]
    fn edges_carry_their_own_gap() {
        let mut g = learned(GateConfig::default());
        assert_eq!(g.on_edge(10 * MS, None), Some(Action::Preempt));
        // Launches between edges only move the clock; the next edge's idle gap is what is learned.
        g.saw_launch(10 * MS + 20 * US);
        assert_eq!(g.on_edge(12 * MS, Some(1_980 * US)), None);
        assert_eq!(g.cooldown(), Duration::from_micros(3_960));
        assert_eq!(g.resume_due_ns(), Some(12 * MS + 3_960 * US));
        g.saw_launch(13 * MS);
        assert_eq!(
            g.on_tick(16 * MS),
            None,
            "the idle clock restarted at 13 ms"
        );
        assert_eq!(g.on_tick(13 * MS + 3_960 * US), Some(Action::Resume));
    }

    #[test]
    fn busy_pins_until_idle_and_idle_resumes_at_once() {
        let mut g = GatePolicy::new(GateConfig::default());
        assert_eq!(g.on_busy(MS), Some(Action::Preempt));
        assert!(g.pinned());
        // Launches and long silences do not resume a pinned gate.
        assert_eq!(g.on_edge(2 * MS, Some(MS)), None);
        assert_eq!(g.on_tick(10_000 * MS), None);
        assert_eq!(g.resume_due_ns(), None);
        assert_eq!(g.on_idle(), Some(Action::Resume));
        assert!(!g.preempted() && !g.pinned());
        assert_eq!(g.on_idle(), None, "idle twice is harmless");
        // The gap after an explicit idle is between requests: only the 1 ms one is learned.
        assert_eq!(g.on_edge(150 * MS, Some(148 * MS)), Some(Action::Preempt));
        assert_eq!(g.cooldown(), Duration::from_millis(2));
        assert_eq!(g.preemptions(), 2);
    }

    #[test]
    fn an_arrival_preempts_before_the_first_launch_and_holds_until_it() {
        let mut g = learned(GateConfig::default());
        // A request: data arrives, 3 ms of parsing and scheduling, then decode iterations 1 ms
        // apart. Offline stops at the arrival; the first launch finds it stopped.
        assert_eq!(g.on_arrival(10 * MS), Some(Action::Preempt));
        assert_eq!(g.pending_arrival_ns(), Some(10 * MS));
        // Not learned yet: the hold is the ceiling, so no resume before the first launch.
        assert_eq!(g.arrival_hold(), Duration::from_millis(200));
        assert_eq!(g.on_tick(12 * MS), None);
        assert_eq!(g.on_edge(13 * MS, Some(50 * MS)), None, "already stopped");
        assert_eq!(g.pending_arrival_ns(), None);
        // Its first token comes back through a wait for the GPU: the request's hold ends.
        assert_eq!(g.first_wait_pending(), Some(13 * MS));
        g.saw_wait_end(13 * MS + 500 * US);
        assert_eq!(g.first_wait_pending(), None);
        assert_eq!(
            g.arrival_hold(),
            Duration::from_millis(6),
            "2 x the 3 ms delay"
        );
        // The idle gap before the request's first launch is between requests: not learned.
        assert_eq!(
            g.cooldown(),
            Duration::from_millis(1),
            "nothing learned: floor"
        );
        for i in 1..=5 {
            assert_eq!(g.on_edge(13 * MS + i * MS, Some(MS - 10 * US)), None);
        }
        assert_eq!(g.cooldown(), Duration::from_micros(1_980));
        // The request ends at 18 ms: resumed after the cooldown.
        assert_eq!(g.on_tick(19 * MS), None);
        assert_eq!(g.on_tick(20 * MS), Some(Action::Resume));
        // The next request: again one preemption, at its arrival.
        assert_eq!(g.on_arrival(50 * MS), Some(Action::Preempt));
        assert_eq!(g.preemptions(), 3);
        assert_eq!(g.arrivals(), 2);
    }

    #[test]
    fn with_arrivals_a_gap_resumed_in_without_one_is_learned() {
        let mut g = learned(GateConfig::default());
        g.on_arrival(0);
        g.on_edge(MS, None);
        g.saw_wait_end(MS + 50 * US); // its first token
        assert_eq!(
            g.cooldown(),
            Duration::from_millis(1),
            "floor: nothing learned yet"
        );
        // A 3 ms pause inside the request: resumed after the 1 ms cooldown, then the launch
        // preempts again, and the pause is learned (no request arrived in it).
        assert_eq!(g.on_tick(2 * MS + 100 * US), Some(Action::Resume));
        assert_eq!(g.on_edge(4 * MS, Some(3 * MS)), Some(Action::Preempt));
        assert_eq!(g.cooldown(), Duration::from_millis(6));
        // Without arrivals the same gap is taken to be between requests.
        let mut h = learned(GateConfig::default());
        h.on_edge(0, None);
        assert_eq!(h.on_tick(MS + 100 * US), Some(Action::Resume));
        h.on_edge(4 * MS, Some(3 * MS));
        assert_eq!(h.cooldown(), Duration::from_millis(1));
    }

    #[test]
    fn an_edge_that_comes_after_the_counters_showed_its_launch_still_teaches_the_delay() {
        // Offline held: the first launch's edge (at 13 ms) reaches the gate after a tick read
        // the counters (latest launch 14 ms). The arrival's hold ends then; the edge, the
        // arrival's first launch (the launch before it came at 5 ms), teaches its 3 ms.
        let mut g = learned(GateConfig::default());
        assert_eq!(
            g.arrival_hold(),
            Duration::from_millis(200),
            "nothing learned"
        );
        g.on_arrival(10 * MS);
        g.saw_launch(14 * MS);
        assert_eq!(g.pending_arrival_ns(), None);
        assert_eq!(g.first_wait_pending(), Some(14 * MS));
        g.saw_wait_end(15 * MS);
        assert_eq!(g.on_edge(13 * MS, Some(8 * MS)), None);
        assert_eq!(g.arrival_hold(), Duration::from_millis(6), "2 x 3 ms");
        assert_eq!(
            g.first_wait_pending(),
            None,
            "its first wait is not awaited again"
        );
        // An edge after a launch that followed the arrival is not its first launch: nothing.
        let mut h = learned(GateConfig::default());
        h.on_arrival(10 * MS);
        h.saw_launch(12 * MS);
        h.on_edge(30 * MS, Some(10 * MS));
        assert_eq!(h.arrival_hold(), Duration::from_millis(200));
        // Nor is one after a newer arrival's.
        h.on_arrival(40 * MS);
        h.saw_launch(41 * MS);
        h.on_arrival(50 * MS);
        h.on_edge(52 * MS, None);
        assert_eq!(
            h.arrival_hold(),
            Duration::from_millis(4),
            "2 x 2 ms, from 50 ms"
        );
    }

    #[test]
    fn an_arrival_without_launches_releases_offline_after_its_hold() {
        // Hold 8 ms. A health check: data, no GPU work. Held for the arrival hold (longer than
        // the cooldown), then released.
        let mut g = after_a_request_with_delay(4 * MS);
        assert_eq!(g.on_arrival(100 * MS), Some(Action::Preempt));
        assert_eq!(g.resume_due_ns(), Some(108 * MS));
        assert_eq!(g.on_tick(107 * MS), None);
        assert_eq!(g.on_tick(108 * MS), Some(Action::Resume));
        assert_eq!(g.pending_arrival_ns(), None, "the hold is over");
        // Non-edge launches after an arrival end its hold too (the cooldown takes over).
        g.on_arrival(200 * MS);
        g.saw_launch(201 * MS);
        assert_eq!(g.pending_arrival_ns(), None);
        g.saw_wait_end(202 * MS);
        assert_eq!(
            g.resume_due_ns(),
            Some(201 * MS + g.cooldown().as_nanos() as u64)
        );
    }

    #[test]
    fn a_first_launch_after_the_hold_ran_out_teaches_a_hold_that_covers_it() {
        // Hold 16 ms. A request the server takes 20 ms to start (measured: 17-26 ms, a few in
        // 400): its hold runs out first, and its first launch preempts a second time.
        let mut g = after_a_request_with_delay(8 * MS);
        assert_eq!(g.on_arrival(100 * MS), Some(Action::Preempt));
        assert_eq!(g.on_tick(116 * MS), Some(Action::Resume));
        assert_eq!(g.on_edge(120 * MS, Some(20 * MS)), Some(Action::Preempt));
        g.saw_wait_end(121 * MS);
        assert_eq!(g.arrival_hold(), Duration::from_millis(40), "2 x its 20 ms");
        assert_eq!(g.on_tick(130 * MS), Some(Action::Resume));
        // The next one as slow is held through: one preemption.
        assert_eq!(g.on_arrival(300 * MS), Some(Action::Preempt));
        assert_eq!(g.on_tick(316 * MS), None);
        assert_eq!(g.on_edge(320 * MS, Some(190 * MS)), None, "still stopped");
        assert_eq!(g.preemptions(), 5);
    }

    #[test]
    fn an_expired_arrival_followed_by_another_teaches_nothing() {
        // Hold 8 ms. A health check (no GPU work) expires; a real request then arrives and
        // launches 4 ms later. Only the request's delay is learned, not the 54 ms since the
        // health check.
        let mut g = after_a_request_with_delay(4 * MS);
        g.on_arrival(50 * MS);
        assert_eq!(g.on_tick(58 * MS), Some(Action::Resume));
        g.on_arrival(100 * MS);
        g.on_edge(104 * MS, Some(54 * MS));
        g.saw_wait_end(105 * MS);
        assert_eq!(g.on_tick(120 * MS), Some(Action::Resume));
        // Online launches again without an arrival (another port, a background kernel).
        g.on_edge(130 * MS, Some(26 * MS));
        assert_eq!(g.arrival_hold(), Duration::from_millis(8));
        // A non-edge launch after an expired arrival: its first launch time is unknown.
        g.saw_wait_end(131 * MS);
        assert_eq!(g.on_tick(300 * MS), Some(Action::Resume));
        g.on_arrival(400 * MS);
        // (The 26 ms gap above was learned: cooldown 52 ms, which outlasts the 8 ms hold.)
        assert_eq!(g.on_tick(460 * MS), Some(Action::Resume));
        g.saw_launch(462 * MS);
        g.on_edge(490 * MS, Some(28 * MS));
        assert_eq!(g.arrival_hold(), Duration::from_millis(8));
    }

    #[test]
    fn an_arrival_while_a_request_runs_teaches_no_delay_from_a_later_edge() {
        let mut g = after_a_request_with_delay(4 * MS); // hold 8 ms
        assert_eq!(g.on_arrival(100 * MS), Some(Action::Preempt));
        assert_eq!(g.on_edge(104 * MS, Some(90 * MS)), None);
        // A second request arrives while the first decodes; the server takes it into the running
        // batch, so its first launch is no edge. 50 ms later a 0.3 ms pause in the launches ends
        // in an edge: it is not the second request's first launch (the one before it, 0.3 ms
        // earlier, came after the arrival).
        g.on_arrival(110 * MS);
        g.on_edge(160 * MS, Some(300 * US));
        assert_eq!(g.arrival_hold(), Duration::from_millis(8), "not 2 x 50 ms");
        // An edge whose previous launch came before the arrival is still its first launch.
        g.on_arrival(170 * MS);
        g.on_edge(176 * MS, Some(10 * MS));
        assert_eq!(g.arrival_hold(), Duration::from_millis(12), "2 x its 6 ms");
    }

    #[test]
    fn a_request_holds_offline_until_its_host_has_waited_for_the_gpu_once() {
        // Measured on the H100 (serving bench, cb server): arrival, first launch 4 ms later,
        // then the host quiet for 12.7 ms while the prefill ran on the GPU. Resuming after the
        // 1 ms cooldown let offline time-slice with that prefill: TTFT 25 ms against 12 ms alone.
        let mut g = learned(GateConfig::default());
        assert_eq!(g.on_arrival(0), Some(Action::Preempt));
        assert_eq!(g.on_edge(4 * MS, Some(900 * MS)), None);
        g.saw_activity(4 * MS + 300 * US);
        assert_eq!(g.cooldown(), Duration::from_millis(1));
        assert_eq!(
            g.on_tick(10 * MS),
            None,
            "no wait yet: the prefill may be queued"
        );
        // A wait that ended before the first launch is not the request's.
        g.saw_wait_end(3 * MS);
        assert_eq!(g.on_tick(16 * MS), None);
        // The host launches again, and its first token's copy returns at 17 ms.
        g.on_edge(16 * MS + 800 * US, Some(12 * MS));
        g.saw_wait_end(17 * MS);
        g.saw_activity(17 * MS);
        assert_eq!(g.first_wait_pending(), None);
        assert_eq!(g.on_tick(17 * MS + 500 * US), None);
        assert!(
            g.cooldown() >= Duration::from_millis(24),
            "the 12 ms gap inside the request was learned"
        );
        // A request whose host never waits is held at most the ceiling after its first launch.
        let mut h = learned(GateConfig::default());
        h.on_arrival(0);
        h.on_edge(MS, None);
        assert_eq!(h.on_tick(200 * MS), None);
        assert_eq!(h.on_tick(201 * MS), Some(Action::Resume));
        assert_eq!(h.first_wait_pending(), None);
        // With waits not watched (--no-waits) nothing is held for them.
        let mut n = learned(GateConfig {
            waits: false,
            ..GateConfig::default()
        });
        n.on_arrival(0);
        n.on_edge(MS, None);
        assert_eq!(n.first_wait_pending(), None);
        assert_eq!(n.on_tick(2 * MS + 100 * US), Some(Action::Resume));
    }

    #[test]
    fn a_fixed_cooldown_ignores_the_gaps() {
        let cfg = GateConfig {
            fixed_cooldown: Some(Duration::ZERO),
            ..GateConfig::default()
        };
        let mut g = GatePolicy::new(cfg);
        let mut preemptions = 0;
        // Every burst is preempted and resumed at the next tick: frequent preemption.
        for i in 0..10 {
            let t = i * 2 * MS;
            preemptions += usize::from(g.on_edge(t, Some(2 * MS)).is_some());
            assert_eq!(g.on_tick(t + 100 * US), Some(Action::Resume));
        }
        assert_eq!(preemptions, 10);
        assert_eq!(g.cooldown(), Duration::ZERO);
    }

    /// Pseudo-random gaps (ns): exponential with the given mean, from a fixed LCG.
    fn exponential_gaps(n: usize, mean_ns: f64) -> Vec<u64> {
        let mut x: u64 = 0x2545_f491_4f6c_dd1d;
        (0..n)
            .map(|_| {
                x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                let u = ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
                (-u.ln() * mean_ns) as u64
            })
            .collect()
    }

    fn cost_and_caught(gaps: &[u64], hold: u64) -> (f64, f64) {
        let total: f64 = gaps.iter().map(|&g| g as f64).sum();
        let held: f64 = gaps.iter().map(|&g| g.min(hold) as f64).sum();
        let caught = gaps.iter().filter(|&&g| g < hold).count() as f64 / gaps.len() as f64;
        (held / total, caught)
    }

    #[test]
    fn the_hold_is_the_longest_within_the_budget() {
        for gaps in [
            exponential_gaps(256, 1e9),
            vec![
                5 * MS,
                5 * MS,
                7 * MS,
                2_000 * MS,
                9 * MS,
                3_000 * MS,
                6 * MS,
                8 * MS,
            ],
            vec![100 * MS; 10],
        ] {
            for budget in [0.02, 0.1, 0.3] {
                let hold = hold_within_budget(&gaps, budget);
                let (cost, _) = cost_and_caught(&gaps, hold);
                assert!(cost <= budget + 1e-9, "{budget}: costs {cost}");
                let (more, _) = cost_and_caught(&gaps, hold + 1_000);
                assert!(
                    more > budget - 1e-6,
                    "{budget}: 1 us longer would still fit ({more})"
                );
            }
        }
        assert_eq!(hold_within_budget(&[], 0.1), 0);
        assert_eq!(hold_within_budget(&[MS, MS], 0.0), 0);
    }

    #[test]
    fn random_arrivals_are_caught_at_the_budget_clustered_ones_far_more() {
        // Evenly random (Poisson) gaps: the share caught is the share given up.
        let poisson = exponential_gaps(256, 1e9);
        let (cost, caught) = cost_and_caught(&poisson, hold_within_budget(&poisson, 0.1));
        assert!(
            (caught - cost).abs() < 0.03,
            "caught {caught} at cost {cost}"
        );
        // Arrivals in bursts (nine in ten gaps 20-60 ms, the rest 5-15 s): most are caught.
        let clustered: Vec<u64> = exponential_gaps(256, 1e9)
            .iter()
            .enumerate()
            .map(|(i, &g)| {
                if i % 10 == 0 {
                    5_000 * MS + 10 * g
                } else {
                    20 * MS + g / 25
                }
            })
            .collect();
        let (cost, caught) = cost_and_caught(&clustered, hold_within_budget(&clustered, 0.1));
        assert!(
            cost <= 0.1 + 1e-9 && caught > 0.85,
            "caught {caught} at cost {cost}"
        );
    }

    /// A gate with `budget` after requests whose idle gaps (after the 2-ms learned cooldown) are
    /// `gaps`: each request arrives, launches 1 ms later and runs 5 decode steps 1 ms apart.
    fn after_requests(budget: Option<f64>, gaps: &[u64]) -> (GatePolicy, u64) {
        let mut g = learned(GateConfig {
            hold_budget: budget,
            ..GateConfig::default()
        });
        let mut t = 10 * MS;
        for &gap in gaps {
            g.on_arrival(t);
            for step in 1..=6 {
                g.on_edge(t + step * MS, Some(MS));
                // Its first token comes back through a wait for the GPU.
                g.saw_wait_end(t + step * MS + 500 * US);
            }
            let end = t + 6 * MS;
            let mut now = end;
            let next = end + 2 * MS + gap;
            while now < next {
                g.on_tick(now);
                now += 500 * US;
            }
            t = next;
        }
        (g, t)
    }

    #[test]
    fn a_hold_budget_keeps_offline_frozen_for_clustered_arrivals_and_none_without_it() {
        // Nine in ten gaps 30 ms, one in ten 5 s: a 10% budget holds past the short ones.
        let gaps: Vec<u64> = (0..40)
            .map(|i| if i % 10 == 9 { 5_000 * MS } else { 30 * MS })
            .collect();
        let (mut g, t) = after_requests(Some(0.1), &gaps);
        g.on_tick(t);
        assert!(g.idle_gaps() >= HOLD_MIN_GAPS, "{} gaps", g.idle_gaps());
        assert!(g.hold() > Duration::from_millis(30), "hold {:?}", g.hold());
        assert_eq!(g.cooldown(), g.learned_cooldown() + g.hold());
        // The next request 30 ms after the last one's cooldown finds offline frozen already.
        let preemptions = g.preemptions();
        g.on_arrival(t);
        for step in 1..=6 {
            g.on_edge(t + step * MS, Some(MS));
            g.saw_wait_end(t + step * MS + 500 * US);
        }
        let mut now = t + 6 * MS;
        let next = now + 2 * MS + 30 * MS;
        while now < next {
            assert_eq!(g.on_tick(now), None, "resumed at {now} inside the hold");
            now += 500 * US;
        }
        assert!(
            g.held_at(next, LaunchesBefore::Heard),
            "within the hold, past the learned cooldown"
        );
        assert_eq!(
            g.on_arrival(next),
            None,
            "an arrival within the hold: offline already off"
        );
        assert!(
            !g.held_at(next + MS, LaunchesBefore::Heard),
            "inside the request it started: not the hold's"
        );
        assert_eq!(g.preemptions(), preemptions + 1);
        // Without a budget: no gaps kept, no hold, every such arrival preempts.
        let (g, t) = after_requests(None, &gaps);
        assert_eq!((g.idle_gaps(), g.hold()), (0, Duration::ZERO));
        assert!(
            !g.held_at(t, LaunchesBefore::Heard),
            "resumed after the cooldown"
        );
    }

    #[test]
    fn an_arrival_while_a_request_runs_unheard_is_no_gap_and_not_the_hold_s() {
        // Offline frozen by the hold; a request starts with an edge at `t` and launches for
        // 300 ms without another (no gap reaches the edge gap), so the gate hears nothing more.
        let gaps: Vec<u64> = (0..40)
            .map(|i| if i % 10 == 9 { 5_000 * MS } else { 30 * MS })
            .collect();
        let (mut g, t) = after_requests(Some(0.1), &gaps);
        g.on_tick(t);
        g.on_arrival(t);
        g.on_edge(t + MS, Some(40 * MS));
        assert!(g.preempted());
        let queued = t + 200 * MS;
        // Its own clock says online idled 199 ms: an arrival then would count as caught.
        assert!(g.held_at(queued, LaunchesBefore::Heard));
        // The counters say online launched 1 ms before it: neither caught nor a gap.
        let before = LaunchesBefore::Last(queued - MS);
        assert!(!g.held_at(queued, before) && !g.idle_at(queued, before));
        let gaps_before = g.hold_history().gaps;
        g.on_arrival_after(queued, before);
        assert_eq!(g.hold_history().gaps, gaps_before, "no gap noted");
        // Busy (a launch after it that is no edge): the same.
        assert!(!g.held_at(queued + MS, LaunchesBefore::Busy));
        g.on_arrival_after(queued + MS, LaunchesBefore::Busy);
        assert_eq!(g.hold_history().gaps, gaps_before);
        // Online's last activity 2 s before an arrival: idle, caught, and the gap is noted.
        let late = queued + 2_300 * MS;
        let before = LaunchesBefore::Last(late - 2_000 * MS);
        assert!(g.held_at(late, before) == g.preempted() && g.idle_at(late, before));
        g.on_arrival_after(late, before);
        // 2 s less the learned cooldown (at most the ceiling); the gate's own clock said 2.5 s.
        let noted = *g.hold_history().gaps.last().unwrap();
        let ceiling = g.cfg.cooldown_ceiling.as_nanos() as u64;
        assert!(
            noted <= 2_000 * MS && noted + ceiling >= 2_000 * MS,
            "noted {noted} ns"
        );
    }

    #[test]
    fn a_gate_seeded_with_an_earlier_gate_s_gaps_holds_from_its_first_tick() {
        let gaps: Vec<u64> = (0..40)
            .map(|i| if i % 10 == 9 { 5_000 * MS } else { 30 * MS })
            .collect();
        let cfg = GateConfig {
            hold_budget: Some(0.1),
            ..GateConfig::default()
        };
        let (old, t) = after_requests(Some(0.1), &gaps);
        let history = old.hold_history();
        assert_eq!(history.gaps.len(), old.idle_gaps());
        assert!(history.last_activity_ns.is_some_and(|last| last < t));
        let mut fresh = GatePolicy::new(cfg);
        fresh.on_tick(t);
        assert_eq!(fresh.hold(), Duration::ZERO, "nothing learned yet");
        fresh.seed_hold_history(&history);
        fresh.on_tick(t + MS);
        assert_eq!(fresh.idle_gaps(), history.gaps.len());
        assert_eq!(fresh.hold(), old.hold(), "the same gaps, the same hold");
        // The lull that spans the restart counts, from the old gate's last activity, once.
        let first = history.last_activity_ns.unwrap() + 60_000 * MS;
        fresh.on_arrival(first);
        assert_eq!(fresh.idle_gaps(), history.gaps.len() + 1);
        let ceiling = cfg.cooldown_ceiling.as_nanos() as u64;
        assert_eq!(
            fresh.hold_history().gaps.last(),
            Some(&(60_000 * MS - ceiling))
        );
        fresh.on_arrival(first + 10_000 * MS);
        assert_eq!(
            fresh.idle_gaps(),
            history.gaps.len() + 1,
            "then its own, once it has learned"
        );
        // The newest HOLD_GAPS are kept, its own gaps after them; zeros are dropped.
        let mut g = GatePolicy::new(cfg);
        let many = HoldHistory {
            gaps: (1..=(HOLD_GAPS as u64 + 10)).chain([0]).collect(),
            last_activity_ns: None,
        };
        g.seed_hold_history(&many);
        assert_eq!(g.hold_history().gaps.first(), Some(&11));
        assert_eq!(g.hold_history().gaps.last(), Some(&(HOLD_GAPS as u64 + 10)));
        assert_eq!(g.idle_gaps(), HOLD_GAPS);
        // A short history leaves the deque as large as it was made: no allocation on an arrival.
        let mut short = GatePolicy::new(cfg);
        short.seed_hold_history(&HoldHistory {
            gaps: vec![5, 6],
            last_activity_ns: None,
        });
        assert!(short.idle_gaps.capacity() > HOLD_GAPS);
    }

    #[test]
    fn no_hold_before_enough_gaps_nor_past_the_longest() {
        let (mut g, t) = after_requests(Some(0.5), &[30 * MS; HOLD_MIN_GAPS - 1]);
        g.on_tick(t);
        assert_eq!(g.hold(), Duration::ZERO, "{} gaps", g.idle_gaps());
        let (mut g, t) = after_requests(Some(0.5), &[60_000 * MS; 2 * HOLD_MIN_GAPS]);
        g.on_tick(t);
        assert_eq!(g.hold(), HOLD_MAX);
    }

    #[test]
    fn without_arrivals_a_held_gap_between_requests_is_not_learned_as_an_iteration_gap() {
        // Launch edges only: requests of 6 steps 1 ms apart, 30 ms or 3 s apart.
        let mut g = learned(GateConfig {
            hold_budget: Some(0.1),
            ..GateConfig::default()
        });
        let mut t = 10 * MS;
        let mut last = None;
        for i in 0..40 {
            for step in 0..6 {
                g.on_edge(t + step * MS, last.map(|l| t + step * MS - l));
                last = Some(t + step * MS);
            }
            let next = t + 5 * MS + if i % 10 == 9 { 3_000 * MS } else { 30 * MS };
            let mut now = t + 5 * MS;
            while now < next {
                g.on_tick(now);
                now += 500 * US;
            }
            t = next;
        }
        // 35 gaps of 28 ms and 3 of 2,998 ms past the cooldown: 10% of them is a hold of 25.6 ms.
        assert_eq!(g.idle_gaps(), 38 + 1);
        assert!(g.hold() > Duration::from_millis(25), "hold {:?}", g.hold());
        assert!(
            g.learned_cooldown() < Duration::from_millis(5),
            "the held 30-ms gaps were learned: cooldown {:?}",
            g.learned_cooldown()
        );
    }

    #[test]
    fn after_a_lull_longer_than_the_gap_memory_the_last_gaps_still_hold_a_request() {
        let mut g = learned(GateConfig::default());
        let run = |g: &mut GatePolicy, t: u64| {
            let mut actions = vec![g.on_arrival(t)];
            for step in 1..=20 {
                actions.push(g.on_edge(t + step * 5 * MS, Some(5 * MS)));
                g.saw_wait_end(t + step * 5 * MS + 100 * US);
                let mut now = t + step * 5 * MS + 100 * US;
                while now < t + (step + 1) * 5 * MS {
                    actions.push(g.on_tick(now));
                    now += 100 * US;
                }
            }
            actions.into_iter().flatten().collect::<Vec<_>>()
        };
        run(&mut g, 10 * MS);
        let mut now = 200 * MS;
        while now < 121_000 * MS {
            g.on_tick(now);
            now += 10 * MS;
        }
        assert_eq!(
            g.learned_cooldown(),
            Duration::from_millis(10),
            "2 x 5 ms, kept"
        );
        assert_eq!(
            run(&mut g, 121_000 * MS),
            vec![Action::Preempt],
            "one preemption, no resume inside"
        );
    }

    #[test]
    fn a_health_check_that_launches_nothing_does_not_hide_the_next_request_s_gap() {
        let (mut g, t) = after_requests(Some(0.1), &[30 * MS; 8]);
        g.on_tick(t);
        let before = g.idle_gaps();
        g.on_arrival(t + 500 * MS); // a health check: no launch follows
        let mut now = t + 500 * MS;
        while now < t + 2_000 * MS {
            g.on_tick(now);
            now += MS;
        }
        g.on_arrival(t + 2_000 * MS); // the next request
        assert_eq!(
            g.idle_gaps(),
            before + 2,
            "the gap to the check and the one after it"
        );
    }
}
