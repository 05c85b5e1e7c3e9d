//! What the daemon costs a new CUDA process: the online client's context creation
//! (cudaSetDevice + cudaFree(0)) with no daemon, with a daemon that has just answered its socket,
//! with one that has settled, and with a settled one that loads no eBPF probes
//! (`valvectl daemon --no-discovery`). The variants are interleaved in rounds, so that drift
//! hits all alike; the check judges the settled daemon ("with the daemon running"), and every
//! variant is reported with its spread. docs/hardening.md, "What the daemon costs a new CUDA
//! process", lists what each variant separates.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use valve::GpuInfo;

use crate::daemon::{status_of, Daemon};
use crate::hog::Bins;
use crate::Report;

/// How many rounds to run, and the wall time after which no new round starts.
pub(crate) struct Plan {
    pub(crate) rounds: usize,
    pub(crate) bound: Duration,
}

impl Plan {
    /// Inside the full hardware test: 24 samples per variant, about 70 s.
    pub(crate) const IN_FULL_RUN: Plan = Plan {
        rounds: 12,
        bound: Duration::from_secs(75),
    };
    /// `--only-ctx`: 40 samples per variant, under 2 minutes.
    pub(crate) const ONLY: Plan = Plan {
        rounds: 20,
        bound: Duration::from_secs(110),
    };
}

/// The longest one online client may take (context creation takes about 0.23 s) before it is
/// killed and counted as an error.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(15);
/// The longest a daemon may take to answer its socket (it takes about 60 ms).
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest a daemon may take to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);
/// Past the plan's bound by this much, not even the round under way goes on.
const HARD_SLACK: Duration = Duration::from_secs(20);
/// The pause after a daemon exits, so that no sample runs beside its teardown.
const AFTER_STOP: Duration = Duration::from_millis(100);
/// The pause before the daemon's event count is read, so that the ring buffer has been drained.
const EVENTS_DRAINED: Duration = Duration::from_millis(20);

/// What runs beside a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Variant {
    /// No daemon.
    Alone,
    /// A daemon that answered its socket just before (its start-up may still be going on).
    JustStarted,
    /// A daemon that answered 0.2-1.2 s before.
    Settled,
    /// The same, started with `--no-discovery`: no eBPF probes.
    NoProbes,
}

impl Variant {
    const ALL: [Variant; 4] = [
        Variant::Alone,
        Variant::Settled,
        Variant::NoProbes,
        Variant::JustStarted,
    ];

    fn key(self) -> &'static str {
        match self {
            Variant::Alone => "no_daemon",
            Variant::JustStarted => "just_started",
            Variant::Settled => "settled",
            Variant::NoProbes => "settled_no_probes",
        }
    }

    fn label(self) -> &'static str {
        match self {
            Variant::Alone => "no daemon",
            Variant::JustStarted => {
                "daemon just started (for information: overlaps its start-up, as the old check did)"
            }
            Variant::Settled => "daemon settled (judged)",
            Variant::NoProbes => "daemon settled, no eBPF probes (--no-discovery)",
        }
    }
}

/// One piece of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Step {
    /// One sample with no daemon.
    Alone,
    /// Start a daemon; a sample as soon as it answers, another once it has settled; stop it.
    Full,
    /// Start a daemon with `--no-discovery`; two samples once it has settled; stop it.
    Quiet,
}

/// Round `r`: two samples of each variant. The steps are rotated by the round's number, so
/// that no variant always comes first or always follows the same one.
fn round_steps(r: usize) -> [Step; 5] {
    let mut s = [
        Step::Alone,
        Step::Full,
        Step::Alone,
        Step::Quiet,
        Step::Full,
    ];
    s.rotate_left(r % 5);
    s
}

/// How long the `k`-th daemon is left to settle: 0.2 to 1.2 s, spread evenly over that second
/// (golden-ratio steps), so that the settled samples meet the daemon's once-a-second memory
/// sample at every phase, as a CUDA process started at a random time would.
fn settle(k: usize) -> Duration {
    let phase = (k as f64 * 0.618_033_988_749_894_9).fract();
    Duration::from_millis(200 + (phase * 1000.0) as u64)
}

