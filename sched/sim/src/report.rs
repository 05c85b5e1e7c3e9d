//! What a simulation measured, per policy, and the targets: utilisation over online only,
//! harvested GPU-hours against the oracle, SLA job-hours, SLA violations where online GPUs run out
//! of step, the model's prediction error, and the cost of a scheduling pass.

use serde::Serialize;

use super::cluster::ClusterSummary;
use super::counts::Metrics;
use super::jobs::{ArrivalSummary, WorkDist, SLAS};
use super::run::{Policy, PolicyKind, PolicySettings};

/// One policy's results.
#[derive(Clone, Debug, Serialize)]
pub struct PolicyReport {
    /// Its name.
    pub name: String,
    /// What it is.
    pub kind: PolicyKind,
    /// Its scheduler settings.
    pub settings: PolicySettings,
    /// Online busy fraction (mean over GPU-minutes).
    pub online_busy: f64,
    /// Offline busy fraction.
    pub offline_busy: f64,
    /// Their sum.
    pub utilisation: f64,
    /// Utilisation over online only, in points.
    pub gain_points: f64,
    /// ... and relative (%).
    pub gain_pct: f64,
    /// Harvested GPU-hours (work in alone-GPU-hours).
    pub harvested_gpu_h: f64,
    /// ... as % of the oracle's.
    pub harvested_pct_of_oracle: Option<f64>,
    /// Harvested GPU-hours in whole job-hours that met their SLA, as % of the oracle's: with
    /// large profile errors the plain harvest counts work of runs that miss and are evicted.
    pub harvested_met_pct_of_oracle: Option<f64>,
    /// Job-hours meeting their SLA (%).
    pub sla_met_pct: Option<f64>,
    /// The same, counting also the partial hours (10 min or more) of evicted or killed runs.
    pub sla_met_strict_pct: Option<f64>,
    /// Share of GPU-minutes held by offline jobs.
    pub held: f64,
    /// SLA-violating job-hours on GPUs of one online series.
    pub violated_in_step: u64,
    /// SLA-violating job-hours on GPUs spanning several series ("out of step").
    pub violated_out_of_step: u64,
    /// Placements with a prediction whose run lasted an hour.
    pub predictions: usize,
    /// Median of |predicted - true| / true over the first hour.
    pub pred_err_median: Option<f64>,
    /// 90th percentile of it.
    pub pred_err_p90: Option<f64>,
    /// Median of (predicted - true) / true: positive is optimistic.
    pub pred_bias_median: Option<f64>,
    /// Median shortfall (SLA - mean share) of SLA-violating job-hours.
    pub shortfall_median: Option<f64>,
    /// Mean minutes from arrival to first start.
    pub mean_queue_delay_min: Option<f64>,
    /// Median `cycle::plan` time (ms).
    pub pass_ms_median: Option<f64>,
    /// Longest `cycle::plan` time (ms).
    pub pass_ms_max: Option<f64>,
    /// All its `cycle::plan` calls together (s).
    pub pass_s_total: f64,
    /// Wall time of the policy's own work: its passes and simulated minutes, without the load
    /// and documents the policies share (`shared_s`) (s).
    pub work_s: f64,
    /// CPU time of that work, on the thread that did it (s).
    pub work_cpu_s: f64,
    /// CPU time of its `cycle::plan` calls (s).
    pub pass_cpu_s_total: f64,
    /// The raw counts.
    pub counts: Metrics,
}

/// One of the targets.
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    /// What is asked.
    pub name: String,
    /// The policy measured (Valve's default, or an operator variant).
    pub policy: String,
    /// The measured value, for people.
    pub measured: String,
    /// Whether it was met (`None`: a policy it needs was not run).
    pub pass: Option<bool>,
}

