//! The floor experiment's numbers: per-cycle samples, their summaries, the markdown tables, the
//! verdict on what online's first kernel waits for, the one on how much of a burst's delay the
//! split removes and the one on whether online's launch waits for a disable in progress. Pure
//! functions, tested without a GPU.

use std::collections::BTreeMap;

use serde::Serialize;
use valve::bindings::RmStatus;
use valve::stats::{summarize_us, Summary};

/// One cycle of one row. Times are microseconds after the issue (the first ioctl's start, or the
/// trigger's flag; in (g) always the flag, and the issue is `issue_us`), on the runner's clock; a
/// field the row does not measure stays `None`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Sample {
    /// The (first) control's ioctl.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ioctl_us: Option<f64>,
    /// Split: the second call's ioctl.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub second_ioctl_us: Option<f64>,
    /// RM's status (the floor's controls, which may be refused).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u32>,
    /// (g): the disable's issue (its first ioctl's start) after the flag; negative when the flag
    /// came after the issue.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub issue_us: Option<f64>,
    /// The (last) disable ioctl's return.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub return_us: Option<f64>,
    /// The hog's last heartbeat (host poller): the GPU stop.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stop_us: Option<f64>,
    /// The enable ioctl(s) that ended the hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub enable_us: Option<f64>,
    /// Nothing of the hog advanced during the hold.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frozen: Option<bool>,
    /// The hog's heartbeat came back within 2 s of the enable.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resumed: Option<bool>,
    /// Online's kernel started (its `%globaltimer`, mapped to the host clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub online_start_us: Option<f64>,
    /// Online's host thread saw the flag.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub online_seen_us: Option<f64>,
    /// Online's launch call returned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub online_launched_us: Option<f64>,
    /// Online's stream synchronisation returned.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub online_synced_us: Option<f64>,
    /// Burst: the last kernel's end (its `%globaltimer`, mapped to the host clock).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub online_end_us: Option<f64>,
    /// Burst: the last kernel's end minus the first one's start, `%globaltimer` only.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub burst_span_us: Option<f64>,
    /// Online's kernel start minus the hog's last heartbeat, both `%globaltimer` (no mapping).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub start_minus_stop_gpu_us: Option<f64>,
    /// The trigger fired but online's kernel had not finished within the shot timeout.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub online_timeout: bool,
}

/// A named timing of a sample.
pub type Field = (&'static str, fn(&Sample) -> Option<f64>);

/// Every timing a sample can carry, by the name the JSON summaries use.
pub const FIELDS: [Field; 16] = [
    ("ioctl_us", |s| s.ioctl_us),
    ("issue_us", |s| s.issue_us),
    ("second_ioctl_us", |s| s.second_ioctl_us),
    ("return_us", |s| s.return_us),
    ("stop_us", |s| s.stop_us),
    ("enable_us", |s| s.enable_us),
    ("online_start_us", |s| s.online_start_us),
    ("online_seen_us", |s| s.online_seen_us),
    ("online_launched_us", |s| s.online_launched_us),
    ("online_synced_us", |s| s.online_synced_us),
    ("online_end_us", |s| s.online_end_us),
    ("burst_span_us", |s| s.burst_span_us),
    ("start_minus_stop_gpu_us", |s| s.start_minus_stop_gpu_us),
    ("start_minus_return_us", start_minus_return),
    ("start_minus_stop_us", start_minus_stop),
    ("launch_to_start_us", launch_to_start),
];

/// Online's start minus the ioctl's return.
pub fn start_minus_return(s: &Sample) -> Option<f64> {
    Some(s.online_start_us? - s.return_us?)
}

/// Online's start minus the GPU stop (host clock).
pub fn start_minus_stop(s: &Sample) -> Option<f64> {
    Some(s.online_start_us? - s.stop_us?)
}

/// Online's kernel start minus its launch call's return (host clock): how long a launched kernel
/// waited for the GPU.
pub fn launch_to_start(s: &Sample) -> Option<f64> {
    Some(s.online_start_us? - s.online_launched_us?)
}

/// The values of one timing.
pub fn values(samples: &[Sample], f: fn(&Sample) -> Option<f64>) -> Vec<f64> {
    samples.iter().filter_map(f).collect()
}

/// Summaries of every timing that has at least one value.
pub fn summaries(samples: &[Sample]) -> BTreeMap<&'static str, Summary> {
    FIELDS
        .iter()
        .filter_map(|(name, f)| {
            let v = values(samples, *f);
            (!v.is_empty()).then(|| (*name, summarize_us(&v)))
        })
        .collect()
}

