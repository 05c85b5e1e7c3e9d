//! One child's GPU side: a CUDA context and the probe's kernels (memstream.ptx), launched at any
//! device address the client library hands out.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, LaunchConfig, PushKernelArg,
};

/// Microseconds since `t`.
pub fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
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
