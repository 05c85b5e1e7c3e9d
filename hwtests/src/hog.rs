//! Starting and stopping the CUDA workloads (hog under the ioctl logger, online client), and the
//! poller thread that timestamps the hog's heartbeat on the host clock.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::Value;
use valve::{ChannelTarget, GpuInfo};

use crate::clock::now_ns;
use crate::heartbeat::Heartbeat;
use crate::ioctl_log::{self, ProcessObjects};

/// Where the built workloads are.
#[derive(Clone, Debug)]
pub struct Bins {
    /// `hog` executable.
    pub hog: PathBuf,
    /// `online` executable.
    pub online: PathBuf,
    /// `serving` executable (the gate benchmark's online client).
    pub serving: PathBuf,
    /// `libvalve_ioctl_log.so`.
    pub logger: PathBuf,
}

impl Bins {
    /// The four required files in `dir`.
    pub fn in_dir(dir: &Path) -> Result<Self> {
        let b = Bins {
            hog: dir.join("hog"),
            online: dir.join("online"),
            serving: dir.join("serving"),
            logger: dir.join("libvalve_ioctl_log.so"),
        };
        for p in [&b.hog, &b.online, &b.serving, &b.logger] {
            if !p.exists() {
                bail!(
                    "{} is missing: build the workloads with hwtests/cuda/build.sh",
                    p.display()
                );
            }
        }
        Ok(b)
    }
}

/// Which of a process's channels to name in a preemption.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum ChannelSet {
    /// Every channel on the GPU.
    All,
    /// The channels of the TSG that holds the compute objects.
    ComputeTsg,
    /// The first channel of each TSG.
    OnePerTsg,
    /// The first channel of the compute TSG.
    One,
}

impl ChannelSet {
    /// All sets, largest first.
    pub const ALL: [ChannelSet; 4] = [
        ChannelSet::All,
        ChannelSet::ComputeTsg,
        ChannelSet::OnePerTsg,
        ChannelSet::One,
    ];
}

/// Every hog carries `VALVE_LABEL=<this>`, so a gate can name it by label.
pub const HOG_LABEL: &str = "valve-hwtest-hog";

/// A running hog.
pub struct Hog {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    /// Its heartbeat page.
    pub hb: Arc<Heartbeat>,
    /// Its RM objects, from the ioctl log.
    pub objects: ProcessObjects,
    /// Valve's index of its GPU.
    pub gpu: usize,
    log_path: PathBuf,
}

impl Hog {
    /// Starts `hog --mode <mode> <extra>` on `gpu` under the ioctl logger and waits until it runs.
    pub fn start(bins: &Bins, gpu: &GpuInfo, mode: &str, extra: &[&str]) -> Result<Hog> {
        Self::start_visible(bins, gpu, &gpu.uuid, mode, extra)
    }

