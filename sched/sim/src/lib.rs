//! The cluster simulator: a week of a large GPU cluster whose online load
//! replays the Azure LLM trace, with offline jobs placed by the scheduler's own pass.
//!
//! - [`trace`]: the Azure trace as per-minute busy tables; the daily cycle.
//! - [`cluster`]: nodes, online services and their load minute by minute.
//! - [`jobs`]: offline profile classes, work and arrivals.
//! - [`docs`]: the nodes' harvest documents, built from the load as an agent measures it.
//! - [`drift`]: the drift of a running job's own level over minutes (ground truth only).
//! - [`run`]: the loop, the policies and the ground truth of each job's minute.
//! - [`counts`]: each policy's raw counts, minute by minute.
//! - [`report`]: metrics, the targets and the tables.
//!
//! Every policy but `random` places through [`valve_scheduler::cycle::plan`], and every policy
//! evicts through [`valve_scheduler::monitor::Monitor`] (inside `plan`): the code the Slurm
//! adapter runs. The `valve-sim` binary (run by `valve-scheduler simulate`) is its command line.

pub mod cluster;
pub mod counts;
pub mod docs;
pub mod drift;
pub mod jobs;
pub mod report;
pub mod run;
pub mod trace;

use std::time::Instant;

use report::{ClassSummary, ConfigSummary, Results};
use run::{SimConfig, World};

/// The assumptions the simulation makes beyond its traces (printed with the results).
pub fn assumptions(cfg: &SimConfig) -> Vec<String> {
    let mut out = vec![
        "Online load replays the Azure LLM inference trace 2023 (code and conversation, 50/50 per service); only its one-hour version could be obtained, so each series tiles that hour from its own random offset.".into(),
        format!(
            "The week is built with an assumed daily cycle (the week-long trace was not obtainable): a sine peaking at 14:00, amplitude {} for code and {} for conversation, weekends at {} of weekdays, each service shifted by up to +-{} h.",
            cluster::amplitude(trace::Kind::Code),
            cluster::amplitude(trace::Kind::Conv),
            cluster::WEEKEND,
            cluster::PHASE_MAX_S / 3600.0
        ),
        format!(
            "Each service's base load is uniform in [{}, {}] x one cluster scale, calibrated so the mean online busy fraction is about {} (the measured value is reported).",
            cluster::BASE_SPREAD[0], cluster::BASE_SPREAD[1], cfg.online.target_busy
        ),
        format!(
            "Every GPU has {} GiB (also on Alibaba-shaped nodes, whose GPU models are older); online weights {}-{} GiB per GPU, a {} GiB reserve, and online KV taking up to {} of the rest in proportion to the minute's peak busy second.",
            cluster::CAPACITY_GIB, cluster::WEIGHTS_GIB[0], cluster::WEIGHTS_GIB[1], cluster::RESERVE_GIB, cluster::KV_SHARE
        ),
        "GPUs of one in-step service share one busy series; out-of-step ranks and different services are independent within a minute (overlap = b1 b2).".into(),
        format!(
            "Preemption costs {} ms of offline time per online idle-to-busy transition, and the gate {:.0}% of offline's running time; transitions per minute = the trace's requests that minute x the service's load x its idle share, at most {}.",
            cfg.costs.preempt_s * 1e3, cfg.costs.gate_overhead * 100.0, cluster::TRANSITIONS_CAP_PER_MIN
        ),
        format!(
            "A job's true throughput differs from its profile by a normal factor (sd {}, clamped to [{}, {}]) drawn once; a reclaim (memory below what the job held the minute before) costs deficit_penalty x drop / R of that minute's work; a multi-GPU job runs only when all its GPUs are idle and at its worst GPU's T(m).",
            cfg.profile_error_sd, jobs::PROFILE_ERROR_BOUNDS[0], jobs::PROFILE_ERROR_BOUNDS[1]
        ),
        format!(
            "Evicted or killed jobs lose their last {} minutes of progress (since their last checkpoint), are requeued and avoid that node; a static-split job holds min(least memory of the past hour, R) and is killed when online needs that memory.",
            run::ROLLBACK_MIN
        ),
        format!(
            "Each (class, SLA) stream keeps at most {} jobs waiting; later arrivals are turned away (counted), so there is always a backlog of every kind without the queue growing for a week.",
            cfg.max_pending_per_stream
        ),
        "Offline busy time counts a job's GPUs x the share of the minute all of them are idle, in minutes where its memory lets it run at all.".into(),
        "Monitor (all policies): 600 s window, 2 misses in a row to evict, 0.05 hysteresis, at most one eviction per 10 nodes a minute; jobs report progress every pass.".into(),
        "The oracle is Valve's placement fed with documents of the hour after each pass (what will happen on each GPU) and each job's true level relative to its profile (to 0.01); it does not see reclaim losses or preemption costs the profiles do not carry.".into(),
    ];
    if cfg.level_drift_sd > 0.0 {
        out.push(format!(
            "Each run's true level also drifts: x (1 + d), d an AR(1) process with stationary sd {} and correlation time {} min (drawn afresh at each placement, 1 + d clamped to [{}, {}]). No policy knows it: the oracle knows each job's static level, not its drift.",
            cfg.level_drift_sd,
            cfg.level_drift_minutes,
            drift::FACTOR_BOUNDS[0],
            drift::FACTOR_BOUNDS[1]
        ));
    }
    if cfg.node_speed_sd > 0.0 {
        out.push(format!(
            "Each node runs every job at a true speed drawn once, lognormal with log-sd {} clamped to [{}, {}] (H100s of one model ran the same job 26-30% apart); the oracle knows it, Valve learns it from its running jobs (calibration: {}), the other policies do not see it.",
            cfg.node_speed_sd,
            cluster::SPEED_BOUNDS[0],
            cluster::SPEED_BOUNDS[1],
            if cfg.policies.iter().any(|p| p.params.calibration) { "on" } else { "off" }
        ));
    }
    out
}