/// "p50 / p99" of one timing, whole microseconds; "-" without values.
pub fn p50_p99(samples: &[Sample], f: fn(&Sample) -> Option<f64>) -> String {
    let v = values(samples, f);
    if v.is_empty() {
        return "-".into();
    }
    let s = summarize_us(&v);
    format!("{:.0} / {:.0}", s.p50_us, s.p99_us)
}

/// The p50 of one timing; "-" without values.
pub fn p50(samples: &[Sample], f: fn(&Sample) -> Option<f64>) -> String {
    let v = values(samples, f);
    if v.is_empty() {
        return "-".into();
    }
    format!("{:.0}", summarize_us(&v).p50_us)
}

/// "yes" if every known value holds, "NO (k of n)" if k do not, "-" if none is known.
pub fn all_hold(samples: &[Sample], f: fn(&Sample) -> Option<bool>) -> String {
    let known: Vec<bool> = samples.iter().filter_map(f).collect();
    let bad = known.iter().filter(|b| !**b).count();
    match (known.len(), bad) {
        (0, _) => "-".into(),
        (_, 0) => "yes".into(),
        (n, k) => format!("NO ({k} of {n})"),
    }
}

/// RM's statuses and how often each came, e.g. "NV_OK (0x0) x100".
pub fn statuses(samples: &[Sample]) -> String {
    let mut counts = BTreeMap::<u32, usize>::new();
    for s in samples.iter().filter_map(|s| s.status) {
        *counts.entry(s).or_default() += 1;
    }
    if counts.is_empty() {
        return "-".into();
    }
    counts
        .iter()
        .map(|(s, n)| format!("{} x{n}", RmStatus(*s)))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One table row: a label, its samples and the errors that cost it cycles.
pub struct Row<'a> {
    /// What the row measures.
    pub label: String,
    /// Its cycles.
    pub samples: &'a [Sample],
    /// Cycles that failed, with why.
    pub errors: &'a [String],
}

/// Shots whose online kernel (or burst) did not run within 500 ms.
fn timeouts_cell(r: &Row) -> String {
    r.samples
        .iter()
        .filter(|s| s.online_timeout)
        .count()
        .to_string()
}

/// Whether the hog was frozen in every hold, and resumed after every one.
fn hog_cell(r: &Row) -> String {
    format!(
        "{} / {}",
        all_hold(r.samples, |s| s.frozen),
        all_hold(r.samples, |s| s.resumed)
    )
}

/// "0", or the number of failed cycles and the first reason (markdown-safe, at most 120 chars).
pub fn errors_cell(r: &Row) -> String {
    match r.errors.first() {
        None => "0".into(),
        Some(e) => {
            let short: String = e
                .replace('|', "/")
                .replace('\n', " ")
                .chars()
                .take(120)
                .collect();
            format!("{}: {short}", r.errors.len())
        }
    }
}

