//! The floor experiment (`valve-hwtest --only-floor`; docs/gate.md, "Candidates for the next
//! hardware session", 1-4): against the persistent hog at full occupancy, bare
//! DISABLE_CHANNELS calls of several kinds, interleaved in blocks so drift hits all alike:
//! (a) all channels, the baseline; (b) controls that preempt nothing (the floor); (c) schedule-only;
//! (d) the compute TSG, then the rest; (e) an online process's first kernel fired together with a
//! disable, against the GPU stop and the ioctl's return on one clock; (f) a burst of online
//! kernels fired together with the disable of all channels or the split, against offline already
//! frozen and no control: how much of the burst's delay the split removes; (g) online's kernel
//! launched at offsets before and after the disable's issue (`--floor-offsets-us`): whether a
//! launch that comes while the disable is in progress waits for it, and one before it does not.
//!
//! Every row is independent: a failed cycle is recorded and its channels enabled again, a row
//! that fails 5 times stops, and the whole loop stops at a time budget.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use valve::{ChannelTarget, Controller, GpuInfo};

use crate::clock::now_ns;
use crate::clock::{us_between, GpuClock, HostClock};
use crate::experiments::{cycle, IssueTiming, Preempter, RawPreempter};
use crate::floor_report::{
    self as fr, Row, Sample, BURST_COLS, CYCLE_COLS, FLOOR_COLS, OFFSET_COLS, SPLIT_COLS,
    TRIGGER_COLS,
};
use crate::hog::{Bins, ChannelSet, Hog, Poller};
use crate::trigger::{Burst, Shot, Trigger};
use crate::Report;

/// Rows are interleaved in blocks of this many cycles.
const BLOCK: usize = 10;
/// Hold of each disabling cycle (as in the main experiment).
const HOLD: Duration = Duration::from_millis(10);
/// Running hog before each cycle (and the GPU clock's calibration window).
const GAP: Duration = Duration::from_millis(5);
/// Offline frozen this long before the "already frozen" shot (stops take under ~1 ms).
const FROZEN_SETTLE: Duration = Duration::from_millis(3);
/// How long a shot may take before it counts as "no kernel".
const SHOT_TIMEOUT: Duration = Duration::from_millis(500);
/// A row stops after this many failed cycles.
const MAX_ERRORS: usize = 5;
/// The interleaved loop stops here, whatever is left.
const BUDGET: Duration = Duration::from_secs(75);

/// Two bare calls back to back on one thread: the compute TSG's channels, then the rest.
pub struct Split {
    first: RawPreempter,
    second: RawPreempter,
    /// The last disable's two ioctl times (us).
    last: (f64, f64),
}

impl Preempter for Split {
    fn disable(&mut self) -> Result<IssueTiming> {
        let t0 = now_ns();
        let a = self.first.disable()?;
        let b = match self.second.disable() {
            Ok(b) => b,
            Err(e) => {
                let _ = self.first.enable();
                return Err(e.context("the second call"));
            }
        };
        self.last = (a.ioctl_us, b.ioctl_us);
        Ok(IssueTiming {
            call_us: (now_ns() - t0) as f64 / 1e3,
            ioctl_us: a.ioctl_us,
        })
    }

    fn enable(&mut self) -> Result<IssueTiming> {
        let t0 = now_ns();
        let a = self.first.enable();
        let b = self.second.enable();
        let call_us = (now_ns() - t0) as f64 / 1e3;
        let (a, b) = (a?, b?);
        Ok(IssueTiming {
            call_us,
            ioctl_us: a.ioctl_us + b.ioctl_us,
        })
    }
}

/// A row's way of disabling.
enum Preempt {
    Raw(Box<RawPreempter>),
    Split(Box<Split>),
}

impl Preempt {
    fn as_dyn(&mut self) -> &mut dyn Preempter {
        match self {
            Preempt::Raw(p) => p.as_mut(),
            Preempt::Split(p) => p.as_mut(),
        }
    }

    /// The split's second ioctl of the last disable.
    fn second_us(&self) -> Option<f64> {
        match self {
            Preempt::Split(s) => Some(s.last.1),
            Preempt::Raw(_) => None,
        }
    }
}

/// When a trigger row disables offline, relative to the shot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum When {
    /// Right after the flag.
    Issue,
    /// (g): `D` us after the flag (D > 0), or the flag `-D` us after the disable's issue (D < 0;
    /// never 0, which is `Issue`).
    Offset(i64),
    /// Before the flag: offline is already frozen.
    Frozen,
    /// Never: time-sliced with the hog.
    Never,
}

/// What a row does each cycle.
enum Action {
    /// Disable, hold, enable (`experiments::cycle`).
    Cycle(Preempt),
    /// One control (disable or enable) that preempts nothing.
    Control { p: Box<RawPreempter>, disable: bool },
    /// Fire the trigger (one tiny kernel, or a burst), with a disable as `when` says.
    Trigger {
        p: Option<Preempt>,
        when: When,
        burst: Burst,
    },
}

/// Which sub-experiment a row belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
enum Group {
    A,
    B,
    C,
    D,
    E,
    F,
    G,
}

impl Group {
    /// The rows that need the online trigger.
    fn online(self) -> bool {
        matches!(self, Group::E | Group::F | Group::G)
    }
}

/// One row: what it does, its samples and its failures.
struct Arm {
    key: String,
    label: String,
    group: Group,
    action: Action,
    samples: Vec<Sample>,
    errors: Vec<String>,
}

/// The channel sets of the hog on GPU 0.
struct Sets {
    all: Vec<ChannelTarget>,
    one: Vec<ChannelTarget>,
    compute: Vec<ChannelTarget>,
    rest: Vec<ChannelTarget>,
}

impl Sets {
    fn of(hog: &Hog, g0: &GpuInfo) -> Sets {
        let all = hog.targets(ChannelSet::All, g0.device_instance);
        let compute = hog.targets(ChannelSet::ComputeTsg, g0.device_instance);
        let rest = all
            .iter()
            .copied()
            .filter(|t| !compute.contains(t))
            .collect();
        Sets {
            one: hog.targets(ChannelSet::One, g0.device_instance),
            all,
            compute,
            rest,
        }
    }
}

/// What every cycle needs.
struct Ctx<'a> {
    hog: &'a Hog,
    poller: &'a Poller,
    host: HostClock,
    /// Enables every channel of the hog after a failed cycle.
    rescue: Option<RawPreempter>,
    rescues: usize,
    /// Rescues after which the hog's heartbeat did not come back within 2 s.
    rescue_failed: usize,
}