/// The whole result of a simulation.
#[derive(Clone, Debug, Serialize)]
pub struct Results {
    /// Where it ran.
    pub device: String,
    /// The command line.
    pub command: String,
    /// What was simulated.
    pub config: ConfigSummary,
    /// The assumptions beyond the traces.
    pub assumptions: Vec<String>,
    /// The cluster as laid out.
    pub cluster: ClusterSummary,
    /// Online busy fraction measured over the run (every GPU-minute).
    pub online_busy_measured: f64,
    /// Share of GPU-minutes by memory left to offline: (bin, share).
    pub online_memory: Vec<(String, f64)>,
    /// The offline profile classes.
    pub classes: Vec<ClassSummary>,
    /// Job work.
    pub work: WorkDist,
    /// Offline arrivals.
    pub arrivals: ArrivalSummary,
    /// Per policy.
    pub policies: Vec<PolicyReport>,
    /// The targets.
    pub targets: Vec<Target>,
    /// Wall time of the whole run (s).
    pub wall_s: f64,
    /// Of it, the time in the work every policy shares: online load and documents (s).
    pub shared_s: f64,
}

/// What was simulated.
#[derive(Clone, Debug, Serialize)]
pub struct ConfigSummary {
    /// Nodes.
    pub nodes: usize,
    /// Node shape.
    pub shape: String,
    /// Simulated days.
    pub days: f64,
    /// Minutes between passes.
    pub pass_every_min: u32,
    /// Share of GPUs in multi-GPU online services asked for.
    pub online_multi_gpu_share: f64,
    /// How that share was chosen.
    pub online_multi_gpu_share_source: String,
    /// Share of multi-GPU services out of step.
    pub out_of_step_share: f64,
    /// Share of offline jobs on 2 or 4 GPUs.
    pub offline_multi_gpu_share: f64,
    /// Offered load.
    pub offered_load: f64,
    /// Target online busy fraction.
    pub target_online_busy: f64,
    /// Backlog cap per (class, SLA) stream.
    pub max_pending_per_stream: usize,
    /// Seeds (online, offline).
    pub seeds: (u64, u64),
    /// Worker threads.
    pub threads: usize,
    /// Log-sd of the nodes' true speeds (0: all 1.0).
    pub node_speed_sd: f64,
    /// Standard deviation of each job's true throughput relative to its profile.
    pub profile_error_sd: f64,
    /// Stationary sd of the drift of each run's level around its static level (0: none).
    pub level_drift_sd: f64,
    /// The drift's correlation time (minutes).
    pub level_drift_minutes: f64,
}

/// One profile class, for the results.
#[derive(Clone, Debug, Serialize)]
pub struct ClassSummary {
    /// Its name.
    pub name: String,
    /// GPUs.
    pub gpus: u32,
    /// Least memory it runs with (GiB).
    pub min_gib: f64,
    /// Full-speed memory R (GiB).
    pub required_gib: f64,
    /// Deficit penalty.
    pub deficit_penalty: f64,
    /// Its share of arrivals.
    pub mix: f64,
    /// T(m)/T_alone points (GiB, share).
    pub curve: Vec<(f64, f64)>,
}

fn quantile(sorted: &[f64], q: f64) -> Option<f64> {
    if sorted.is_empty() {
        return None;
    }
    let i = ((sorted.len() - 1) as f64 * q).round() as usize;
    Some(sorted[i])
}