/// The online client's context creation, in microseconds (killed after [`SAMPLE_TIMEOUT`]).
fn context_init_us(bins: &Bins, gpu: &GpuInfo) -> Result<f64> {
    let child = Command::new(&bins.online)
        .args(["--count", "1", "--think-us", "0"])
        .env("CUDA_VISIBLE_DEVICES", &gpu.uuid)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("running {}", bins.online.display()))?;
    let pid = nix::unistd::Pid::from_raw(child.id() as i32);
    let (done, wait) = std::sync::mpsc::channel::<()>();
    let watchdog = std::thread::spawn(move || {
        let late = wait.recv_timeout(SAMPLE_TIMEOUT).is_err();
        if late {
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        }
        late
    });
    let out = child.wait_with_output();
    let _ = done.send(());
    if watchdog.join().unwrap_or(false) {
        bail!("the online client took over {SAMPLE_TIMEOUT:?} and was killed");
    }
    let out = out?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("online client failed ({}): {text}", out.status);
    }
    let line = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("online client printed no JSON")?;
    let v: Value = serde_json::from_str(line)?;
    v["context_init_us"]
        .as_f64()
        .context("online printed no context_init_us")
}

/// What the rounds collected.
#[derive(Default)]
struct Samples {
    /// (round, variant, context creation in us).
    taken: Vec<(usize, Variant, f64)>,
    /// Every error, in order.
    errors: Vec<String>,
    /// RM events the settled daemon counted over one online client's life (allocs, frees, exit).
    events: Vec<f64>,
    /// From each daemon's spawn to its first answer, ms.
    answer_ms: Vec<f64>,
    /// Rounds run.
    rounds: usize,
}

/// Runs the rounds: the binaries, the GPU, where daemons keep their files, and what was taken.
struct Runner<'a> {
    bins: &'a Bins,
    gpu: &'a GpuInfo,
    vc: &'a Path,
    dir: PathBuf,
    log: PathBuf,
    starts: usize,
    s: Samples,
}

impl Runner<'_> {
    fn sample(&mut self, round: usize, v: Variant) {
        match context_init_us(self.bins, self.gpu) {
            Ok(us) => self.s.taken.push((round, v, us)),
            Err(e) => self
                .s
                .errors
                .push(format!("round {round}, {}: {e:#}", v.key())),
        }
    }

    /// Starts a daemon (with `extra` flags) on a fresh state directory.
    fn start(&mut self, extra: &[&str]) -> Result<Daemon> {
        self.starts += 1;
        let state = self.dir.join(format!("state-{}", self.starts));
        let sock = self.dir.join("valve.sock");
        let t0 = Instant::now();
        let (d, status) =
            Daemon::start_answering(self.vc, &sock, &state, &self.log, extra, START_TIMEOUT)?;
        self.s.answer_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        let probes = extra.is_empty();
        if status["discovery"] != json!(probes) {
            bail!("the daemon's status says discovery {}", status["discovery"]);
        }
        Ok(d)
    }

    fn stop(&mut self, d: Daemon) -> Result<()> {
        d.stop_within(STOP_TIMEOUT)?;
        std::thread::sleep(AFTER_STOP);
        Ok(())
    }

    /// The daemon's event count, once what the last client did has been delivered.
    fn events(&self) -> Option<f64> {
        std::thread::sleep(EVENTS_DRAINED);
        status_of(&self.dir.join("valve.sock")).ok()?["events"].as_f64()
    }

    fn full(&mut self, round: usize) -> Result<()> {
        let d = self.start(&[])?;
        self.sample(round, Variant::JustStarted);
        let before = self.events();
        std::thread::sleep(settle(self.starts));
        self.sample(round, Variant::Settled);
        if let (Some(a), Some(b)) = (before, self.events()) {
            self.s.events.push(b - a);
        }
        self.stop(d)
    }

    fn quiet(&mut self, round: usize) -> Result<()> {
        let d = self.start(&["--no-discovery"])?;
        std::thread::sleep(settle(self.starts));
        self.sample(round, Variant::NoProbes);
        self.sample(round, Variant::NoProbes);
        self.stop(d)
    }

    fn step(&mut self, round: usize, step: Step) {
        let done = match step {
            Step::Alone => {
                self.sample(round, Variant::Alone);
                Ok(())
            }
            Step::Full => self.full(round),
            Step::Quiet => self.quiet(round),
        };
        if let Err(e) = done {
            self.s
                .errors
                .push(format!("round {round}, {step:?}: {e:#}"));
        }
    }
}

