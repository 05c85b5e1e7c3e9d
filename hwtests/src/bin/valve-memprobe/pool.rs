//! The probe's pool side: creates shareable handles (without a CUDA context), starts the offline
//! and online children, and times reclaim cycles in three ways (see [`Mode`]).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Child as Process, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use valve::stats::summarize_us;
use valve::{Controller, NvDriver, PreemptPlan};
use valve_vmm::{Gpu, PhysicalHandle};

use crate::discover::Discovery;
use crate::proto;
use crate::side::us;

#[derive(clap::Args)]
pub struct RunArgs {
    /// memstream.ptx (hwtests/cuda/build.sh builds it).
    #[arg(long)]
    pub ptx: PathBuf,
    /// Where memprobe.json goes.
    #[arg(long)]
    pub out: PathBuf,
    /// Handle sizes to try, MiB.
    #[arg(long, value_delimiter = ',', default_value = "2,64,256")]
    pub handle_mib: Vec<usize>,
    /// Reclaim sizes, MiB.
    #[arg(long, value_delimiter = ',', default_value = "64,1024,8192")]
    pub reclaim_mib: Vec<usize>,
    /// Offline's memory, GiB (reclaims take from its start; the rest is verified).
    #[arg(long, default_value_t = 16)]
    pub offline_gib: usize,
    /// Reclaim cycles per configuration.
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    /// Length of one offline kernel (the step that reclamation lands in the middle of).
    #[arg(long, default_value_t = 200.0)]
    pub kernel_ms: f64,
    /// Quarantine layouts: handle (one handle-sized block per slot) or page (one 2 MiB page mapped
    /// over and over).
    #[arg(long, value_delimiter = ',', default_value = "handle")]
    pub quarantine: Vec<String>,
    /// How access is granted: per-handle or range (one call per contiguous run).
    #[arg(long, value_delimiter = ',', default_value = "per-handle,range")]
    pub access: Vec<String>,
    /// Most slots per reclaim cycle for 2 MiB handles (8 GiB would be 4096 handles per cycle).
    #[arg(long, default_value_t = 512)]
    pub max_handles_per_cycle: usize,
}

/// A child process with its socket; killed if still running when dropped.
pub struct Child {
    proc: Process,
    sock: UnixStream,
}

impl Child {
    pub fn spawn(role: &str, args: &[String]) -> Result<Child> {
        let (mine, theirs) = proto::seqpacket_pair()?;
        let fd = theirs.as_raw_fd();
        // The child's end must survive exec: clear close-on-exec on it only.
        nix::fcntl::fcntl(
            fd,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )?;
        let proc = Command::new(std::env::current_exe()?)
            .arg(role)
            .arg("--sock-fd")
            .arg(fd.to_string())
            .args(args)
            .spawn()
            .with_context(|| format!("starting the {role} child"))?;
        drop(theirs);
        Ok(Child { proc, sock: mine })
    }

    pub fn call(&self, m: Value, fds: &[OwnedFd]) -> Result<Value> {
        proto::call(&self.sock, &m, fds)
    }

    pub fn pid(&self) -> u32 {
        self.proc.id()
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.proc.kill();
        let _ = self.proc.wait();
    }
}

pub fn nvml_used() -> Option<u64> {
    let nvml = nvml_wrapper::Nvml::init().ok()?;
    let used = nvml.device_by_index(0).ok()?.memory_info().ok()?.used;
    Some(used)
}

/// The pool's memory: each handle is exported once, at creation (85 us each on an H100), and
/// what travels to a child is a duplicate of that descriptor.
struct Pool {
    _handles: Vec<PhysicalHandle>,
    fds: Vec<OwnedFd>,
}

impl Pool {
    fn export(&self, first: usize, count: usize) -> Result<(Vec<OwnedFd>, f64)> {
        let t = Instant::now();
        let fds = self.fds[first..first + count]
            .iter()
            .map(|f| f.try_clone())
            .collect::<Result<Vec<_>, _>>()?;
        Ok((fds, us(t)))
    }
}