/// Derives each policy's figures and the targets.
pub fn policy_reports(
    policies: Vec<(Policy, Metrics)>,
    online_busy_gpu_min: f64,
    gpu_minutes: f64,
) -> Vec<PolicyReport> {
    let online = online_busy_gpu_min / gpu_minutes.max(1.0);
    let oracle = policies
        .iter()
        .find(|(p, _)| p.kind == PolicyKind::Oracle)
        .map(|(_, m)| (m.harvested_gpu_h, m.harvested_met_gpu_h));
    policies
        .into_iter()
        .map(|(p, m)| {
            let offline = m.offline_busy_gpu_min / gpu_minutes.max(1.0);
            let util = online + offline;
            let mut errs: Vec<f64> = m
                .pred
                .iter()
                .map(|&(p, t)| (f64::from(p) - f64::from(t)).abs() / f64::from(t).max(1e-3))
                .collect();
            errs.sort_by(f64::total_cmp);
            let mut bias: Vec<f64> = m
                .pred
                .iter()
                .map(|&(p, t)| (f64::from(p) - f64::from(t)) / f64::from(t).max(1e-3))
                .collect();
            bias.sort_by(f64::total_cmp);
            let mut short: Vec<f64> = m.shortfalls.iter().map(|&x| f64::from(x)).collect();
            short.sort_by(f64::total_cmp);
            let mut pass = m.pass_ms.clone();
            pass.sort_by(f64::total_cmp);
            let has_jobs = p.kind != PolicyKind::OnlineOnly;
            PolicyReport {
                name: p.name.clone(),
                kind: p.kind,
                settings: p.settings(),
                online_busy: online,
                offline_busy: offline,
                utilisation: util,
                gain_points: offline * 100.0,
                gain_pct: offline / online.max(1e-12) * 100.0,
                harvested_gpu_h: m.harvested_gpu_h,
                harvested_pct_of_oracle: oracle
                    .filter(|o| o.0 > 0.0)
                    .map(|o| m.harvested_gpu_h / o.0 * 100.0),
                harvested_met_pct_of_oracle: oracle
                    .filter(|o| o.1 > 0.0)
                    .map(|o| m.harvested_met_gpu_h / o.1 * 100.0),
                sla_met_pct: (has_jobs && m.job_hours > 0)
                    .then(|| m.job_hours_met as f64 / m.job_hours as f64 * 100.0),
                sla_met_strict_pct: (has_jobs && m.job_hours + m.partial_hours_evicted > 0).then(
                    || {
                        (m.job_hours_met + m.partial_hours_evicted_met) as f64
                            / (m.job_hours + m.partial_hours_evicted) as f64
                            * 100.0
                    },
                ),
                held: m.held_gpu_min / gpu_minutes.max(1.0),
                violated_in_step: m.job_hours - m.job_hours_met - m.job_hours_violated_out_of_step,
                violated_out_of_step: m.job_hours_violated_out_of_step,
                predictions: m.pred.len(),
                pred_err_median: quantile(&errs, 0.5),
                pred_err_p90: quantile(&errs, 0.9),
                pred_bias_median: quantile(&bias, 0.5),
                shortfall_median: quantile(&short, 0.5),
                mean_queue_delay_min: (m.first_starts > 0)
                    .then(|| m.queue_delay_min_sum / m.first_starts as f64),
                pass_ms_median: quantile(&pass, 0.5),
                pass_ms_max: pass.last().copied(),
                pass_s_total: pass.iter().fold(0.0, |a, b| a + b) / 1e3,
                work_s: m.work_s,
                work_cpu_s: m.work_cpu_s,
                pass_cpu_s_total: m.pass_cpu_s,
                counts: m,
            }
        })
        .collect()
}

