//! One scheduling pass, independent of the engine: from the engine's snapshot of nodes and jobs
//! and the nodes' harvest documents, decide placements and evictions, each with its reason.
//!
//! The Slurm adapter and the simulator both call [`plan`] and then carry out its [`Plan`]; neither
//! has placement or monitoring logic of its own.

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::Serialize;
use valve_harvest::NodeHarvest;

use crate::calibrate::{JobLevels, NodeSpeed, MIN_SAMPLES};
use crate::job::JobProfile;
use crate::meta::{ClassedProfile, JobMeta, MetaError, PlacedOn};
use crate::monitor::{Check, Measured, Monitor, MonitorParams, RunningJob};
use crate::place::{place, Decision, NodeSlot, Outcome, Pending, PendingJob, PlaceParams};
use crate::predict::{predict, NodeModel};

/// The scheduler's settings.
#[derive(Clone, Debug)]
pub struct Params {
    /// Placement.
    pub place: PlaceParams,
    /// The SLA monitor.
    pub monitor: MonitorParams,
    /// A node whose last harvest document is older than this gets no new jobs.
    pub node_timeout_ms: u64,
    /// The profile assumed for jobs submitted without one (`None`: such jobs are refused).
    pub default_profile: Option<ClassedProfile>,
    /// Whether each node's speed factor is learned from its running jobs (the monitor's
    /// windows) and scales its predictions (`--no-calibration` turns it off).
    pub calibration: bool,
    /// Whether each job's level (measured over predicted, with its node's speed) is learned from
    /// its judged windows and, where it is 0.9 or less, scales its profile when it is placed
    /// again (`--no-job-calibration` turns it off).
    pub job_calibration: bool,
    /// Speed factors known beforehand, by node; they take the place of learned ones (the
    /// simulator's oracle knows the true speeds).
    pub known_speeds: HashMap<String, f64>,
}

impl Default for Params {
    fn default() -> Self {
        Params {
            place: PlaceParams::default(),
            monitor: MonitorParams::default(),
            node_timeout_ms: 60_000,
            default_profile: None,
            calibration: true,
            job_calibration: true,
            known_speeds: HashMap::new(),
        }
    }
}

/// A node as the engine reports it.
#[derive(Clone, Debug, PartialEq)]
pub struct NodeInfo {
    /// Its name.
    pub name: String,
    /// Why the engine will not run jobs there (down, drained), if it will not.
    pub closed: Option<String>,
}

/// Where a job is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Submitted held: waiting for the scheduler.
    Held,
    /// Released onto a node; the engine has not started it yet.
    Released,
    /// Running since (Unix ms).
    Running(u64),
}

/// A job of the scheduler's (its comment is Valve's).
#[derive(Clone, Debug)]
pub struct JobInfo {
    /// The engine's id.
    pub id: String,
    /// Where it is in its life.
    pub phase: Phase,
    /// Its metadata, or why that could not be read.
    pub meta: Result<JobMeta, MetaError>,
    /// Lower is older (submission order).
    pub order: u64,
}

/// What the engine knows.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Nodes.
    pub nodes: Vec<NodeInfo>,
    /// The scheduler's jobs.
    pub jobs: Vec<JobInfo>,
}

/// A node's latest harvest document and when it arrived.
#[derive(Clone, Debug)]
pub struct Report {
    /// The document (validated).
    pub doc: NodeHarvest,
    /// When it was received (Unix ms).
    pub received_unix_ms: u64,
}

/// A node left out of this pass, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Excluded {
    /// The node.
    pub node: String,
    /// Why.
    pub why: String,
    /// Why, without the figures that grow from pass to pass (how long an agent has been
    /// silent): the loop logs a node's exclusion again only when this changes.
    #[serde(skip)]
    pub cause: String,
}

/// A held job left pending this pass, and why in words, counted against the pass's open nodes.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Waiting {
    /// The job.
    pub job: String,
    /// Why it waits.
    pub why: String,
    /// Why, without the figures that drift from pass to pass (predicted shares): the loop logs
    /// a job's reason again only when this changes.
    #[serde(skip)]
    pub cause: String,
}

/// A job the scheduler will not place, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Refusal {
    /// The job.
    pub job: String,
    /// Why.
    pub why: String,
}

