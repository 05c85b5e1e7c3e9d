//! The controller: Valve's own RM client with a device + subdevice per GPU, preemption plans, and
//! the [`DisabledChannels`] guard that re-enables on drop. Several GPUs are issued serially or on
//! persistent per-GPU workers ([`crate::issue`]), whichever the driver makes faster.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Serialize;
use valve_ioctl_bindings::{
    ChannelHandle, ClientHandle, DeviceHandle, Nv0080AllocParams, Nv2080AllocParams,
    Nv2080FifoDisableChannelsParams, Nv2080GetGidInfoParams, Nv2080GetNameStringParams,
    ObjectHandle, SubdeviceHandle, FIFO_DISABLE_CHANNELS_MAX_ENTRIES, NV2080_GID_FORMAT_ASCII,
    NV2080_GPU_NAME_STRING_ASCII,
};

use crate::driver::{DriverInfo, NvDriver, RmDriver};
use crate::error::{Error, Result};
use crate::gpu::{c_string, enumerate, GpuInfo};
use crate::issue::{
    p50, us_since, GpuResult, Handler, IssueMode, IssueSetting, LockProbe, ModeCell, WorkerPool,
};

/// Handles of the objects Valve allocates under its own client: `BASE | instance << 8 | kind`.
pub(crate) const OWN_HANDLE_BASE: u32 = 0xcaf0_0000;

/// One GPU opened for control.
pub(crate) struct OpenGpu {
    pub(crate) info: GpuInfo,
    pub(crate) subdevice: SubdeviceHandle,
    /// Its diag object, allocated on first use (the error if RM refused it).
    pub(crate) diag: std::sync::OnceLock<std::result::Result<ObjectHandle, String>>,
}

/// The driver, the client and the GPUs: shared with the issue workers. Dropping it frees the
/// client (RM frees everything under it).
pub(crate) struct Inner<D: RmDriver> {
    pub(crate) rm: D,
    pub(crate) client: ClientHandle,
    pub(crate) gpus: Vec<OpenGpu>,
}

/// A parallel issue's job for one worker: that GPU's chunks, disable or enable, the batch start.
type IssueJob = (Arc<GpuBatch>, bool, Instant);

/// Valve's handle on the driver: an RM root client plus a device and subdevice on every GPU.
/// Dropping it stops its issue workers and frees the client.
pub struct Controller<D: RmDriver = NvDriver> {
    pub(crate) inner: Arc<Inner<D>>,
    /// One worker per GPU slot (none with one GPU), started with the controller.
    workers: Option<WorkerPool<IssueJob, GpuTiming>>,
    mode: ModeCell,
    setting: Mutex<IssueSetting>,
}

impl Controller<NvDriver> {
    /// Opens the real driver: checks it is the open module, opens `/dev/nvidiactl`, allocates
    /// a client and a device + subdevice on every GPU.
    pub fn open() -> Result<Self> {
        if !std::path::Path::new(crate::driver::NVIDIACTL).exists() {
            return Err(Error::DriverMissing {
                path: crate::driver::NVIDIACTL.into(),
            });
        }
        DriverInfo::read()?.require_open()?;
        Self::with_driver(NvDriver::open()?)
    }
}

/// Whether disabling also preempts the work already running.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub enum PreemptMode {
    /// Disable the channels and preempt their running work (`bOnlyDisableScheduling = 0`).
    #[default]
    Preempt,
    /// Only stop scheduling new work; a running kernel keeps running (`bOnlyDisableScheduling = 1`).
    ScheduleOnly,
}

/// One channel of another process, on one GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChannelTarget {
    /// Valve's GPU index.
    pub gpu: usize,
    /// The owning process's RM client.
    pub client: ClientHandle,
    /// The channel.
    pub channel: ChannelHandle,
}

/// The prebuilt controls for one GPU.
#[derive(Clone, Debug)]
struct GpuBatch {
    slot: usize,
    channels: usize,
    chunks: Vec<Nv2080FifoDisableChannelsParams>,
}

/// Targets grouped per GPU and chunked into prebuilt FIFO_DISABLE_CHANNELS blocks, so the
/// preemption path only flips a flag and issues ioctls.
#[derive(Clone, Debug)]
pub struct PreemptPlan {
    batches: Vec<Arc<GpuBatch>>,
    mode: PreemptMode,
}