/// The three ways a reclaim can reach online.
#[derive(Clone, Copy, Debug)]
enum Mode {
    /// Disable offline, offline swaps to quarantine, then online imports, maps and uses.
    Serial,
    /// Online imports and maps while offline is being disabled; it uses the memory as soon as
    /// both are done; offline's swap finishes before offline resumes.
    Overlap,
    /// Online mapped all of the pool ahead of time: a reclaim is disable + use.
    Premapped,
}

struct Rig<'a> {
    ctl: &'a Controller<NvDriver>,
    plan: PreemptPlan,
    pool: Pool,
    offline: Child,
    online: Child,
    access: String,
}

impl Rig<'_> {
    fn reclaim_msg(&self, k: usize) -> Value {
        json!({"op": "reclaim", "first": 0, "count": k, "access": self.access})
    }

    /// One reclaim of `k` slots; returns the timings, with offline resumed and the slots back.
    fn cycle(&self, mode: Mode, k: usize, premap_base: usize) -> Result<Value> {
        let mut s = match mode {
            Mode::Serial => self.serial(k)?,
            Mode::Overlap => self.overlap(k)?,
            Mode::Premapped => self.premapped(k, premap_base)?,
        };
        // Give the memory back to offline (online lets go first, except in premapped mode
        // where it keeps its mapping and just stops using it). Offline's kernel streams over
        // every slot, so it must be frozen while a slot goes from quarantine back to memory: in
        // between, the slot is unmapped. (A framework returns memory only to blocks that no
        // request references, and needs no freeze.)
        if !matches!(mode, Mode::Premapped) {
            self.online
                .call(json!({"op": "unmap", "first": 0, "count": k}), &[])?;
        }
        let t = Instant::now();
        let guard = self.ctl.disable(&self.plan)?;
        let (fds, _) = self.pool.export(0, k)?;
        let back = self.offline.call(
            json!({"op": "return", "first": 0, "access": self.access}),
            &fds,
        )?;
        guard.enable()?;
        s["return_us"] = us(t).into();
        s["offline_return"] = back;
        Ok(s)
    }

    fn serial(&self, k: usize) -> Result<Value> {
        let t0 = Instant::now();
        let guard = self.ctl.disable(&self.plan)?;
        let disable_us = us(t0);
        let swap = self.offline.call(self.reclaim_msg(k), &[])?;
        let swapped_us = us(t0);
        let (fds, export_us) = self.pool.export(0, k)?;
        let on = self.online.call(
            json!({"op": "map", "map_only": true, "first": 0, "access": self.access}),
            &fds,
        )?;
        let ready_us = us(t0);
        let used = self
            .online
            .call(json!({"op": "use", "first": 0, "count": k}), &[])?;
        let online_us = us(t0);
        guard.enable()?;
        Ok(
            json!({"ready_us": ready_us, "online_us": online_us, "disable_us": disable_us, "swapped_us": swapped_us,
                  "offline_frozen_us": us(t0), "export_us": export_us, "offline_swap": swap, "online_map": on, "online_use": used}),
        )
    }

    fn overlap(&self, k: usize) -> Result<Value> {
        let t0 = Instant::now();
        let (fds, export_us) = self.pool.export(0, k)?;
        proto::send(
            &self.online.sock,
            &json!({"op": "map", "map_only": true, "first": 0, "access": self.access}),
            &fds,
        )?;
        let guard = self.ctl.disable(&self.plan)?;
        let disable_us = us(t0);
        proto::send(&self.offline.sock, &self.reclaim_msg(k), &[])?;
        let on = proto::reply(&self.online.sock)?;
        let mapped_us = us(t0);
        let ready_us = us(t0);
        let used = self
            .online
            .call(json!({"op": "use", "first": 0, "count": k}), &[])?;
        let online_us = us(t0);
        let swap = proto::reply(&self.offline.sock)?;
        let swapped_us = us(t0);
        guard.enable()?;
        Ok(
            json!({"ready_us": ready_us, "online_us": online_us, "disable_us": disable_us, "mapped_us": mapped_us, "swapped_us": swapped_us,
                  "offline_frozen_us": us(t0), "export_us": export_us, "offline_swap": swap, "online_map": on, "online_use": used}),
        )
    }

    fn premapped(&self, k: usize, base: usize) -> Result<Value> {
        let t0 = Instant::now();
        let guard = self.ctl.disable(&self.plan)?;
        let disable_us = us(t0);
        proto::send(&self.offline.sock, &self.reclaim_msg(k), &[])?;
        self.online.call(json!({"op": "grant"}), &[])?;
        let ready_us = us(t0);
        let used = self
            .online
            .call(json!({"op": "use", "first": base, "count": k}), &[])?;
        let online_us = us(t0);
        let swap = proto::reply(&self.offline.sock)?;
        let swapped_us = us(t0);
        guard.enable()?;
        Ok(
            json!({"ready_us": ready_us, "online_us": online_us, "disable_us": disable_us, "swapped_us": swapped_us,
                  "offline_frozen_us": us(t0), "offline_swap": swap, "online_use": used}),
        )
    }
}

