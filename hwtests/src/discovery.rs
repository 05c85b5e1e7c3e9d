//! The discovery test on a GPU host: the real daemon (eBPF) learns CUDA processes' channels, its
//! `ps` must equal the ioctl logger's ground truth, `preempt --pid` must freeze exactly that
//! process, and a daemon killed with SIGKILL must be undone by its restart within 1 s.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Result};
use serde_json::Value;
use valve::GpuInfo;

use crate::daemon::{vc_json, Daemon};
use crate::heartbeat::Heartbeat;
use crate::hog::{Bins, Hog};
use crate::Report;

/// (RM device instance, client, channels) as a comparable set.
type Tree = BTreeSet<(u32, u32, Vec<u32>)>;

fn truth(h: &Hog) -> Tree {
    truth_of(&h.objects)
}

fn truth_of(objects: &crate::ioctl_log::ProcessObjects) -> Tree {
    objects
        .gpus
        .iter()
        .map(|g| {
            let mut c: Vec<u32> = g.all_channels().iter().map(|c| c.0).collect();
            c.sort();
            (g.device_instance, objects.client.0, c)
        })
        .collect()
}

fn hex(v: &Value) -> u32 {
    let s = v.as_str().unwrap_or("");
    u32::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or(0)
}

/// The channels `valvectl --json ps` lists for `pid`, by GPU (`None`: not listed).
pub(crate) fn from_ps(ps: &Value, pid: u32) -> Option<Tree> {
    let p = ps["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"] == pid)?;
    Some(
        p["gpus"]
            .as_array()?
            .iter()
            .map(|g| {
                let mut c: Vec<u32> = g["tsgs"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .flat_map(|t| t["channels"].as_array().into_iter().flatten().map(hex))
                    .collect();
                c.sort();
                (
                    g["device_instance"].as_u64().unwrap_or(u64::MAX) as u32,
                    hex(&g["client"]),
                    c,
                )
            })
            .collect(),
    )
}

fn frozen_for(hb: &Heartbeat, d: Duration) -> bool {
    let a = hb.snapshot();
    std::thread::sleep(d);
    a == hb.snapshot()
}

/// A process with channels on every GPU (`valvectl test-load`): registry vs ground truth, and
/// `preempt --pid` on all its GPUs at once.
fn multi_gpu_process(
    bins: &Bins,
    gpus: &[GpuInfo],
    vc: &Path,
    sock: &Path,
    dir: &Path,
    r: &mut Report,
) -> Result<()> {
    use std::io::{BufRead, Write};
    let log = dir.join("test-load.ioctl.log");
    let mut child = Command::new(vc)
        .arg("test-load")
        .env("LD_PRELOAD", &bins.logger)
        .env("VALVE_IOCTL_LOG", &log)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("piped")).read_line(&mut line)?;
    let pid = child.id();
    let result = (|| -> Result<()> {
        if !line.starts_with("ready") {
            bail!("valvectl test-load did not start: {line:?}");
        }
        std::thread::sleep(Duration::from_millis(300));
        let want = truth_of(&crate::ioctl_log::parse(
            &std::fs::read_to_string(&log)?,
            pid,
        )?);
        let (_, ps, _) = vc_json(vc, sock, &["ps"])?;
        let got = from_ps(&ps, pid);
        r.check(
            "daemon's registry equals the ground truth for a process with channels on every GPU",
            got.as_ref() == Some(&want) && want.len() == gpus.len(),
            format!(
                "{} GPU(s), {} channel(s)",
                want.len(),
                want.iter().map(|t| t.2.len()).sum::<usize>()
            ),
        );
        let (rc, data, err) = vc_json(
            vc,
            sock,
            &["preempt", "--pid", &pid.to_string(), "--detach"],
        )?;
        let (rc2, _, err2) = vc_json(vc, sock, &["resume", "--pid", &pid.to_string()])?;
        r.check(
            "preempt --pid covers all GPUs of a multi-GPU process, resume undoes it",
            rc == 0 && rc2 == 0 && data["preempted"]["gpus"].as_u64() == Some(gpus.len() as u64),
            format!(
                "preempted {} channel(s) on {} GPU(s) in {} us wall; {}{}",
                data["preempted"]["channels"],
                data["preempted"]["gpus"],
                data["preempted"]["disable"]["wall"],
                err.trim(),
                err2.trim()
            ),
        );
        Ok(())
    })();
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(b"\n");
    }
    let _ = child.wait();
    result
}

