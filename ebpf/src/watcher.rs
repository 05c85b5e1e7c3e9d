//! Loads and attaches the rm_watch BPF program and hands its events out as typed [`RmEvent`]s.
//! The BPF object lives on a dedicated thread that polls the ring buffer; dropping the
//! [`Watcher`] stops that thread, which detaches the programs.

use crate::poll_thread::PollThread;
use std::ffi::CString;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use libbpf_rs::skel::{OpenSkel, Skel, SkelBuilder};
use libbpf_rs::{ErrorKind, MapCore, MapFlags, Program, RingBufferBuilder};
use std::os::fd::AsFd;

pub use crate::error::WatchError;
use crate::event::RmEvent;
use crate::skel::RmWatchSkelBuilder;

/// Major number of `/dev/nvidiactl` and `/dev/nvidia<N>` (fixed by the NVIDIA driver).
pub const NVIDIA_MAJOR: u32 = 195;

/// Kernel BTF that CO-RE relocations are resolved against.
pub const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const TRACEFS_ROOTS: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];
const TRACEPOINTS: [&str; 3] = [
    "syscalls/sys_enter_ioctl",
    "syscalls/sys_exit_ioctl",
    "sched/sched_process_exit",
];

/// How to start a [`Watcher`].
#[derive(Clone, Debug)]
pub struct WatchConfig {
    /// Only ioctls on character devices of this major are watched ([`NVIDIA_MAJOR`] by default).
    pub device_major: u32,
    /// TEST ONLY: also report RM-shaped ioctls that returned `-ENOTTY`, which is what a device
    /// without an ioctl handler (`/dev/null`) answers. Lets CI exercise the real program on
    /// machines without an NVIDIA driver. Never set this on a GPU host.
    pub test_accept_enotty: bool,
    /// How often the polling thread wakes to check for shutdown and refresh [`WatchStats`];
    /// bounds how long `drop` takes. Without `batched_delivery`, events are delivered as soon as
    /// they arrive regardless; with it, this is the most an event waits in the ring buffer.
    pub poll_interval: Duration,
    /// Do not wake the consumer from the ioctl path (`BPF_RB_NO_WAKEUP`); the polling thread
    /// drains the ring buffer every `poll_interval` instead. Takes the ~2 us wake-up off every
    /// observed RM call, at the price of up to `poll_interval` of delivery delay.
    pub batched_delivery: bool,
    /// When tracefs is mounted nowhere, mount it privately: the polling thread moves to its own
    /// mount namespace and mounts tracefs at `/sys/kernel/tracing` there, so libbpf can look up
    /// the tracepoint ids without changing the host's mounts. Needs CAP_SYS_ADMIN.
    pub mount_private_tracefs: bool,
}

impl Default for WatchConfig {
    fn default() -> Self {
        WatchConfig {
            device_major: NVIDIA_MAJOR,
            test_accept_enotty: false,
            poll_interval: Duration::from_millis(50),
            batched_delivery: false,
            mount_private_tracefs: true,
        }
    }
}

/// Counters of events the program could not deliver; all zero when nothing was lost.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WatchStats {
    /// Events dropped because the ring buffer was full (user space not polling fast enough).
    pub ringbuf_full: u64,
    /// RM structs the program could not read back from user memory.
    pub read_failed: u64,
    /// RM calls that returned a non-zero RM status (not errors of the watcher; not reported).
    pub rm_status_nonzero: u64,
    /// Ring-buffer records user space could not decode.
    pub decode_errors: u64,
}

#[derive(Default)]
struct Shared {
    ringbuf_full: AtomicU64,
    read_failed: AtomicU64,
    rm_status_nonzero: AtomicU64,
    decode_errors: AtomicU64,
}

/// A running watcher. Poll it for events (from any thread); drop it to detach.
pub struct Watcher {
    /// Dropped first: stops the polling thread, which detaches the programs.
    thread: PollThread,
    rx: Mutex<Receiver<RmEvent>>,
    program_ids: [u32; 3],
    shared: Arc<Shared>,
}