impl PreemptPlan {
    /// Number of distinct channels.
    pub fn channels(&self) -> usize {
        self.batches.iter().map(|b| b.channels).sum()
    }

    /// Number of GPUs touched.
    pub fn gpus(&self) -> usize {
        self.batches.len()
    }

    /// Number of ioctls one disable issues.
    pub fn ioctls(&self) -> usize {
        self.batches.iter().map(|b| b.chunks.len()).sum()
    }

    /// The preemption mode.
    pub fn mode(&self) -> PreemptMode {
        self.mode
    }

    /// The part of the plan on its first GPU only.
    pub fn first_gpu(&self) -> PreemptPlan {
        PreemptPlan {
            batches: self.batches.iter().take(1).cloned().collect(),
            mode: self.mode,
        }
    }
}

/// The timing of one GPU's share of a disable or enable.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct GpuTiming {
    /// Valve's GPU index.
    pub gpu: usize,
    /// Channels named.
    pub channels: usize,
    /// When this GPU's first ioctl was issued, after the batch started.
    #[serde(serialize_with = "as_us")]
    pub start_offset: Duration,
    /// Time inside this GPU's ioctls (all chunks).
    #[serde(serialize_with = "as_us")]
    pub ioctl: Duration,
}

/// The timing of one disable or enable over all GPUs of a plan.
#[derive(Clone, Debug, Serialize)]
pub struct BatchReport {
    /// Per GPU.
    pub gpus: Vec<GpuTiming>,
    /// From the call until the last GPU finished.
    #[serde(serialize_with = "as_us")]
    pub wall: Duration,
    /// When the batch started (not serialised).
    #[serde(skip)]
    pub started_at: Option<Instant>,
}

fn as_us<S: serde::Serializer>(d: &Duration, s: S) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e6)
}

impl<D: RmDriver> Inner<D> {
    fn issue_chunk(
        &self,
        slot: usize,
        chunk: &Nv2080FifoDisableChannelsParams,
        disable: bool,
    ) -> Result<()> {
        let mut params = *chunk;
        params.disable = u8::from(disable);
        let gpu = &self.gpus[slot];
        self.rm
            .control(self.client, gpu.subdevice.into(), &mut params)
            .map_err(|e| {
                e.into_error(format!(
                    "{} {} channel(s) on GPU {}",
                    if disable { "disabling" } else { "enabling" },
                    chunk.num_channels,
                    slot
                ))
            })
    }

    /// Issues one GPU's chunks; on failure reports how many chunks went through.
    fn issue_gpu(
        &self,
        batch: &GpuBatch,
        disable: bool,
        started: Instant,
    ) -> std::result::Result<GpuTiming, (usize, Error)> {
        let t0 = Instant::now();
        for (i, chunk) in batch.chunks.iter().enumerate() {
            self.issue_chunk(batch.slot, chunk, disable)
                .map_err(|e| (i, e))?;
        }
        Ok(GpuTiming {
            gpu: batch.slot,
            channels: batch.channels,
            start_offset: t0 - started,
            ioctl: t0.elapsed(),
        })
    }
}

impl<D: RmDriver> Drop for Inner<D> {
    fn drop(&mut self) {
        // Freeing the client frees its devices and subdevices. Closing the fd would too.
        let _ = self
            .rm
            .free(self.client, ObjectHandle(0), self.client.into());
    }
}

impl<D: RmDriver> Controller<D> {
    /// Opens control over every GPU through `rm`. With several GPUs it starts one issue worker
    /// per GPU; the issue mode starts serial (see [`Self::probe_issue`]).
    pub fn with_driver(rm: D) -> Result<Self> {
        let client = rm
            .alloc_root_client()
            .map_err(|e| e.into_error("allocating Valve's RM client"))?;
        let mut inner = Inner {
            rm,
            client,
            gpus: Vec::new(),
        };
        // From here on `inner` frees the client on every error path.
        for info in enumerate(&inner.rm, client)? {
            let opened = open_gpu(&inner, info)?;
            inner.gpus.push(opened);
        }
        let inner = Arc::new(inner);
        let workers = if inner.gpus.len() > 1 {
            let shared = inner.clone();
            let handler: Handler<IssueJob, GpuTiming> =
                Arc::new(move |_slot, (batch, disable, started): IssueJob| {
                    shared.issue_gpu(&batch, disable, started)
                });
            let pool = WorkerPool::start(inner.gpus.len(), handler).map_err(|e| Error::Os {
                op: "starting the GPU issue workers".into(),
                source: e,
            })?;
            Some(pool)
        } else {
            None
        };
        Ok(Controller {
            inner,
            workers,
            mode: ModeCell::default(),
            setting: Mutex::new(IssueSetting::default()),
        })
    }