/// A column: its header and how a row fills it.
pub type Column = (&'static str, fn(&Row) -> String);

/// A markdown table of `rows` under `cols` (a first "row" column holds the labels).
pub fn table(cols: &[Column], rows: &[Row]) -> String {
    let head: Vec<&str> = std::iter::once("row")
        .chain(cols.iter().map(|c| c.0))
        .collect();
    let mut out = format!("| {} |\n|{}", head.join(" | "), "---|".repeat(head.len()));
    for r in rows {
        let cells: Vec<String> = std::iter::once(r.label.replace('|', "/"))
            .chain(cols.iter().map(|c| (c.1)(r)))
            .collect();
        out.push_str(&format!("\n| {} |", cells.join(" | ")));
    }
    out
}

/// (a) and (c): disable, hold, enable.
pub const CYCLE_COLS: &[Column] = &[
    ("cycles", |r| r.samples.len().to_string()),
    ("disable ioctl p50 / p99 (us)", |r| {
        p50_p99(r.samples, |s| s.ioctl_us)
    }),
    ("GPU stop after issue p50 / p99", |r| {
        p50_p99(r.samples, |s| s.stop_us)
    }),
    ("enable ioctl p50 / p99", |r| {
        p50_p99(r.samples, |s| s.enable_us)
    }),
    ("frozen every hold", |r| all_hold(r.samples, |s| s.frozen)),
    ("resumed every time", |r| all_hold(r.samples, |s| s.resumed)),
    ("failed cycles", errors_cell),
];

/// (b): one control that preempts nothing.
pub const FLOOR_COLS: &[Column] = &[
    ("calls", |r| r.samples.len().to_string()),
    ("ioctl p50 / p99 (us)", |r| {
        p50_p99(r.samples, |s| s.ioctl_us)
    }),
    ("ioctl max", |r| {
        let v = values(r.samples, |s| s.ioctl_us);
        if v.is_empty() {
            "-".into()
        } else {
            format!("{:.0}", summarize_us(&v).max_us)
        }
    }),
    ("RM status", |r| statuses(r.samples)),
    ("hog kept running", |r| {
        all_hold(r.samples, |s| s.frozen.map(|f| !f))
    }),
    ("failed calls", errors_cell),
];

/// (d): the compute TSG, then the rest, back to back.
pub const SPLIT_COLS: &[Column] = &[
    ("cycles", |r| r.samples.len().to_string()),
    ("first ioctl p50 / p99 (us)", |r| {
        p50_p99(r.samples, |s| s.ioctl_us)
    }),
    ("second ioctl p50 / p99", |r| {
        p50_p99(r.samples, |s| s.second_ioctl_us)
    }),
    ("last return after first issue p50 / p99", |r| {
        p50_p99(r.samples, |s| s.return_us)
    }),
    ("GPU stop after first issue p50 / p99", |r| {
        p50_p99(r.samples, |s| s.stop_us)
    }),
    ("enable p50", |r| p50(r.samples, |s| s.enable_us)),
    ("frozen every hold", |r| all_hold(r.samples, |s| s.frozen)),
    ("resumed every time", |r| all_hold(r.samples, |s| s.resumed)),
    ("failed cycles", errors_cell),
];

/// (e): online's first kernel against the disable.
pub const TRIGGER_COLS: &[Column] = &[
    ("shots", |r| r.samples.len().to_string()),
    ("online kernel start - issue p50 / p99 (us)", |r| {
        p50_p99(r.samples, |s| s.online_start_us)
    }),
    ("GPU stop - issue p50 / p99", |r| {
        p50_p99(r.samples, |s| s.stop_us)
    }),
    ("ioctl return - issue p50 / p99", |r| {
        p50_p99(r.samples, |s| s.return_us)
    }),
    ("online start - GPU stop p50 / p99", |r| {
        p50_p99(r.samples, start_minus_stop)
    }),
    ("the same, GPU clock only", |r| {
        p50_p99(r.samples, |s| s.start_minus_stop_gpu_us)
    }),
    ("online start - ioctl return p50 / p99", |r| {
        p50_p99(r.samples, start_minus_return)
    }),
    (
        "online saw flag / launch returned / sync returned - issue p50",
        |r| {
            format!(
                "{} / {} / {}",
                p50(r.samples, |s| s.online_seen_us),
                p50(r.samples, |s| s.online_launched_us),
                p50(r.samples, |s| s.online_synced_us)
            )
        },
    ),
    ("no kernel within 500 ms", timeouts_cell),
    ("hog frozen / resumed", hog_cell),
    ("failed cycles", errors_cell),
];

/// (f): a burst of online kernels against the disable.
pub const BURST_COLS: &[Column] = &[
    ("shots", |r| r.samples.len().to_string()),
    ("first kernel start - flag p50 / p99 (us)", |r| {
        p50_p99(r.samples, |s| s.online_start_us)
    }),
    ("last kernel end - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.online_end_us)
    }),
    ("burst GPU span p50 / p99", |r| {
        p50_p99(r.samples, |s| s.burst_span_us)
    }),
    ("GPU stop - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.stop_us)
    }),
    ("(last) ioctl return - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.return_us)
    }),
    ("sync returned - flag p50", |r| {
        p50(r.samples, |s| s.online_synced_us)
    }),
    ("no burst within 500 ms", timeouts_cell),
    ("hog frozen / resumed", hog_cell),
    ("failed cycles", errors_cell),
];

/// "k of n": cycles where online's kernel started before the GPU stop, of those with both; "-"
/// if none has both.
pub fn before_stop(samples: &[Sample]) -> String {
    let d = values(samples, start_minus_stop);
    if d.is_empty() {
        return "-".into();
    }
    format!("{} of {}", d.iter().filter(|x| **x < 0.0).count(), d.len())
}

/// (g): online's launch at offsets from the disable's issue; every time after the flag.
pub const OFFSET_COLS: &[Column] = &[
    ("shots", |r| r.samples.len().to_string()),
    ("online start - launch returned p50 / p99 (us)", |r| {
        p50_p99(r.samples, launch_to_start)
    }),
    ("online start - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.online_start_us)
    }),
    ("launch returned - flag p50", |r| {
        p50(r.samples, |s| s.online_launched_us)
    }),
    ("disable issue - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.issue_us)
    }),
    ("GPU stop - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.stop_us)
    }),
    ("ioctl return - flag p50 / p99", |r| {
        p50_p99(r.samples, |s| s.return_us)
    }),
    ("online started before the GPU stop", |r| {
        before_stop(r.samples)
    }),
    ("no kernel within 500 ms", timeouts_cell),
    ("hog frozen / resumed", hog_cell),
    ("failed cycles", errors_cell),
];