/// Builds the world of `cfg` and runs every policy; `command` and `multi_source` (how the online
/// multi-GPU share was chosen) go into the results.
pub fn simulate(cfg: &SimConfig, command: &str, multi_source: &str) -> Results {
    let wall = Instant::now();
    let cluster = cluster::Cluster::build(&cfg.online);
    let classes = jobs::classes();
    let mix = jobs::class_mix(&classes, cfg.offline_multi_gpu_share);
    let work = jobs::work_distribution();
    let idle_gpus = cluster.gpus.len() as f64 * (1.0 - cluster.estimated_busy);
    let offer = jobs::Offer {
        idle_gpus,
        load: cfg.offered_load,
        minutes: cfg.minutes,
        profile_error_sd: cfg.profile_error_sd,
        seed: cfg.seed,
    };
    let (arrivals, arrival_summary) = jobs::arrivals(&classes, &mix, &work, offer);
    let cluster_summary = cluster.summary();
    let class_summaries = class_summaries(&classes, &mix);
    let world = World::new(
        cluster,
        classes,
        arrivals,
        cfg.minutes,
        cfg.max_pending_per_stream,
    )
    .with_costs(cfg.costs)
    .with_node_speeds(cfg.node_speed_sd, cfg.online.seed)
    .with_level_drift(
        drift::LevelDrift::new(cfg.level_drift_sd, cfg.level_drift_minutes),
        cfg.seed,
    );
    let out = run::run_world(&world, cfg);
    let online = out.online_busy_gpu_min / out.gpu_minutes.max(1.0);
    let online_memory = online_memory(&out.memory_hist, out.gpu_minutes);
    let policies = report::policy_reports(out.policies, out.online_busy_gpu_min, out.gpu_minutes);
    let targets = report::targets(&policies);
    Results {
        device: "this machine (CPU), no GPU".into(),
        command: command.into(),
        config: config_summary(cfg, multi_source),
        assumptions: assumptions(cfg),
        cluster: cluster_summary,
        online_busy_measured: online,
        online_memory,
        classes: class_summaries,
        work,
        arrivals: arrival_summary,
        policies,
        targets,
        wall_s: wall.elapsed().as_secs_f64(),
        shared_s: out.shared_s,
    }
}

/// What the report says of each job class: its size, memory needs, share of the mix and curve.
fn class_summaries(classes: &[jobs::Class], mix: &[f64]) -> Vec<ClassSummary> {
    classes
        .iter()
        .zip(mix)
        .map(|(c, &p)| {
            let pr = &c.profile.profile;
            ClassSummary {
                name: pr.name.clone(),
                gpus: pr.gpus,
                min_gib: pr.minimum() as f64 / (1u64 << 30) as f64,
                required_gib: c.required_gib,
                deficit_penalty: pr.deficit_penalty,
                mix: p,
                curve: pr
                    .curve
                    .iter()
                    .map(|q| {
                        (
                            q.memory_bytes as f64 / (1u64 << 30) as f64,
                            q.per_s / pr.alone_per_s,
                        )
                    })
                    .collect(),
            }
        })
        .collect()
}

/// The share of GPU-minutes online spent in each memory bin.
fn online_memory(memory_hist: &[f64], gpu_minutes: f64) -> Vec<(String, f64)> {
    let mut lo = 0.0;
    run::MEMORY_BINS_GIB
        .iter()
        .zip(memory_hist.iter().copied())
        .map(|(&hi, n)| {
            let bin = if hi.is_finite() {
                format!("{lo}-{hi} GiB")
            } else {
                format!("{lo}+ GiB")
            };
            lo = hi;
            (bin, n / gpu_minutes.max(1.0))
        })
        .collect()
}

/// The configuration as the report names it.
fn config_summary(cfg: &SimConfig, multi_source: &str) -> ConfigSummary {
    ConfigSummary {
        nodes: cfg.online.nodes,
        shape: cfg.online.shape.to_string(),
        days: f64::from(cfg.minutes) / 1440.0,
        pass_every_min: run::PASS_EVERY_MIN,
        online_multi_gpu_share: cfg.online.multi_gpu_share,
        online_multi_gpu_share_source: multi_source.into(),
        out_of_step_share: cfg.online.out_of_step_share,
        offline_multi_gpu_share: cfg.offline_multi_gpu_share,
        offered_load: cfg.offered_load,
        target_online_busy: cfg.online.target_busy,
        max_pending_per_stream: cfg.max_pending_per_stream,
        seeds: (cfg.online.seed, cfg.seed),
        threads: cfg.threads,
        node_speed_sd: cfg.node_speed_sd,
        profile_error_sd: cfg.profile_error_sd,
        level_drift_sd: cfg.level_drift_sd,
        level_drift_minutes: cfg.level_drift_minutes,
    }
}