impl Ctx<'_> {
    /// Enables every channel once more; returns (rescues, rescues not ticking after, host clock).
    fn close(mut self) -> (usize, usize, HostClock) {
        if let Some(p) = self.rescue.as_mut() {
            let _ = p.control(false);
        }
        (self.rescues, self.rescue_failed, self.host)
    }

    /// Enables all the hog's channels (harmless if enabled) and waits for its heartbeat.
    fn rescue(&mut self) {
        self.rescues += 1;
        if let Some(p) = self.rescue.as_mut() {
            let _ = p.control(false);
        }
        if self.poller.wait_ticking(Duration::from_secs(2)).is_err() {
            self.rescue_failed += 1;
        }
    }
}

/// Runs the section and writes its tables, JSON and checks into `r`; the (f) rows fire `burst`,
/// (g) has one row per offset.
pub fn run(
    ctl: &Controller,
    bins: &Bins,
    g0: &GpuInfo,
    cycles: usize,
    (burst, offsets): (Burst, &Offsets),
    r: &mut Report,
) {
    r.line("\n## The disable's floor, and what online's first kernel waits for (`--only-floor`), GPU 0\n");
    let hog = match Hog::start(bins, g0, "persistent", &[]).or_else(|e| {
        println!("retrying once after: {e:#}");
        Hog::start(bins, g0, "persistent", &[])
    }) {
        Ok(h) => h,
        Err(e) => {
            r.check("floor: the persistent hog starts", false, format!("{e:#}"));
            return;
        }
    };
    let poller = Poller::start(hog.hb.clone());
    let sets = Sets::of(&hog, g0);
    let mut notes = Vec::new();
    let mut trigger = start_trigger(bins, g0, &mut notes);
    let online = trigger.is_some().then_some(burst);
    let mut arms = build_arms(ctl, g0, &sets, (online, &offsets.0), &mut notes);
    let mut ctx = Ctx {
        hog: &hog,
        poller: &poller,
        host: HostClock::calibrate(),
        rescue: RawPreempter::new(ctl, &sets.all).ok(),
        rescues: 0,
        rescue_failed: 0,
    };
    let t0 = Instant::now();
    if let Some(why) = interleave(&mut arms, &mut ctx, trigger.as_mut(), cycles) {
        notes.push(why);
    }
    let loop_s = t0.elapsed().as_secs_f64();
    let closed = ctx.close();
    let end = End {
        burst,
        offsets: offsets.0.clone(),
        ..wind_down(arms, closed, trigger, poller, hog)
    };
    report(r, &sets, cycles, loop_s, &notes, &end);
}

/// Drops every row's preempter (each enables what it left disabled; `Ctx::close` has enabled
/// all channels once more), then stops the trigger and the hog.
fn wind_down(
    arms: Vec<Arm>,
    (rescues, rescue_failed, host): (usize, usize, HostClock),
    trigger: Option<Trigger>,
    poller: Poller,
    hog: Hog,
) -> End {
    let rows = arms
        .into_iter()
        .map(|a| (a.key, a.label, a.group, a.samples, a.errors))
        .collect();
    let ticking_at_end = poller.wait_ticking(Duration::from_secs(2));
    let trigger = trigger.map(Trigger::finish);
    drop(poller);
    End {
        rows,
        rescues,
        rescue_failed,
        ticking_at_end,
        hog: hog.finish(),
        trigger,
        host,
        burst: Burst::SINGLE,
        offsets: Vec::new(),
    }
}

/// Starts the online trigger; `None` (with a note) if it is missing or does not start.
fn start_trigger(bins: &Bins, g0: &GpuInfo, notes: &mut Vec<String>) -> Option<Trigger> {
    if !bins.trigger.exists() {
        notes.push(format!(
            "{} is missing (hwtests/cuda/build.sh says why it did not build): the (e), (f) and (g) rows are skipped.",
            bins.trigger.display()
        ));
        return None;
    }
    match Trigger::start(&bins.trigger, &g0.uuid) {
        Ok(t) => Some(t),
        Err(e) => {
            notes.push(format!(
                "The online trigger did not start ({e:#}): the (e), (f) and (g) rows are skipped."
            ));
            None
        }
    }
}

/// Which channels a row's bare control names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Chans {
    All,
    AllScheduleOnly,
    One,
    Empty,
}

/// How a row is built.
#[derive(Clone, Copy, Debug)]
enum Kind {
    /// Disable, hold, enable.
    Cycle(Chans),
    /// The same with the split preempter.
    SplitCycle,
    /// One control: disable (true) or enable.
    Control(Chans, bool),
    /// A trigger shot with a bare control.
    Trigger(Chans, When),
    /// A trigger shot followed by the split.
    TriggerSplit,
    /// A trigger shot with no control.
    TriggerAlone,
    /// (g): a trigger shot and the all-channel disable this many us apart (`When::Offset`).
    TriggerOffset(i64),
}

/// Every row, in the order the loop visits them: key, label, group, kind.
const ROWS: [(&str, &str, Group, Kind); 17] = [
    (
        "all",
        "all channels, one call",
        Group::A,
        Kind::Cycle(Chans::All),
    ),
    (
        "one",
        "one channel of the compute TSG",
        Group::A,
        Kind::Cycle(Chans::One),
    ),
    (
        "empty_disable",
        "disable, numChannels 0",
        Group::B,
        Kind::Control(Chans::Empty, true),
    ),
    (
        "empty_enable",
        "enable, numChannels 0",
        Group::B,
        Kind::Control(Chans::Empty, false),
    ),
    (
        "enable_enabled_one",
        "enable of 1 enabled channel",
        Group::B,
        Kind::Control(Chans::One, false),
    ),
    (
        "enable_enabled_all",
        "enable of all channels, all enabled",
        Group::B,
        Kind::Control(Chans::All, false),
    ),
    (
        "schedule_only",
        "all channels, schedule-only",
        Group::C,
        Kind::Cycle(Chans::AllScheduleOnly),
    ),
    (
        "split",
        "compute TSG, then the rest",
        Group::D,
        Kind::SplitCycle,
    ),
    (
        "trigger_disable",
        "disable all channels right after the flag",
        Group::E,
        Kind::Trigger(Chans::All, When::Issue),
    ),
    (
        "trigger_split",
        "split (compute TSG, then the rest) right after the flag",
        Group::E,
        Kind::TriggerSplit,
    ),
    (
        "trigger_schedule_only",
        "schedule-only disable right after the flag",
        Group::E,
        Kind::Trigger(Chans::AllScheduleOnly, When::Issue),
    ),
    (
        "trigger_frozen",
        "baseline: offline already frozen",
        Group::E,
        Kind::Trigger(Chans::All, When::Frozen),
    ),
    (
        "trigger_none",
        "baseline: no control (time-sliced with the hog)",
        Group::E,
        Kind::TriggerAlone,
    ),
    (
        "burst_disable",
        "burst, disable all channels right after the flag",
        Group::F,
        Kind::Trigger(Chans::All, When::Issue),
    ),
    (
        "burst_split",
        "burst, split right after the flag",
        Group::F,
        Kind::TriggerSplit,
    ),
    (
        "burst_frozen",
        "burst, offline already frozen",
        Group::F,
        Kind::Trigger(Chans::All, When::Frozen),
    ),
    (
        "burst_none",
        "burst, no control (time-sliced with the hog)",
        Group::F,
        Kind::TriggerAlone,
    ),
];