/// p50/p99/max of microsecond samples.
pub fn summary_of(xs: &[f64]) -> Value {
    serde_json::to_value(summarize_us(xs)).unwrap_or(Value::Null)
}

/// p50/p99/max of one field over samples.
fn summary(samples: &[Value], path: &[&str]) -> Value {
    let xs: Vec<f64> = samples
        .iter()
        .filter_map(|s| {
            path.iter()
                .try_fold(s, |v, k| v.get(*k))
                .and_then(Value::as_f64)
        })
        .collect();
    serde_json::to_value(summarize_us(&xs)).unwrap_or(Value::Null)
}

fn summarize_cycles(samples: &[Value]) -> Value {
    let mut out = serde_json::Map::new();
    for (name, path) in [
        ("ready_us", &["ready_us"][..]),
        ("online_us", &["online_us"]),
        ("disable_us", &["disable_us"]),
        ("swapped_us", &["swapped_us"]),
        ("offline_frozen_us", &["offline_frozen_us"]),
        ("export_us", &["export_us"]),
        ("return_us", &["return_us"]),
        ("off_unmap_us", &["offline_swap", "unmap_us"]),
        ("off_map_us", &["offline_swap", "map_us"]),
        ("off_access_us", &["offline_swap", "access_us"]),
        ("on_import_us", &["online_map", "import_us"]),
        ("on_map_us", &["online_map", "map_us"]),
        ("on_access_us", &["online_map", "access_us"]),
        ("on_use_us", &["online_use", "use_us"]),
    ] {
        let s = summary(samples, path);
        if s["n"].as_u64().unwrap_or(0) > 0 {
            out.insert(name.into(), s);
        }
    }
    Value::Object(out)
}

fn create_pool(gpu: &Gpu, slot: usize, n: usize) -> Result<(Pool, Value)> {
    let mut times = Vec::with_capacity(n);
    let mut handles = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        handles.push(
            PhysicalHandle::create(gpu, slot)
                .context("creating pool memory (no CUDA context in the pool)")?,
        );
        times.push(us(t));
    }
    let t = Instant::now();
    let fds = handles
        .iter()
        .map(|h| h.export())
        .collect::<Result<Vec<_>, _>>()?;
    let export_us = us(t);
    let pool = Pool {
        _handles: handles,
        fds,
    };
    Ok((
        pool,
        json!({"create_us": summarize_us(&times), "export_all_us": export_us}),
    ))
}

fn reclaim_sizes(a: &RunArgs, h: usize, n: usize) -> Vec<usize> {
    a.reclaim_mib
        .iter()
        .map(|r| r / h)
        .filter(|&k| k > 0 && k < n && (h > 2 || k <= a.max_handles_per_cycle))
        .collect()
}