    /// Like [`Hog::start`], with `CUDA_VISIBLE_DEVICES=visible`; the hog uses CUDA device 0 of
    /// that list, which must be `gpu`.
    pub fn start_visible(
        bins: &Bins,
        gpu: &GpuInfo,
        visible: &str,
        mode: &str,
        extra: &[&str],
    ) -> Result<Hog> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let name = format!("valve-hog-{}-{n}", std::process::id());
        let log_path = std::env::temp_dir().join(format!("{name}.ioctl.log"));
        let _ = std::fs::remove_file(&log_path);
        let mut child = Command::new(&bins.hog)
            .args(["--shm", &name, "--mode", mode])
            .args(extra)
            .env("LD_PRELOAD", &bins.logger)
            .env("VALVE_IOCTL_LOG", &log_path)
            .env("CUDA_VISIBLE_DEVICES", visible)
            .env("VALVE_HOG_TRACE", "1")
            .env("VALVE_LABEL", HOG_LABEL)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bins.hog.display()))?;
        let mut out = child.stdout.take().expect("piped");
        let stdout = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let started = (|| -> Result<(Arc<Heartbeat>, ProcessObjects)> {
            let hb = Arc::new(Heartbeat::open(&name, Duration::from_secs(60))?);
            hb.wait_running(Duration::from_secs(60))?;
            let text = std::fs::read_to_string(&log_path)
                .with_context(|| format!("reading the ioctl log {}", log_path.display()))?;
            let objects = ioctl_log::parse(&text, child.id())?;
            if !objects
                .gpus
                .iter()
                .any(|g| g.device_instance == gpu.device_instance)
            {
                bail!(
                    "the hog's channels are on RM instance(s) {:?}, expected {} ({})",
                    objects
                        .gpus
                        .iter()
                        .map(|g| g.device_instance)
                        .collect::<Vec<_>>(),
                    gpu.device_instance,
                    gpu.pci_bus_id
                );
            }
            Ok((hb, objects))
        })();
        match started {
            Ok((hb, objects)) => Ok(Hog {
                child,
                stdout: Some(stdout),
                hb,
                objects,
                gpu: gpu.index,
                log_path,
            }),
            Err(e) => {
                let exited = child.try_wait().ok().flatten();
                let _ = child.kill();
                let status = child.wait().map(|s| s.to_string()).unwrap_or_default();
                let out = stdout.join().unwrap_or_default();
                let _ = std::fs::remove_file(format!("/dev/shm/{name}"));
                let log_lines = std::fs::read_to_string(&log_path)
                    .map(|t| t.lines().count())
                    .unwrap_or(0);
                let _ = std::fs::remove_file(&log_path);
                Err(e.context(format!(
                    "hog --mode {mode} {} on GPU {}: {} ({status}); {log_lines} RM calls logged; stdout: {}",
                    extra.join(" "),
                    gpu.index,
                    if exited.is_some() { "it had exited" } else { "it was still running and was killed" },
                    out.trim()
                )))
            }
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The channel targets of `set` on the hog's GPU.
    pub fn targets(&self, set: ChannelSet, device_instance: u32) -> Vec<ChannelTarget> {
        let Some(g) = self
            .objects
            .gpus
            .iter()
            .find(|g| g.device_instance == device_instance)
        else {
            return Vec::new();
        };
        let chans = match set {
            ChannelSet::All => g.all_channels(),
            ChannelSet::ComputeTsg => g
                .compute_tsg()
                .map(|t| t.channels.iter().map(|c| c.0).collect())
                .unwrap_or_default(),
            ChannelSet::OnePerTsg => g
                .tsgs
                .iter()
                .filter_map(|t| t.channels.first().map(|c| c.0))
                .collect(),
            ChannelSet::One => g
                .compute_tsg()
                .and_then(|t| t.channels.first().map(|c| vec![c.0]))
                .unwrap_or_default(),
        };
        chans
            .into_iter()
            .map(|channel| ChannelTarget {
                gpu: self.gpu,
                client: self.objects.client,
                channel,
            })
            .collect()
    }

    /// What a hog that does not stop is doing: whether its kernels and copies still advance
    /// (a frozen GPU side means channels left disabled; an advancing one, a host that missed the
    /// stop), its shared state, and where each of its threads sleeps in the kernel.
    fn stuck_report(&self) -> String {
        let (slots0, copies0) = (self.hb.snapshot(), self.hb.copies_done());
        std::thread::sleep(Duration::from_millis(200));
        let (slots1, copies1) = (self.hb.snapshot(), self.hb.copies_done());
        let advancing = slots0.iter().zip(&slots1).filter(|(a, b)| b > a).count();
        let task_dir = format!("/proc/{}/task", self.pid());
        let waits: Vec<String> = std::fs::read_dir(&task_dir)
            .map(|d| {
                d.flatten()
                    .map(|t| {
                        let read =
                            |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
                        format!("{}:{}", read("comm").trim(), read("wchan").trim())
                    })
                    .collect()
            })
            .unwrap_or_default();
        format!(
            "state {}, {advancing} of {} slots advancing over 200 ms, copies {copies0} -> \
             {copies1}; threads (name:kernel wait) {}",
            self.hb.state(),
            slots1.len(),
            waits.join(" ")
        )
    }

    /// Asks the hog to stop, waits for it, returns its final JSON line (with `checksum_ok`).
    pub fn finish(mut self) -> Result<Value> {
        self.hb.request_stop();
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Some(status) = self.child.try_wait()? {
                let out = self.stdout.take().expect("once").join().unwrap_or_default();
                let last = out
                    .lines()
                    .rev()
                    .find(|l| l.trim_start().starts_with('{'))
                    .unwrap_or("{}");
                let mut v: Value = serde_json::from_str(last).unwrap_or(Value::Null);
                if !v.is_object() {
                    v = serde_json::json!({"raw_output": out});
                }
                v["exit_code"] = status.code().into();
                v["checksum_ok_shm"] = self.hb.checksum_ok().into();
                return Ok(v);
            }
            if Instant::now() > deadline {
                bail!(
                    "the hog (pid {}) did not finish within 60 s of the stop request ({})",
                    self.pid(),
                    self.stuck_report()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Hog {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.hb.request_stop();
            for _ in 0..400 {
                if let Ok(Some(_)) = self.child.try_wait() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        let _ = std::fs::remove_file(&self.log_path);
    }
}

struct PollShared {
    hb: Arc<Heartbeat>,
    last_change: AtomicU64,
    armed_at: AtomicU64,
    first_after_arm: AtomicU64,
    stop: AtomicBool,
}

/// A thread spinning on heartbeat slot 0 that records, on the host clock, when it last changed
/// and the first change after an arming instant.
pub struct Poller {
    shared: Arc<PollShared>,
    thread: Option<JoinHandle<()>>,
}

const DISARMED: u64 = u64::MAX;

impl Poller {
    /// Starts polling.
    pub fn start(hb: Arc<Heartbeat>) -> Poller {
        let shared = Arc::new(PollShared {
            hb,
            last_change: AtomicU64::new(0),
            armed_at: AtomicU64::new(DISARMED),
            first_after_arm: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        });
        let s = shared.clone();
        let thread = std::thread::spawn(move || {
            let mut prev = s.hb.counter(0);
            while !s.stop.load(Ordering::Relaxed) {
                let c = s.hb.counter(0);
                if c != prev {
                    let now = now_ns();
                    prev = c;
                    s.last_change.store(now, Ordering::Release);
                    if now >= s.armed_at.load(Ordering::Acquire)
                        && s.first_after_arm.load(Ordering::Relaxed) == 0
                    {
                        s.first_after_arm.store(now, Ordering::Release);
                    }
                }
                std::hint::spin_loop();
            }
        });
        Poller {
            shared,
            thread: Some(thread),
        }
    }

    /// When slot 0 last changed (host ns).
    pub fn last_change(&self) -> u64 {
        self.shared.last_change.load(Ordering::Acquire)
    }

    /// Records the first change at or after `at`.
    pub fn arm(&self, at: u64) {
        self.shared.first_after_arm.store(0, Ordering::Release);
        self.shared.armed_at.store(at, Ordering::Release);
    }

    /// Waits up to `timeout` for the first change after the arming instant.
    pub fn wait_first_after_arm(&self, timeout: Duration) -> Option<u64> {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.shared.first_after_arm.load(Ordering::Acquire);
            if v != 0 {
                self.shared.armed_at.store(DISARMED, Ordering::Release);
                return Some(v);
            }
            if Instant::now() > deadline {
                self.shared.armed_at.store(DISARMED, Ordering::Release);
                return None;
            }
            std::hint::spin_loop();
        }
    }

    /// Waits until the heartbeat is ticking (changed within the last 2 ms).
    pub fn wait_ticking(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while now_ns().saturating_sub(self.last_change()) > 2_000_000 {
            if Instant::now() > deadline {
                bail!(
                    "the hog's heartbeat is not ticking (last change {} ms ago)",
                    (now_ns() - self.last_change()) / 1_000_000
                );
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        Ok(())
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Runs the online client on `gpu` and returns its JSON summary.
pub fn run_online(bins: &Bins, gpu: &GpuInfo, args: &[&str]) -> Result<Value> {
    let out = Command::new(&bins.online)
        .args(args)
        .env("CUDA_VISIBLE_DEVICES", &gpu.uuid)
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", bins.online.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!("online client failed ({}): {text}", out.status);
    }
    let last = text
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .context("online client printed no JSON")?;
    Ok(serde_json::from_str(last)?)
}