/// The largest |D| of `--floor-offsets-us`, us.
pub const MAX_OFFSET_US: i64 = 2000;
/// `--floor-offsets-us`'s default.
pub const DEFAULT_OFFSETS_US: &str = "-400,-200,-100,50,150,300";

/// (g)'s offsets D, us: the all-channel disable's issue after online's flag (negative: the flag
/// after the issue). Empty: no (g) rows.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Offsets(pub Vec<i64>);

/// Parses `--floor-offsets-us`: comma-separated signed integers (spaces allowed), each with
/// 0 < |D| <= `MAX_OFFSET_US` and none twice; an empty string gives no offsets.
pub fn parse_offsets(s: &str) -> Result<Offsets, String> {
    if s.trim().is_empty() {
        return Ok(Offsets::default());
    }
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let d: i64 = part.parse().map_err(|_| {
            format!("\"{part}\" is not a signed integer (us); give e.g. \"-200,150\"")
        })?;
        if d == 0 {
            return Err(
                "0 is the (e) row \"disable all channels right after the flag\"; leave it out"
                    .into(),
            );
        }
        if d.abs() > MAX_OFFSET_US {
            return Err(format!(
                "{d} us is out of range: each offset is within +-{MAX_OFFSET_US} us"
            ));
        }
        if out.contains(&d) {
            return Err(format!("{d} is given twice"));
        }
        out.push(d);
    }
    Ok(Offsets(out))
}

/// (g)'s row for offset `d`: key and label.
fn offset_row(d: i64) -> (String, String) {
    let label = if d > 0 {
        format!("D = +{d}: disable all channels {d} us after the flag")
    } else {
        format!("D = {d}: the flag {} us after the disable's issue", -d)
    };
    (format!("offset_{d:+}us"), label)
}

/// A row before it is built: key, label, group, kind.
type RowSpec = (String, String, Group, Kind);

/// Every row in the loop's order: `ROWS`, with (g)'s rows (one per offset) after the (e) rows.
fn all_rows(offsets: &[i64]) -> Vec<RowSpec> {
    let mut rows: Vec<RowSpec> = ROWS
        .iter()
        .map(|&(k, l, g, kind)| (k.to_string(), l.to_string(), g, kind))
        .collect();
    let at = rows
        .iter()
        .position(|r| r.2 == Group::F)
        .unwrap_or(rows.len());
    let g = offsets.iter().map(|&d| {
        let (key, label) = offset_row(d);
        (key, label, Group::G, Kind::TriggerOffset(d))
    });
    rows.splice(at..at, g);
    rows
}

/// Every row that can be built; a row that cannot leaves a note. `online`: the (f) rows' burst,
/// `None` without a trigger (then no (e), (f) or (g) rows); `offsets`: (g)'s.
fn build_arms(
    ctl: &Controller,
    g0: &GpuInfo,
    sets: &Sets,
    (online, offsets): (Option<Burst>, &[i64]),
    notes: &mut Vec<String>,
) -> Vec<Arm> {
    all_rows(offsets)
        .into_iter()
        .filter(|row| online.is_some() || !row.2.online())
        .filter_map(|(key, label, group, kind)| {
            let mut action = match build(ctl, g0, sets, kind) {
                Ok(a) => a,
                Err(e) => {
                    notes.push(format!("Row \"{label}\" not run: {e:#}."));
                    return None;
                }
            };
            if let (Action::Trigger { burst, .. }, Group::F) = (&mut action, group) {
                *burst = online.unwrap_or(Burst::SINGLE);
            }
            Some(Arm {
                key,
                label,
                group,
                action,
                samples: Vec::new(),
                errors: Vec::new(),
            })
        })
        .collect()
}

/// One row's action.
fn build(ctl: &Controller, g0: &GpuInfo, sets: &Sets, kind: Kind) -> Result<Action> {
    let raw = |c: Chans| -> Result<RawPreempter> {
        match c {
            Chans::All => RawPreempter::new(ctl, &sets.all),
            Chans::AllScheduleOnly => Ok(RawPreempter::new(ctl, &sets.all)?.schedule_only()),
            Chans::One => RawPreempter::new(ctl, &sets.one),
            Chans::Empty => RawPreempter::empty(ctl, g0.index),
        }
    };
    let split = || split(ctl, sets).map(|s| Preempt::Split(Box::new(s)));
    Ok(match kind {
        Kind::Cycle(c) => Action::Cycle(Preempt::Raw(Box::new(raw(c)?))),
        Kind::SplitCycle => Action::Cycle(split()?),
        Kind::Control(c, disable) => Action::Control {
            p: Box::new(raw(c)?),
            disable,
        },
        Kind::Trigger(c, when) => Action::Trigger {
            p: Some(Preempt::Raw(Box::new(raw(c)?))),
            when,
            burst: Burst::SINGLE,
        },
        Kind::TriggerSplit => Action::Trigger {
            p: Some(split()?),
            when: When::Issue,
            burst: Burst::SINGLE,
        },
        Kind::TriggerAlone => Action::Trigger {
            p: None,
            when: When::Never,
            burst: Burst::SINGLE,
        },
        Kind::TriggerOffset(d) => Action::Trigger {
            p: Some(Preempt::Raw(Box::new(raw(Chans::All)?))),
            when: When::Offset(d),
            burst: Burst::SINGLE,
        },
    })
}

/// The split preempter: the compute TSG's channels, then the rest.
fn split(ctl: &Controller, sets: &Sets) -> Result<Split> {
    if sets.compute.is_empty() || sets.rest.is_empty() {
        bail!(
            "the compute TSG has {} channel(s) and the rest {}",
            sets.compute.len(),
            sets.rest.len()
        );
    }
    Ok(Split {
        first: RawPreempter::new(ctl, &sets.compute)?,
        second: RawPreempter::new(ctl, &sets.rest)?,
        last: (0.0, 0.0),
    })
}

/// Visits every row for `BLOCK` cycles at a time until each has `cycles`; `Some(why)` if it
/// stopped at the budget.
fn interleave(
    arms: &mut [Arm],
    ctx: &mut Ctx,
    mut trig: Option<&mut Trigger>,
    cycles: usize,
) -> Option<String> {
    let t0 = Instant::now();
    let mut done = 0;
    while done < cycles {
        let n = BLOCK.min(cycles - done);
        for arm in arms.iter_mut() {
            for _ in 0..n {
                if arm.errors.len() >= MAX_ERRORS {
                    break;
                }
                if t0.elapsed() > BUDGET {
                    return Some(format!(
                        "The loop stopped at its {BUDGET:?} budget after {done} cycles per row."
                    ));
                }
                let res = once(arm, ctx, trig.as_deref_mut());
                match res {
                    Ok(s) => arm.samples.push(s),
                    Err(e) => {
                        arm.errors.push(format!("{e:#}"));
                        ctx.rescue();
                    }
                }
            }
        }
        done += n;
    }
    None
}

