//! One child's GPU side: a CUDA context, the probe's kernels, and a VA range of equal slots into
//! which pool handles are mapped (offline's KV-like memory, or online's).

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};
use serde_json::{json, Value};
use valve_vmm::{Gpu, PhysicalHandle, VaRange};

/// Microseconds since `t`.
pub fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// How access is granted after mapping several slots.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// One cuMemSetAccess per handle.
    PerHandle,
    /// One cuMemSetAccess over the whole contiguous run.
    Range,
}

impl Access {
    pub fn parse(s: &str) -> Access {
        if s == "range" {
            Access::Range
        } else {
            Access::PerHandle
        }
    }
}

/// A CUDA context with the probe's kernels, usable at any device address (the probe's own
/// ranges, or the client library's regions in the end-to-end run).
pub struct Kernels {
    pub ctx: Arc<CudaContext>,
    pub module: Arc<CudaModule>,
    pub stream: Arc<CudaStream>,
}

impl Kernels {
    pub fn new(ptx: &Path) -> Result<Kernels> {
        let ctx = CudaContext::new(0).context("creating the CUDA context")?;
        let src =
            std::fs::read_to_string(ptx).with_context(|| format!("reading {}", ptx.display()))?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(src))?;
        let stream = ctx.new_stream()?;
        Ok(Kernels {
            ctx,
            module,
            stream,
        })
    }

    pub fn func(&self, name: &str) -> Result<CudaFunction> {
        Ok(self.module.load_function(name)?)
    }

    fn launch_cfg() -> LaunchConfig {
        LaunchConfig {
            grid_dim: (132 * 8, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        }
    }

    /// Writes `v` to `words` words at `p` and waits.
    pub fn fill_at(&self, p: u64, words: u64, v: u32) -> Result<()> {
        let f = self.func("fill")?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&p).arg(&words).arg(&v);
        // SAFETY: `fill` takes (u32*, u64, u32); the caller maps p..p+words words with access.
        unsafe { b.launch(Self::launch_cfg()) }?;
        self.stream.synchronize()?;
        Ok(())
    }

    /// Words at `p..p+words` that differ from `v`.
    pub fn count_ne_at(&self, p: u64, words: u64, v: u32) -> Result<u64> {
        let f = self.func("count_ne")?;
        let mut bad = self.stream.alloc_zeros::<u64>(1)?;
        let mut b = self.stream.launch_builder(&f);
        b.arg(&p).arg(&words).arg(&v).arg(&mut bad);
        // SAFETY: `count_ne` takes (const u32*, u64, u32, u64*); the range is mapped and `bad`
        // is a live one-element device buffer.
        unsafe { b.launch(Self::launch_cfg()) }?;
        let host = self.stream.clone_dtoh(&bad)?;
        self.stream.synchronize()?;
        Ok(host[0])
    }

    /// Launches `stream_add` over `words` words at `p` with `passes` passes (does not wait).
    pub fn stream_add_at(
        &self,
        stream: &Arc<CudaStream>,
        p: u64,
        words: u64,
        passes: u32,
    ) -> Result<()> {
        let f = self.func("stream_add")?;
        let mut b = stream.launch_builder(&f);
        b.arg(&p).arg(&words).arg(&passes);
        // SAFETY: `stream_add` takes (u32*, u64, u32); the caller keeps every word mapped (pool
        // memory or the quarantine) for as long as the launch can run.
        unsafe { b.launch(Self::launch_cfg()) }?;
        Ok(())
    }
}

pub struct Side {
    pub k: Kernels,
    pub gpu: Gpu,
    pub va: VaRange,
    pub slot: usize,
    pub slots: usize,
}

impl Side {
    pub fn new(ptx: &Path, slot: usize, slots: usize) -> Result<Side> {
        let k = Kernels::new(ptx)?;
        let gpu = Gpu::open(0)?;
        let va = VaRange::reserve(slot * slots, slot)?;
        Ok(Side {
            k,
            gpu,
            va,
            slot,
            slots,
        })
    }

    pub fn func(&self, name: &str) -> Result<CudaFunction> {
        self.k.func(name)
    }

    pub fn ptr(&self, first: usize) -> u64 {
        self.va.base() + (first * self.slot) as u64
    }

    pub fn words(&self, count: usize) -> u64 {
        (count * self.slot / 4) as u64
    }

    /// Imports `fds` and maps them at slots `first..`, granting access as `access` says.
    /// Returns per-step totals in microseconds.
    pub fn map_fds(&mut self, first: usize, fds: &[OwnedFd], access: Access) -> Result<Value> {
        let (mut import_us, mut map_us, mut access_us) = (0.0, 0.0, 0.0);
        for (i, fd) in fds.iter().enumerate() {
            let off = (first + i) * self.slot;
            let t = Instant::now();
            let h = PhysicalHandle::import(fd.as_fd(), self.slot)?;
            import_us += us(t);
            let t = Instant::now();
            self.va.map(off, &h)?;
            map_us += us(t);
            if access == Access::PerHandle {
                let t = Instant::now();
                self.va.set_access(&self.gpu, off, self.slot)?;
                access_us += us(t);
            }
            drop(h); // the mapping keeps the memory; the pool keeps its own handle
        }
        if access == Access::Range && !fds.is_empty() {
            let t = Instant::now();
            self.va
                .set_access(&self.gpu, first * self.slot, fds.len() * self.slot)?;
            access_us += us(t);
        }
        Ok(json!({"import_us": import_us, "map_us": map_us, "access_us": access_us}))
    }

    /// Writes `v` to every word of slots `first..first+count` and waits.
    pub fn fill(&self, first: usize, count: usize, v: u32) -> Result<()> {
        self.k.fill_at(self.ptr(first), self.words(count), v)
    }

    /// Words of slots `first..first+count` that differ from `v`.
    pub fn count_ne(&self, first: usize, count: usize, v: u32) -> Result<u64> {
        self.k.count_ne_at(self.ptr(first), self.words(count), v)
    }

    /// Launches `stream_add` over every slot with `passes` passes (does not wait).
    pub fn launch_stream_add(&self, stream: &Arc<CudaStream>, passes: u32) -> Result<()> {
        self.k
            .stream_add_at(stream, self.ptr(0), self.words(self.slots), passes)
    }
}