/// (g): online's launch-to-start at one offset between the flag and the disable's issue.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OffsetP50 {
    /// D: the disable's issue after the flag (negative: the flag after the issue), us.
    pub offset_us: i64,
    /// Cycles with online's launch and start.
    pub cycles: usize,
    /// Their launch-to-start p50 (`None` without cycles).
    pub p50_us: Option<f64>,
}

/// (g)'s description: does online's launch wait when it comes during the disable, and not when
/// it comes before? Launch-to-start p50s against the no-control row's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct OffsetVerdict {
    /// The no-control row's launch-to-start p50 (`None` without cycles).
    pub no_control_p50_us: Option<f64>,
    /// Every offset's, in the order given.
    pub offsets: Vec<OffsetP50>,
    /// The most negative offset's p50 exceeds no control's by more than `DURING_WAITS_US`
    /// (`None`: no such offset, or no p50 to compare).
    pub during_waits: Option<bool>,
    /// Every positive offset's p50 is within `BEFORE_WITHIN_US` of no control's (`None`: no
    /// positive offset with a p50, or no control has none).
    pub before_within: Option<bool>,
    /// The sentences the report prints.
    pub text: String,
}

/// Above this excess over no control (us), a launch during the disable is said to wait.
pub const DURING_WAITS_US: f64 = 100.0;
/// Within this distance of no control (us), a launch before the disable is said not to wait.
pub const BEFORE_WITHIN_US: f64 = 50.0;

/// Describes (g): `none` is the no-control row, `rows` the offset rows (D, samples).
pub fn offset_verdict(none: &[Sample], rows: &[(i64, &[Sample])]) -> OffsetVerdict {
    let p50_of = |x: &[Sample]| {
        let v = values(x, launch_to_start);
        (v.len(), (!v.is_empty()).then(|| summarize_us(&v).p50_us))
    };
    let offsets: Vec<OffsetP50> = rows
        .iter()
        .map(|(d, x)| {
            let (cycles, p50_us) = p50_of(x);
            OffsetP50 {
                offset_us: *d,
                cycles,
                p50_us,
            }
        })
        .collect();
    let base = p50_of(none).1;
    let during = most_negative(&offsets).and_then(|o| o.p50_us);
    let positive: Vec<f64> = positive(&offsets).filter_map(|o| o.p50_us).collect();
    let mut v = OffsetVerdict {
        no_control_p50_us: base,
        during_waits: base.zip(during).map(|(b, p)| p - b > DURING_WAITS_US),
        before_within: base
            .filter(|_| !positive.is_empty())
            .map(|b| positive.iter().all(|p| (p - b).abs() <= BEFORE_WITHIN_US)),
        offsets,
        text: String::new(),
    };
    v.text = offset_text(&v);
    v
}

fn most_negative(offsets: &[OffsetP50]) -> Option<&OffsetP50> {
    offsets
        .iter()
        .filter(|o| o.offset_us < 0)
        .min_by_key(|o| o.offset_us)
}

fn positive(offsets: &[OffsetP50]) -> impl Iterator<Item = &OffsetP50> {
    offsets.iter().filter(|o| o.offset_us > 0)
}

fn offset_text(v: &OffsetVerdict) -> String {
    let Some(base) = v.no_control_p50_us else {
        return "No verdict: the no-control row has no cycle with online's launch and start."
            .into();
    };
    format!(
        "With no control, online's kernel started p50 {base:.0} us after its launch returned. {} {}",
        during_text(v, base),
        before_text(v, base)
    )
}

/// The most negative offset against no control.
fn during_text(v: &OffsetVerdict, base: f64) -> String {
    let Some(o) = most_negative(&v.offsets) else {
        return "No negative offset was run.".into();
    };
    let d = o.offset_us.unsigned_abs();
    let Some(p) = o.p50_us else {
        return format!("At D = -{d} us no cycle has online's launch and start.");
    };
    let at = format!(
        "At D = -{d} us (the flag {d} us after the disable's issue) it started p50 {p:.0} us after its launch, {:+.0} us against no control ({} cycles)",
        p - base,
        o.cycles
    );
    if v.during_waits == Some(true) {
        format!("{at}: more than {DURING_WAITS_US:.0} us, a launch during the disable waits.")
    } else {
        format!("{at}: not more than {DURING_WAITS_US:.0} us, no sign that a launch during the disable waits.")
    }
}

