//! `valve-scheduler profile-job`: runs an offline job alone on a node's memory pool, its pool
//! share capped at several sizes in turn, and writes its profile (T_alone and T(m)).
//!
//! The cap is raised step by step (`valvectl pool cap`), so the job never loses memory while it
//! runs; the cap is lifted and the job stopped on every way out, Ctrl-C included.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode};
use std::time::{Duration, Instant};

use clap::Args;
use serde_json::Value;

use super::common::duration;
use super::stop::{install_signals, nap, stopped};
use crate::error::usage;
use valve_harvest::progress;
use valve_scheduler::job::{spread_of, InterruptCosts, Measured};
use valve_scheduler::profiling::{
    build, costs_from, interrupt_cost_s, preemption_costs, rebase_on_fresh_alone, step_effect,
    About, Step, StepReading,
};
use valve_scheduler::replay::unix_ms;

/// The job id the profiled run reports progress under.
const JOB: &str = "profile";
/// The job id of the second run, started uncapped, that measures T_alone (--fresh-alone).
const JOB_FRESH: &str = "profile-alone";

/// Measures a job's memory-throughput curve on this node and writes its profile.
///
/// Needs root and the Valve daemon with its pool (`valvectl daemon --pool`), no other offline
/// pool client on the GPU, and a job that is an offline pool client (e.g. transformers through
/// `valve_transformers.install("offline")`) and reports its progress: it gets
/// VALVE_PROGRESS_DIR and SLURM_JOB_ID and appends `UNIX_MS UNITS_DONE` lines to
/// $VALVE_PROGRESS_DIR/$SLURM_JOB_ID (or calls `valve-scheduler report UNITS_DONE`).
///
/// Steps: cap at each --caps size, smallest first (settle, then measure --seconds), then no cap.
/// Each point's memory is what the job held at the end of its step. With caps, the job is then
/// stopped and started again uncapped where --fresh-alone says so, and that run measures T_alone;
/// the capped points are scaled by the same factor. With --preempt-every and --reclaim-every, one
/// step each then measures what an interruption costs.
///
/// Example: sudo valve-scheduler profile-job --name llama-1b-cb --caps 1GiB,2GiB,4GiB,8GiB \
///   --out llama-1b-cb.json -- env VALVE_LABEL=batch python batch.py
#[derive(Args, Debug)]
pub struct ProfileJobArgs {
    /// The job's name in the profile.
    #[arg(long)]
    name: String,
    /// What its progress counts.
    #[arg(long, default_value = "tokens")]
    units: String,
    /// GPUs it runs on (the pool cap is set on --gpu; multi-GPU jobs: profile one rank).
    #[arg(long, default_value_t = 1)]
    gpus: u32,
    /// The GPU whose pool is capped.
    #[arg(long, default_value_t = 0)]
    gpu: u32,
    /// Pool shares to measure, e.g. 1GiB,2GiB,4GiB (MiB and GiB suffixes). None: the job is not a
    /// pool client (training, fixed memory): only its throughput alone is measured, and its
    /// curve is flat.
    #[arg(long, value_delimiter = ',', value_parser = bytes)]
    caps: Vec<u64>,
    /// Time from the job's first progress report to the first step.
    #[arg(long, default_value = "20s", value_parser = duration)]
    warmup: Duration,
    /// Time after a cap change before measuring (the job grows to the new cap).
    #[arg(long, default_value = "5s", value_parser = duration)]
    settle: Duration,
    /// Measuring time per step.
    #[arg(long, default_value = "20s", value_parser = duration)]
    seconds: Duration,
    /// Measuring time of the uncapped step, T_alone (default: twice --seconds). Every prediction
    /// scales with T_alone: measure it longest. Its two halves' difference is recorded as
    /// `measured.alone_spread`, the noise of the job's rate over half of it.
    #[arg(long, value_parser = duration)]
    alone_seconds: Option<Duration>,
    /// The deficit penalty to record (throughput lost per unit of relative memory deficit).
    #[arg(long, default_value_t = 0.0)]
    deficit_penalty: f64,
    /// Measure what a preemption costs the job: one more step in which it is preempted this
    /// often (`valvectl preempt --pid`, the job's own pid), each time for --preempt-for. The
    /// work lost beyond the time held, per preemption, becomes the profile's
    /// `costs.preemption_s`; held time the job did not lose (its host work went on) becomes
    /// `costs.held_overlap`. E.g. 1s.
    #[arg(long, value_parser = duration)]
    preempt_every: Option<Duration>,
    /// How long each profiling preemption holds the job. At half of --preempt-every, a job whose
    /// rate is steady to 3% gives its held time not lost to about 0.06; at a tenth, to about 0.3.
    #[arg(long, default_value = "500ms", value_parser = duration)]
    preempt_for: Duration,
    /// Measure what a reclaim costs the job (a pool client): one more step per --reclaim-mib
    /// size in which that much is taken back from it this often (`valvectl pool reclaim`), as
    /// online bursts would. The work lost per GiB over all of them becomes
    /// `costs.reclaim_s_per_gib`, and the work lost per reclaim at each size
    /// `costs.reclaim_episodes`. E.g. 10s: long enough for the job to grow back in between.
    #[arg(long, value_parser = duration)]
    reclaim_every: Option<Duration>,
    /// How much each profiling reclaim takes back, in MiB; several sizes (e.g. 1024,6144)
    /// measure how the loss grows with the size of a burst.
    #[arg(long, default_value = "1024", value_delimiter = ',')]
    reclaim_mib: Vec<u64>,
    /// With --caps, measure T_alone and the interruptions in a second run of the job, started
    /// uncapped, and scale the capped points by T_alone over the capped run's own uncapped rate
    /// (kept as `measured.capped_run_alone_per_s`). For a job whose level may depend on how it
    /// started. On an H200 a capped run read 13% below the job's level in another process; a
    /// later capped run and a fresh one differed by 2.2%, so one run is the default
    /// (docs/cluster.md, "Sixth check").
    #[arg(long, default_value_t = false, action = clap::ArgAction::Set)]
    fresh_alone: bool,
    /// Charge every interruption cost the steps read. By default a step whose rate is within
    /// the spread of the job's uninterrupted rates (how far its own level moved while profiled)
    /// is taken to have measured nothing: on an H100 a profile whose level moved 13.4% read
    /// 0.025 s a preemption and 0.17 s a GiB, and the predictions came out 7% and 16% low. The
    /// readings left out are kept as `measured.costs_as_read` (docs/cluster.md, "Costs inside
    /// the noise").
    #[arg(long)]
    keep_costs_within_noise: bool,
    /// The valvectl binary.
    #[arg(long, default_value = "valvectl")]
    valvectl: PathBuf,
    /// Where to write the profile (also printed).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The job's command line.
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

/// `1GiB`, `512MiB`, or a number of bytes.
fn bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = if let Some(n) = t.strip_suffix("GiB") {
        (n, 1u64 << 30)
    } else if let Some(n) = t.strip_suffix("MiB") {
        (n, 1 << 20)
    } else {
        (t, 1)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("'{s}' is not a size (e.g. 512MiB, 4GiB)"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("'{s}' must be above 0"));
    }
    Ok((v * mult as f64) as u64)
}