/// One cycle of one row.
fn once(arm: &mut Arm, ctx: &Ctx, trig: Option<&mut Trigger>) -> Result<Sample> {
    match &mut arm.action {
        Action::Cycle(p) => disable_cycle(p, ctx),
        Action::Control { p, disable } => control(p, *disable, ctx),
        Action::Trigger { p, when, burst } => {
            let trig = trig.context("no trigger")?;
            trigger_cycle(p.as_mut(), (*when, *burst), trig, ctx)
        }
    }
}

/// (a), (c), (d): disable, hold, enable, through `experiments::cycle`.
fn disable_cycle(p: &mut Preempt, ctx: &Ctx) -> Result<Sample> {
    std::thread::sleep(GAP);
    let c = cycle(p.as_dyn(), &ctx.hog.hb, ctx.poller, HOLD)?;
    Ok(Sample {
        ioctl_us: Some(c.disable_ioctl_us),
        second_ioctl_us: p.second_us(),
        return_us: Some(c.disable_call_us),
        stop_us: Some(c.stop_us),
        enable_us: Some(c.enable_ioctl_us),
        frozen: Some(c.frozen),
        resumed: Some(c.resume_us.is_some()),
        ..Default::default()
    })
}

/// (b): one control against the running hog; a status RM refuses with is a sample, not an error.
/// `frozen` records whether the hog's heartbeat stood still for 1 ms after the call returned.
fn control(p: &mut RawPreempter, disable: bool, ctx: &Ctx) -> Result<Sample> {
    std::thread::sleep(GAP);
    ctx.poller.wait_ticking(Duration::from_secs(2))?;
    let (status, us) = p.control(disable)?;
    let t = now_ns();
    std::thread::sleep(Duration::from_millis(1));
    Ok(Sample {
        ioctl_us: Some(us),
        status: Some(status.0),
        frozen: Some(ctx.poller.last_change() <= t),
        ..Default::default()
    })
}

/// (e), (f): one shot of the trigger (one kernel or a burst), with offline disabled right after
/// it, before it, or never. Offline is enabled again whatever happened in between.
fn trigger_cycle(
    mut p: Option<&mut Preempt>,
    (when, burst): (When, Burst),
    trig: &mut Trigger,
    ctx: &Ctx,
) -> Result<Sample> {
    trig.idle(SHOT_TIMEOUT * 4)?;
    ctx.poller.reset_clock();
    std::thread::sleep(GAP);
    ctx.poller.wait_ticking(Duration::from_secs(2))?;
    let clock = ctx
        .poller
        .gpu_clock()
        .context("slot 0 did not change during the gap: no GPU clock")?;
    let needs_p = when != When::Never;
    if needs_p && p.is_none() {
        bail!("a disabling trigger row without a preempter");
    }
    if when == When::Frozen {
        if let Some(p) = p.as_deref_mut() {
            p.as_dyn().disable()?;
        }
        std::thread::sleep(FROZEN_SETTLE);
    }
    let mid = shot_and_hold(p.as_deref_mut(), (when, burst), trig, ctx, clock);
    let enabled = match p {
        Some(p) if needs_p => Some(enable_and_resume(p, ctx)),
        _ => None,
    };
    let mut s = mid?;
    if let Some(e) = enabled {
        let (us, resumed) = e?;
        s.enable_us = Some(us);
        s.resumed = Some(resumed);
    }
    Ok(s)
}

/// Fires the shot (and, for `When::Issue` or `When::Offset`, the disable), waits for online's
/// kernels and, while offline is disabled, watches the hold. Times are relative to the flag.
fn shot_and_hold(
    p: Option<&mut Preempt>,
    (when, burst): (When, Burst),
    trig: &mut Trigger,
    ctx: &Ctx,
    clock: GpuClock,
) -> Result<Sample> {
    let mut s = Sample::default();
    let before = ctx.hog.hb.snapshot();
    let (t_flag, t_issue, n) = fire_and_disable(p, (when, burst), trig, &mut s)?;
    let shot = trig.page.wait_done(n, SHOT_TIMEOUT);
    let disabled_here = matches!(when, When::Issue | When::Offset(_));
    match when {
        When::Issue | When::Offset(_) => watch_hold(&mut s, ctx, t_issue, t_flag),
        When::Frozen => {
            sleep_until(t_flag + 1_000_000);
            s.frozen = Some(ctx.hog.hb.snapshot() == before);
        }
        When::Never => {}
    }
    let Some(shot) = shot else {
        s.online_timeout = true;
        return Ok(s);
    };
    record_shot(&mut s, &shot, burst, (ctx, clock), t_flag)?;
    if s.frozen == Some(true) && disabled_here && shot.gpu_start_ns != 0 {
        let gpu_stop = ctx.hog.hb.gpu_time(0);
        s.start_minus_stop_gpu_us = Some(us_between(shot.gpu_start_ns as i64, gpu_stop as i64));
    }
    Ok(s)
}

/// Sets the flag and issues the disable as `when` says; fills the ioctl's times (after the
/// flag) into `s`. Returns (the flag's time, the disable's issue (the flag's without one), the
/// shot's number).
fn fire_and_disable(
    p: Option<&mut Preempt>,
    (when, burst): (When, Burst),
    trig: &mut Trigger,
    s: &mut Sample,
) -> Result<(u64, u64, u64)> {
    if let When::Offset(d) = when {
        return offset_shot(p.context("no preempter")?, d, trig, s);
    }
    let t_issue = now_ns();
    let n = trig.fire(burst);
    if when == When::Issue {
        let p = p.context("no preempter")?;
        let d = p.as_dyn().disable();
        let t_ret = now_ns();
        let d = d?;
        s.ioctl_us = Some(d.ioctl_us);
        s.second_ioctl_us = p.second_us();
        s.return_us = Some(us_between(t_ret as i64, t_issue as i64));
    }
    Ok((t_issue, t_issue, n))
}

/// (g): one tiny kernel's flag and the disable `d` us apart. For d > 0 this thread sets the flag,
/// spins `d` us and issues the disable; for d < 0 the ioctl blocks this thread, so a second one
/// sets the flag `-d` us after the issue. Returns as `fire_and_disable` does.
fn offset_shot(
    p: &mut Preempt,
    d: i64,
    trig: &mut Trigger,
    s: &mut Sample,
) -> Result<(u64, u64, u64)> {
    let (t_flag, t_issue, n, res, t_ret) = if d > 0 {
        let t_flag = now_ns();
        let n = trig.fire(Burst::SINGLE);
        let t_issue = spin_until(t_flag + d.unsigned_abs() * 1000);
        let res = p.as_dyn().disable();
        (t_flag, t_issue, n, res, now_ns())
    } else {
        flag_during_disable(p, d.unsigned_abs() * 1000, trig)
    };
    let res = res?;
    s.ioctl_us = Some(res.ioctl_us);
    s.issue_us = Some(us_between(t_issue as i64, t_flag as i64));
    s.return_us = Some(us_between(t_ret as i64, t_flag as i64));
    Ok((t_flag, t_issue, n))
}