/// What one pass decided.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Plan {
    /// Placements and reasons for pending jobs.
    pub decisions: Vec<Decision>,
    /// Jobs refused for their metadata.
    pub refused: Vec<Refusal>,
    /// The monitor's view of running jobs, evictions among them.
    pub checks: Vec<Check>,
    /// Nodes left out.
    pub excluded: Vec<Excluded>,
    /// Why each pending job waits (the pending decisions, in words).
    pub waiting: Vec<Waiting>,
    /// Open nodes whose speed factor this pass was not 1, with the samples it was learned from.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub speeds: Vec<NodeSpeed>,
    /// Held jobs this pass considered at a learned level (their profiles scaled by it), placed
    /// or still pending.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub levels: Vec<JobLevel>,
}

/// A held job's learned level, as a pass applied it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct JobLevel {
    /// The job.
    pub job: String,
    /// Its level: what its profile's rates were multiplied by.
    pub level: f64,
}

/// Decides one pass at `now_unix_ms`.
pub fn plan(
    now_unix_ms: u64,
    snap: &Snapshot,
    reports: &HashMap<String, Report>,
    monitor: &mut Monitor,
    params: &Params,
) -> Plan {
    let mut out = Plan::default();
    let open = open_nodes(now_unix_ms, snap, reports, params, &mut out.excluded);
    let factors = if params.calibration {
        monitor.calibration.factors()
    } else {
        HashMap::new()
    };
    let mut slots = slots(&open, snap, params, &factors);
    out.speeds = slots
        .iter()
        .filter(|s| s.model.speed != 1.0)
        .map(|s| NodeSpeed {
            node: s.model.name.clone(),
            factor: s.model.speed,
            samples: monitor.calibration.samples(&s.model.name),
        })
        .collect();
    let levels = if params.job_calibration {
        held_levels(snap, &monitor.job_levels)
    } else {
        HashMap::new()
    };
    let pending = pending_jobs(snap, params, &levels, &mut out.refused);
    out.levels = levels
        .iter()
        .map(|(job, &level)| JobLevel {
            job: job.clone(),
            level,
        })
        .collect();
    out.levels.sort_by(|a, b| a.job.cmp(&b.job));
    out.decisions = place(&pending, &mut slots, &params.place);
    out.waiting = waiting(&out.decisions, &pending, &slots, out.excluded.len());
    out.checks = check_running(now_unix_ms, snap, reports, &slots, monitor, params);
    if params.job_calibration {
        let ids: HashSet<&str> = snap.jobs.iter().map(|j| j.id.as_str()).collect();
        monitor.job_levels.retain(|j| ids.contains(j));
    }
    out
}

/// The learned level of each held job that has one.
fn held_levels(snap: &Snapshot, levels: &JobLevels) -> HashMap<String, f64> {
    snap.jobs
        .iter()
        .filter(|j| j.phase == Phase::Held)
        .filter_map(|j| Some((j.id.clone(), levels.applied(&j.id)?)))
        .collect()
}

/// The speed factor placement uses on `node`: a known one, else the learned one (`factors`,
/// empty with calibration off), else 1.0.
fn speed_of(node: &str, params: &Params, factors: &HashMap<String, f64>) -> f64 {
    params
        .known_speeds
        .get(node)
        .or_else(|| factors.get(node))
        .copied()
        .unwrap_or(1.0)
}

/// Nodes open to placement with their documents; the others go to `excluded` with a reason.
fn open_nodes<'a>(
    now: u64,
    snap: &Snapshot,
    reports: &'a HashMap<String, Report>,
    params: &Params,
    excluded: &mut Vec<Excluded>,
) -> Vec<&'a Report> {
    let mut open = Vec::new();
    for n in &snap.nodes {
        let (why, cause) = match (&n.closed, reports.get(&n.name)) {
            (Some(c), _) => {
                let why = format!("the engine reports it {c}");
                (why.clone(), why)
            }
            (None, None) => {
                let why = "no harvest document from its agent yet".to_string();
                (why.clone(), why)
            }
            (None, Some(r)) if now.saturating_sub(r.received_unix_ms) > params.node_timeout_ms => (
                format!(
                    "its agent has not reported for {:.1} s (timeout {} s)",
                    now.saturating_sub(r.received_unix_ms) as f64 / 1000.0,
                    params.node_timeout_ms as f64 / 1000.0
                ),
                format!("silent since {}", r.received_unix_ms),
            ),
            (None, Some(r)) => {
                open.push(r);
                continue;
            }
        };
        excluded.push(Excluded {
            node: n.name.clone(),
            why,
            cause,
        });
    }
    open
}

