//! The floor experiment's online process (`hwtests/cuda/trigger.cu`) and the shared page it is
//! driven through: the runner writes shot n into `request`, the trigger launches one tiny kernel
//! that records `%globaltimer` at its start (or a burst of kernels, if the runner asked for one
//! with `set_burst`) and answers with `done` = n. The page layout is
//! `TriggerPage` in `hwtests/cuda/common.h` (the unit tests check the two agree).

use std::fs::OpenOptions;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memmap2::MmapRaw;
use serde_json::Value;

/// "VALVETRG" as little-endian bytes.
pub const MAGIC: u64 = 0x4752_5445_564C_4156;
/// Page layout version (2: burst shots).
pub const VERSION: u32 = 2;
/// Page size.
pub const PAGE_BYTES: usize = 4096;
/// The most kernels of one burst (`kTriggerMaxBurst`).
pub const MAX_BURST: u32 = 256;
/// The longest GPU time of one burst kernel the trigger accepts, us (`kMaxKernelNs` in trigger.cu).
pub const MAX_KERNEL_US: u64 = 100_000;
const OFF_MAGIC: usize = 0;
const OFF_VERSION: usize = 8;
const OFF_STATE: usize = 12;
const OFF_STOP: usize = 16;
const OFF_PID: usize = 20;
const OFF_REQUEST: usize = 24;
const OFF_DONE: usize = 32;
const OFF_SEEN: usize = 40;
const OFF_LAUNCHED: usize = 48;
const OFF_SYNCED: usize = 56;
const OFF_GPU_START: usize = 64;
const OFF_GPU_END: usize = 72;
const OFF_ERROR: usize = 80;
const OFF_BURST_KERNELS: usize = 88;
const OFF_BURST_RAN: usize = 92;
const OFF_BURST_KERNEL_NS: usize = 96;

/// Trigger states.
pub const STATE_READY: u32 = 1;
/// Failed (a CUDA call failed; its stderr says which).
pub const STATE_FAILED: u32 = 3;

/// What the trigger recorded for one shot.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Shot {
    /// CLOCK_MONOTONIC when the trigger saw the request.
    pub seen_mono_ns: u64,
    /// After the launch call returned.
    pub launched_mono_ns: u64,
    /// After the stream synchronised.
    pub synced_mono_ns: u64,
    /// `%globaltimer` at the kernel's start (0: it wrote nothing).
    pub gpu_start_ns: u64,
    /// `%globaltimer` at its end.
    pub gpu_end_ns: u64,
    /// The CUDA error of the launch or the sync (0: none).
    pub error: u32,
    /// Burst shots: the kernels that wrote their end (0 for a single-kernel shot).
    pub burst_ran: u32,
}

/// What the next shots launch: `kernels` kernels of `kernel_us` GPU time each, back to back on
/// one stream; 0 kernels is the single tiny kernel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Burst {
    /// Kernels per shot (at most `MAX_BURST`).
    pub kernels: u32,
    /// Each kernel's GPU time, us (1 to `MAX_KERNEL_US` when `kernels` > 0).
    pub kernel_us: u64,
}

impl Burst {
    /// The single tiny kernel of the (e) rows.
    pub const SINGLE: Burst = Burst {
        kernels: 0,
        kernel_us: 0,
    };

    /// A burst the trigger accepts, or why not.
    pub fn new(kernels: u32, kernel_us: u64) -> Result<Burst> {
        if !(1..=MAX_BURST).contains(&kernels) {
            bail!("a burst has 1 to {MAX_BURST} kernels, not {kernels}");
        }
        if !(1..=MAX_KERNEL_US).contains(&kernel_us) {
            bail!("a burst kernel spins 1 to {MAX_KERNEL_US} us, not {kernel_us}");
        }
        Ok(Burst { kernels, kernel_us })
    }
}

/// The shared page, mapped read/write. The runner creates it and removes it on drop.
pub struct TriggerPage {
    map: MmapRaw,
    path: PathBuf,
}