/// The positive offsets against no control.
fn before_text(v: &OffsetVerdict, base: f64) -> String {
    let pos: Vec<(i64, f64)> = positive(&v.offsets)
        .filter_map(|o| Some((o.offset_us, o.p50_us?)))
        .collect();
    if pos.is_empty() {
        return "No positive offset has a cycle with online's launch and start.".into();
    }
    let list = pos
        .iter()
        .map(|(d, p)| format!("{p:.0} us ({:+.0}) at D = +{d}", p - base))
        .collect::<Vec<_>>()
        .join(", ");
    let far: Vec<String> = pos
        .iter()
        .filter(|(_, p)| (p - base).abs() > BEFORE_WITHIN_US)
        .map(|(d, _)| format!("+{d}"))
        .collect();
    let head =
        format!("With the disable issued after the flag it started p50 {list} after its launch");
    if far.is_empty() {
        format!("{head}: within {BEFORE_WITHIN_US:.0} us of no control at each, a launch before the disable does not wait.")
    } else {
        format!(
            "{head}: more than {BEFORE_WITHIN_US:.0} us from no control at D = {}, a launch before the disable does not start as it does with no control there.",
            far.join(", ")
        )
    }
}

/// How much of the burst's delay the split removes: the last kernel's end after the flag with
/// the disable of all channels, with the split and with offline already frozen.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BurstVerdict {
    /// The last kernel's end after the flag: disable all, split, already frozen.
    pub end_all: Summary,
    /// With the split.
    pub end_split: Summary,
    /// With offline already frozen.
    pub end_frozen: Summary,
    /// Disable all minus already frozen (the delay a slow disable adds), p50 and p99 (us).
    pub excess: [f64; 2],
    /// Disable all minus split (what the split removes of it), p50 and p99 (us).
    pub removed: [f64; 2],
    /// The sentence the report prints.
    pub text: String,
}

/// Compares the burst rows; `None` if one of the three has no burst that ended.
pub fn burst_verdict(all: &[Sample], split: &[Sample], frozen: &[Sample]) -> Option<BurstVerdict> {
    let end = |x: &[Sample]| {
        let v = values(x, |s| s.online_end_us);
        (!v.is_empty()).then(|| summarize_us(&v))
    };
    let (a, sp, f) = (end(all)?, end(split)?, end(frozen)?);
    let mut v = BurstVerdict {
        end_all: a,
        end_split: sp,
        end_frozen: f,
        excess: [a.p50_us - f.p50_us, a.p99_us - f.p99_us],
        removed: [a.p50_us - sp.p50_us, a.p99_us - sp.p99_us],
        text: String::new(),
    };
    v.text = burst_text(&v);
    Some(v)
}

/// "a of b us (c%)", or why there is no share.
fn share(removed: f64, excess: f64) -> String {
    if excess > 0.0 {
        format!(
            "{removed:.0} of {excess:.0} us ({:.0}%)",
            100.0 * removed / excess
        )
    } else {
        format!("{removed:.0} us of no delay (disable all is {excess:.0} us from already frozen)")
    }
}

fn burst_text(v: &BurstVerdict) -> String {
    let pair = |s: &Summary| format!("{:.0} / {:.0}", s.p50_us, s.p99_us);
    format!(
        "The split removes {} of the burst's delay at p50 and {} at p99. The last kernel ended p50 / p99 {} us after the flag with disable all, {} with the split, {} with offline already frozen ({} / {} / {} bursts).",
        share(v.removed[0], v.excess[0]),
        share(v.removed[1], v.excess[1]),
        pair(&v.end_all),
        pair(&v.end_split),
        pair(&v.end_frozen),
        v.end_all.n,
        v.end_split.n,
        v.end_frozen.n
    )
}

/// Where online's first kernel started against the disable, over the cycles of the "disable all
/// channels right after the trigger" row that have all three times and a frozen hold.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    /// Cycles with online's start, the GPU stop and the ioctl's return.
    pub cycles: usize,
    /// Of those, online started nearer the stop than the return.
    pub nearer_stop: usize,
    /// Online started nearer the return.
    pub nearer_return: usize,
    /// Online started before the ioctl returned.
    pub before_return: usize,
    /// Return minus stop.
    pub return_minus_stop: Summary,
    /// Online's start minus the stop.
    pub start_minus_stop: Summary,
    /// Online's start minus the return.
    pub start_minus_return: Summary,
    /// The sentence the report prints.
    pub text: String,
}

/// Share of cycles one explanation must win for a verdict.
pub const VERDICT_SHARE: f64 = 0.8;
/// Below this p50 gap between the stop and the return (us), the two cannot be told apart.
pub const MIN_GAP_US: f64 = 50.0;