/// What `flag_during_disable` saw: the flag's time, the issue's, the shot's number, the
/// disable's result and its return's time.
type DuringDisable = (u64, u64, u64, Result<IssueTiming>, u64);

/// Issues the disable on this thread while a scoped second thread, started and spinning before
/// the issue, sets the flag `after_ns` after it (the shot is prepared here, so its burst is
/// published; the page is `Sync`). The flag is always set, whatever the disable returns.
fn flag_during_disable(p: &mut Preempt, after_ns: u64, trig: &mut Trigger) -> DuringDisable {
    let n = trig.prepare(Burst::SINGLE);
    let page = &trig.page;
    let issued = AtomicU64::new(0);
    let ready = AtomicBool::new(false);
    std::thread::scope(|sc| {
        let flagger = sc.spawn(|| {
            ready.store(true, Ordering::Release);
            let t_issue = loop {
                match issued.load(Ordering::Acquire) {
                    0 => std::hint::spin_loop(),
                    t => break t,
                }
            };
            let t_flag = spin_until(t_issue + after_ns);
            page.fire(n);
            t_flag
        });
        while !ready.load(Ordering::Acquire) {
            std::hint::spin_loop();
        }
        let t_issue = now_ns().max(1);
        issued.store(t_issue, Ordering::Release);
        let res = p.as_dyn().disable();
        let t_ret = now_ns();
        let t_flag = flagger
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e));
        (t_flag, t_issue, n, res, t_ret)
    })
}

/// Busy-waits (no sleep: a sleep's wake-up is tens of us late) until `now_ns()` reaches `t`;
/// returns the time it saw.
fn spin_until(t: u64) -> u64 {
    loop {
        let now = now_ns();
        if now >= t {
            return now;
        }
        std::hint::spin_loop();
    }
}

/// The trigger's record of a shot, on the runner's clock and relative to the flag; an error if
/// the shot failed or a burst kernel wrote no end.
fn record_shot(
    s: &mut Sample,
    shot: &Shot,
    burst: Burst,
    (ctx, clock): (&Ctx, GpuClock),
    t_issue: u64,
) -> Result<()> {
    if shot.error != 0 {
        bail!("the trigger's shot failed: CUDA error {}", shot.error);
    }
    let host = |mono: u64| Some(us_between(ctx.host.to_now(mono), t_issue as i64));
    let gpu = |t: u64| Some(us_between(clock.to_now(t), t_issue as i64));
    if shot.gpu_start_ns != 0 {
        s.online_start_us = gpu(shot.gpu_start_ns);
    }
    s.online_seen_us = host(shot.seen_mono_ns);
    s.online_launched_us = host(shot.launched_mono_ns);
    s.online_synced_us = host(shot.synced_mono_ns);
    if burst.kernels == 0 {
        return Ok(());
    }
    if shot.burst_ran != burst.kernels || shot.gpu_start_ns == 0 {
        bail!(
            "{} of the burst's {} kernels wrote their end (first start {})",
            shot.burst_ran,
            burst.kernels,
            shot.gpu_start_ns
        );
    }
    s.online_end_us = gpu(shot.gpu_end_ns);
    s.burst_span_us = Some(us_between(shot.gpu_end_ns as i64, shot.gpu_start_ns as i64));
    Ok(())
}

/// The rest of the hold after a disable issued at `t_issue`: frozen from 2 ms to the hold's end
/// (at least 2 ms of watching, however long the shot took), and the stop after `t0` (the flag).
fn watch_hold(s: &mut Sample, ctx: &Ctx, t_issue: u64, t0: u64) {
    sleep_until(t_issue + 2_000_000);
    let a = ctx.hog.hb.snapshot();
    sleep_until((t_issue + HOLD.as_nanos() as u64).max(now_ns() + 2_000_000));
    let b = ctx.hog.hb.snapshot();
    s.frozen = Some(a == b);
    s.stop_us = Some(us_between(ctx.poller.last_change() as i64, t0 as i64));
}

fn sleep_until(t: u64) {
    let now = now_ns();
    if t > now {
        std::thread::sleep(Duration::from_nanos(t - now));
    }
}

/// Enables and waits up to 2 s for the heartbeat: (enable ioctl us, resumed).
fn enable_and_resume(p: &mut Preempt, ctx: &Ctx) -> Result<(f64, bool)> {
    let t2 = now_ns();
    ctx.poller.arm(t2);
    let e = p.as_dyn().enable()?;
    let resumed = ctx
        .poller
        .wait_first_after_arm(Duration::from_secs(2))
        .is_some();
    Ok((e.ioctl_us, resumed))
}

/// A finished row: key, label, group, samples, errors.
type RowResult = (String, String, Group, Vec<Sample>, Vec<String>);

/// What the section measured, after the hog finished.
struct End {
    rows: Vec<RowResult>,
    rescues: usize,
    rescue_failed: usize,
    ticking_at_end: Result<()>,
    hog: Result<Value>,
    trigger: Option<Value>,
    host: HostClock,
    /// What each (f) shot launched.
    burst: Burst,
    /// (g)'s offsets, us.
    offsets: Vec<i64>,
}

impl End {
    /// The samples of the row `key` (none if it did not run).
    fn samples(&self, key: &str) -> &[Sample] {
        self.row(key).map(|x| x.3.as_slice()).unwrap_or(&[])
    }

    /// The row `key`, if it was built.
    fn row(&self, key: &str) -> Option<&RowResult> {
        self.rows.iter().find(|x| x.0 == key)
    }

    /// (g)'s description, over the offset rows that were built (`None` if none was).
    fn offset_verdict(&self) -> Option<fr::OffsetVerdict> {
        let rows: Vec<(i64, &[Sample])> = self
            .offsets
            .iter()
            .filter_map(|&d| Some((d, self.row(&offset_row(d).0)?.3.as_slice())))
            .collect();
        (!rows.is_empty()).then(|| fr::offset_verdict(self.samples("trigger_none"), &rows))
    }

    /// (f)'s verdict, if its three compared rows have bursts that ended.
    fn burst_verdict(&self) -> Option<fr::BurstVerdict> {
        fr::burst_verdict(
            self.samples("burst_disable"),
            self.samples("burst_split"),
            self.samples("burst_frozen"),
        )
    }
}