// SAFETY: the mapping is only accessed through atomics on aligned words (see `u64_at`), which is
// what sharing it between threads and processes needs.
unsafe impl Sync for TriggerPage {}
// SAFETY: as above; the mapping is not tied to the creating thread.
unsafe impl Send for TriggerPage {}

impl TriggerPage {
    /// Creates `path` (it must not exist), zeroed, with the magic and version written.
    pub fn create(path: &Path) -> Result<TriggerPage> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .with_context(|| format!("creating {}", path.display()))?;
        file.set_len(PAGE_BYTES as u64)?;
        let map = MmapRaw::map_raw(&file).with_context(|| format!("mapping {}", path.display()))?;
        let page = TriggerPage {
            map,
            path: path.to_path_buf(),
        };
        page.u32_at(OFF_VERSION).store(VERSION, Ordering::Relaxed);
        page.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Release);
        Ok(page)
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        assert!(off % 8 == 0 && off + 8 <= self.map.len(), "offset {off}");
        // SAFETY: in bounds and 8-aligned (asserted; the mapping is page-aligned), AtomicU64 has
        // u64's layout, and the mapping lives as long as `self`, which the reference borrows.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU64) }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.map.len(), "offset {off}");
        // SAFETY: as in `u64_at`, for a 4-aligned u32.
        unsafe { &*(self.map.as_mut_ptr().add(off) as *const AtomicU32) }
    }

    /// The trigger's state (0 starting, 1 ready, 2 finished, 3 failed).
    pub fn state(&self) -> u32 {
        self.u32_at(OFF_STATE).load(Ordering::Acquire)
    }

    /// The trigger's pid (0 until it mapped the page).
    pub fn pid(&self) -> u32 {
        self.u32_at(OFF_PID).load(Ordering::Relaxed)
    }

    /// Asks the trigger to exit.
    pub fn request_stop(&self) {
        self.u32_at(OFF_STOP).store(1, Ordering::Release);
    }

    /// The last shot requested.
    #[cfg(test)]
    pub fn requested(&self) -> u64 {
        self.u64_at(OFF_REQUEST).load(Ordering::Relaxed)
    }

    /// What the next shots launch (read by the trigger after it sees the next request).
    pub fn set_burst(&self, b: Burst) {
        self.u32_at(OFF_BURST_KERNELS)
            .store(b.kernels, Ordering::Relaxed);
        self.u64_at(OFF_BURST_KERNEL_NS)
            .store(b.kernel_us * 1000, Ordering::Relaxed);
    }

    /// The burst the next shots launch (what the trigger reads).
    #[cfg(test)]
    pub fn burst(&self) -> Burst {
        Burst {
            kernels: self.u32_at(OFF_BURST_KERNELS).load(Ordering::Relaxed),
            kernel_us: self.u64_at(OFF_BURST_KERNEL_NS).load(Ordering::Relaxed) / 1000,
        }
    }

    /// Fires shot `n`: one store (release: it publishes `set_burst`'s stores too).
    pub fn fire(&self, n: u64) {
        self.u64_at(OFF_REQUEST).store(n, Ordering::Release);
    }

    /// The last shot answered.
    pub fn done(&self) -> u64 {
        self.u64_at(OFF_DONE).load(Ordering::Acquire)
    }

    /// The last answered shot's record (read after `done` showed it).
    pub fn shot(&self) -> Shot {
        let r = |off| self.u64_at(off).load(Ordering::Relaxed);
        Shot {
            seen_mono_ns: r(OFF_SEEN),
            launched_mono_ns: r(OFF_LAUNCHED),
            synced_mono_ns: r(OFF_SYNCED),
            gpu_start_ns: r(OFF_GPU_START),
            gpu_end_ns: r(OFF_GPU_END),
            error: self.u32_at(OFF_ERROR).load(Ordering::Relaxed),
            burst_ran: self.u32_at(OFF_BURST_RAN).load(Ordering::Relaxed),
        }
    }

    /// Writes shot `n`'s record and then `done` = n: what the trigger does (for tests).
    #[cfg(test)]
    pub fn answer(&self, n: u64, s: &Shot) {
        let w = |off, v| self.u64_at(off).store(v, Ordering::Relaxed);
        w(OFF_SEEN, s.seen_mono_ns);
        w(OFF_LAUNCHED, s.launched_mono_ns);
        w(OFF_SYNCED, s.synced_mono_ns);
        w(OFF_GPU_START, s.gpu_start_ns);
        w(OFF_GPU_END, s.gpu_end_ns);
        self.u32_at(OFF_ERROR).store(s.error, Ordering::Relaxed);
        self.u32_at(OFF_BURST_RAN)
            .store(s.burst_ran, Ordering::Relaxed);
        self.u64_at(OFF_DONE).store(n, Ordering::Release);
    }

    /// Waits up to `timeout` for shot `n`'s answer.
    pub fn wait_done(&self, n: u64, timeout: Duration) -> Option<Shot> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.done() >= n {
                return Some(self.shot());
            }
            if Instant::now() > deadline {
                return None;
            }
            std::hint::spin_loop();
        }
    }
}