/// Runs the measurement on `gpu` and reports it (errors go into the report, never abort).
pub(crate) fn run(bins: &Bins, gpu: &GpuInfo, vc: &Path, out: &Path, plan: &Plan, r: &mut Report) {
    r.line("\n## What the daemon costs a new CUDA process (context creation)\n");
    if !nix::unistd::geteuid().is_root() {
        r.line("Skipped: the daemon needs root.");
        return;
    }
    let dir = PathBuf::from(format!("/tmp/valve-ctx-{}", std::process::id()));
    if let Err(e) = std::fs::create_dir_all(&dir) {
        r.check("context-creation experiment ran", false, format!("{e}"));
        return;
    }
    let mut run = Runner {
        bins,
        gpu,
        vc,
        dir: dir.clone(),
        log: out.join("ctx-daemon.log"),
        starts: 0,
        s: Samples::default(),
    };
    let wall = run.rounds(plan);
    let _ = std::fs::remove_dir_all(&dir);
    report(&run.s, plan, wall, r);
}

impl Runner<'_> {
    /// Runs the plan's rounds, none started after its bound and no step after the bound plus
    /// [`HARD_SLACK`]; returns the wall time taken.
    fn rounds(&mut self, plan: &Plan) -> Duration {
        let t0 = Instant::now();
        while self.s.rounds < plan.rounds && t0.elapsed() < plan.bound {
            for step in round_steps(self.s.rounds) {
                if t0.elapsed() > plan.bound + HARD_SLACK {
                    self.s
                        .errors
                        .push("stopped mid-round: past the time bound".into());
                    break;
                }
                self.step(self.s.rounds, step);
            }
            self.s.rounds += 1;
        }
        t0.elapsed()
    }
}

/// A variant's samples: (n, p50, p25, p75, min, max) in us.
fn spread(s: &Samples, v: Variant) -> (usize, f64, f64, f64, f64, f64) {
    let mut x: Vec<f64> = s.taken.iter().filter(|t| t.1 == v).map(|t| t.2).collect();
    x.sort_by(f64::total_cmp);
    let p = |q| valve::stats::percentile(&x, q);
    let (min, max) = (x.first().copied(), x.last().copied());
    (
        x.len(),
        p(0.5),
        p(0.25),
        p(0.75),
        min.unwrap_or(0.0),
        max.unwrap_or(0.0),
    )
}

/// The median over rounds of (variant's mean in the round / no daemon's mean in it - 1):
/// a paired figure that round-to-round drift cannot move. `None` without a complete round.
fn paired(s: &Samples, v: Variant) -> Option<f64> {
    let mean = |round: usize, w: Variant| {
        let x: Vec<f64> = s
            .taken
            .iter()
            .filter(|t| t.0 == round && t.1 == w)
            .map(|t| t.2)
            .collect();
        (!x.is_empty()).then(|| x.iter().sum::<f64>() / x.len() as f64)
    };
    let mut d: Vec<f64> = (0..s.rounds)
        .filter_map(|k| Some(mean(k, v)? / mean(k, Variant::Alone)? - 1.0))
        .collect();
    d.sort_by(f64::total_cmp);
    (!d.is_empty()).then(|| valve::stats::percentile(&d, 0.5))
}

/// The report's lines, its JSON and the check.
fn report(s: &Samples, plan: &Plan, wall: Duration, r: &mut Report) {
    let alone = spread(s, Variant::Alone);
    r.line(&format!(
        "cudaSetDevice + cudaFree(0) in a new process, {} interleaved round(s) of 2 samples per \
         variant ({:.0} s; at most {} rounds or {} s). p50 [p25 .. p75] (min .. max), and against \
         no daemon by p50 and paired per round:\n",
        s.rounds,
        wall.as_secs_f64(),
        plan.rounds,
        plan.bound.as_secs()
    ));
    r.line("| variant | n | p50 ms | p25 .. p75 ms | min .. max ms | vs no daemon (p50) | vs no daemon (paired) |\n|---|---|---|---|---|---|---|");
    let mut variants = serde_json::Map::new();
    for v in Variant::ALL {
        let (n, p50, p25, p75, min, max) = spread(s, v);
        let vs = |x: Option<f64>| x.map_or("-".into(), |x| format!("{:+.2}%", x * 100.0));
        let by_p50 = (v != Variant::Alone && n > 0 && alone.0 > 0).then(|| p50 / alone.1 - 1.0);
        let by_pair = (v != Variant::Alone).then(|| paired(s, v)).flatten();
        r.line(&format!(
            "| {} | {n} | {:.1} | {:.1} .. {:.1} | {:.1} .. {:.1} | {} | {} |",
            v.label(),
            p50 / 1e3,
            p25 / 1e3,
            p75 / 1e3,
            min / 1e3,
            max / 1e3,
            vs(by_p50),
            vs(by_pair)
        ));
        let samples: Vec<f64> = s.taken.iter().filter(|t| t.1 == v).map(|t| t.2).collect();
        variants.insert(
            v.key().into(),
            json!({"n": n, "p50_us": p50, "p25_us": p25, "p75_us": p75, "min_us": min,
                   "max_us": max, "vs_no_daemon_p50": by_p50, "vs_no_daemon_paired": by_pair,
                   "samples_us": samples}),
        );
    }
    notes(s, r);
    judge(s, r);
    r.json.insert(
        "context_creation".into(),
        json!({"rounds": s.rounds, "wall_s": wall.as_secs_f64(), "variants": variants,
               "rm_events_per_client": s.events, "daemon_answer_ms": s.answer_ms,
               "errors": s.errors}),
    );
}