/// The targets for every Valve row (the default and any operator variants).
pub fn targets(reports: &[PolicyReport]) -> Vec<Target> {
    let oracle = reports.iter().find(|r| r.kind == PolicyKind::Oracle);
    let idle = reports.iter().find(|r| r.kind == PolicyKind::IdleOnly);
    let mut out = Vec::new();
    for v in reports.iter().filter(|r| r.kind == PolicyKind::Valve) {
        out.push(Target {
            name: "cluster utilisation at least +30% over online only".into(),
            policy: v.name.clone(),
            measured: format!(
                "{:.3} vs {:.3}: {:+.1}% ({:+.1} points)",
                v.utilisation, v.online_busy, v.gain_pct, v.gain_points
            ),
            pass: Some(v.gain_pct >= 30.0),
        });
        out.push(Target {
            name: "harvested GPU-hours within 10% of the oracle's".into(),
            policy: v.name.clone(),
            measured: match oracle {
                Some(o) => format!(
                    "{:.0} vs {:.0} GPU-h: {:.1}% of the oracle; in job-hours within SLA {:.1}%",
                    v.harvested_gpu_h,
                    o.harvested_gpu_h,
                    v.harvested_pct_of_oracle.unwrap_or(0.0),
                    v.harvested_met_pct_of_oracle.unwrap_or(0.0)
                ),
                None => "the oracle was not run".into(),
            },
            pass: oracle.map(|_| v.harvested_pct_of_oracle.unwrap_or(0.0) >= 90.0),
        });
        out.push(Target {
            name: "at least 99% of offline job-hours meet their SLA".into(),
            policy: v.name.clone(),
            measured: match v.sla_met_pct {
                Some(pct) => format!(
                    "{pct:.2}% of {} job-hours ({} violated)",
                    v.counts.job_hours,
                    v.counts.job_hours - v.counts.job_hours_met
                ),
                None => "no job ran a full hour".into(),
            },
            pass: v.sla_met_pct.map(|p| p >= 99.0),
        });
        out.push(Target {
            name: "at least 2x fewer SLA-violating job-hours than idle-only where online GPUs are out of step".into(),
            policy: v.name.clone(),
            measured: match idle {
                Some(i) => format!(
                    "{} vs idle-only {} violating job-hours on out-of-step GPU sets ({} and {} job-hours there){}",
                    v.violated_out_of_step,
                    i.violated_out_of_step,
                    v.counts.job_hours_out_of_step,
                    i.counts.job_hours_out_of_step,
                    if v.violated_out_of_step > 0 {
                        format!(": {:.1}x fewer", i.violated_out_of_step as f64 / v.violated_out_of_step as f64)
                    } else if i.violated_out_of_step > 0 {
                        ": none for Valve".into()
                    } else {
                        ": none for either".into()
                    }
                ),
                None => "idle-only was not run".into(),
            },
            pass: idle.map(|i| {
                i.violated_out_of_step > 0 && i.violated_out_of_step >= 2 * v.violated_out_of_step
            }),
        });
    }
    out
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or_else(|| "-".into(), f)
}

/// The results as text tables.
pub fn render(r: &Results) -> String {
    let cycle_ones: Vec<&PolicyReport> = r
        .policies
        .iter()
        .filter(|p| p.kind != PolicyKind::OnlineOnly && p.counts.job_hours > 0)
        .collect();
    let mut s = render_setting(r);
    s += &render_outcomes(r);
    s += &render_counts(r);
    if !cycle_ones.is_empty() {
        s += &render_violations(r, &cycle_ones);
        s += &render_when(&cycle_ones);
    }
    s += &render_speeds(r);
    s += &render_targets(r);
    let own: Vec<String> = r
        .policies
        .iter()
        .map(|p| {
            format!(
                "{} {:.1} s (passes {:.1} s; CPU {:.1} s, passes {:.1} s)",
                p.name, p.work_s, p.pass_s_total, p.work_cpu_s, p.pass_cpu_s_total
            )
        })
        .collect();
    s += &format!(
        "\nWall time {:.1} s ({} threads); load and documents shared by every policy {:.1} s; each policy's own work: {}.\n",
        r.wall_s,
        r.config.threads,
        r.shared_s,
        own.join(", ")
    );
    s
}

