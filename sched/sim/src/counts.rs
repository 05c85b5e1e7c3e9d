//! Raw counts of one policy's simulated run, accumulated minute by minute: offline busy and
//! harvested time, job-hours met and violated (by class, SLA, hour of day), evictions, predictions.

use serde::Serialize;

use super::jobs::{Arrival, SLAS};

/// The speed factors a policy learned against the nodes' true speeds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SpeedCheck {
    /// Nodes.
    pub nodes: usize,
    /// Nodes whose factor was in use (enough samples).
    pub calibrated: usize,
    /// Mean |factor - true speed| over all nodes (1.0 where none was learned).
    pub mean_abs_err: f64,
    /// Mean |1 - true speed|: the error without calibration.
    pub mean_abs_err_uncalibrated: f64,
    /// Mean learned factor over the calibrated nodes.
    pub mean_factor: Option<f64>,
    /// Pearson correlation of learned factor and true speed over the calibrated nodes (`None`
    /// where either does not vary).
    pub correlation: Option<f64>,
}

/// Raw counts of one policy's run.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Metrics {
    /// GPU-minutes in which offline ran: per running job and minute, its GPUs x the share of
    /// the minute all of them were idle (where its memory let it run at all).
    pub offline_busy_gpu_min: f64,
    /// Work done, in GPU-hours alone: per running job and minute, GPUs x share / 60.
    pub harvested_gpu_h: f64,
    /// The part of it done in whole job-hours that met their SLA, GPU-hours: the harvest an
    /// SLA-keeping placement is compared by (partial hours of evicted runs are left out).
    #[serde(default)]
    pub harvested_met_gpu_h: f64,
    /// Work thrown away by evictions and kills (progress since the last checkpoint), GPU-hours.
    pub lost_gpu_h: f64,
    /// Full hours of runtime (since a job's start or restart).
    pub job_hours: u64,
    /// Of them, those whose mean share met the job's SLA.
    pub job_hours_met: u64,
    /// Job-hours of jobs whose GPUs span more than one online busy series (out-of-step ranks or
    /// different services).
    pub job_hours_out_of_step: u64,
    /// Of them, those that missed the SLA.
    pub job_hours_violated_out_of_step: u64,
    /// Job-hours per profile class.
    pub job_hours_by_class: Vec<u64>,
    /// SLA-violating job-hours per profile class.
    pub violated_by_class: Vec<u64>,
    /// Job-hours per SLA (0.3 .. 0.7).
    pub job_hours_by_sla: Vec<u64>,
    /// SLA-violating job-hours per SLA.
    pub violated_by_sla: Vec<u64>,
    /// Partial hours (at least 10 minutes) of runs that ended in an eviction or kill: not
    /// job-hours by the targets' definition, counted here for the strict SLA figure.
    pub partial_hours_evicted: u64,
    /// Of them, those whose mean share met the SLA.
    pub partial_hours_evicted_met: u64,
    /// GPU-minutes held by offline jobs (whether or not they could run).
    pub held_gpu_min: f64,
    /// Job-hours that were the first hour of their run.
    pub job_hours_first: u64,
    /// Of them, SLA-violating.
    pub violated_first: u64,
    /// Job-hours by the hour of day they ended in.
    pub job_hours_by_hour_of_day: Vec<u64>,
    /// SLA-violating job-hours by the hour of day they ended in.
    pub violated_by_hour_of_day: Vec<u64>,
    /// SLA-violating job-hours that fell short of the SLA by less than 0.02.
    pub violated_near_miss: u64,
    /// Jobs that arrived.
    pub arrived: u64,
    /// Jobs taken into the queue.
    pub admitted: u64,
    /// Jobs turned away because their stream's backlog was full.
    pub turned_away: u64,
    /// Jobs refused by the scheduler (bad metadata): none expected.
    pub refused: u64,
    /// Runs started (first starts and restarts).
    pub placements: u64,
    /// Runs started on GPUs of more than one online series.
    pub placements_out_of_step: u64,
    /// Jobs started at least once.
    pub first_starts: u64,
    /// Jobs that finished their work.
    pub finished: u64,
    /// Monitor evictions.
    pub evictions: u64,
    /// Static-split jobs killed because online took back their memory.
    pub kills: u64,
    /// Sum of minutes from arrival to first start.
    pub queue_delay_min_sum: f64,
    /// The most any GPU was busy in a minute (online + offline): must not exceed 1.
    pub max_gpu_utilisation: f64,
    /// Placements onto a GPU another job held (must be 0).
    pub conflicts: u64,
    /// Jobs pending at the end.
    pub pending_end: u64,
    /// Jobs running at the end.
    pub running_end: u64,
    /// At the last pass: jobs pending because no node had enough free GPUs.
    pub pending_no_free_gpus_last: u64,
    /// At the last pass: jobs pending because no free GPUs met their SLA.
    pub pending_below_sla_last: u64,
    /// Wall time of each `cycle::plan` call (ms).
    #[serde(skip)]
    pub pass_ms: Vec<f64>,
    /// Wall time of the policy's own work, its passes and simulated minutes (s).
    #[serde(skip)]
    pub work_s: f64,
    /// CPU time of the thread that did that work, over the same spans (s): what waiting for a
    /// core under other load does not add to.
    #[serde(skip)]
    pub work_cpu_s: f64,
    /// CPU time of the thread in `cycle::plan`, all calls together (s).
    #[serde(skip)]
    pub pass_cpu_s: f64,
    /// (predicted share, true mean share over the first hour) per run that lasted an hour.
    #[serde(skip)]
    pub pred: Vec<(f32, f32)>,
    /// How far each SLA-violating job-hour fell short (SLA - mean share).
    #[serde(skip)]
    pub shortfalls: Vec<f32>,
    /// How well the calibration learned the nodes' true speeds, at the end (policies that learn
    /// them, on worlds whose nodes differ).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speeds: Option<SpeedCheck>,
}

