//! The hog's shared heartbeat page (`/dev/shm/<name>`), mapped read/write: the contract with
//! `hwtests/cuda/hog.cu` (layout in `hwtests/cuda/README.md`). All reads are volatile.

use std::fs::OpenOptions;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use memmap2::MmapRaw;

/// "VALVEHOG" as little-endian bytes.
pub const MAGIC: u64 = 0x474F_4845_564C_4156;
const OFF_MAGIC: usize = 0;
const OFF_STATE: usize = 12;
const OFF_STOP: usize = 16;
const OFF_NUM_SLOTS: usize = 20;
const OFF_COPIES: usize = 24;
const OFF_CHECKSUM_OK: usize = 32;
const OFF_SLOTS: usize = 64;
const SLOT_SIZE: usize = 16;

/// Hog states.
pub const STATE_RUNNING: u32 = 1;
/// Failed.
pub const STATE_FAILED: u32 = 3;

/// A mapped heartbeat page.
pub struct Heartbeat {
    map: MmapRaw,
    path: PathBuf,
}

// SAFETY: the mapping is shared memory accessed only through volatile reads/writes of aligned
// integers; concurrent access from several threads is what it is for.
unsafe impl Sync for Heartbeat {}
// SAFETY: as above; the mapping is not tied to the creating thread.
unsafe impl Send for Heartbeat {}

impl Heartbeat {
    /// Waits up to `timeout` for the hog to create and initialise `/dev/shm/<name>`, then maps it.
    pub fn open(name: &str, timeout: Duration) -> Result<Self> {
        let path = PathBuf::from(format!("/dev/shm/{name}"));
        let deadline = Instant::now() + timeout;
        loop {
            if let Ok(file) = OpenOptions::new().read(true).write(true).open(&path) {
                let len = file.metadata()?.len() as usize;
                if len >= OFF_SLOTS {
                    let map = MmapRaw::map_raw(&file)
                        .with_context(|| format!("mapping {}", path.display()))?;
                    // SAFETY: the mapping is at least OFF_SLOTS (64) bytes and page-aligned, so
                    // the u64 at offset 0 is in bounds and aligned; volatile: the hog writes it.
                    let magic = unsafe {
                        std::ptr::read_volatile(map.as_ptr().add(OFF_MAGIC) as *const u64)
                    };
                    // Only a page with its magic becomes a Heartbeat: its Drop unlinks the file,
                    // which must never happen to a page the hog is still initialising.
                    if magic == MAGIC {
                        let hb = Heartbeat {
                            map,
                            path: path.clone(),
                        };
                        let need = OFF_SLOTS + SLOT_SIZE * hb.num_slots();
                        if len < need {
                            bail!(
                                "{} is {len} bytes but declares {} slots",
                                path.display(),
                                hb.num_slots()
                            );
                        }
                        return Ok(hb);
                    }
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "the hog did not initialise {} within {timeout:?}",
                    path.display()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn ptr(&self, off: usize) -> *mut u8 {
        assert!(
            off + 8 <= self.map.len(),
            "heartbeat offset {off} out of range"
        );
        // SAFETY: `off + 8 <= len` was just checked, so the result stays inside the mapping.
        unsafe { self.map.as_mut_ptr().add(off) }
    }

    fn read_u64(&self, off: usize) -> u64 {
        // SAFETY: in bounds (checked by `ptr`), 8-aligned (all u64 offsets are multiples of 8
        // and the mapping is page-aligned); volatile because the GPU and the hog write it.
        unsafe { std::ptr::read_volatile(self.ptr(off) as *const u64) }
    }

    fn read_u32(&self, off: usize) -> u32 {
        // SAFETY: in bounds and 4-aligned, see `read_u64`.
        unsafe { std::ptr::read_volatile(self.ptr(off) as *const u32) }
    }

    /// The hog's state (0 starting, 1 running, 2 finished, 3 failed).
    pub fn state(&self) -> u32 {
        self.read_u32(OFF_STATE)
    }

    /// Asks the hog to finish (its kernels poll this flag).
    pub fn request_stop(&self) {
        // SAFETY: in bounds and 4-aligned; the hog only reads this word.
        unsafe { std::ptr::write_volatile(self.ptr(OFF_STOP) as *mut u32, 1) }
    }

    /// Heartbeat slots in use.
    pub fn num_slots(&self) -> usize {
        self.read_u32(OFF_NUM_SLOTS) as usize
    }

    /// Copies completed (copy mode).
    pub fn copies_done(&self) -> u64 {
        self.read_u64(OFF_COPIES)
    }

    /// -1 unknown, 0 mismatch, 1 verified.
    pub fn checksum_ok(&self) -> i32 {
        self.read_u32(OFF_CHECKSUM_OK) as i32
    }

    /// Slot `i`'s iteration counter.
    pub fn counter(&self, i: usize) -> u64 {
        self.read_u64(OFF_SLOTS + SLOT_SIZE * i)
    }

    /// All counters plus the copy counter: equal snapshots mean nothing ran in between.
    pub fn snapshot(&self) -> Vec<u64> {
        let mut v: Vec<u64> = (0..self.num_slots()).map(|i| self.counter(i)).collect();
        v.push(self.copies_done());
        v
    }

    /// Waits until the hog reports running.
    pub fn wait_running(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.state() != STATE_RUNNING {
            if self.state() == STATE_FAILED {
                bail!("the hog failed while starting (see its output)");
            }
            if Instant::now() > deadline {
                bail!(
                    "the hog did not start running within {timeout:?} (state {})",
                    self.state()
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}