/// Why each pending decision's job waits, in words. A job that found no node with room is
/// counted against the open nodes as placement saw them: the ones it was considered on (enough
/// free GPUs), the ones it avoids (it was evicted from them), the rest full.
fn waiting(
    decisions: &[Decision],
    pending: &[PendingJob],
    slots: &[NodeSlot],
    excluded: usize,
) -> Vec<Waiting> {
    let jobs: HashMap<&str, &PendingJob> = pending.iter().map(|j| (j.id.as_str(), j)).collect();
    let open: HashSet<&str> = slots.iter().map(|s| s.model.name.as_str()).collect();
    decisions
        .iter()
        .filter_map(|d| {
            let Outcome::Pending(p) = &d.outcome else {
                return None;
            };
            let (why, cause) = match p {
                Pending::NoFreeGpus { gpus, nodes } => {
                    let avoided = jobs.get(d.job.as_str()).map_or(0, |j| {
                        j.avoid.iter().filter(|n| open.contains(n.as_str())).count()
                    });
                    let why = no_room(*gpus, open.len(), *nodes, avoided, excluded);
                    (why.clone(), why)
                }
                Pending::BelowSla { needed, best } => (
                    format!(
                        "no free GPUs meet its SLA (needs {needed:.2} of alone); best: {} GPUs {:?}, predicted {}",
                        best.node, best.gpus, best.prediction
                    ),
                    format!("below its SLA, best on {}", best.node),
                ),
            };
            Some(Waiting {
                job: d.job.clone(),
                why,
                cause,
            })
        })
        .collect()
}

/// Why a job of `gpus` GPUs found no node with room: `open` nodes open, `considered` of them
/// with enough free GPUs (yet no set it could take), `avoided` ones it was evicted from,
/// `excluded` nodes left out of the pass.
fn no_room(gpus: u32, open: usize, considered: usize, avoided: usize, excluded: usize) -> String {
    if open == 0 {
        return format!("no node is open to placement ({excluded} excluded: see their reasons)");
    }
    let full = open.saturating_sub(considered + avoided);
    if full == open {
        return format!("all {open} open node(s) are full: none has {gpus} free GPU(s)");
    }
    let mut parts = Vec::new();
    if full > 0 {
        parts.push(format!("{full} full (fewer than {gpus} free GPU(s))"));
    }
    if avoided > 0 {
        parts.push(format!("{avoided} it was evicted from"));
    }
    if considered > 0 {
        parts.push(format!(
            "{considered} with {gpus} free GPU(s), none of whose GPU sets can take it"
        ));
    }
    format!("of {open} open node(s): {}", parts.join(", "))
}

/// Each open node with its GPUs that no released or running job of ours holds.
fn slots(
    open: &[&Report],
    snap: &Snapshot,
    params: &Params,
    factors: &HashMap<String, f64>,
) -> Vec<NodeSlot> {
    let mut taken: HashMap<&str, BTreeSet<u32>> = HashMap::new();
    for j in &snap.jobs {
        if let (Phase::Released | Phase::Running(_), Ok(m)) = (j.phase, &j.meta) {
            if let Some(PlacedOn { node, gpus }) = &m.placed {
                taken.entry(node).or_default().extend(gpus);
            }
        }
    }
    open.iter()
        .map(|r| {
            let model = NodeModel::from_doc(&r.doc, &params.place.model).with_speed(speed_of(
                &r.doc.node,
                params,
                factors,
            ));
            let held = taken.get(r.doc.node.as_str());
            let free = model
                .gpus
                .iter()
                .map(|g| held.is_none_or(|h| !h.contains(&g.index)))
                .collect();
            NodeSlot { model, free }
        })
        .collect()
}

/// Held jobs with their profiles (at their learned `levels`, where they have one); jobs that
/// cannot be placed go to `refused`.
fn pending_jobs(
    snap: &Snapshot,
    params: &Params,
    levels: &HashMap<String, f64>,
    refused: &mut Vec<Refusal>,
) -> Vec<PendingJob> {
    let mut classes: HashMap<String, ClassedProfile> = HashMap::new();
    let mut pending = Vec::new();
    for j in snap.jobs.iter().filter(|j| j.phase == Phase::Held) {
        let meta = match &j.meta {
            Ok(m) => m,
            Err(e) => {
                refused.push(Refusal {
                    job: j.id.clone(),
                    why: e.to_string(),
                });
                continue;
            }
        };
        let profile = match (&meta.profile, &params.default_profile) {
            (Some(p), _) => {
                let key = serde_json::to_string(p).expect("profile serialises");
                classes
                    .entry(key)
                    .or_insert_with(|| ClassedProfile::new(p.clone()))
                    .clone()
            }
            (None, Some(d)) => d.clone(),
            (None, None) => {
                refused.push(Refusal {
                    job: j.id.clone(),
                    why: "submitted without a profile, and the scheduler has no --default-profile: profile it (`valve-scheduler profile-job`) and resubmit".into(),
                });
                continue;
            }
        };
        let profile = match levels.get(&j.id) {
            Some(&level) if level != 1.0 => ClassedProfile::new(profile.profile.at_level(level)),
            _ => profile,
        };
        pending.push(PendingJob {
            id: j.id.clone(),
            profile: profile.profile,
            class: profile.class,
            sla: meta.sla,
            avoid: meta.avoid.clone(),
            order: j.order,
        });
    }
    pending
}