    /// Valve's RM client handle.
    pub fn client(&self) -> ClientHandle {
        self.inner.client
    }

    /// The GPUs, in PCI order (index = position).
    pub fn gpus(&self) -> Vec<GpuInfo> {
        self.inner.gpus.iter().map(|g| g.info.clone()).collect()
    }

    /// The subdevice Valve allocated on GPU `gpu` (for callers that issue raw controls, such as
    /// the hardware test's bare-ioctl baseline).
    pub fn subdevice(&self, gpu: usize) -> Option<SubdeviceHandle> {
        self.inner.gpus.get(gpu).map(|g| g.subdevice)
    }

    /// The driver behind this controller.
    pub fn driver(&self) -> &D {
        &self.inner.rm
    }

    /// How [`Self::disable`] and [`Self::enable`] issue several GPUs now, and why.
    pub fn issue_mode(&self) -> IssueSetting {
        *self.setting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Forces the issue mode (`valvectl gate start --issue serial|parallel`).
    pub fn set_issue_mode(&self, mode: IssueMode) {
        self.apply_setting(IssueSetting {
            mode,
            probe: None,
            forced: true,
        });
    }

    fn apply_setting(&self, s: IssueSetting) {
        self.mode.set(s.mode);
        *self.setting.lock().unwrap_or_else(PoisonError::into_inner) = s;
    }

    /// Measures, on `plan`'s real channels, one GPU alone against all of its GPUs serially and
    /// in parallel (`cycles` interleaved disable/enable rounds of each, p50 wall times), and
    /// switches to the faster mode unless the mode was forced. Needs a plan on 2 or more GPUs.
    /// Each disable is undone before the next one starts.
    pub fn probe_issue(&self, plan: &PreemptPlan, cycles: usize) -> Result<LockProbe> {
        if plan.gpus() < 2 {
            return Err(Error::NoChannels);
        }
        let single = plan.first_gpu();
        let (mut s1, mut ser, mut par) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..cycles.max(1) {
            for (which, out) in [(0, &mut s1), (1, &mut ser), (2, &mut par)] {
                let p = if which == 0 { &single } else { plan };
                let mode = if which == 2 {
                    IssueMode::Parallel
                } else {
                    IssueMode::Serial
                };
                let t0 = Instant::now();
                let g = self.disable_with(p, mode)?;
                out.push(us_since(t0));
                g.enable()?;
            }
        }
        let probe = LockProbe {
            gpus: plan.gpus(),
            single_us: p50(&mut s1),
            serial_us: p50(&mut ser),
            parallel_us: p50(&mut par),
        };
        if !self.issue_mode().forced {
            self.apply_setting(IssueSetting {
                mode: probe.best_mode(),
                probe: Some(probe),
                forced: false,
            });
        }
        Ok(probe)
    }

    /// Groups `targets` per GPU, drops duplicates and prebuilds the controls (64 channels each).
    pub fn plan(&self, targets: &[ChannelTarget], mode: PreemptMode) -> Result<PreemptPlan> {
        if targets.is_empty() {
            return Err(Error::NoChannels);
        }
        let mut sorted = targets.to_vec();
        sorted.sort();
        sorted.dedup();
        let mut batches: Vec<GpuBatch> = Vec::new();
        for t in &sorted {
            if t.gpu >= self.inner.gpus.len() {
                return Err(Error::UnknownGpu {
                    selector: t.gpu.to_string(),
                    count: self.inner.gpus.len(),
                });
            }
            if batches.last().map(|b| b.slot) != Some(t.gpu) {
                batches.push(GpuBatch {
                    slot: t.gpu,
                    channels: 0,
                    chunks: Vec::new(),
                });
            }
            let batch = batches.last_mut().expect("pushed above");
            let needs_chunk = batch
                .chunks
                .last()
                .is_none_or(|c| c.num_channels as usize == FIFO_DISABLE_CHANNELS_MAX_ENTRIES);
            if needs_chunk {
                batch.chunks.push(Nv2080FifoDisableChannelsParams {
                    only_disable_scheduling: u8::from(mode == PreemptMode::ScheduleOnly),
                    ..Default::default()
                });
            }
            let chunk = batch.chunks.last_mut().expect("pushed above");
            let i = chunk.num_channels as usize;
            chunk.client_list[i] = t.client;
            chunk.channel_list[i] = t.channel;
            chunk.num_channels += 1;
            batch.channels += 1;
        }
        Ok(PreemptPlan {
            batches: batches.into_iter().map(Arc::new).collect(),
            mode,
        })
    }

    /// Disables (and, in [`PreemptMode::Preempt`], preempts) the plan's channels on all its GPUs,
    /// in the controller's issue mode. On failure, whatever this call disabled is enabled again
    /// before returning.
    pub fn disable<'a>(&'a self, plan: &'a PreemptPlan) -> Result<DisabledChannels<'a, D>> {
        self.disable_with(plan, self.mode.get())
    }

    /// Like [`Self::disable`], but one GPU after another on this thread, stopping at the first
    /// failure (with the stock driver's global lock the faster of the two).
    pub fn disable_serial<'a>(&'a self, plan: &'a PreemptPlan) -> Result<DisabledChannels<'a, D>> {
        self.disable_with(plan, IssueMode::Serial)
    }

    /// Like [`Self::disable`], but all GPUs at once on the issue workers.
    pub fn disable_parallel<'a>(
        &'a self,
        plan: &'a PreemptPlan,
    ) -> Result<DisabledChannels<'a, D>> {
        self.disable_with(plan, IssueMode::Parallel)
    }

    fn disable_with<'a>(
        &'a self,
        plan: &'a PreemptPlan,
        mode: IssueMode,
    ) -> Result<DisabledChannels<'a, D>> {
        let started = Instant::now();
        let results = self.issue(plan, true, started, mode);
        if let Some(failed) = results.iter().position(|r| r.1.is_err()) {
            return Err(self.roll_back(plan, results, failed));
        }
        let gpus = results.into_iter().filter_map(|(_, r)| r.ok()).collect();
        Ok(DisabledChannels {
            ctl: self,
            plan,
            disable_report: BatchReport {
                gpus,
                wall: started.elapsed(),
                started_at: Some(started),
            },
            enabled: false,
        })
    }

    /// After a failed disable: enables every chunk that went through, on every GPU, and returns
    /// the error of the GPU at `results[failed]`.
    fn roll_back(
        &self,
        plan: &PreemptPlan,
        mut results: Vec<GpuResult<GpuTiming>>,
        failed: usize,
    ) -> Error {
        let (gpu, r) = results.swap_remove(failed);
        let Err((done_chunks, err)) = r else {
            unreachable!("results[failed] is an error")
        };
        let mut rollback_errors = Vec::new();
        for batch in &plan.batches {
            let done = if batch.slot == gpu {
                done_chunks.min(batch.chunks.len())
            } else {
                match results.iter().find(|r| r.0 == batch.slot) {
                    Some((_, Ok(_))) => batch.chunks.len(),
                    Some((_, Err((n, _)))) => (*n).min(batch.chunks.len()),
                    None => 0,
                }
            };
            for chunk in &batch.chunks[..done] {
                if let Err(e) = self.inner.issue_chunk(batch.slot, chunk, false) {
                    rollback_errors.push(format!("GPU {}: {e}", batch.slot));
                }
            }
        }
        let rollback = if rollback_errors.is_empty() {
            "nothing was left disabled".to_string()
        } else {
            format!(
                "re-enabling what had been disabled ALSO failed: {}",
                rollback_errors.join("; ")
            )
        };
        Error::PreemptFailed {
            gpu,
            cause: Box::new(err),
            rollback,
        }
    }

    /// Enables the plan's channels (the `resume` of channels disabled earlier, e.g. by another
    /// `valvectl` run), in the controller's issue mode. Tries every GPU even if one fails;
    /// returns the first failure.
    pub fn enable(&self, plan: &PreemptPlan) -> Result<BatchReport> {
        let started = Instant::now();
        let results = self.issue(plan, false, started, self.mode.get());
        let mut gpus = Vec::with_capacity(results.len());
        let mut first_err = None;
        for (_, r) in results {
            match r {
                Ok(t) => gpus.push(t),
                Err((_, e)) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        match first_err {
            Some(e) => Err(e),
            None => Ok(BatchReport {
                gpus,
                wall: started.elapsed(),
                started_at: Some(started),
            }),
        }
    }

    /// Issues a plan on all its GPUs: inline for one GPU, one GPU after another when serial (a
    /// disable stops at the first failure), otherwise the calling thread takes the first GPU and
    /// the persistent workers the others, all at once.
    fn issue(
        &self,
        plan: &PreemptPlan,
        disable: bool,
        started: Instant,
        mode: IssueMode,
    ) -> Vec<GpuResult<GpuTiming>> {
        let mut results = Vec::with_capacity(plan.batches.len());
        let Some((first, rest)) = plan.batches.split_first() else {
            return results;
        };
        match (&self.workers, mode) {
            (Some(pool), IssueMode::Parallel) if !rest.is_empty() => pool.run(
                || (first.slot, self.inner.issue_gpu(first, disable, started)),
                rest.iter().map(|b| (b.slot, (b.clone(), disable, started))),
                &mut results,
            ),
            _ => {
                for batch in &plan.batches {
                    let r = self.inner.issue_gpu(batch, disable, started);
                    let failed = r.is_err();
                    results.push((batch.slot, r));
                    if failed && disable {
                        break;
                    }
                }
            }
        }
        results
    }
}

fn open_gpu<D: RmDriver>(inner: &Inner<D>, mut info: GpuInfo) -> Result<OpenGpu> {
    let inst = info.device_instance;
    let device = DeviceHandle(OWN_HANDLE_BASE | (inst << 8) | 1);
    let subdevice = SubdeviceHandle(OWN_HANDLE_BASE | (inst << 8) | 2);
    inner.rm.register_device_file(info.minor)?;
    let mut dev_params = Nv0080AllocParams {
        device_id: inst,
        h_client_share: inner.client,
        ..Default::default()
    };
    inner
        .rm
        .alloc(
            inner.client,
            inner.client.into(),
            device.into(),
            &mut dev_params,
        )
        .map_err(|e| e.into_error(format!("opening GPU {} (device {inst})", info.pci_bus_id)))?;
    let mut sub_params = Nv2080AllocParams::default();
    inner
        .rm
        .alloc(
            inner.client,
            device.into(),
            subdevice.into(),
            &mut sub_params,
        )
        .map_err(|e| e.into_error(format!("opening GPU {} subdevice", info.pci_bus_id)))?;
    let mut name = Nv2080GetNameStringParams {
        flags: NV2080_GPU_NAME_STRING_ASCII,
        ..Default::default()
    };
    if inner
        .rm
        .control(inner.client, subdevice.into(), &mut name)
        .is_ok()
    {
        info.name = c_string(&name.name);
    }
    let mut gid = Nv2080GetGidInfoParams {
        flags: NV2080_GID_FORMAT_ASCII,
        ..Default::default()
    };
    if inner
        .rm
        .control(inner.client, subdevice.into(), &mut gid)
        .is_ok()
    {
        let len = (gid.length as usize).min(gid.data.len());
        info.uuid = c_string(&gid.data[..len]);
    }
    Ok(OpenGpu {
        info,
        subdevice,
        diag: std::sync::OnceLock::new(),
    })
}

impl<D: RmDriver> Drop for Controller<D> {
    fn drop(&mut self) {
        // The workers hold the inner state: stop them first; the last reference frees the client.
        self.workers = None;
    }
}

/// Channels this process disabled. Dropping it enables them again (errors are logged); call
/// [`DisabledChannels::enable`] to get the timing and errors, or
/// [`DisabledChannels::keep_disabled`] to deliberately leave them disabled.
#[must_use = "dropping the guard re-enables the channels at once"]
pub struct DisabledChannels<'a, D: RmDriver = NvDriver> {
    ctl: &'a Controller<D>,
    plan: &'a PreemptPlan,
    disable_report: BatchReport,
    enabled: bool,
}