/// Decides whether online's first kernel starts at the GPU stop or at the ioctl's return.
pub fn verdict(samples: &[Sample]) -> Verdict {
    let usable: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.frozen == Some(true) && start_minus_stop(s).is_some())
        .filter(|s| s.return_us.is_some())
        .collect();
    let col = |f: fn(&Sample) -> Option<f64>| {
        summarize_us(&usable.iter().filter_map(|s| f(s)).collect::<Vec<_>>())
    };
    let rs = |s: &Sample| Some(s.return_us? - s.stop_us?);
    let n = usable.len();
    let nearer_stop = usable
        .iter()
        .filter(|s| start_minus_stop(s).map(f64::abs) < start_minus_return(s).map(f64::abs))
        .count();
    let before_return = usable
        .iter()
        .filter(|s| start_minus_return(s).is_some_and(|d| d < 0.0))
        .count();
    let mut v = Verdict {
        cycles: n,
        nearer_stop,
        nearer_return: n - nearer_stop,
        before_return,
        return_minus_stop: col(rs),
        start_minus_stop: col(start_minus_stop),
        start_minus_return: col(start_minus_return),
        text: String::new(),
    };
    v.text = verdict_text(&v);
    v
}

fn verdict_text(v: &Verdict) -> String {
    let n = v.cycles;
    if n == 0 {
        return "No cycle had online's start, the GPU stop and the ioctl's return with the hog frozen: no verdict.".into();
    }
    let nums = format!(
        "online's kernel started p50 {:+.0} us (p99 {:+.0}) from the GPU stop and {:+.0} us (p99 {:+.0}) from the ioctl's return; it started before the return in {} of {n} cycles; the return came p50 {:.0} us after the stop",
        v.start_minus_stop.p50_us, v.start_minus_stop.p99_us, v.start_minus_return.p50_us,
        v.start_minus_return.p99_us, v.before_return, v.return_minus_stop.p50_us
    );
    let share = |k: usize| k as f64 >= VERDICT_SHARE * n as f64;
    if v.return_minus_stop.p50_us < MIN_GAP_US {
        format!("Undecided: the GPU stop and the ioctl's return are too close to tell apart (under {MIN_GAP_US:.0} us at p50); {nums}.")
    } else if share(v.nearer_stop) {
        format!("Online's first kernel starts at the GPU stop, not at the ioctl's return: nearer the stop in {} of {n} cycles; {nums}.", v.nearer_stop)
    } else if share(v.nearer_return) {
        format!("Online's first kernel starts at the ioctl's return, not at the GPU stop: nearer the return in {} of {n} cycles, so online waits on RM (look for an RM call on its launch path with the ioctl logger); {nums}.", v.nearer_return)
    } else {
        format!(
            "Mixed: nearer the stop in {} and nearer the return in {} of {n} cycles; {nums}.",
            v.nearer_stop, v.nearer_return
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shot(start: f64, stop: f64, ret: f64) -> Sample {
        Sample {
            online_start_us: Some(start),
            stop_us: Some(stop),
            return_us: Some(ret),
            frozen: Some(true),
            resumed: Some(true),
            ..Default::default()
        }
    }

    #[test]
    fn summaries_cover_the_measured_fields_only() {
        let s: Vec<Sample> = (1..=100).map(|i| shot(i as f64, 0.0, 200.0)).collect();
        let m = summaries(&s);
        assert_eq!(m["online_start_us"].p50_us, 50.0);
        assert_eq!(m["online_start_us"].p99_us, 99.0);
        assert_eq!(m["start_minus_return_us"].p50_us, -150.0);
        assert!(!m.contains_key("ioctl_us"));
        assert_eq!(p50_p99(&s, |s| s.online_start_us), "50 / 99");
        assert_eq!(p50_p99(&s, |s| s.ioctl_us), "-");
        assert_eq!(p50(&s, |s| s.stop_us), "0");
    }

    #[test]
    fn holds_and_statuses() {
        let mut s = vec![shot(1.0, 0.0, 2.0); 4];
        assert_eq!(all_hold(&s, |s| s.frozen), "yes");
        s[1].frozen = Some(false);
        s[2].frozen = None;
        assert_eq!(all_hold(&s, |s| s.frozen), "NO (1 of 3)");
        assert_eq!(all_hold(&s, |s| s.status.map(|_| true)), "-");
        let st: Vec<Sample> = [0u32, 0, 0x1f]
            .iter()
            .map(|c| Sample {
                status: Some(*c),
                ..Default::default()
            })
            .collect();
        let text = statuses(&st);
        assert!(text.starts_with("NV_OK"), "{text}");
        assert!(text.contains("x2") && text.contains("x1"), "{text}");
        assert_eq!(statuses(&[]), "-");
    }

    #[test]
    fn table_layout() {
        let s = vec![
            Sample {
                ioctl_us: Some(300.0),
                status: Some(0),
                frozen: Some(false),
                ..Default::default()
            };
            3
        ];
        let errs = vec!["raw ioctl failed: a | b\nc".to_string()];
        let rows = [
            Row {
                label: "empty disable".into(),
                samples: &s,
                errors: &[],
            },
            Row {
                label: "refused".into(),
                samples: &[],
                errors: &errs,
            },
        ];
        let t = table(FLOOR_COLS, &rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(
            lines[0],
            "| row | calls | ioctl p50 / p99 (us) | ioctl max | RM status | hog kept running | failed calls |"
        );
        assert_eq!(lines[1], "|---|---|---|---|---|---|---|");
        assert_eq!(
            lines[2],
            "| empty disable | 3 | 300 / 300 | 300 | NV_OK (0x0) x3 | yes | 0 |"
        );
        assert_eq!(
            lines[3],
            "| refused | 0 | - | - | - | - | 1: raw ioctl failed: a / b c |"
        );
        for cols in [
            CYCLE_COLS,
            SPLIT_COLS,
            TRIGGER_COLS,
            BURST_COLS,
            OFFSET_COLS,
        ] {
            let t = table(cols, &rows);
            let bars = |l: &str| l.matches('|').count();
            assert!(t.lines().all(|l| bars(l) == cols.len() + 2), "{t}");
        }
    }

    fn burst(start: f64, end: f64) -> Sample {
        Sample {
            online_start_us: Some(start),
            online_end_us: Some(end),
            burst_span_us: Some(end - start - 5.0),
            ..Default::default()
        }
    }

    fn bursts(ends: impl Iterator<Item = f64>) -> Vec<Sample> {
        ends.map(|e| burst(200.0, e)).collect()
    }

    #[test]
    fn burst_table_row() {
        let s = bursts((1..=100).map(|i| 1000.0 + i as f64));
        let rows = [Row {
            label: "split".into(),
            samples: &s,
            errors: &[],
        }];
        let t = table(BURST_COLS, &rows);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(
            lines[0],
            "| row | shots | first kernel start - flag p50 / p99 (us) | last kernel end - flag p50 / p99 | burst GPU span p50 / p99 | GPU stop - flag p50 / p99 | (last) ioctl return - flag p50 / p99 | sync returned - flag p50 | no burst within 500 ms | hog frozen / resumed | failed cycles |"
        );
        assert_eq!(
            lines[2],
            "| split | 100 | 200 / 200 | 1050 / 1099 | 845 / 894 | - | - | - | 0 | - / - | 0 |"
        );
        let m = summaries(&s);
        assert_eq!(m["online_end_us"].p50_us, 1050.0);
        assert_eq!(m["burst_span_us"].p99_us, 894.0);
    }

    #[test]
    fn burst_verdict_shares_of_the_excess() {
        // Frozen ends at 1200 / 1300, disable all at 1800 / 2000, the split at 1500 / 1650.
        let all = bursts((0..100).map(|i| if i < 98 { 1800.0 } else { 2000.0 }));
        let split = bursts((0..100).map(|i| if i < 98 { 1500.0 } else { 1650.0 }));
        let frozen = bursts((0..100).map(|i| if i < 98 { 1200.0 } else { 1300.0 }));
        let v = burst_verdict(&all, &split, &frozen).expect("a verdict");
        assert_eq!(v.excess, [600.0, 700.0]);
        assert_eq!(v.removed, [300.0, 350.0]);
        assert!(
            v.text.starts_with(
                "The split removes 300 of 600 us (50%) of the burst's delay at p50 and 350 of 700 us (50%) at p99."
            ),
            "{}",
            v.text
        );
        assert!(v.text.contains("1800 / 2000 us after the flag with disable all, 1500 / 1650 with the split, 1200 / 1300 with offline"), "{}", v.text);
        assert!(v.text.ends_with("(100 / 100 / 100 bursts)."), "{}", v.text);
    }

    #[test]
    fn burst_verdict_without_an_excess_or_a_row() {
        let same = bursts((0..10).map(|_| 1200.0));
        let v = burst_verdict(&same, &same, &same).expect("a verdict");
        assert!(v.text.contains("0 us of no delay"), "{}", v.text);
        let timed_out = vec![Sample {
            online_timeout: true,
            ..Default::default()
        }];
        assert!(burst_verdict(&same, &timed_out, &same).is_none());
        assert!(burst_verdict(&[], &same, &same).is_none());
    }

    /// A (g) shot: launch returned at 10 us, the kernel started `l2s` us later.
    fn launched(l2s: f64) -> Sample {
        Sample {
            online_launched_us: Some(10.0),
            online_start_us: Some(10.0 + l2s),
            stop_us: Some(400.0),
            ..Default::default()
        }
    }

    #[test]
    fn offset_verdict_waits_during_not_before() {
        let none = vec![launched(190.0); 10];
        let (m400, m100, p50, p300) = (
            vec![launched(480.0); 10],
            vec![launched(300.0); 10],
            vec![launched(200.0); 10],
            vec![launched(160.0); 10],
        );
        let rows: Vec<(i64, &[Sample])> =
            vec![(-100, &m100), (300, &p300), (-400, &m400), (50, &p50)];
        let v = offset_verdict(&none, &rows);
        assert_eq!(v.no_control_p50_us, Some(190.0));
        assert_eq!((v.during_waits, v.before_within), (Some(true), Some(true)));
        assert_eq!(v.offsets[2].p50_us, Some(480.0));
        assert_eq!(
            v.text,
            "With no control, online's kernel started p50 190 us after its launch returned. At D = -400 us (the flag 400 us after the disable's issue) it started p50 480 us after its launch, +290 us against no control (10 cycles): more than 100 us, a launch during the disable waits. With the disable issued after the flag it started p50 160 us (-30) at D = +300, 200 us (+10) at D = +50 after its launch: within 50 us of no control at each, a launch before the disable does not wait."
        );
        assert_eq!(before_stop(&m400), "0 of 10");
        assert_eq!(before_stop(&p50), "10 of 10");
        assert_eq!(before_stop(&none[..0]), "-");
    }

    #[test]
    fn offset_verdict_other_outcomes() {
        let none = vec![launched(190.0); 10];
        let (m400, p150) = (vec![launched(250.0); 10], vec![launched(260.0); 10]);
        let v = offset_verdict(&none, &[(-400, &m400), (150, &p150)]);
        assert_eq!(
            (v.during_waits, v.before_within),
            (Some(false), Some(false))
        );
        assert!(
            v.text.contains("+60 us against no control (10 cycles): not more than 100 us, no sign that a launch during the disable waits."),
            "{}",
            v.text
        );
        assert!(
            v.text.ends_with("more than 50 us from no control at D = +150, a launch before the disable does not start as it does with no control there."),
            "{}",
            v.text
        );
        let v = offset_verdict(&none, &[(150, &p150)]);
        assert!(v.text.contains("No negative offset was run."), "{}", v.text);
        assert_eq!(v.during_waits, None);
        let v = offset_verdict(&none, &[(-400, &[]), (150, &[])]);
        assert!(v.text.contains("At D = -400 us no cycle has"), "{}", v.text);
        assert!(v
            .text
            .ends_with("No positive offset has a cycle with online's launch and start."));
        assert_eq!((v.during_waits, v.before_within), (None, None));
        let v = offset_verdict(&[], &[(-400, &m400)]);
        assert!(v.text.starts_with("No verdict"), "{}", v.text);
        assert_eq!(v.during_waits, None);
    }

    #[test]
    fn verdict_at_the_stop() {
        // Stop at 500 us, return at 750 us, online starts 5-15 us after the stop.
        let s: Vec<Sample> = (0..100)
            .map(|i| shot(505.0 + (i % 10) as f64, 500.0, 750.0))
            .collect();
        let v = verdict(&s);
        assert_eq!((v.cycles, v.nearer_stop, v.before_return), (100, 100, 100));
        assert!(v
            .text
            .starts_with("Online's first kernel starts at the GPU stop"));
        assert_eq!(v.return_minus_stop.p50_us, 250.0);
    }

    #[test]
    fn verdict_at_the_return_and_mixed() {
        let s: Vec<Sample> = (0..10).map(|_| shot(760.0, 500.0, 750.0)).collect();
        let v = verdict(&s);
        assert_eq!(v.nearer_return, 10);
        assert!(v
            .text
            .starts_with("Online's first kernel starts at the ioctl's return"));
        let mut m = s.clone();
        m.extend((0..10).map(|_| shot(510.0, 500.0, 750.0)));
        assert!(verdict(&m).text.starts_with("Mixed"));
    }

    #[test]
    fn verdict_needs_frozen_complete_cycles_and_a_gap() {
        let mut s = vec![shot(505.0, 500.0, 520.0); 10];
        assert!(verdict(&s).text.starts_with("Undecided"));
        for x in &mut s {
            x.frozen = Some(false);
        }
        s.push(Sample::default());
        let v = verdict(&s);
        assert_eq!(v.cycles, 0);
        assert!(v.text.starts_with("No cycle"));
    }
}