/// What was simulated, and the memory left to offline.
fn render_setting(r: &Results) -> String {
    let mut s = String::new();
    let c = &r.config;
    s += &format!(
        "Simulated {} nodes ({} GPUs, shape {}) for {:.2} days, a pass every {} min; online busy {:.3} (target {:.2}); {:.0}% of GPUs in multi-GPU online services ({}), {:.0}% of those services out of step; offline: {:.0}% multi-GPU jobs, offered load {:.2} x idle GPU time ({:.1} jobs/min), backlog cap {} per (class, SLA) stream.\n\n",
        r.cluster.nodes,
        r.cluster.gpus,
        c.shape,
        c.days,
        c.pass_every_min,
        r.online_busy_measured,
        c.target_online_busy,
        r.cluster.multi_gpu_share_by_gpu * 100.0,
        c.online_multi_gpu_share_source,
        r.cluster.out_of_step_share_of_multi_services * 100.0,
        c.offline_multi_gpu_share * 100.0,
        c.offered_load,
        r.arrivals.rate_per_min,
        c.max_pending_per_stream,
    );
    if c.level_drift_sd > 0.0 {
        s += &format!(
            "Ground truth: each run's level drifts around its static level (sd {}, correlation time {} min), unknown to every policy, the oracle included.\n\n",
            c.level_drift_sd, c.level_drift_minutes
        );
    }
    s += "Memory left to offline, share of GPU-minutes: ";
    s += &r
        .online_memory
        .iter()
        .map(|(bin, x)| format!("{bin} {:.1}%", x * 100.0))
        .collect::<Vec<_>>()
        .join(", ");
    s += ".\n\n";
    s
}

/// Utilisation, harvest and SLA per policy.
fn render_outcomes(r: &Results) -> String {
    let mut s = String::new();
    s += "| policy | online busy | offline busy | utilisation | gain (points) | gain (%) | GPUs held by offline | harvested GPU-h | % of oracle | job-hours | SLA met | SLA met, evicted partial hours too | violating: in step / out of step |\n";
    s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for p in &r.policies {
        s += &format!(
            "| {} | {:.3} | {:.3} | {:.3} | {:+.1} | {:+.1}% | {:.3} | {:.0} | {} | {} | {} | {} | {} / {} |\n",
            p.name,
            p.online_busy,
            p.offline_busy,
            p.utilisation,
            p.gain_points,
            p.gain_pct,
            p.held,
            p.harvested_gpu_h,
            opt(p.harvested_pct_of_oracle, |x| format!("{x:.1}%")),
            p.counts.job_hours,
            opt(p.sla_met_pct, |x| format!("{x:.2}%")),
            opt(p.sla_met_strict_pct, |x| format!("{x:.2}%")),
            p.violated_in_step,
            p.violated_out_of_step,
        );
    }
    s
}

/// Jobs, evictions, predictions and pass times per policy.
fn render_counts(r: &Results) -> String {
    let mut s = String::new();
    s += "\n| policy | arrived | turned away | started | finished | evictions | kills | lost GPU-h | pending at end: no free GPUs / below SLA | mean queue delay | pred. err. median / p90 (n) | pred. bias | plan ms median / max |\n";
    s += "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for p in &r.policies {
        let m = &p.counts;
        s += &format!(
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} | {} / {} | {} | {} | {} | {} |\n",
            p.name,
            m.arrived,
            m.turned_away,
            m.first_starts,
            m.finished,
            m.evictions,
            m.kills,
            m.lost_gpu_h,
            m.pending_no_free_gpus_last,
            m.pending_below_sla_last,
            opt(p.mean_queue_delay_min, |x| format!("{x:.0} min")),
            match (p.pred_err_median, p.pred_err_p90) {
                (Some(a), Some(b)) =>
                    format!("{:.1}% / {:.1}% ({})", a * 100.0, b * 100.0, p.predictions),
                _ => "-".into(),
            },
            opt(p.pred_bias_median, |x| format!("{:+.1}%", x * 100.0)),
            match (p.pass_ms_median, p.pass_ms_max) {
                (Some(a), Some(b)) => format!("{a:.0} / {b:.0}"),
                _ => "-".into(),
            },
        );
    }
    s
}