fn run_cycles(
    rig: &Rig,
    modes: &[Mode],
    ks: &[usize],
    reps: usize,
    base: usize,
    slot: usize,
) -> Result<Vec<Value>> {
    let mut out = Vec::new();
    for &k in ks {
        for &mode in modes {
            rig.cycle(mode, k, base)?; // warm-up, not counted (first use of code paths)
            let mut samples = Vec::with_capacity(reps);
            for _ in 0..reps {
                samples.push(rig.cycle(mode, k, base)?);
                std::thread::sleep(Duration::from_millis(20));
            }
            let s = summarize_cycles(&samples);
            println!(
                "  {:>5} MiB in {k:>4} handles, {mode:?}: online can use it after p50 {:.2} ms / p99 {:.2} ms, has written and read all of it after p50 {:.2} ms (disable p50 {:.2} ms); offline frozen p50 {:.2} ms",
                (k * slot) >> 20,
                s["ready_us"]["p50_us"].as_f64().unwrap_or(0.0) / 1e3,
                s["ready_us"]["p99_us"].as_f64().unwrap_or(0.0) / 1e3,
                s["online_us"]["p50_us"].as_f64().unwrap_or(0.0) / 1e3,
                s["disable_us"]["p50_us"].as_f64().unwrap_or(0.0) / 1e3,
                s["offline_frozen_us"]["p50_us"].as_f64().unwrap_or(0.0) / 1e3,
            );
            out.push(json!({"reclaim_mib": (k * slot) >> 20, "handles": k, "mode": format!("{mode:?}"), "summary": s, "samples": samples}));
        }
    }
    Ok(out)
}

fn config(
    a: &RunArgs,
    gpu: &Gpu,
    ctl: &Controller<NvDriver>,
    disc: &mut Discovery,
    h: usize,
    q: &str,
    access: &str,
) -> Result<Value> {
    let slot = h << 20;
    let n = a.offline_gib * 1024 / h;
    println!("== handle {h} MiB, quarantine {q}, access {access}: offline maps {n} handles");
    let (pool, create) = create_pool(gpu, slot, n)?;
    let ptx = a.ptx.display().to_string();
    let offline = Child::spawn(
        "offline",
        &[
            "--ptx".into(),
            ptx.clone(),
            "--slot".into(),
            slot.to_string(),
            "--slots".into(),
            n.to_string(),
            "--quarantine".into(),
            q.into(),
            "--kernel-ms".into(),
            a.kernel_ms.to_string(),
        ],
    )?;
    let (fds, _) = pool.export(0, n)?;
    let setup = offline.call(json!({"op": "map", "first": 0, "access": access}), &fds)?;
    drop(fds);
    let started = offline.call(json!({"op": "start"}), &[])?;
    let (plan, channels) = disc.plan(ctl, offline.pid())?;
    let ks = reclaim_sizes(a, h, n);
    let base = ks.iter().copied().max().unwrap_or(0);
    let online = Child::spawn(
        "online",
        &[
            "--ptx".into(),
            ptx,
            "--slot".into(),
            slot.to_string(),
            "--slots".into(),
            (base + n).to_string(),
        ],
    )?;
    let rig = Rig {
        ctl,
        plan,
        pool,
        offline,
        online,
        access: access.into(),
    };
    let mut cycles = run_cycles(
        &rig,
        &[Mode::Serial, Mode::Overlap],
        &ks,
        a.reps,
        base,
        slot,
    )?;
    let (fds, _) = rig.pool.export(0, n)?;
    let premap = rig.online.call(
        json!({"op": "map", "map_only": true, "first": base, "access": access}),
        &fds,
    )?;
    drop(fds);
    cycles.extend(run_cycles(
        &rig,
        &[Mode::Premapped],
        &ks,
        a.reps,
        base,
        slot,
    )?);
    let stop = rig
        .offline
        .call(json!({"op": "stop", "verify_from": base}), &[])?;
    let ok = stop["kernel_error"].is_null()
        && stop["bad_words"] == 0
        && stop["launches"].as_u64().unwrap_or(0) > 0;
    println!("  offline: {} launches of {} passes, kernel error {}, {} bad words in {} untouched slots -> {}",
        stop["launches"], stop["passes_per_launch"], stop["kernel_error"], stop["bad_words"], stop["verified_slots"],
        if ok { "OK" } else { "FAILED" });
    Ok(
        json!({"handle_mib": h, "quarantine": q, "access": access, "offline_handles": n, "offline_channels": channels,
              "pool": create, "offline_setup": setup, "offline_start": started, "online_premap": premap,
              "cycles": cycles, "offline_end": stop, "offline_ok": ok}),
    )
}