/// Where the experiment's daemon keeps its socket, state and log.
struct DaemonFiles {
    sock: PathBuf,
    state: PathBuf,
    log: PathBuf,
}

/// Runs the discovery experiment.
pub fn run(bins: &Bins, gpus: &[GpuInfo], vc: &Path, out: &Path, r: &mut Report) -> Result<()> {
    r.line("\n## Discovery: the eBPF daemon, `ps`, `preempt --pid`, crash recovery\n");
    if !nix::unistd::geteuid().is_root() {
        r.line("Skipped: the daemon needs root.");
        return Ok(());
    }
    let dir = PathBuf::from(format!("/tmp/valve-discovery-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let f = DaemonFiles {
        sock: dir.join("valve.sock"),
        state: dir.join("state"),
        log: out.join("daemon.log"),
    };
    crate::ctx::run(bins, &gpus[0], vc, out, &crate::ctx::Plan::IN_FULL_RUN, r);
    let t0 = Instant::now();
    let daemon = Daemon::start(vc, &f.sock, &f.state, &f.log)?;
    r.line(&format!(
        "Daemon answering {:.0} ms after start.",
        t0.elapsed().as_secs_f64() * 1e3
    ));
    let (a, b, c) = start_hogs(bins, gpus)?;
    std::thread::sleep(Duration::from_millis(300));
    registry_checks(vc, &f.sock, &a, &b, c.as_ref(), r)?;

    if gpus.len() > 1 {
        multi_gpu_process(bins, gpus, vc, &f.sock, &dir, r)?;
    }

    preempt_checks(vc, &f.sock, &a, &b, r)?;
    let daemon2 = crash_recovery(daemon, vc, &f, &a, &b, r)?;
    daemon2.stop()?;
    let mut ok = true;
    for h in [Some(a), Some(b), c].into_iter().flatten() {
        ok &= h.finish()?["checksum_ok"].as_bool() == Some(true);
    }
    r.check("discovery hogs' checksums correct", ok, String::new());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// Hogs A and B on GPU 0 (the same RM handles, other clients), and C on the last GPU with
/// CUDA_VISIBLE_DEVICES reordered if there are several GPUs.
fn start_hogs(bins: &Bins, gpus: &[GpuInfo]) -> Result<(Hog, Hog, Option<Hog>)> {
    let g0 = &gpus[0];
    let a = Hog::start(bins, g0, "persistent", &["--blocks-per-sm", "2"])?;
    let b = Hog::start(bins, g0, "persistent", &["--blocks-per-sm", "2"])?;
    let c = match gpus.last() {
        Some(last) if gpus.len() > 1 => {
            let visible = format!("{},{}", last.uuid, g0.uuid);
            Some(Hog::start_visible(
                bins,
                last,
                &visible,
                "persistent",
                &["--blocks-per-sm", "2"],
            )?)
        }
        _ => None,
    };
    Ok((a, b, c))
}

/// `valvectl ps`, and the daemon's registry against the ioctl logger's ground truth.
fn registry_checks(
    vc: &Path,
    sock: &Path,
    a: &Hog,
    b: &Hog,
    c: Option<&Hog>,
    r: &mut Report,
) -> Result<()> {
    let text = Command::new(vc)
        .arg("--socket")
        .arg(sock)
        .arg("ps")
        .output()?;
    r.line(&format!(
        "```\n$ valvectl ps\n{}```",
        String::from_utf8_lossy(&text.stdout)
    ));
    let (_, ps, _) = vc_json(vc, sock, &["ps"])?;
    let mut hogs: Vec<(&str, &Hog)> =
        vec![("hog A (GPU 0)", a), ("hog B (GPU 0, same handles)", b)];
    if let Some(c) = c {
        hogs.push(("hog C (last GPU, CUDA_VISIBLE_DEVICES reordered)", c));
    }
    for (name, h) in &hogs {
        let want = truth(h);
        let got = from_ps(&ps, h.pid());
        r.check(
            &format!("daemon's registry equals the ground truth for {name}"),
            got.as_ref() == Some(&want),
            format!(
                "{} channel(s) on RM instance(s) {:?}",
                want.iter().map(|t| t.2.len()).sum::<usize>(),
                want.iter().map(|t| t.0).collect::<Vec<_>>()
            ),
        );
    }
    Ok(())
}

/// `preempt --pid` freezes exactly that process; a missing pid is a named error.
fn preempt_checks(vc: &Path, sock: &Path, a: &Hog, b: &Hog, r: &mut Report) -> Result<()> {
    let (rc, data, err) = vc_json(
        vc,
        sock,
        &["preempt", "--pid", &a.pid().to_string(), "--detach"],
    )?;
    r.check(
        "valvectl preempt --pid A --detach",
        rc == 0,
        format!(
            "exit {rc}; {} {}",
            data["preempted"]["channels"],
            err.trim()
        ),
    );
    std::thread::sleep(Duration::from_millis(20));
    let a_frozen = frozen_for(&a.hb, Duration::from_millis(200));
    let b_runs = !frozen_for(&b.hb, Duration::from_millis(200));
    r.check(
        "preempt --pid freezes exactly that process (A frozen, B on the same GPU runs)",
        a_frozen && b_runs,
        format!("A frozen {a_frozen}, B running {b_runs}"),
    );

    let (rc, _, err) = vc_json(vc, sock, &["preempt", "--pid", "999999"])?;
    r.check(
        "preempt --pid of a missing process: exit 8, named error",
        rc == 8 && err.contains("no such process"),
        err.trim().to_string(),
    );

    Ok(())
}

/// SIGKILLs the daemon while A is preempted: A must stay frozen until the restart re-enables
/// it, and the restarted daemon must still know A and B. Returns the restarted daemon.
fn crash_recovery(
    mut daemon: Daemon,
    vc: &Path,
    f: &DaemonFiles,
    a: &Hog,
    b: &Hog,
    r: &mut Report,
) -> Result<Daemon> {
    // SIGKILL the daemon while A is preempted; A must stay frozen until the restart re-enables it.
    daemon.kill()?;
    let still = frozen_for(&a.hb, Duration::from_millis(200));
    let before = a.hb.counter(0);
    let t_restart = Instant::now();
    let daemon2 = Daemon::start(vc, &f.sock, &f.state, &f.log)?;
    let mut resumed_after = None;
    while t_restart.elapsed() < Duration::from_secs(5) {
        if a.hb.counter(0) != before {
            resumed_after = Some(t_restart.elapsed());
            break;
        }
        std::hint::spin_loop();
    }
    r.check(
        "daemon killed with SIGKILL while A is preempted: the restart re-enables A within 1 s",
        still && resumed_after.is_some_and(|d| d <= Duration::from_secs(1)),
        format!(
            "A stayed frozen while no daemon ran: {still}; heartbeat back {} after the restart began",
            resumed_after.map(|d| format!("{:.0} ms", d.as_secs_f64() * 1e3)).unwrap_or("NEVER".into())
        ),
    );
    let (_, ps2, _) = vc_json(vc, &f.sock, &["ps"])?;
    let kept = from_ps(&ps2, a.pid()) == Some(truth(a)) && from_ps(&ps2, b.pid()) == Some(truth(b));
    r.check(
        "the restarted daemon still knows the processes started before it (registry journal)",
        kept,
        format!("A and B listed with all their channels after the restart: {kept}"),
    );
    let (_, status, _) = vc_json(vc, &f.sock, &["status"])?;
    r.line(&format!(
        "Restarted daemon's status: recovered_at_start = {}, recovery_failures = {}, restored_from_journal = {}.",
        status["recovered_at_start"], status["recovery_failures"], status["restored_from_journal"]
    ));
    Ok(daemon2)
}