impl Watcher {
    /// Loads the program with `cfg`'s settings, attaches it to the ioctl and process-exit
    /// tracepoints and starts delivering events. Returns once the programs are attached: every
    /// RM call completing after this is reported.
    pub fn start(cfg: WatchConfig) -> Result<Watcher, WatchError> {
        if !Path::new(VMLINUX_BTF).exists() {
            return Err(WatchError::NoBtf(VMLINUX_BTF.into()));
        }
        let (tx, rx) = mpsc::channel();
        let shared = Arc::new(Shared::default());
        let shared2 = Arc::clone(&shared);
        let (thread, program_ids) =
            PollThread::spawn("valve-rm-watch", None, move |ready, stop| {
                run(cfg, ready, tx, stop, shared2)
            })?;
        Ok(Watcher {
            thread,
            rx: Mutex::new(rx),
            program_ids,
            shared,
        })
    }

    /// The next event, waiting up to `timeout`; `None` if none arrived in time.
    pub fn poll(&self, timeout: Duration) -> Option<RmEvent> {
        let rx = self.rx.lock().unwrap_or_else(PoisonError::into_inner);
        rx.recv_timeout(timeout).ok()
    }

    /// Kernel ids of the three attached programs (ioctl enter, ioctl exit, process exit), for
    /// `bpftool prog show id N`.
    pub fn program_ids(&self) -> [u32; 3] {
        self.program_ids
    }

    /// False once the polling thread has ended (it only ends early if it panicked): no more
    /// events will come.
    pub fn is_alive(&self) -> bool {
        self.thread.is_alive()
    }

    /// Every event already delivered, without waiting.
    pub fn drain(&self) -> Vec<RmEvent> {
        let rx = self.rx.lock().unwrap_or_else(PoisonError::into_inner);
        rx.try_iter().collect()
    }

    /// Loss counters, refreshed every `poll_interval`.
    pub fn stats(&self) -> WatchStats {
        WatchStats {
            ringbuf_full: self.shared.ringbuf_full.load(Ordering::Relaxed),
            read_failed: self.shared.read_failed.load(Ordering::Relaxed),
            rm_status_nonzero: self.shared.rm_status_nonzero.load(Ordering::Relaxed),
            decode_errors: self.shared.decode_errors.load(Ordering::Relaxed),
        }
    }
}

/// Whether a BPF program with kernel id `id` is still loaded (ids from
/// [`Watcher::program_ids`]; the kernel frees a program shortly after its last link closes).
pub fn program_loaded(id: u32) -> bool {
    Program::fd_from_id(id).is_ok()
}

/// The polling thread: everything BPF lives and dies here.
fn run(
    cfg: WatchConfig,
    ready: SyncSender<Result<[u32; 3], WatchError>>,
    tx: Sender<RmEvent>,
    stop: Arc<AtomicBool>,
    shared: Arc<Shared>,
) {
    let mut storage = MaybeUninit::uninit();
    let setup = || -> Result<_, WatchError> {
        let tracefs = ensure_tracefs(cfg.mount_private_tracefs)?;
        for tp in TRACEPOINTS {
            if !tracefs.join("events").join(tp).exists() {
                return Err(WatchError::MissingTracepoint(tp, tracefs));
            }
        }
        crate::libbpf_log::route_to_tracing();
        let mut open = RmWatchSkelBuilder::default()
            .open(&mut storage)
            .map_err(|e| WatchError::bpf("opening the BPF object", e))?;
        if let Some(ro) = open.maps.rodata_data.as_deref_mut() {
            ro.device_major = cfg.device_major;
            ro.accept_enotty = u8::from(cfg.test_accept_enotty);
            // BPF_RB_NO_WAKEUP (include/uapi/linux/bpf.h) is 1.
            ro.ringbuf_flags = u64::from(cfg.batched_delivery);
        }
        let mut skel = open
            .load()
            .map_err(|e| WatchError::bpf("loading the BPF program", e))?;
        skel.attach()
            .map_err(|e| WatchError::bpf("attaching to the tracepoints", e))?;
        let id = |p: &libbpf_rs::ProgramMut<'_>| {
            Program::id_from_fd(p.as_fd()).map_err(|e| WatchError::bpf("querying program ids", e))
        };
        let ids = [
            id(&skel.progs.rm_ioctl_enter)?,
            id(&skel.progs.rm_ioctl_exit)?,
            id(&skel.progs.rm_process_exit)?,
        ];
        let mut rb = RingBufferBuilder::new();
        let decode_shared = Arc::clone(&shared);
        rb.add(&skel.maps.events, move |data: &[u8]| {
            match RmEvent::decode(data) {
                Ok(ev) => {
                    let _ = tx.send(ev);
                }
                Err(e) => {
                    decode_shared.decode_errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("rm_watch: {e}");
                }
            }
            0
        })
        .map_err(|e| WatchError::bpf("opening the ring buffer", e))?;
        let rb = rb
            .build()
            .map_err(|e| WatchError::bpf("opening the ring buffer", e))?;
        Ok((skel, rb, ids))
    };
    let (skel, rb, ids) = match setup() {
        Ok(x) => x,
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    let _ = ready.send(Ok(ids));
    while !stop.load(Ordering::Relaxed) {
        if cfg.batched_delivery {
            // Nothing wakes epoll in this mode: drain on the interval.
            std::thread::sleep(cfg.poll_interval);
            if let Err(e) = rb.consume() {
                tracing::warn!("rm_watch: ring buffer consume: {e}");
            }
        } else if let Err(e) = rb.poll(cfg.poll_interval) {
            if e.kind() != ErrorKind::Interrupted {
                tracing::warn!("rm_watch: ring buffer poll: {e}");
                std::thread::sleep(cfg.poll_interval);
            }
        }
        let sums = read_stats(&skel.maps.stats);
        shared.ringbuf_full.store(sums[0], Ordering::Relaxed);
        shared.read_failed.store(sums[1], Ordering::Relaxed);
        shared.rm_status_nonzero.store(sums[2], Ordering::Relaxed);
    }
    // Deliver what is still buffered, then drop rb and skel: that detaches the programs.
    let _ = rb.consume();
}