/// The job and the cap, undone when dropped.
struct Session<'a> {
    a: &'a ProfileJobArgs,
    child: Option<Child>,
    /// The job id the running job reports progress under.
    job: &'static str,
}

impl Session<'_> {
    fn capped(&self) -> bool {
        !self.a.caps.is_empty()
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        self.stop_job();
        if !self.capped() {
            return;
        }
        if let Err(e) = self.pool(&["cap", "--gpu", &self.a.gpu.to_string(), "--lift"]) {
            eprintln!("valve-scheduler profile-job: could not lift the pool cap: {e}; run `sudo valvectl pool cap --gpu {} --lift`", self.a.gpu);
        }
    }
}

impl Session<'_> {
    /// Starts the job reporting progress as `job` into `dir`; returns once it has reported and
    /// --warmup has passed.
    fn start_job(&mut self, dir: &Path, job: &'static str) -> anyhow::Result<()> {
        let a = self.a;
        let child = Command::new(&a.command[0])
            .args(&a.command[1..])
            .env("VALVE_PROGRESS_DIR", dir)
            .env("SLURM_JOB_ID", job)
            .process_group(0)
            .spawn()
            .map_err(|e| usage(format!("cannot start {}: {e}", a.command[0])))?;
        (self.child, self.job) = (Some(child), job);
        let started = Instant::now();
        while rate(dir, job, Duration::from_secs(3600)).is_none() {
            self.alive().map_err(anyhow::Error::msg)?;
            if started.elapsed() > Duration::from_secs(600) {
                anyhow::bail!("the job has not reported progress in 10 minutes: it must append to $VALVE_PROGRESS_DIR/$SLURM_JOB_ID");
            }
            nap(Duration::from_millis(500));
        }
        nap(a.warmup);
        Ok(())
    }

    /// Stops the job's process group: SIGTERM, SIGKILL after 15 s.
    fn stop_job(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pg = nix::unistd::Pid::from_raw(-(c.id() as i32));
            let _ = nix::sys::signal::kill(pg, nix::sys::signal::Signal::SIGTERM);
            let end = Instant::now() + Duration::from_secs(15);
            while Instant::now() < end && matches!(c.try_wait(), Ok(None)) {
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = nix::sys::signal::kill(pg, nix::sys::signal::Signal::SIGKILL);
            let _ = c.wait();
        }
    }

    /// The running job's rate over the last `window`.
    fn rate(&self, dir: &Path, window: Duration) -> Option<f64> {
        rate(dir, self.job, window)
    }

    fn pool(&self, args: &[&str]) -> Result<Value, String> {
        let out = Command::new(&self.a.valvectl)
            .arg("--json")
            .arg("pool")
            .args(args)
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.a.valvectl.display()))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_string());
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("valvectl pool: {e}"))
    }

    fn cap(&self, bytes: Option<u64>) -> Result<(), String> {
        let gpu = self.a.gpu.to_string();
        match bytes {
            Some(b) => self.pool(&[
                "cap",
                "--gpu",
                &gpu,
                "--offline-mib",
                &(b >> 20).to_string(),
            ]),
            None => self.pool(&["cap", "--gpu", &gpu, "--lift"]),
        }
        .map(|_| ())
    }

    /// What offline holds on the GPU now.
    fn held_bytes(&self) -> Result<u64, String> {
        let st = self.pool(&["status"])?;
        let g = st["gpus"]
            .as_array()
            .and_then(|gs| gs.iter().find(|g| g["gpu"] == u64::from(self.a.gpu)))
            .ok_or_else(|| format!("the pool has no GPU {}", self.a.gpu))?;
        Ok(g["offline"].as_u64().unwrap_or(0) * g["handle_bytes"].as_u64().unwrap_or(0))
    }

    /// Preempts the job for --preempt-for (valvectl returns once it resumed).
    fn preempt_once(&self) -> Result<(), String> {
        let pid = self.child.as_ref().map_or(0, Child::id).to_string();
        let hold = format!("{}ms", self.a.preempt_for.as_millis());
        let out = Command::new(&self.a.valvectl)
            .args(["--json", "preempt", "--pid", &pid, "--for", &hold])
            .output()
            .map_err(|e| format!("cannot run {}: {e}", self.a.valvectl.display()))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "valvectl preempt --pid {pid}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// Takes `mib` back from offline; returns the GiB actually taken.
    fn reclaim_once(&self, mib: u64) -> Result<f64, String> {
        let gpu = self.a.gpu.to_string();
        let mib = mib.to_string();
        let v = self.pool(&["reclaim", "--gpu", &gpu, "--mib", &mib])?;
        Ok(v["reclaimed_mib"].as_f64().unwrap_or(0.0) / 1024.0)
    }

    fn alive(&mut self) -> Result<(), String> {
        match self.child.as_mut().map(Child::try_wait) {
            Some(Ok(Some(status))) => {
                Err(format!("the job exited ({status}) before profiling ended"))
            }
            _ if stopped() => Err("interrupted".into()),
            _ => Ok(()),
        }
    }
}