impl Metrics {
    /// Empty counts for `classes` profile classes.
    pub fn new(classes: usize) -> Metrics {
        Metrics {
            job_hours_by_class: vec![0; classes],
            violated_by_class: vec![0; classes],
            job_hours_by_sla: vec![0; SLAS.len()],
            violated_by_sla: vec![0; SLAS.len()],
            job_hours_by_hour_of_day: vec![0; 24],
            violated_by_hour_of_day: vec![0; 24],
            ..Metrics::default()
        }
    }

    /// One full hour of a job's run with mean share `mean`, ending at the end of minute
    /// `minute`; `first`: the run's first hour.
    pub fn job_hour(
        &mut self,
        a: &Arrival,
        mean: f64,
        out_of_step: bool,
        minute: u32,
        first: bool,
    ) {
        let met = mean >= a.sla();
        let hod = ((minute / 60) % 24) as usize;
        self.job_hours_by_hour_of_day[hod] += 1;
        if first {
            self.job_hours_first += 1;
        }
        if !met {
            self.violated_by_hour_of_day[hod] += 1;
            self.violated_first += u64::from(first);
            self.shortfalls.push((a.sla() - mean) as f32);
            self.violated_near_miss += u64::from(a.sla() - mean < 0.02);
        }
        self.job_hours += 1;
        self.job_hours_by_class[usize::from(a.class)] += 1;
        self.job_hours_by_sla[usize::from(a.sla)] += 1;
        if met {
            self.job_hours_met += 1;
        } else {
            self.violated_by_class[usize::from(a.class)] += 1;
            self.violated_by_sla[usize::from(a.sla)] += 1;
        }
        if out_of_step {
            self.job_hours_out_of_step += 1;
            if !met {
                self.job_hours_violated_out_of_step += 1;
            }
        }
    }
}