/// The tables, the verdict, the checks and the JSON.
fn report(r: &mut Report, sets: &Sets, cycles: usize, loop_s: f64, notes: &[String], end: &End) {
    r.line(&format!(
        "Persistent hog at full occupancy: {} channels, compute TSG {} channels. Bare ioctls on the runner's thread (`RawPreempter`). Up to {cycles} cycles per row, all rows interleaved in blocks of {BLOCK} (drift hits all alike); hold {} ms; {} ms of running hog before each cycle. Times in us after the issue (the first ioctl's start; in (e) and (f) the trigger's flag, set immediately before the ioctl; in (g) always the flag), host CLOCK_MONOTONIC. GPU stop: the hog's last heartbeat seen by the host. The trigger's idle CUDA context exists throughout. Loop: {loop_s:.1} s.",
        sets.all.len(), sets.compute.len(), HOLD.as_millis(), GAP.as_millis()
    ));
    for n in notes {
        r.line(&format!("\n{n}"));
    }
    let rows = |g: Group| -> Vec<Row> {
        end.rows
            .iter()
            .filter(|x| x.2 == g)
            .map(|x| Row {
                label: x.1.to_string(),
                samples: &x.3,
                errors: &x.4,
            })
            .collect()
    };
    let reference = |keys: &[&str]| -> Vec<Row> {
        end.rows
            .iter()
            .filter(|x| keys.contains(&x.0.as_str()))
            .map(|x| Row {
                label: format!("reference, (a): {}", x.1),
                samples: &x.3,
                errors: &x.4,
            })
            .collect()
    };
    r.line("\n### (a) Baseline: disable, 10 ms hold, enable\n");
    r.line(&fr::table(CYCLE_COLS, &rows(Group::A)));
    r.line("\n### (b) The floor: controls that preempt nothing (docs/gate.md candidate 1)\n\nAgainst the running hog, no hold. A status other than NV_OK means RM refused the call; the time is still the ioctl's.\n");
    r.line(&fr::table(FLOOR_COLS, &rows(Group::B)));
    r.line("\n### (c) Schedule-only disable (`bOnlyDisableScheduling`, candidate 4)\n\nThe running TSG may keep the engine until its timeslice ends; \"frozen\" says whether it left within the hold.\n");
    let mut c = reference(&["all"]);
    c.extend(rows(Group::C));
    r.line(&fr::table(CYCLE_COLS, &c));
    r.line("\n### (d) Split: the compute TSG's channels, then the rest, back to back on one thread (candidate 3)\n");
    let mut d = reference(&["all"]);
    d.extend(rows(Group::D));
    r.line(&fr::table(SPLIT_COLS, &d));
    report_trigger(r, end, &rows(Group::E));
    report_burst(r, end, &rows(Group::F));
    report_offsets(r, end);
    report_checks(r, end);
    report_json(r, sets, cycles, loop_s, notes, end);
}

/// (e)'s table, the verdict and how the clocks were joined.
fn report_trigger(r: &mut Report, end: &End, rows: &[Row]) {
    r.line("\n### (e) Where online's first kernel starts (candidate 2)\n\nA separate CUDA process (`trigger`) busy-polls a flag in /dev/shm; on seeing it, it launches one 32-thread kernel that records `%globaltimer` at its start. The runner sets the flag immediately before the disable ioctl (or with offline already frozen, or with no control). The kernel's GPU time is put on the host clock by the hog's heartbeat (the smallest host-minus-GPU time of slot 0's writes in the 5 ms before each shot: exact up to one PCIe write, about 1 us); \"the same, GPU clock only\" compares the two `%globaltimer`s directly, without the mapping. In the baselines the issue is the flag.\n");
    if rows.is_empty() {
        r.line("Not run (see above).");
        return;
    }
    r.line(&fr::table(TRIGGER_COLS, rows));
    if let Some(t) = &end.trigger {
        r.line(&format!("\nThe trigger at exit: `{t}`."));
    }
    let v = fr::verdict(end.samples("trigger_disable"));
    r.line(&format!("\n**Verdict** (row \"disable all channels right after the flag\", cycles with the hog frozen; nearer = smaller absolute distance): {}", v.text));
    r.line(&format!(
        "\nHost clocks joined within {} ns (CLOCK_MONOTONIC of the trigger to the runner's clock).",
        end.host.uncertainty_ns
    ));
}

/// (f)'s table and the verdict on the split.
fn report_burst(r: &mut Report, end: &End, rows: &[Row]) {
    let b = end.burst;
    r.line(&format!("\n### (f) A burst of online kernels against the disable: what the split saves a request of many kernels\n\nOn the flag the trigger launches {} kernels of {} us GPU time each, 32 threads each, back to back on one stream; the first records `%globaltimer` at its start and the last at its end (mapped to the host clock as in (e)). The GPU span is the last end minus the first start, GPU clock only. The delay a slow disable adds is the disable-all row's last end minus the already-frozen row's. The GPU stop is confounded as in (e), more so here: the hog also stops ticking while online's slices run.\n", b.kernels, b.kernel_us));
    if rows.is_empty() {
        r.line("Not run (see above).");
        return;
    }
    r.line(&fr::table(BURST_COLS, rows));
    let text = end.burst_verdict().map_or_else(
        || "No verdict: one of the disable-all, split and already-frozen rows has no burst that ended.".to_string(),
        |v| v.text,
    );
    r.line(&format!(
        "\n**Verdict** (last kernel's end after the flag): {text}"
    ));
}

/// (g)'s table: the offset rows in order of D, with (e)'s no-control, already-frozen and D = 0
/// rows, and the description of what they show.
fn report_offsets(r: &mut Report, end: &End) {
    r.line("\n### (g) Online's launch against the disable's issue, at offsets\n\nAs in (e), one tiny online kernel, and the disable of all channels D us after the flag (D > 0), or the flag set -D us after the disable's issue by a second thread while the ioctl blocks the first (D < 0). Every time is after the flag, on the host clock; \"launch returned\" is the trigger's launch call's return, and online start - launch returned is the wait to compare with no control's. A launch during the disable waiting for the preemption would show in the negative offsets; the positive ones ask whether disabling right after online's launch costs it nothing. The (e) rows repeat here as baselines (D = 0 is (e)'s disable right after the flag).\n");
    let Some(verdict) = end.offset_verdict() else {
        r.line(if end.offsets.is_empty() {
            "Not run (`--floor-offsets-us` is empty)."
        } else {
            "Not run (see above)."
        });
        return;
    };
    let row = |key: &str, label: String| {
        end.row(key).map(|x| Row {
            label,
            samples: &x.3,
            errors: &x.4,
        })
    };
    let mut ds = end.offsets.clone();
    ds.push(0);
    ds.sort_unstable();
    let mut rows: Vec<Row> = [
        ("trigger_none", "(e) baseline: no control"),
        ("trigger_frozen", "(e) baseline: offline already frozen"),
    ]
    .iter()
    .filter_map(|(k, l)| row(k, l.to_string()))
    .collect();
    rows.extend(ds.iter().filter_map(|&d| match d {
        0 => row(
            "trigger_disable",
            "(e) D = 0: disable all channels right after the flag".into(),
        ),
        _ => {
            let (key, label) = offset_row(d);
            row(&key, label)
        }
    }));
    r.line(&fr::table(OFFSET_COLS, &rows));
    r.line(&format!(
        "\n**Verdict** (a description of the data, not a target; online start - launch returned, p50): {}",
        verdict.text
    ));
}