/// Job `job`'s rate over the last `window`.
fn rate(dir: &Path, job: &str, window: Duration) -> Option<f64> {
    let w = window.as_secs().max(1) as u32;
    progress::read_all(dir, unix_ms(), &[w], 600_000)
        .into_iter()
        .find(|j| j.job == job)?
        .rate(w)
        .map(|r| r.per_s)
}

/// Profiles the job.
pub fn exec(a: &ProfileJobArgs, json: bool) -> anyhow::Result<ExitCode> {
    let mut caps = a.caps.clone();
    caps.sort_unstable();
    caps.dedup();
    install_signals()?;
    let dir = tempfile_dir()?;
    let mut s = Session {
        a,
        child: None,
        job: JOB,
    };
    if let Some(&first) = caps.first() {
        s.pool(&["status"])
            .map_err(|e| usage(format!("the pool is not reachable: {e}")))?;
        s.cap(Some(first)).map_err(usage)?;
    }
    s.start_job(&dir, JOB)?;
    let (mut steps, mut alone_spread) = memory_steps(&mut s, &dir, &caps)?;
    let mut capped_run_alone_per_s = None;
    if !caps.is_empty() && a.fresh_alone {
        s.stop_job();
        s.start_job(&dir, JOB_FRESH)?;
        let alone_for = a.alone_seconds.unwrap_or(2 * a.seconds);
        let (fresh, spread) = alone_step(&mut s, &dir, alone_for)?;
        alone_spread = spread;
        capped_run_alone_per_s = steps.last().map(|st| st.per_s);
        let factor = rebase_on_fresh_alone(&mut steps, fresh);
        eprintln!(
            "started uncapped: {fresh:.1} {}/s alone, {} the capped run's uncapped rate{}",
            a.units,
            factor.map_or("unlike".into(), |f| format!("{f:.3}x")),
            factor.map_or("", |_| " (its points scaled by that)")
        );
    }
    let alone = steps.last().map_or(0.0, |st| st.per_s);
    let mut uninterrupted = vec![alone];
    let readings = interruptions(&mut s, &dir, &mut uninterrupted).map_err(anyhow::Error::msg)?;
    drop(s);
    let (costs, costs_as_read) = charged_costs(&readings, &uninterrupted, a);
    let about = About {
        name: a.name.clone(),
        units: a.units.clone(),
        gpus: a.gpus,
        measured: Measured {
            device: device_name(),
            unix_ms: unix_ms(),
            seconds_per_point: a.seconds.as_secs_f64(),
            alone_spread,
            uninterrupted_per_s: uninterrupted,
            capped_run_alone_per_s,
            costs_as_read,
        },
        deficit_penalty: a.deficit_penalty,
        costs,
    };
    if caps.is_empty() {
        steps[0].cap_bytes = Some(0); // not a pool client: one flat point
    }
    if let Some(moved) = about.measured.uninterrupted_spread() {
        eprintln!(
            "the job's uninterrupted rate moved {:.1}% (highest - lowest over mean) while profiled: \
             no prediction from this profile is closer than its own level",
            100.0 * moved
        );
    }
    let profile = build(&about, &steps).map_err(anyhow::Error::msg)?;
    let text = serde_json::to_string_pretty(&profile)?;
    if let Some(out) = &a.out {
        std::fs::write(out, &text)?;
    }
    if json || a.out.is_none() {
        println!("{text}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(ExitCode::SUCCESS)
}

/// The costs the profile charges, and the costs as the steps read them where some were left
/// out for lying inside the job's own spread (unless --keep-costs-within-noise). Prints what it
/// left out and the costs.
fn charged_costs(
    readings: &[StepReading],
    uninterrupted: &[f64],
    a: &ProfileJobArgs,
) -> (InterruptCosts, Option<InterruptCosts>) {
    let noise = (!a.keep_costs_within_noise)
        .then(|| spread_of(uninterrupted))
        .flatten();
    let (costs, notes) = costs_from(readings, noise);
    for n in &notes {
        eprintln!("{n}");
    }
    if a.reclaim_every.is_some() {
        eprintln!("{:.3} s lost per GiB reclaimed", costs.reclaim_s_per_gib);
    }
    let as_read = (!notes.is_empty()).then(|| costs_from(readings, None).0);
    (costs, as_read)
}

/// One step per cap, smallest first, then the uncapped one (measured over --alone-seconds, in
/// two halves). Returns the steps and the uncapped step's halves' spread.
fn memory_steps(
    s: &mut Session<'_>,
    dir: &Path,
    caps: &[u64],
) -> anyhow::Result<(Vec<Step>, Option<f64>)> {
    let a = s.a;
    let alone_for = a.alone_seconds.unwrap_or(2 * a.seconds);
    let mut steps = Vec::new();
    let mut alone_spread = None;
    for cap in caps.iter().map(|&c| Some(c)).chain([None]) {
        if !caps.is_empty() {
            s.cap(cap).map_err(anyhow::Error::msg)?;
        }
        let per_s = if cap.is_none() {
            let (per_s, spread) = alone_step(s, dir, alone_for)?;
            alone_spread = spread;
            per_s
        } else {
            nap(a.settle + a.seconds);
            s.alive().map_err(anyhow::Error::msg)?;
            s.rate(dir, a.seconds).unwrap_or(0.0)
        };
        let held_bytes = if caps.is_empty() {
            0
        } else {
            s.held_bytes().map_err(anyhow::Error::msg)?
        };
        eprintln!(
            "cap {}: held {} MiB, {per_s:.1} {}/s",
            cap.map_or("none".into(), |c| format!("{} MiB", c >> 20)),
            held_bytes >> 20,
            a.units
        );
        steps.push(Step {
            cap_bytes: cap,
            held_bytes,
            per_s,
        });
    }
    Ok((steps, alone_spread))
}

/// The uncapped step: settle, then `seconds` measured in two halves. Returns the rate over all
/// of it and the halves' relative difference (None where a half measured nothing).
fn alone_step(
    s: &mut Session<'_>,
    dir: &Path,
    seconds: Duration,
) -> anyhow::Result<(f64, Option<f64>)> {
    let half = seconds / 2;
    nap(s.a.settle + half);
    s.alive().map_err(anyhow::Error::msg)?;
    let first = s.rate(dir, half);
    nap(seconds - half);
    s.alive().map_err(anyhow::Error::msg)?;
    let second = s.rate(dir, half);
    let all = s.rate(dir, seconds).unwrap_or(0.0);
    Ok((all, first.zip(second).and_then(|(x, y)| spread(x, y))))
}

/// |x - y| over their mean; None where both are 0.
fn spread(x: f64, y: f64) -> Option<f64> {
    let mean = (x + y) / 2.0;
    (mean > 0.0).then(|| (x - y).abs() / mean)
}

/// The interruption steps (after the uncapped one, whose rate is the last of `uninterrupted`,
/// to which each later uninterrupted rate is added): what a preemption and a GiB reclaimed
/// cost the job, where asked for, as read ([`costs_from`] decides what is kept). Each
/// interrupted step is followed by an uninterrupted one and compared with the mean of the rates
/// just before and just after it ([`bracket`]), so that the job's own drift over the profile is
/// not charged to the interruptions (two profiles of one job on one H200 read 0.46 and 2.41 s
/// per 6 GiB reclaim when the step was compared with T_alone measured minutes earlier).
fn interruptions(
    s: &mut Session<'_>,
    dir: &Path,
    uninterrupted: &mut Vec<f64>,
) -> Result<Vec<StepReading>, String> {
    let a = s.a;
    let seconds = a.seconds.as_secs_f64();
    let mut readings = Vec::new();
    if let Some(every) = a.preempt_every {
        let held = a.preempt_for.as_secs_f64();
        let (n, _, per_s) = interrupted_step(s, dir, every, |s| s.preempt_once().map(|()| 1.0))?;
        let base = rebase(s, dir, uninterrupted)?;
        let (held_overlap, preemption_s) =
            preemption_costs(base, per_s, seconds, n * held, n).unwrap_or((0.0, 0.0));
        eprintln!(
            "preempted {n:.0} times for {} ms: {per_s:.1} {}/s, {preemption_s:.3} s lost per \
             preemption beyond the held time, {:.0}% of the held time not lost (host work went on)",
            a.preempt_for.as_millis(),
            a.units,
            100.0 * held_overlap
        );
        readings.push(StepReading::Preemption {
            held_overlap,
            preemption_s,
            effect: step_effect(base, per_s, seconds, n * held).unwrap_or(0.0),
        });
    }
    if let Some(every) = a.reclaim_every {
        let mut sizes = a.reclaim_mib.clone();
        sizes.sort_unstable();
        sizes.dedup();
        for mib in sizes {
            let (n, gib, per_s) = interrupted_step(s, dir, every, |s| s.reclaim_once(mib))?;
            let base = rebase(s, dir, uninterrupted)?;
            let lost_s = interrupt_cost_s(base, per_s, seconds, 0.0, 1.0).unwrap_or(0.0);
            eprintln!(
                "reclaimed {gib:.2} GiB in {n:.0} reclaims of {mib} MiB: {per_s:.1} {}/s, {:.3} s lost per reclaim",
                a.units,
                if n > 0.0 { lost_s / n } else { 0.0 }
            );
            readings.push(StepReading::Reclaim {
                mib,
                episodes: n,
                gib,
                lost_s,
                effect: step_effect(base, per_s, seconds, 0.0).unwrap_or(0.0),
            });
        }
    }
    Ok(readings)
}

/// After an interrupted step: --settle and --seconds uninterrupted, then the baseline that step
/// is compared with, [`bracket`] of the last of `uninterrupted` (the rate measured just before
/// it) and this one, which is added to `uninterrupted`.
fn rebase(s: &mut Session<'_>, dir: &Path, uninterrupted: &mut Vec<f64>) -> Result<f64, String> {
    nap(s.a.settle + s.a.seconds);
    s.alive()?;
    let after = s.rate(dir, s.a.seconds).unwrap_or(0.0);
    let before = uninterrupted.last().copied().unwrap_or(0.0);
    let base = bracket(before, after);
    eprintln!(
        "uninterrupted: {before:.1} {u}/s before, {after:.1} {u}/s after: baseline {base:.1} {u}/s (the job drifted {})",
        spread(before, after).map_or("?".into(), |d| format!("{:.1}%", 100.0 * d)),
        u = s.a.units
    );
    uninterrupted.push(after);
    Ok(base)
}

/// The rate an interrupted step would have had uninterrupted: the mean of the rates measured
/// just before and just after it (linear drift cancels), or whichever of them measured
/// anything.
fn bracket(before: f64, after: f64) -> f64 {
    match (before > 0.0, after > 0.0) {
        (true, true) => (before + after) / 2.0,
        (true, false) => before,
        _ => after,
    }
}

/// Runs `interrupt` every `every` through --settle and --seconds; returns how often it ran
/// inside the measured --seconds, the sum of what it returned there, and the job's rate over
/// them.
fn interrupted_step<'a>(
    s: &mut Session<'a>,
    dir: &Path,
    every: Duration,
    mut interrupt: impl FnMut(&Session<'a>) -> Result<f64, String>,
) -> Result<(f64, f64, f64), String> {
    let (settle, seconds) = (s.a.settle, s.a.seconds);
    let start = Instant::now();
    let mut next = start + every / 2;
    let (mut times, mut counted) = (0.0, 0.0);
    while start.elapsed() < settle + seconds {
        s.alive()?;
        let now = Instant::now();
        if now >= next {
            let amount = interrupt(s)?;
            if now >= start + settle {
                (times, counted) = (times + 1.0, counted + amount);
            }
            next += every;
        } else {
            nap((next - now).min(Duration::from_millis(200)));
        }
    }
    Ok((times, counted, s.rate(dir, seconds).unwrap_or(0.0)))
}

fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("valve-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The first GPU's name from nvidia-smi, where it answers.
fn device_name() -> String {
    Command::new("nvidia-smi")
        .args(["--query-gpu=name", "--format=csv,noheader"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().next().map(str::to_string))
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(test)]
mod tests {
    use super::{bracket, bytes, spread};

    #[test]
    fn an_interrupted_step_is_compared_with_the_rates_just_before_and_after_it() {
        assert_eq!(bracket(1331.0, 1229.0), 1280.0);
        assert_eq!(bracket(1000.0, 0.0), 1000.0, "after measured nothing");
        assert_eq!(bracket(0.0, 900.0), 900.0, "before measured nothing");
    }

    #[test]
    fn the_alone_spread_is_the_halves_difference_over_their_mean() {
        assert_eq!(spread(90.0, 110.0), Some(0.2));
        assert_eq!(spread(110.0, 90.0), Some(0.2));
        assert_eq!(spread(0.0, 0.0), None);
    }

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(bytes("1GiB"), Ok(1 << 30));
        assert_eq!(bytes("512MiB"), Ok(512 << 20));
        assert_eq!(bytes("1.5GiB"), Ok(3 << 29));
        assert!(bytes("lots").is_err());
        assert!(bytes("0GiB").is_err());
    }
}