impl<D: RmDriver> DisabledChannels<'_, D> {
    /// Timing of the disable.
    pub fn disable_report(&self) -> &BatchReport {
        &self.disable_report
    }

    /// Enables the channels now.
    pub fn enable(mut self) -> Result<BatchReport> {
        self.enabled = true;
        self.ctl.enable(self.plan)
    }

    /// Leaves the channels disabled (for `valvectl preempt --detach`); `resume` undoes it.
    pub fn keep_disabled(mut self) -> BatchReport {
        self.enabled = true;
        std::mem::replace(
            &mut self.disable_report,
            BatchReport {
                gpus: Vec::new(),
                wall: Duration::ZERO,
                started_at: None,
            },
        )
    }
}

impl<D: RmDriver> Drop for DisabledChannels<'_, D> {
    fn drop(&mut self) {
        if !self.enabled {
            if let Err(e) = self.ctl.enable(self.plan) {
                tracing::error!("re-enabling channels on drop failed: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeRm;
    use valve_ioctl_bindings as b;

    const OTHER: ClientHandle = ClientHandle(0xc1d0_0042);

    fn chans(range: std::ops::Range<u32>) -> Vec<ChannelHandle> {
        range.map(|i| ChannelHandle(0x5c00_0000 + i)).collect()
    }

    fn targets(gpu: usize, channels: &[ChannelHandle]) -> Vec<ChannelTarget> {
        channels
            .iter()
            .map(|&channel| ChannelTarget {
                gpu,
                client: OTHER,
                channel,
            })
            .collect()
    }

    #[test]
    fn enumeration_maps_ids_instances_minors_in_pci_order() {
        let ctl = Controller::with_driver(FakeRm::host(4)).unwrap();
        let gpus = ctl.gpus();
        assert_eq!(gpus.len(), 4);
        // Sorted by PCI address, indices dense.
        assert!(gpus.windows(2).all(|w| w[0].pci_bus_id < w[1].pci_bus_id));
        assert_eq!(
            gpus.iter().map(|g| g.index).collect::<Vec<_>>(),
            vec![0, 1, 2, 3]
        );
        // Each GPU carries the minor and instance of the same fake GPU, never a mix.
        for g in &gpus {
            let fake = ctl
                .driver()
                .gpus
                .iter()
                .find(|f| f.gpu_id == g.gpu_id)
                .unwrap();
            assert_eq!(g.device_instance, fake.instance);
            assert_eq!(g.minor, fake.minor);
            assert_eq!(g.uuid, fake.uuid);
            assert_eq!(g.name, "NVIDIA H100 80GB HBM3");
        }
        assert!(
            gpus.iter().any(|g| g.minor != g.device_instance),
            "fixture must exercise minor != instance"
        );
    }

    #[test]
    fn plans_chunk_by_64_and_drop_duplicates() {
        let ctl = Controller::with_driver(FakeRm::host(2)).unwrap();
        let mut t = targets(0, &chans(0..130));
        t.extend(targets(0, &chans(0..10))); // duplicates
        t.extend(targets(1, &chans(200..203)));
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        assert_eq!(plan.channels(), 133);
        assert_eq!(plan.gpus(), 2);
        assert_eq!(plan.ioctls(), 3 + 1);
        assert!(matches!(
            ctl.plan(&[], PreemptMode::Preempt),
            Err(Error::NoChannels)
        ));
        let err = ctl.plan(&targets(5, &chans(0..1)), PreemptMode::Preempt);
        assert!(matches!(err, Err(Error::UnknownGpu { count: 2, .. })));
    }

    #[test]
    fn disable_many_gpus_then_guard_drop_reenables() {
        let rm = FakeRm::host(3);
        // Channels live on the GPU whose *instance* matches; targets name Valve indices.
        let ctl = Controller::with_driver(rm).unwrap();
        let gpus = ctl.gpus();
        let mut t = Vec::new();
        for g in &gpus {
            let c = chans(g.index as u32 * 100..g.index as u32 * 100 + 70);
            ctl.driver().add_channels(OTHER, g.device_instance, &c);
            t.extend(targets(g.index, &c));
        }
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        {
            let guard = ctl.disable(&plan).unwrap();
            assert_eq!(ctl.driver().disabled().len(), 210);
            let rep = guard.disable_report();
            assert_eq!(rep.gpus.len(), 3);
            assert!(rep.gpus.iter().all(|g| g.channels == 70));
        }
        assert!(ctl.driver().disabled().is_empty(), "drop must re-enable");
        // 2 chunks per GPU, once to disable and once to enable.
        assert_eq!(ctl.driver().state.lock().unwrap().disable_calls.len(), 12);
    }

    #[test]
    fn schedule_only_mode_sets_the_flag() {
        let ctl = Controller::with_driver(FakeRm::host(1)).unwrap();
        let c = chans(0..2);
        ctl.driver().add_channels(OTHER, 0, &c);
        let plan = ctl
            .plan(&targets(0, &c), PreemptMode::ScheduleOnly)
            .unwrap();
        assert_eq!(plan.batches[0].chunks[0].only_disable_scheduling, 1);
        assert_eq!(plan.batches[0].chunks[0].p_runlist_preempt_event, 0);
        let g = ctl.disable(&plan).unwrap();
        assert_eq!(ctl.driver().disabled().len(), 2);
        g.enable().unwrap();
        assert!(ctl.driver().disabled().is_empty());
    }

    #[test]
    fn failure_on_one_gpu_rolls_back_the_others() {
        let ctl = Controller::with_driver(FakeRm::host(3)).unwrap();
        let gpus = ctl.gpus();
        let mut t = Vec::new();
        for g in &gpus {
            let c = chans(g.index as u32 * 100..g.index as u32 * 100 + 5);
            ctl.driver().add_channels(OTHER, g.device_instance, &c);
            t.extend(targets(g.index, &c));
        }
        let failing = gpus[1].device_instance;
        ctl.driver().state.lock().unwrap().fail_disable_on =
            Some((failing, b::NV_ERR_INSUFFICIENT_PERMISSIONS));
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        let err = ctl.disable(&plan).err().expect("must fail");
        assert_eq!(err.rm_status(), Some(b::NV_ERR_INSUFFICIENT_PERMISSIONS));
        let text = err.to_string();
        assert!(
            text.contains("GPU 1") && text.contains("nothing was left disabled"),
            "{text}"
        );
        assert!(ctl.driver().disabled().is_empty());
        // The serial path rolls back too.
        assert!(ctl.disable_serial(&plan).is_err());
        assert!(ctl.driver().disabled().is_empty());
    }

    #[test]
    fn wrong_handles_get_named_rm_errors_and_change_nothing() {
        let ctl = Controller::with_driver(FakeRm::host(1)).unwrap();
        let c = chans(0..3);
        ctl.driver().add_channels(OTHER, 0, &c);
        let mut t = targets(0, &c);
        t.push(ChannelTarget {
            gpu: 0,
            client: OTHER,
            channel: ChannelHandle(0xdead),
        });
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        let err = ctl.disable(&plan).err().unwrap();
        assert_eq!(err.rm_status(), Some(b::NV_ERR_INVALID_CHANNEL));
        assert!(err.to_string().contains("NV_ERR_INVALID_CHANNEL"));
        assert!(ctl.driver().disabled().is_empty());

        let bad_client = [ChannelTarget {
            gpu: 0,
            client: ClientHandle(0x1234),
            channel: c[0],
        }];
        let plan = ctl.plan(&bad_client, PreemptMode::Preempt).unwrap();
        let err = ctl.disable(&plan).err().unwrap();
        assert_eq!(err.rm_status(), Some(b::NV_ERR_INVALID_CLIENT));
    }

    #[test]
    fn keep_disabled_then_separate_enable() {
        let ctl = Controller::with_driver(FakeRm::host(1)).unwrap();
        let c = chans(0..4);
        ctl.driver().add_channels(OTHER, 0, &c);
        let plan = ctl.plan(&targets(0, &c), PreemptMode::Preempt).unwrap();
        let report = ctl.disable(&plan).unwrap().keep_disabled();
        assert_eq!(report.gpus.len(), 1);
        assert_eq!(ctl.driver().disabled().len(), 4);
        ctl.enable(&plan).unwrap();
        assert!(ctl.driver().disabled().is_empty());
    }

    #[test]
    fn guard_reenables_on_panic() {
        let ctl = Controller::with_driver(FakeRm::host(1)).unwrap();
        let c = chans(0..2);
        ctl.driver().add_channels(OTHER, 0, &c);
        let plan = ctl.plan(&targets(0, &c), PreemptMode::Preempt).unwrap();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _g = ctl.disable(&plan).unwrap();
            assert_eq!(ctl.driver().disabled().len(), 2);
            panic!("boom");
        }));
        assert!(r.is_err());
        assert!(ctl.driver().disabled().is_empty());
    }

    /// A controller with `n` GPUs and 70 channels of OTHER on each; returns it and all targets.
    fn host_with_channels(n: u32) -> (Controller<FakeRm>, Vec<ChannelTarget>) {
        let ctl = Controller::with_driver(FakeRm::host(n)).unwrap();
        let mut t = Vec::new();
        for g in ctl.gpus() {
            let c = chans(g.index as u32 * 100..g.index as u32 * 100 + 70);
            ctl.driver().add_channels(OTHER, g.device_instance, &c);
            t.extend(targets(g.index, &c));
        }
        (ctl, t)
    }

    #[test]
    fn parallel_issue_runs_on_the_same_persistent_workers_every_time() {
        let (ctl, t) = host_with_channels(4);
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        assert_eq!(
            ctl.issue_mode().describe(),
            "serial (default, not measured)"
        );
        ctl.set_issue_mode(IssueMode::Parallel);
        for _ in 0..20 {
            let g = ctl.disable(&plan).unwrap();
            assert_eq!(ctl.driver().disabled().len(), 280);
            assert_eq!(g.disable_report().gpus.len(), 4);
            g.enable().unwrap();
            assert!(ctl.driver().disabled().is_empty());
        }
        let st = ctl.driver().state.lock().unwrap();
        let me = std::thread::current().name().map(str::to_string);
        // GPU 0 on the calling thread; GPUs 1-3 always on the worker of their slot, so no
        // thread is started per preemption.
        for (i, (inst, _, _)) in st.disable_calls.iter().enumerate() {
            let gpu = ctl
                .gpus()
                .iter()
                .position(|g| g.device_instance == *inst)
                .unwrap();
            let want = if gpu == 0 {
                me.clone()
            } else {
                Some(format!("valve-issue-{gpu}"))
            };
            assert_eq!(st.disable_threads[i], want, "call {i} on GPU {gpu}");
        }
        assert_eq!(
            st.disable_calls.len(),
            20 * 4 * 2 * 2,
            "2 chunks per GPU, disable + enable"
        );
    }

    #[test]
    fn serial_issue_stays_on_the_calling_thread() {
        let (ctl, t) = host_with_channels(3);
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        ctl.set_issue_mode(IssueMode::Serial);
        ctl.disable(&plan).unwrap().enable().unwrap();
        let st = ctl.driver().state.lock().unwrap();
        let me = std::thread::current().name().map(str::to_string);
        assert!(st.disable_threads.iter().all(|n| *n == me));
    }

    #[test]
    fn a_parallel_failure_rolls_back_every_gpu() {
        let (ctl, t) = host_with_channels(4);
        let failing = ctl.gpus()[2].device_instance;
        ctl.driver().state.lock().unwrap().fail_disable_on =
            Some((failing, b::NV_ERR_INVALID_CHANNEL));
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        let err = ctl.disable_parallel(&plan).err().expect("must fail");
        assert!(err.to_string().contains("GPU 2"), "{err}");
        assert!(ctl.driver().disabled().is_empty(), "rolled back");
        ctl.driver().state.lock().unwrap().fail_disable_on = None;
        // The workers survive a failure.
        let g = ctl.disable_parallel(&plan).unwrap();
        assert_eq!(ctl.driver().disabled().len(), 280);
        drop(g);
        assert!(ctl.driver().disabled().is_empty(), "drop re-enables");
    }

    #[test]
    fn the_probe_chooses_a_mode_unless_one_was_forced() {
        let (ctl, t) = host_with_channels(2);
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        let probe = ctl.probe_issue(&plan, 3).unwrap();
        assert_eq!(probe.gpus, 2);
        assert!(probe.single_us > 0.0 && probe.serial_us > 0.0 && probe.parallel_us > 0.0);
        let s = ctl.issue_mode();
        assert!(!s.forced);
        assert_eq!(s.probe, Some(probe));
        assert_eq!(s.mode, probe.best_mode());
        assert!(
            ctl.driver().disabled().is_empty(),
            "every probe disable was undone"
        );
        // Forced stays forced.
        ctl.set_issue_mode(IssueMode::Parallel);
        ctl.probe_issue(&plan, 1).unwrap();
        assert_eq!(ctl.issue_mode().mode, IssueMode::Parallel);
        assert!(ctl.issue_mode().forced);
        // One GPU has nothing to compare.
        let one = ctl.plan(&t[..1], PreemptMode::Preempt).unwrap();
        assert!(ctl.probe_issue(&one, 1).is_err());
    }

    #[test]
    fn dropping_the_controller_frees_its_client() {
        let rm = std::sync::Arc::new(FakeRm::host(2));
        let ctl = Controller::with_driver(rm.clone()).unwrap();
        let client = ctl.client();
        assert!(rm.state.lock().unwrap().clients.contains(&client));
        drop(ctl);
        assert!(!rm.state.lock().unwrap().clients.contains(&client));
    }
}