/// Violating job-hours by profile class and by SLA.
fn render_violations(r: &Results, cycle_ones: &[&PolicyReport]) -> String {
    let mut s = String::new();
    s += "\nSLA-violating job-hours by profile class (of job-hours):\n\n| policy |";
    for c in &r.classes {
        s += &format!(" {} |", c.name);
    }
    s += &format!("\n|---|{}\n", "---:|".repeat(r.classes.len()));
    for p in cycle_ones {
        s += &format!("| {} |", p.name);
        for (v, h) in p
            .counts
            .violated_by_class
            .iter()
            .zip(&p.counts.job_hours_by_class)
        {
            s += &format!(" {v} of {h} |");
        }
        s += "\n";
    }
    s += "\nSLA-violating job-hours by SLA (of job-hours):\n\n| policy |";
    for sla in SLAS {
        s += &format!(" {sla} |");
    }
    s += &format!("\n|---|{}\n", "---:|".repeat(SLAS.len()));
    for p in cycle_ones {
        s += &format!("| {} |", p.name);
        for (v, h) in p
            .counts
            .violated_by_sla
            .iter()
            .zip(&p.counts.job_hours_by_sla)
        {
            s += &format!(" {v} of {h} |");
        }
        s += "\n";
    }
    s
}

/// When violating job-hours fall: first hour or later, near misses, hours of day.
fn render_when(cycle_ones: &[&PolicyReport]) -> String {
    let mut s = String::new();
    s += "\nWhere SLA-violating job-hours fall:\n\n| policy | first hour of a run | later hours | near misses (< 0.02 short) | median shortfall | worst hours of day (violating of job-hours) |\n|---|---:|---:|---:|---:|---|\n";
    for p in cycle_ones {
        let m = &p.counts;
        let violated = m.job_hours - m.job_hours_met;
        let mut hours: Vec<usize> = (0..24).collect();
        hours.sort_by(|&a, &b| {
            let rate = |h: usize| {
                m.violated_by_hour_of_day[h] as f64 / m.job_hours_by_hour_of_day[h].max(1) as f64
            };
            rate(b).total_cmp(&rate(a))
        });
        let worst: Vec<String> = hours
            .iter()
            .take(3)
            .map(|&h| {
                format!(
                    "{h:02}:00-{:02}:00 {} of {}",
                    (h + 1) % 24,
                    m.violated_by_hour_of_day[h],
                    m.job_hours_by_hour_of_day[h]
                )
            })
            .collect();
        s += &format!(
            "| {} | {} of {} | {} of {} | {} of {violated} | {} | {} |\n",
            p.name,
            m.violated_first,
            m.job_hours_first,
            violated - m.violated_first,
            m.job_hours - m.job_hours_first,
            m.violated_near_miss,
            opt(p.shortfall_median, |x| format!("{x:.3}")),
            worst.join(", "),
        );
    }
    s
}

/// The targets, PASS or FAIL.
/// The speed factors each calibrating policy learned, against the nodes' true speeds.
fn render_speeds(r: &Results) -> String {
    let mut s = String::new();
    for p in &r.policies {
        let Some(c) = &p.counts.speeds else { continue };
        let opt = |x: Option<f64>| x.map_or("-".to_string(), |x| format!("{x:.2}"));
        s += &format!(
            "\nNode speeds learned by {}: {} of {} nodes calibrated, mean factor {}; mean |factor - true speed| {:.3} ({:.3} without calibration), correlation {}.\n",
            p.name,
            c.calibrated,
            c.nodes,
            opt(c.mean_factor),
            c.mean_abs_err,
            c.mean_abs_err_uncalibrated,
            opt(c.correlation)
        );
    }
    s
}

fn render_targets(r: &Results) -> String {
    let mut s = String::new();
    s += "\nTargets:\n\n";
    for t in &r.targets {
        s += &format!(
            "- {} [{}]: {} ({})\n",
            match t.pass {
                Some(true) => "PASS",
                Some(false) => "FAIL",
                None => "n/a",
            },
            t.policy,
            t.name,
            t.measured
        );
    }
    s
}