/// Children killed with SIGKILL while holding mapped pool memory: what NVML says before, during,
/// after the kill, and after the pool lets go.
fn kill_test(a: &RunArgs, gpu: &Gpu) -> Result<Value> {
    let mib = |b: Option<u64>| b.map(|b| b as f64 / (1u64 << 20) as f64);
    let before = nvml_used();
    let (slot, n) = (64usize << 20, 16usize);
    // Offline gets handles 0..n, online n..n+n/2 (they never share memory here: neither is frozen).
    let (pool, _) = create_pool(gpu, slot, n + n / 2)?;
    let ptx = a.ptx.display().to_string();
    let args = |role: &str| {
        let mut v = vec![
            "--ptx".to_string(),
            ptx.clone(),
            "--slot".into(),
            slot.to_string(),
            "--slots".into(),
            n.to_string(),
        ];
        if role == "offline" {
            v.extend([
                "--quarantine".into(),
                "handle".into(),
                "--kernel-ms".into(),
                "200".into(),
            ]);
        }
        v
    };
    let offline = Child::spawn("offline", &args("offline"))?;
    let online = Child::spawn("online", &args("online"))?;
    // Each descriptor sent is closed here once the child has imported it: an open exported
    // descriptor keeps its memory alive, which would read as a leak below.
    let (fds, _) = pool.export(0, n)?;
    offline.call(json!({"op": "map", "first": 0}), &fds)?;
    drop(fds);
    offline.call(json!({"op": "start"}), &[])?;
    let (fds, _) = pool.export(n, n / 2)?;
    online.call(json!({"op": "map", "first": 0}), &fds)?;
    drop(fds);
    let during = nvml_used();
    drop(offline); // SIGKILL mid-kernel
    drop(online);
    std::thread::sleep(Duration::from_millis(1000));
    let after_kill = nvml_used();
    drop(pool);
    std::thread::sleep(Duration::from_millis(500));
    let after_pool = nvml_used();
    let leaked = match (before, after_pool) {
        (Some(b), Some(e)) => Some(e as f64 / 1048576.0 - b as f64 / 1048576.0),
        _ => None,
    };
    println!("== kill test: NVML used MiB before {:?}, with children {:?}, after SIGKILL {:?}, after the pool let go {:?}",
        mib(before), mib(during), mib(after_kill), mib(after_pool));
    Ok(
        json!({"pool_mib": ((n + n / 2) * slot) >> 20, "used_mib_before": mib(before), "used_mib_during": mib(during),
              "used_mib_after_kill": mib(after_kill), "used_mib_after_pool": mib(after_pool), "leaked_mib": leaked}),
    )
}

pub fn run(a: &RunArgs) -> Result<()> {
    if !valve_vmm::driver_present() {
        println!("SKIP: no CUDA driver here; run valve-memprobe on a GPU host");
        return Ok(());
    }
    let gpu = Gpu::open(0)?;
    let name = gpu.name()?;
    let ctl = Controller::open()?;
    let mut disc = Discovery::start()?;
    let used_at_start = nvml_used();
    println!(
        "device: {name}; granularity {} KiB; NVML used at start {:?} MiB",
        gpu.granularity()? >> 10,
        used_at_start.map(|b| b >> 20)
    );
    let mut configs = Vec::new();
    for &h in &a.handle_mib {
        for q in &a.quarantine {
            for acc in &a.access {
                match config(a, &gpu, &ctl, &mut disc, h, q, acc) {
                    Ok(v) => configs.push(v),
                    Err(e) => {
                        println!("  FAILED: {e:#}");
                        configs.push(json!({"handle_mib": h, "quarantine": q, "access": acc, "error": format!("{e:#}")}));
                    }
                }
            }
        }
    }
    let kill = kill_test(a, &gpu).unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
    let failed = configs.iter().filter(|c| c["offline_ok"] != true).count();
    let report = json!({"device": name, "date_utc": chrono_free_date(), "args": format!("{:?}", std::env::args().collect::<Vec<_>>()),
        "used_mib_at_start": used_at_start.map(|b| b >> 20), "configs": configs, "kill_test": kill});
    std::fs::create_dir_all(&a.out)?;
    std::fs::write(
        a.out.join("memprobe.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    println!("wrote {}", a.out.join("memprobe.json").display());
    if failed > 0 {
        bail!("{failed} configuration(s) failed or corrupted offline's untouched memory");
    }
    Ok(())
}

fn chrono_free_date() -> String {
    let out = Command::new("date").args(["-u", "+%F %T"]).output();
    out.map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}