/// The checks that must hold: offline resumed after every cycle, the hog's checksum.
fn report_checks(r: &mut Report, end: &End) {
    let all: Vec<&Sample> = end.rows.iter().flat_map(|x| x.3.iter()).collect();
    let known = all.iter().filter(|s| s.resumed.is_some()).count();
    let not = all.iter().filter(|s| s.resumed == Some(false)).count();
    let ok = not == 0 && end.rescue_failed == 0 && end.ticking_at_end.is_ok();
    r.check(
        "floor: the hog resumed after every cycle that disabled it",
        ok,
        format!(
            "{not} of {known} cycles not resumed within 2 s; {} failed cycle(s) re-enabled, {} of them not ticking 2 s later; ticking at the end: {}",
            end.rescues,
            end.rescue_failed,
            match &end.ticking_at_end {
                Ok(()) => "yes".to_string(),
                Err(e) => format!("NO ({e:#})"),
            }
        ),
    );
    let (pass, detail) = match &end.hog {
        Ok(v) => (
            v["checksum_ok"].as_bool() == Some(true) || v["checksum_ok_shm"] == 1,
            v.to_string(),
        ),
        Err(e) => (false, format!("{e:#}")),
    };
    r.check(
        "floor: hog checksum equals the unpreempted result",
        pass,
        detail,
    );
}

