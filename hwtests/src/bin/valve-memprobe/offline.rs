//! The offline child: maps pool handles into its range, streams over all of it in long kernels
//! from a worker thread (as a framework's step loop would), and on request swaps slots to a
//! quarantine and back while its channels are disabled. At the end it checks untouched slots.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::{json, Value};
use valve_vmm::PhysicalHandle;

use crate::proto;
use crate::side::{us, Access, Side};

const INITIAL: u32 = 7;

struct Stepper {
    stop: Arc<AtomicBool>,
    launches: Arc<AtomicU64>,
    thread: JoinHandle<Result<()>>,
}

/// The step loop: one `stream_add` launch of `passes` passes after another, each waited for.
fn start_steps(side: &Side, passes: u32) -> Result<Stepper> {
    let stop = Arc::new(AtomicBool::new(false));
    let launches = Arc::new(AtomicU64::new(0));
    let stream = side.k.ctx.new_stream()?;
    // The thread needs its own view of the kernel and range; only raw addresses cross over.
    let (ctx, func, base, words) = (
        side.k.ctx.clone(),
        side.func("stream_add")?,
        side.ptr(0),
        side.words(side.slots),
    );
    let (s2, l2) = (stop.clone(), launches.clone());
    let thread = std::thread::spawn(move || -> Result<()> {
        ctx.bind_to_thread()?;
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (132 * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        while !s2.load(Ordering::Relaxed) {
            use cudarc::driver::PushKernelArg;
            let mut b = stream.launch_builder(&func);
            b.arg(&base).arg(&words).arg(&passes);
            // SAFETY: stream_add takes (u32*, u64, u32); every slot stays mapped (pool handle or
            // quarantine) for the life of the range, which outlives this thread.
            unsafe { b.launch(cfg) }?;
            stream.synchronize()?;
            l2.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    });
    Ok(Stepper {
        stop,
        launches,
        thread,
    })
}

/// Picks passes so one launch lasts about `kernel_ms`.
fn calibrate(side: &Side, kernel_ms: f64) -> Result<u32> {
    let stream = side.k.ctx.new_stream()?;
    side.launch_stream_add(&stream, 1)?;
    stream.synchronize()?;
    let t = Instant::now();
    side.launch_stream_add(&stream, 2)?;
    stream.synchronize()?;
    let per_pass_ms = t.elapsed().as_secs_f64() * 1e3 / 2.0;
    Ok(((kernel_ms / per_pass_ms).round() as u32).max(1))
}

struct Offline {
    side: Side,
    quarantine: PhysicalHandle,
    steps: Option<Stepper>,
    warmup_passes: u32,
    passes: u32,
}

impl Offline {
    /// Slots `first..first+count`: unmap the pool handle, map the quarantine, grant access.
    fn reclaim(&mut self, first: usize, count: usize, access: Access) -> Result<Value> {
        let (mut unmap_us, mut map_us, mut access_us, mut worst) = (0.0, 0.0, 0.0, 0.0f64);
        let q = self.quarantine.size();
        let t_all = Instant::now();
        for s in first..first + count {
            let t_slot = Instant::now();
            let off = s * self.side.slot;
            let t = Instant::now();
            self.side.va.unmap(off)?;
            unmap_us += us(t);
            let t = Instant::now();
            for k in 0..self.side.slot / q {
                self.side.va.map(off + k * q, &self.quarantine)?;
            }
            map_us += us(t);
            if access == Access::PerHandle {
                let t = Instant::now();
                self.side
                    .va
                    .set_access(&self.side.gpu, off, self.side.slot)?;
                access_us += us(t);
            }
            worst = worst.max(us(t_slot));
        }
        if access == Access::Range {
            let t = Instant::now();
            self.side.va.set_access(
                &self.side.gpu,
                first * self.side.slot,
                count * self.side.slot,
            )?;
            access_us += us(t);
        }
        Ok(
            json!({"unmap_us": unmap_us, "map_us": map_us, "access_us": access_us,
                  "worst_slot_us": worst, "total_us": us(t_all)}),
        )
    }

    /// Gives slots back: unmap the quarantine, map the pool's handles again.
    fn give_back(
        &mut self,
        first: usize,
        fds: &[std::os::fd::OwnedFd],
        access: Access,
    ) -> Result<Value> {
        let t = Instant::now();
        let q = self.quarantine.size();
        for s in first..first + fds.len() {
            for k in 0..self.side.slot / q {
                self.side.va.unmap(s * self.side.slot + k * q)?;
            }
        }
        let unmap_us = us(t);
        let mut v = self.side.map_fds(first, fds, access)?;
        v["unmap_quarantine_us"] = unmap_us.into();
        Ok(v)
    }

    fn stop(&mut self, verify_from: usize) -> Result<Value> {
        let Some(st) = self.steps.take() else {
            bail!("not started")
        };
        st.stop.store(true, Ordering::Relaxed);
        let result = st
            .thread
            .join()
            .map_err(|_| anyhow::anyhow!("step thread panicked"))?;
        let launches = st.launches.load(Ordering::Relaxed);
        let kernel_error = result.err().map(|e| format!("{e:#}"));
        let total = self.warmup_passes as u64 + launches * self.passes as u64;
        let expect = INITIAL.wrapping_add(total as u32);
        let untouched = self.side.slots - verify_from;
        let bad = if kernel_error.is_none() && untouched > 0 {
            self.side.count_ne(verify_from, untouched, expect)?
        } else {
            0
        };
        Ok(
            json!({"launches": launches, "passes_per_launch": self.passes, "kernel_error": kernel_error,
                  "verified_slots": untouched, "bad_words": bad}),
        )
    }

    fn handle(&mut self, m: &Value, fds: &[std::os::fd::OwnedFd], kernel_ms: f64) -> Result<Value> {
        let first = m["first"].as_u64().unwrap_or(0) as usize;
        let count = m["count"].as_u64().unwrap_or(0) as usize;
        let access = Access::parse(m["access"].as_str().unwrap_or(""));
        match m["op"].as_str().unwrap_or("") {
            "map" => self.side.map_fds(first, fds, access),
            "start" => {
                self.side.fill(0, self.side.slots, INITIAL)?;
                self.passes = calibrate(&self.side, kernel_ms)?;
                self.warmup_passes = 3; // calibrate's 1 + 2 passes
                self.steps = Some(start_steps(&self.side, self.passes)?);
                Ok(json!({"pid": std::process::id(), "passes": self.passes}))
            }
            "launches" => Ok(
                json!({"launches": self.steps.as_ref().map(|s| s.launches.load(Ordering::Relaxed))}),
            ),
            "reclaim" => self.reclaim(first, count, access),
            "return" => self.give_back(first, fds, access),
            "stop" => self.stop(m["verify_from"].as_u64().unwrap_or(0) as usize),
            op => bail!("unknown op {op}"),
        }
    }
}

/// Runs the offline child on `sock` until the parent closes it.
pub fn run(
    sock: UnixStream,
    ptx: &Path,
    slot: usize,
    slots: usize,
    quarantine: &str,
    kernel_ms: f64,
) -> Result<()> {
    let side = Side::new(ptx, slot, slots)?;
    let page = quarantine == "page";
    let qsize = if page { side.gpu.granularity()? } else { slot };
    let quarantine = PhysicalHandle::create(&side.gpu, qsize)?;
    let mut me = Offline {
        side,
        quarantine,
        steps: None,
        warmup_passes: 0,
        passes: 1,
    };
    while let Some((m, fds)) = proto::recv(&sock)? {
        let reply = me
            .handle(&m, &fds, kernel_ms)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        proto::send(&sock, &reply, &[])?;
    }
    Ok(())
}