/// Sums the per-CPU counters of the `stats` map (indices as in the BPF program).
fn read_stats(map: &dyn MapCore) -> [u64; 3] {
    let mut out = [0u64; 3];
    for (i, slot) in out.iter_mut().enumerate() {
        let key = (i as u32).to_ne_bytes();
        if let Ok(Some(per_cpu)) = map.lookup_percpu(&key, MapFlags::ANY) {
            *slot = per_cpu
                .iter()
                .filter(|v| v.len() >= 8)
                .map(|v| u64::from_ne_bytes([v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]]))
                .sum();
        }
    }
    out
}

/// The last OS error of a mount step: EPERM means we lack privileges (tracefs itself is
/// mode 0700, so an unprivileged user also gets here when it is mounted).
fn mount_error(what: &'static str) -> WatchError {
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EPERM) {
        WatchError::PermissionDenied {
            what,
            source: Box::new(e),
        }
    } else {
        WatchError::Tracefs(e)
    }
}

/// Finds a mounted tracefs, or mounts one in a private mount namespace of this thread.
fn ensure_tracefs(mount_private: bool) -> Result<PathBuf, WatchError> {
    for root in TRACEFS_ROOTS {
        if Path::new(root).join("events").is_dir() {
            return Ok(root.into());
        }
    }
    let root = TRACEFS_ROOTS[0];
    if !mount_private {
        return Err(WatchError::Tracefs(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "not mounted and WatchConfig::mount_private_tracefs is off",
        )));
    }
    // SAFETY: unshare(2) with CLONE_NEWNS only changes this thread's mount namespace (the
    // kernel also unshares this thread's fs_struct); no memory is shared with Rust code.
    if unsafe { libc::unshare(libc::CLONE_NEWNS) } != 0 {
        return Err(mount_error(
            "unsharing the mount namespace to mount tracefs",
        ));
    }
    let slash = CString::new("/").expect("no NUL");
    let target = CString::new(root).expect("no NUL");
    let fstype = CString::new("tracefs").expect("no NUL");
    // SAFETY: the target is a valid NUL-terminated string that outlives the call; source,
    // fstype and data may be null for a propagation change (mount(2)). It makes every mount of
    // this thread's new namespace private, so the next mount does not propagate to the host.
    let private = unsafe {
        libc::mount(
            std::ptr::null(),
            slash.as_ptr(),
            std::ptr::null(),
            libc::MS_REC | libc::MS_PRIVATE,
            std::ptr::null(),
        )
    };
    if private != 0 {
        return Err(mount_error("mounting tracefs privately"));
    }
    // SAFETY: source, target and fstype are valid NUL-terminated strings that outlive the call,
    // and tracefs takes no data (null). The namespace is private (above): nothing reaches the
    // host's mount table.
    let mounted = unsafe {
        libc::mount(
            fstype.as_ptr(),
            target.as_ptr(),
            fstype.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if mounted != 0 {
        return Err(mount_error("mounting tracefs privately"));
    }
    tracing::debug!("rm_watch: mounted tracefs privately at {root}");
    Ok(root.into())
}