/// The daemon's answer time, the RM events per client, and the errors.
fn notes(s: &Samples, r: &mut Report) {
    let median = |x: &[f64]| {
        let mut x = x.to_vec();
        x.sort_by(f64::total_cmp);
        valve::stats::percentile(&x, 0.5)
    };
    r.line(&format!(
        "\nEach daemon answered its socket p50 {:.0} ms after its spawn ({} starts). The settled \
         daemon counted p50 {:.0} RM events (allocs, frees, exit) over one online client's life: \
         at the measured +0.5-0.6 us per reported event (bpf-cost), about {:.2} ms of probe time.",
        median(&s.answer_ms),
        s.answer_ms.len(),
        median(&s.events),
        median(&s.events) * 0.6e-3
    ));
    if !s.errors.is_empty() {
        r.line(&format!("\n{} error(s); the first ones:", s.errors.len()));
        for e in s.errors.iter().take(10) {
            r.line(&format!("- {e}"));
        }
    }
}

/// The check: the settled daemon against no daemon, by p50 (enough samples of both, or it fails
/// saying why).
fn judge(s: &Samples, r: &mut Report) {
    let name = "CUDA context creation with the daemon running is at most 2% slower";
    let (alone, settled) = (spread(s, Variant::Alone), spread(s, Variant::Settled));
    if alone.0 < 10 || settled.0 < 10 {
        r.check(
            name,
            false,
            format!(
                "too few samples: {} without the daemon, {} with it settled ({} error(s))",
                alone.0,
                settled.0,
                s.errors.len()
            ),
        );
        return;
    }
    let slower = settled.1 / alone.1 - 1.0;
    let just = spread(s, Variant::JustStarted);
    r.check(
        name,
        slower <= 0.02,
        format!(
            "{:+.2}% with the daemon settled (p50 {:.0} vs {:.0} us); just started, for \
             information: {:+.2}%",
            slower * 100.0,
            settled.1,
            alone.1,
            (just.1 / alone.1 - 1.0) * 100.0
        ),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_round_takes_two_samples_of_each_variant_and_rotates() {
        for r in 0..10 {
            let steps = round_steps(r);
            let n = |s| steps.iter().filter(|x| **x == s).count();
            assert_eq!((n(Step::Alone), n(Step::Full), n(Step::Quiet)), (2, 2, 1));
        }
        let firsts: std::collections::BTreeSet<_> =
            (0..5).map(|r| format!("{:?}", round_steps(r)[0])).collect();
        assert_eq!(firsts.len(), 3, "each kind of step leads some round");
    }

    #[test]
    fn settle_times_cover_one_second_evenly() {
        let t: Vec<u64> = (1..=20).map(|k| settle(k).as_millis() as u64).collect();
        assert!(t.iter().all(|&ms| (200..1200).contains(&ms)), "{t:?}");
        for bucket in 0..10 {
            let lo = 200 + bucket * 100;
            assert!(
                t.iter().any(|&ms| (lo..lo + 100).contains(&ms)),
                "no settle time in {lo}..{} ms: {t:?}",
                lo + 100
            );
        }
    }

    fn samples(taken: &[(usize, Variant, f64)], rounds: usize) -> Samples {
        Samples {
            taken: taken.to_vec(),
            rounds,
            ..Samples::default()
        }
    }

    #[test]
    fn the_paired_figure_ignores_drift_between_rounds() {
        use Variant::*;
        // Round 1 runs 10% slower for everyone; the daemon adds 1% within each round.
        let s = samples(
            &[
                (0, Alone, 100.0),
                (0, Settled, 101.0),
                (1, Alone, 110.0),
                (1, Settled, 111.1),
                (2, Alone, 100.0),
                (2, Settled, 101.0),
            ],
            3,
        );
        let d = paired(&s, Settled).unwrap();
        assert!((d - 0.01).abs() < 1e-9, "{d}");
        assert_eq!(paired(&s, NoProbes), None);
        assert_eq!(spread(&s, Alone).0, 3);
        assert_eq!(spread(&s, Settled).1, 101.0);
    }

    /// A stand-in `valvectl`: `daemon` serves status lines on `--socket` (discovery as
    /// `--no-discovery` says, 10 more events per request) until SIGTERM.
    const FAKE_VALVECTL: &str = r#"#!/usr/bin/env python3
import json, socket, sys
a = sys.argv
path = a[a.index("--socket") + 1]
srv = socket.socket(socket.AF_UNIX)
srv.bind(path)
srv.listen(8)
events = 0
while True:
    c, _ = srv.accept()
    c.makefile().readline()
    events += 10
    data = {"discovery": "--no-discovery" not in a, "events": events}
    c.sendall((json.dumps({"data": data, "error": None}) + "\n").encode())
    c.close()
"#;

    /// A directory removed when the test ends.
    struct TmpDir(PathBuf);

    impl TmpDir {
        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TmpDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn script(dir: &Path, name: &str, text: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        p
    }

    /// Stand-ins for the binaries in `dir`: the online client prints a context creation of
    /// 1 ms; `valvectl` is [`FAKE_VALVECTL`].
    fn stand_ins(dir: &Path) -> (Bins, GpuInfo, PathBuf) {
        let online = "#!/bin/sh\necho '{\"context_init_us\": 1000}'\n";
        let bins = Bins {
            hog: dir.join("hog"),
            online: script(dir, "online", online),
            serving: dir.join("serving"),
            logger: dir.join("logger"),
        };
        let gpu = GpuInfo {
            index: 0,
            gpu_id: 0,
            device_instance: 0,
            minor: 0,
            pci_bus_id: "0000:00:06.0".into(),
            pci_device_id: 0x2330,
            uuid: "GPU-test".into(),
            name: "stand-in".into(),
        };
        (bins, gpu, script(dir, "valvectl", FAKE_VALVECTL))
    }

    #[test]
    fn a_round_against_stand_ins_takes_every_variant_and_records_errors() {
        if Command::new("python3").arg("-V").output().is_err() {
            eprintln!("skipped: no python3 for the stand-in daemon");
            return;
        }
        let tmp = std::env::temp_dir().join(format!("valve-ctx-test-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        let dir = TmpDir(tmp);
        let (bins, gpu, vc) = stand_ins(dir.path());
        let plan = Plan {
            rounds: 1,
            bound: Duration::from_secs(60),
        };
        let mut run = Runner {
            bins: &bins,
            gpu: &gpu,
            vc: &vc,
            dir: dir.path().to_path_buf(),
            log: dir.path().join("daemon.log"),
            starts: 0,
            s: Samples::default(),
        };
        run.rounds(&plan);
        assert!(run.s.errors.is_empty(), "{:?}", run.s.errors);
        for v in Variant::ALL {
            assert_eq!(spread(&run.s, v).0, 2, "{v:?}");
        }
        assert_eq!(run.s.answer_ms.len(), 3);
        assert_eq!(run.s.events, vec![10.0, 10.0]);
        // No daemon can start: those steps are errors, the samples without it still come.
        let missing = dir.path().join("missing");
        run.vc = &missing;
        run.s = Samples::default();
        run.rounds(&plan);
        assert_eq!(run.s.errors.len(), 3, "{:?}", run.s.errors);
        assert_eq!(spread(&run.s, Variant::Alone).0, 2);
    }

    #[test]
    fn the_check_judges_the_settled_daemon_and_fails_on_too_few_samples() {
        use Variant::*;
        let mut taken = Vec::new();
        for k in 0..12 {
            taken.push((k, Alone, 100.0));
            taken.push((k, JustStarted, 110.0));
            taken.push((k, Settled, 101.0));
        }
        let mut r = crate::Report {
            md: String::new(),
            json: Default::default(),
            checks: vec![],
        };
        judge(&samples(&taken, 12), &mut r);
        let (_, pass, detail) = r.checks.last().unwrap();
        assert!(*pass, "{detail}");
        assert!(
            detail.contains("+1.00%") && detail.contains("+10.00%"),
            "{detail}"
        );
        judge(&samples(&taken[..9], 3), &mut r);
        let (_, pass, detail) = r.checks.last().unwrap();
        assert!(!pass && detail.contains("too few samples"), "{detail}");
    }
}