impl Drop for TriggerPage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// A running trigger process.
pub struct Trigger {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    /// Its page.
    pub page: TriggerPage,
    next: u64,
}

impl Trigger {
    /// Starts `bin` with `CUDA_VISIBLE_DEVICES=visible` (a GPU's UUID) and waits (up to 60 s)
    /// until it reports ready.
    pub fn start(bin: &Path, visible: &str) -> Result<Trigger> {
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "valve-trigger-{}-{}",
            std::process::id(),
            SEQ.fetch_add(1, Ordering::Relaxed)
        );
        let page = TriggerPage::create(&PathBuf::from(format!("/dev/shm/{name}")))?;
        let mut child = Command::new(bin)
            .args(["--shm", &name, "--max-seconds", "300"])
            .env("CUDA_VISIBLE_DEVICES", visible)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let mut out = child.stdout.take().expect("piped");
        let stdout = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = out.read_to_string(&mut s);
            s
        });
        let mut t = Trigger {
            child,
            stdout: Some(stdout),
            page,
            next: 1,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        while t.page.state() != STATE_READY {
            if let Some(status) = t.child.try_wait()? {
                bail!("the trigger exited while starting ({status}); its stderr is above");
            }
            if t.page.state() == STATE_FAILED || Instant::now() > deadline {
                bail!(
                    "the trigger did not become ready within 60 s (state {})",
                    t.page.state()
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(t)
    }

    /// Waits up to `timeout` for the previous shot to be answered, and checks the process lives.
    pub fn idle(&mut self, timeout: Duration) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!(
                "the trigger (pid {}) has exited ({status})",
                self.page.pid()
            );
        }
        if self.page.state() == STATE_FAILED {
            bail!("the trigger failed (a CUDA call; its stderr says which)");
        }
        if self.page.wait_done(self.next - 1, timeout).is_none() {
            bail!(
                "the trigger did not answer shot {} within {timeout:?}",
                self.next - 1
            );
        }
        Ok(())
    }

    /// Fires the next shot, a burst as `b` says (`Burst::SINGLE`: one tiny kernel), and returns
    /// its number.
    pub fn fire(&mut self, b: Burst) -> u64 {
        let n = self.prepare(b);
        self.page.fire(n);
        n
    }

    /// Sets what the next shot launches and reserves its number, without firing it: the caller
    /// fires it with `page.fire(n)`, possibly from another thread (the page is `Sync`), and must
    /// fire it before the next `idle`, which waits for its answer. A thread spawned after this
    /// call sees the burst's stores, so its `fire` (a release) publishes them to the trigger.
    pub fn prepare(&mut self, b: Burst) -> u64 {
        self.page.set_burst(b);
        let n = self.next;
        self.next += 1;
        n
    }

    /// Stops the trigger and returns its JSON line (shots answered), or what it printed.
    pub fn finish(mut self) -> Value {
        self.stop_child();
        let out = self
            .stdout
            .take()
            .and_then(|h| h.join().ok())
            .unwrap_or_default();
        out.lines()
            .rev()
            .find_map(|l| serde_json::from_str::<Value>(l).ok())
            .unwrap_or_else(|| serde_json::json!({ "raw_output": out }))
    }

    fn stop_child(&mut self) {
        self.page.request_stop();
        let deadline = Instant::now() + Duration::from_secs(5);
        while let Ok(None) = self.child.try_wait() {
            if Instant::now() > deadline {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Trigger {
    fn drop(&mut self) {
        self.stop_child();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_page(tag: &str) -> TriggerPage {
        let p =
            std::env::temp_dir().join(format!("valve-trigger-test-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_file(&p);
        TriggerPage::create(&p).expect("create")
    }

    #[test]
    fn offsets_match_common_h() {
        let h = include_str!("../cuda/common.h");
        for (field, off) in [
            ("state", OFF_STATE),
            ("stop", OFF_STOP),
            ("pid", OFF_PID),
            ("request", OFF_REQUEST),
            ("done", OFF_DONE),
            ("seen_mono_ns", OFF_SEEN),
            ("launched_mono_ns", OFF_LAUNCHED),
            ("synced_mono_ns", OFF_SYNCED),
            ("gpu_start_ns", OFF_GPU_START),
            ("gpu_end_ns", OFF_GPU_END),
            ("error", OFF_ERROR),
            ("burst_kernels", OFF_BURST_KERNELS),
            ("burst_ran", OFF_BURST_RAN),
            ("burst_kernel_ns", OFF_BURST_KERNEL_NS),
        ] {
            let want = format!("static_assert(offsetof(TriggerPage, {field}) == {off},");
            assert!(h.contains(&want), "common.h lacks `{want}`");
        }
        assert!(h.contains(&format!("kTriggerMagic = {MAGIC:#X}ull").replace("0X", "0x")));
        assert!(h.contains(&format!("kTriggerVersion = {VERSION};")));
        assert!(h.contains(&format!("kTriggerPageBytes = {PAGE_BYTES};")));
        assert!(h.contains(&format!("kTriggerMaxBurst = {MAX_BURST};")));
        assert!(h.contains("static_assert(sizeof(TriggerPage) == 104,"));
        let cu = include_str!("../cuda/trigger.cu");
        let max_ns = format!("kMaxKernelNs = {}ull;", MAX_KERNEL_US * 1000);
        assert!(cu.contains(&max_ns), "trigger.cu lacks `{max_ns}`");
        assert_eq!(&MAGIC.to_le_bytes(), b"VALVETRG");
    }

    #[test]
    fn bursts_are_checked_and_reach_the_page_in_ns() {
        assert_eq!(
            Burst::new(20, 50).unwrap(),
            Burst {
                kernels: 20,
                kernel_us: 50
            }
        );
        assert!(Burst::new(MAX_BURST, MAX_KERNEL_US).is_ok());
        for (k, us) in [
            (0, 50),
            (MAX_BURST + 1, 50),
            (20, 0),
            (20, MAX_KERNEL_US + 1),
        ] {
            assert!(Burst::new(k, us).is_err(), "{k} x {us} us");
        }
        let page = temp_page("burst");
        page.set_burst(Burst::new(7, 40).unwrap());
        assert_eq!(
            page.u64_at(OFF_BURST_KERNEL_NS).load(Ordering::Relaxed),
            40_000
        );
        assert_eq!(
            page.burst(),
            Burst {
                kernels: 7,
                kernel_us: 40
            }
        );
        page.set_burst(Burst::SINGLE);
        assert_eq!(page.burst(), Burst::SINGLE);
    }

    #[test]
    fn create_writes_magic_and_removes_on_drop() {
        let page = temp_page("magic");
        let path = page.path.clone();
        let bytes = std::fs::read(&path).expect("read back");
        assert_eq!(bytes.len(), PAGE_BYTES);
        assert_eq!(&bytes[0..8], b"VALVETRG");
        assert_eq!(
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()),
            VERSION
        );
        assert_eq!(page.state(), 0);
        assert!(
            TriggerPage::create(&path).is_err(),
            "an existing page is not reused"
        );
        drop(page);
        assert!(!path.exists());
    }

    /// The real `trigger` binary through the real protocol: `VALVE_TRIGGER_BIN` names it (built
    /// by hwtests/cuda/build.sh; on a GPU host, or linked against a stand-in libcudart).
    #[test]
    #[ignore = "needs a built trigger binary in VALVE_TRIGGER_BIN"]
    fn real_trigger_round_trip() {
        let bin = std::env::var("VALVE_TRIGGER_BIN").expect("VALVE_TRIGGER_BIN");
        let mut t = Trigger::start(Path::new(&bin), "0").expect("starts");
        assert_eq!(t.page.pid(), t.child.id());
        let burst = Burst::new(20, 50).expect("valid");
        for i in 0..6 {
            t.idle(Duration::from_secs(2)).expect("idle");
            let b = if i % 2 == 0 { Burst::SINGLE } else { burst };
            let n = t.fire(b);
            let s = t
                .page
                .wait_done(n, Duration::from_secs(2))
                .expect("answered");
            assert_eq!(s.error, 0);
            assert!(
                s.gpu_start_ns != 0 && s.gpu_start_ns <= s.gpu_end_ns,
                "{s:?}"
            );
            assert!(s.seen_mono_ns <= s.launched_mono_ns && s.launched_mono_ns <= s.synced_mono_ns);
            assert_eq!(s.burst_ran, b.kernels, "{s:?}");
            if b.kernels > 0 {
                let min_span = (b.kernels as u64) * b.kernel_us * 1000;
                assert!(s.gpu_end_ns - s.gpu_start_ns >= min_span, "{s:?}");
            }
        }
        let out = t.finish();
        assert_eq!(out["shots"], 6, "{out}");
    }

    #[test]
    fn fire_and_answer_through_another_thread() {
        let page = std::sync::Arc::new(temp_page("shots"));
        let p = page.clone();
        let responder = std::thread::spawn(move || {
            let mut last = 0;
            while last < 3 {
                let n = p.requested();
                if n != last {
                    last = n;
                    let s = Shot {
                        seen_mono_ns: 10 * n,
                        launched_mono_ns: 10 * n + 1,
                        synced_mono_ns: 10 * n + 2,
                        gpu_start_ns: 1000 + n,
                        gpu_end_ns: 2000 + n,
                        error: 0,
                        burst_ran: p.burst().kernels,
                    };
                    p.answer(n, &s);
                }
                std::hint::spin_loop();
            }
        });
        for n in 1..=3 {
            let b = Burst::new(n as u32 * 10, 50).expect("valid");
            page.set_burst(b);
            page.fire(n);
            let s = page
                .wait_done(n, Duration::from_secs(10))
                .expect("answered");
            assert_eq!(s.gpu_start_ns, 1000 + n);
            assert_eq!(s.synced_mono_ns, 10 * n + 2);
            assert_eq!(
                s.burst_ran, b.kernels,
                "the responder read the burst after the request"
            );
        }
        responder.join().unwrap();
        assert!(page.wait_done(4, Duration::from_millis(5)).is_none());
    }

    /// `prepare` reserves the number and sets the burst; a scoped thread fires it (the floor's
    /// (g) rows with the flag after the disable's issue).
    #[test]
    fn prepare_then_fire_from_a_scoped_thread() {
        let child = Command::new("true").spawn().expect("spawns `true`");
        let mut t = Trigger {
            child,
            stdout: None,
            page: temp_page("prepare"),
            next: 1,
        };
        assert_eq!(t.fire(Burst::SINGLE), 1);
        let b = Burst::new(3, 10).expect("valid");
        let n = t.prepare(b);
        assert_eq!((n, t.page.requested()), (2, 1), "not fired yet");
        assert_eq!(t.page.burst(), b);
        let page = &t.page;
        std::thread::scope(|s| {
            s.spawn(|| page.fire(n));
        });
        assert_eq!(t.page.requested(), 2);
        assert_eq!(t.fire(Burst::SINGLE), 3);
    }
}