/// A running job with what its calibration sample needs: its profile and GPUs.
struct Runner<'a> {
    job: RunningJob,
    profile: &'a JobProfile,
    gpus: &'a [u32],
}

/// The scheduler's running jobs.
fn runners<'a>(snap: &'a Snapshot, params: &'a Params) -> Vec<Runner<'a>> {
    snap.jobs
        .iter()
        .filter_map(|j| {
            let Phase::Running(started) = j.phase else {
                return None;
            };
            let m = j.meta.as_ref().ok()?;
            let placed = m.placed.as_ref()?;
            let profile: &JobProfile = match (&m.profile, &params.default_profile) {
                (Some(p), _) => p,
                (None, Some(d)) => &d.profile,
                (None, None) => return None,
            };
            Some(Runner {
                job: RunningJob {
                    id: j.id.clone(),
                    node: placed.node.clone(),
                    sla: m.sla,
                    alone_per_s: profile.alone_per_s,
                    started_unix_ms: started,
                },
                profile,
                gpus: &placed.gpus,
            })
        })
        .collect()
}

/// The monitor's checks of running jobs, measured from their nodes' documents; each judged
/// window also calibrates its node's speed (with calibration on).
fn check_running(
    now: u64,
    snap: &Snapshot,
    reports: &HashMap<String, Report>,
    open: &[NodeSlot],
    monitor: &mut Monitor,
    params: &Params,
) -> Vec<Check> {
    let runners = runners(snap, params);
    let running: Vec<RunningJob> = runners.iter().map(|r| r.job.clone()).collect();
    let window = params.monitor.window_s;
    let models: HashMap<&str, &NodeModel> = open
        .iter()
        .map(|s| (s.model.name.as_str(), &s.model))
        .collect();
    let measured = |r: &RunningJob| {
        if !models.contains_key(r.node.as_str()) {
            return None; // its node is excluded: nothing fresh to judge by
        }
        let rep = reports.get(&r.node)?;
        let rate = rep.doc.job(&r.id)?.rate(window)?;
        // Reports from before this run started do not count.
        let since_start = now.saturating_sub(r.started_unix_ms) as f64 / 1000.0;
        Some(Measured {
            per_s: rate.per_s,
            covered_s: rate.covered_s.min(since_start),
        })
    };
    let checks = monitor.tick(now, &running, measured, &params.monitor);
    if params.calibration || params.job_calibration {
        for (c, r) in checks.iter().zip(&runners) {
            if let (Some(share), Some(model)) = (c.share, models.get(r.job.node.as_str())) {
                calibrate(monitor, r, share, model, params);
            }
        }
    }
    checks
}

/// Feeds one judged window of `r` (measured `share` of alone) to the calibrations on, against the
/// model's prediction for its GPUs on its node's current document, without the speed factor.
/// The node's sample is that ratio, as before job levels existed: its median over many jobs is
/// the node's. The job's is the ratio over the node's speed factor, and only once that factor
/// is settled (known, or learned from enough windows): before, the node's slowness would pass
/// for the job's, and the two factors would count it twice.
fn calibrate(monitor: &mut Monitor, r: &Runner, share: f64, model: &NodeModel, params: &Params) {
    let positions: Option<Vec<usize>> = r
        .gpus
        .iter()
        .map(|&g| model.gpus.iter().position(|m| m.index == g))
        .collect();
    let Some(positions) = positions.filter(|p| !p.is_empty()) else {
        return; // its GPUs are not in the node's document
    };
    let predicted = predict(r.profile, model, &positions, &params.place.model).unscaled_share();
    let alone = r.job.alone_per_s;
    let node_settled = !params.calibration
        || params.known_speeds.contains_key(&model.name)
        || monitor.calibration.samples(&model.name) >= MIN_SAMPLES;
    if params.calibration {
        let node = &mut monitor.calibration;
        node.record(&model.name, share * alone, predicted * alone, alone);
    }
    if params.job_calibration && node_settled {
        let speed = model.speed.max(0.0);
        let jobs = &mut monitor.job_levels;
        jobs.record(&r.job.id, share * alone, predicted * speed * alone, alone);
    }
}

#[cfg(test)]
mod tests;