fn report_json(
    r: &mut Report,
    sets: &Sets,
    cycles: usize,
    loop_s: f64,
    notes: &[String],
    end: &End,
) {
    let rows: Vec<Value> = end
        .rows
        .iter()
        .map(|(key, label, group, samples, errors)| {
            json!({"key": key, "label": label, "group": group, "summaries": fr::summaries(samples),
                   "errors": errors, "samples": samples})
        })
        .collect();
    r.json.insert(
        "floor".into(),
        json!({"cycles": cycles, "block": BLOCK, "hold_ms": HOLD.as_millis() as u64,
               "gap_ms": GAP.as_millis() as u64, "channels": sets.all.len(),
               "compute_tsg_channels": sets.compute.len(), "loop_s": loop_s, "notes": notes,
               "rows": rows, "verdict": fr::verdict(end.samples("trigger_disable")),
               "burst": end.burst, "burst_verdict": end.burst_verdict(), "host_clock": end.host,
               "offsets_us": end.offsets, "offset_verdict": end.offset_verdict(),
               "rescues": end.rescues, "trigger": end.trigger,
               "hog": end.hog.as_ref().ok().cloned().unwrap_or(Value::Null)}),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cycle_sample(stop: f64) -> Sample {
        Sample {
            ioctl_us: Some(800.0),
            return_us: Some(800.0),
            stop_us: Some(stop),
            enable_us: Some(500.0),
            frozen: Some(true),
            resumed: Some(true),
            ..Default::default()
        }
    }

    fn end(resumed: bool, hog: Result<Value>) -> End {
        let floor = Sample {
            ioctl_us: Some(300.0),
            status: Some(0),
            frozen: Some(false),
            ..Default::default()
        };
        let shot = Sample {
            online_start_us: Some(570.0),
            start_minus_stop_gpu_us: Some(4.0),
            resumed: Some(resumed),
            ..cycle_sample(566.0)
        };
        let burst = |end: f64| Sample {
            online_end_us: Some(end),
            burst_span_us: Some(end - 210.0),
            ..shot
        };
        let row = |key: &str, group, s: Sample| {
            let k = key.to_string();
            (k.clone(), k, group, vec![s; 10], Vec::new())
        };
        // (g): launch returned 10 us after the flag; no control starts 200 us after it.
        let g = |issue: Option<f64>, start: f64| Sample {
            issue_us: issue,
            online_launched_us: Some(10.0),
            online_start_us: Some(start),
            ..shot
        };
        End {
            rows: vec![
                row("all", Group::A, cycle_sample(566.0)),
                row("empty_disable", Group::B, floor),
                row("schedule_only", Group::C, cycle_sample(1000.0)),
                row("split", Group::D, cycle_sample(384.0)),
                row("trigger_disable", Group::E, shot),
                row("burst_disable", Group::F, burst(1800.0)),
                row("burst_split", Group::F, burst(1600.0)),
                row("burst_frozen", Group::F, burst(1400.0)),
                row("trigger_none", Group::E, g(None, 210.0)),
                row("offset_-400us", Group::G, g(Some(-400.0), 580.0)),
                row("offset_+150us", Group::G, g(Some(150.0), 215.0)),
            ],
            rescues: 0,
            rescue_failed: 0,
            ticking_at_end: Ok(()),
            hog,
            trigger: Some(json!({"shots": 10})),
            host: HostClock::from_sample(10, 5, 20),
            burst: Burst::new(20, 50).expect("valid"),
            offsets: vec![150, -400],
        }
    }

    fn render(e: &End) -> Report {
        let mut r = Report {
            md: String::new(),
            json: Default::default(),
            checks: vec![],
        };
        let sets = Sets {
            all: vec![],
            one: vec![],
            compute: vec![],
            rest: vec![],
        };
        report(&mut r, &sets, 10, 1.0, &["a note".into()], e);
        r
    }

    #[test]
    fn report_has_every_table_the_verdict_and_the_checks() {
        let r = render(&end(true, Ok(json!({"checksum_ok": true}))));
        for h in [
            "### (a)", "### (b)", "### (c)", "### (d)", "### (e)", "### (f)", "a note",
        ] {
            assert!(r.md.contains(h), "missing {h}:\n{}", r.md);
        }
        assert!(r.md.contains("**Verdict**"));
        assert!(r.md.contains("starts at the GPU stop"), "{}", r.md);
        // (c) and (d) repeat the all-channel row as a reference.
        assert_eq!(r.md.matches("| all | 10 |").count(), 1, "{}", r.md);
        assert_eq!(r.md.matches("| reference, (a): all | 10 |").count(), 2);
        assert!(r.checks.iter().all(|c| c.1), "{:?}", r.checks);
        let rows = r.json["floor"]["rows"].as_array().expect("rows");
        assert_eq!(rows.len(), 11);
        assert_eq!(rows[4]["summaries"]["online_start_us"]["p50_us"], 570.0);
        assert_eq!(r.json["floor"]["verdict"]["nearer_stop"], 10);
        // (f): the table, the verdict and the raw bursts.
        assert!(r.md.contains("launches 20 kernels of 50 us"), "{}", r.md);
        assert!(r
            .md
            .contains("| burst_split | 10 | 570 / 570 | 1600 / 1600 | 1390 / 1390 |"));
        assert!(r
            .md
            .contains("The split removes 200 of 400 us (50%) of the burst's delay at p50"));
        assert_eq!(rows[6]["group"], "F");
        assert_eq!(rows[6]["samples"][0]["online_end_us"], 1600.0);
        assert_eq!(r.json["floor"]["burst"]["kernels"], 20);
        assert_eq!(r.json["floor"]["burst_verdict"]["removed"][0], 200.0);
    }

    #[test]
    fn offsets_table_orders_rows_by_d_with_the_baselines() {
        let r = render(&end(true, Ok(json!({"checksum_ok": true}))));
        let g = &r.md[r.md.find("### (g)").expect("(g)")..];
        let order: Vec<usize> = [
            "| (e) baseline: no control | 10 | 200 / 200 | 210 / 210 | 10 | - |",
            "| D = -400: the flag 400 us after the disable's issue | 10 | 570 / 570 | 580 / 580 | 10 | -400 / -400 | 566 / 566 | 800 / 800 | 0 of 10 |",
            "| (e) D = 0: disable all channels right after the flag | 10 | - | 570 / 570 | - | - |",
            "| D = +150: disable all channels 150 us after the flag | 10 | 205 / 205 | 215 / 215 | 10 | 150 / 150 | 566 / 566 | 800 / 800 | 10 of 10 |",
        ]
        .iter()
        .map(|l| g.find(l).unwrap_or_else(|| panic!("missing {l}:\n{g}")))
        .collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{g}");
        assert!(
            !g.contains("already frozen"),
            "no trigger_frozen row was run"
        );
        assert!(g.contains("a launch during the disable waits."), "{g}");
        assert!(
            g.contains("a launch before the disable does not wait."),
            "{g}"
        );
        let f = &r.json["floor"];
        assert_eq!(f["offsets_us"], json!([150, -400]));
        assert_eq!(f["offset_verdict"]["during_waits"], true);
        assert_eq!(f["offset_verdict"]["before_within"], true);
        let rows = f["rows"].as_array().expect("rows");
        assert_eq!(rows[9]["group"], "G");
        assert_eq!(rows[9]["samples"][0]["issue_us"], -400.0);
        assert_eq!(rows[9]["summaries"]["launch_to_start_us"]["p50_us"], 570.0);
        assert_eq!(rows[9]["summaries"]["start_minus_stop_us"]["p50_us"], 14.0);
        // Without offsets (g) says so and the verdict is null.
        let mut e = end(true, Ok(json!({"checksum_ok": true})));
        e.offsets.clear();
        let r = render(&e);
        assert!(r.md.contains("Not run (`--floor-offsets-us` is empty)."));
        assert!(r.json["floor"]["offset_verdict"].is_null());
    }

    #[test]
    fn offsets_parse_and_reject_clearly() {
        assert_eq!(
            parse_offsets(DEFAULT_OFFSETS_US).expect("default").0,
            [-400, -200, -100, 50, 150, 300]
        );
        assert_eq!(parse_offsets(" -5 , 7 ").expect("spaces").0, [-5, 7]);
        assert_eq!(parse_offsets("").expect("empty"), Offsets::default());
        assert!(parse_offsets("  ").expect("blank").0.is_empty());
        for (bad, why) in [
            ("2001", "out of range"),
            ("-2001", "out of range"),
            ("0", "(e) row"),
            ("a", "not a signed integer"),
            ("50,", "not a signed integer"),
            ("-100,-100", "given twice"),
        ] {
            let e = parse_offsets(bad).expect_err(bad);
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn offset_rows_keys_labels_and_place() {
        assert_eq!(
            offset_row(150),
            (
                "offset_+150us".to_string(),
                "D = +150: disable all channels 150 us after the flag".to_string()
            )
        );
        assert_eq!(
            offset_row(-400),
            (
                "offset_-400us".to_string(),
                "D = -400: the flag 400 us after the disable's issue".to_string()
            )
        );
        let rows = all_rows(&[-400, 50]);
        assert_eq!(rows.len(), ROWS.len() + 2);
        let g: Vec<usize> = (0..rows.len()).filter(|&i| rows[i].2 == Group::G).collect();
        let last_e = rows.iter().rposition(|r| r.2 == Group::E).expect("(e)");
        let first_f = rows.iter().position(|r| r.2 == Group::F).expect("(f)");
        assert_eq!(g, [last_e + 1, last_e + 2]);
        assert_eq!(first_f, last_e + 3);
        assert_eq!(rows[g[0]].0, "offset_-400us");
        assert!(matches!(rows[g[1]].3, Kind::TriggerOffset(50)));
        assert!(Group::G.online());
        let keys: std::collections::BTreeSet<_> = all_rows(&[-400, -200, -100, 50, 150, 300])
            .into_iter()
            .map(|r| r.0)
            .collect();
        assert_eq!(keys.len(), ROWS.len() + 6, "keys are unique");
        assert_eq!(all_rows(&[]).len(), ROWS.len());
    }

    #[test]
    fn burst_without_its_rows_says_so() {
        let mut e = end(true, Ok(json!({"checksum_ok": true})));
        e.rows.retain(|x| x.0 != "burst_frozen");
        let r = render(&e);
        assert!(
            r.md.contains("No verdict: one of the disable-all"),
            "{}",
            r.md
        );
        assert!(r.json["floor"]["burst_verdict"].is_null());
        e.rows.retain(|x| x.2 != Group::F);
        assert!(render(&e).md.contains("### (f)"));
    }

    #[test]
    fn burst_rows_are_interleaved_and_need_the_trigger() {
        let f: Vec<_> = ROWS.iter().filter(|r| r.2 == Group::F).collect();
        assert_eq!(f.len(), 4);
        assert!(f.iter().all(|r| r.2.online() && r.0.starts_with("burst_")));
        assert!(matches!(f[0].3, Kind::Trigger(Chans::All, When::Issue)));
        assert!(matches!(f[1].3, Kind::TriggerSplit));
        assert!(matches!(f[2].3, Kind::Trigger(Chans::All, When::Frozen)));
        assert!(matches!(f[3].3, Kind::TriggerAlone));
        assert!(!Group::D.online() && Group::E.online());
    }

    #[test]
    fn checks_fail_on_a_missed_resume_or_a_bad_hog() {
        let r = render(&end(false, Ok(json!({"checksum_ok": false}))));
        assert_eq!(r.checks.len(), 2);
        assert!(r.checks.iter().all(|c| !c.1), "{:?}", r.checks);
        let r = render(&end(true, Err(anyhow::anyhow!("the hog hung"))));
        assert!(r.checks[0].1 && !r.checks[1].1);
        assert!(r.checks[1].2.contains("the hog hung"));
    }
}
