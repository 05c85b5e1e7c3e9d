//! The controller: Valve's own RM client with a device + subdevice per GPU, preemption plans, and
//! the [`DisabledChannels`] guard that re-enables on drop. Issues one thread per GPU, started together.

use std::sync::Barrier;
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

/// Handles of the objects Valve allocates under its own client: `BASE | instance << 8 | kind`.
const OWN_HANDLE_BASE: u32 = 0xcaf0_0000;

/// One GPU opened for control.
struct OpenGpu {
    info: GpuInfo,
    subdevice: SubdeviceHandle,
}

/// Valve's handle on the driver: an RM root client plus a device and subdevice on every GPU.
/// Dropping it frees the client (RM frees everything under it).
pub struct Controller<D: RmDriver = NvDriver> {
    rm: D,
    client: ClientHandle,
    gpus: Vec<OpenGpu>,
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
    batches: Vec<GpuBatch>,
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

impl<D: RmDriver> Controller<D> {
    /// Opens control over every GPU through `rm`.
    pub fn with_driver(rm: D) -> Result<Self> {
        let client = rm
            .alloc_root_client()
            .map_err(|e| e.into_error("allocating Valve's RM client"))?;
        let mut ctl = Controller {
            rm,
            client,
            gpus: Vec::new(),
        };
        // From here on `ctl` frees the client on every error path.
        for info in enumerate(&ctl.rm, client)? {
            let opened = ctl.open_gpu(info)?;
            ctl.gpus.push(opened);
        }
        Ok(ctl)
    }

    fn open_gpu(&self, mut info: GpuInfo) -> Result<OpenGpu> {
        let inst = info.device_instance;
        let device = DeviceHandle(OWN_HANDLE_BASE | (inst << 8) | 1);
        let subdevice = SubdeviceHandle(OWN_HANDLE_BASE | (inst << 8) | 2);
        self.rm.register_device_file(info.minor)?;
        let mut dev_params = Nv0080AllocParams {
            device_id: inst,
            h_client_share: self.client,
            ..Default::default()
        };
        self.rm
            .alloc(
                self.client,
                self.client.into(),
                device.into(),
                &mut dev_params,
            )
            .map_err(|e| {
                e.into_error(format!("opening GPU {} (device {inst})", info.pci_bus_id))
            })?;
        let mut sub_params = Nv2080AllocParams::default();
        self.rm
            .alloc(
                self.client,
                device.into(),
                subdevice.into(),
                &mut sub_params,
            )
            .map_err(|e| e.into_error(format!("opening GPU {} subdevice", info.pci_bus_id)))?;
        let mut name = Nv2080GetNameStringParams {
            flags: NV2080_GPU_NAME_STRING_ASCII,
            ..Default::default()
        };
        if self
            .rm
            .control(self.client, subdevice.into(), &mut name)
            .is_ok()
        {
            info.name = c_string(&name.name);
        }
        let mut gid = Nv2080GetGidInfoParams {
            flags: NV2080_GID_FORMAT_ASCII,
            ..Default::default()
        };
        if self
            .rm
            .control(self.client, subdevice.into(), &mut gid)
            .is_ok()
        {
            let len = (gid.length as usize).min(gid.data.len());
            info.uuid = c_string(&gid.data[..len]);
        }
        Ok(OpenGpu { info, subdevice })
    }

    /// Valve's RM client handle.
    pub fn client(&self) -> ClientHandle {
        self.client
    }

    /// The GPUs, in PCI order (index = position).
    pub fn gpus(&self) -> Vec<GpuInfo> {
        self.gpus.iter().map(|g| g.info.clone()).collect()
    }

    /// The subdevice Valve allocated on GPU `gpu` (for callers that issue raw controls, such as
    /// the hardware test's bare-ioctl baseline).
    pub fn subdevice(&self, gpu: usize) -> Option<SubdeviceHandle> {
        self.gpus.get(gpu).map(|g| g.subdevice)
    }

    /// The driver behind this controller.
    pub fn driver(&self) -> &D {
        &self.rm
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
            if t.gpu >= self.gpus.len() {
                return Err(Error::UnknownGpu {
                    selector: t.gpu.to_string(),
                    count: self.gpus.len(),
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
        Ok(PreemptPlan { batches, mode })
    }

    /// Disables (and, in [`PreemptMode::Preempt`], preempts) the plan's channels on all its GPUs
    /// at once. On failure, whatever this call disabled is enabled again before returning.
    pub fn disable<'a>(&'a self, plan: &'a PreemptPlan) -> Result<DisabledChannels<'a, D>> {
        self.disable_with(plan, false)
    }

    /// Like [`Self::disable`], but one GPU after another on this thread, stopping at the first
    /// failure (for comparison with the parallel path; with the stock driver's global lock it
    /// is the faster of the two).
    pub fn disable_serial<'a>(&'a self, plan: &'a PreemptPlan) -> Result<DisabledChannels<'a, D>> {
        self.disable_with(plan, true)
    }

    fn disable_with<'a>(
        &'a self,
        plan: &'a PreemptPlan,
        serial: bool,
    ) -> Result<DisabledChannels<'a, D>> {
        let started = Instant::now();
        let results = self.issue(plan, true, started, serial);
        let (ok, failed): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.1.is_ok());
        if let Some((gpu, Err((done_chunks, err)))) = failed.into_iter().next() {
            // Roll back: enable every chunk that went through, on every GPU.
            let mut rollback_errors = Vec::new();
            for batch in &plan.batches {
                let done = if batch.slot == gpu {
                    done_chunks
                } else if ok.iter().any(|r| r.0 == batch.slot) {
                    batch.chunks.len()
                } else {
                    0
                };
                for chunk in &batch.chunks[..done] {
                    if let Err(e) = self.issue_chunk(batch.slot, chunk, false) {
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
            return Err(Error::PreemptFailed {
                gpu,
                cause: Box::new(err),
                rollback,
            });
        }
        let gpus = ok
            .into_iter()
            .map(|(_, r)| r.expect("partitioned ok"))
            .collect();
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

    /// Enables the plan's channels (the `resume` of channels disabled earlier, e.g. by another
    /// `valvectl` run). Tries every GPU even if one fails; returns the first failure.
    pub fn enable(&self, plan: &PreemptPlan) -> Result<BatchReport> {
        let started = Instant::now();
        let results = self.issue(plan, false, started, false);
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
    ) -> Result<GpuTiming, (usize, Error)> {
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

    /// Issues a plan on all its GPUs: inline for one GPU, or with `serial` one GPU after
    /// another (a disable stops at the first failure); otherwise the calling thread takes the
    /// first GPU and one spawned thread each of the others, all released together by a barrier.
    #[allow(clippy::type_complexity)]
    fn issue(
        &self,
        plan: &PreemptPlan,
        disable: bool,
        started: Instant,
        serial: bool,
    ) -> Vec<(usize, Result<GpuTiming, (usize, Error)>)> {
        let Some((first, rest)) = plan.batches.split_first() else {
            return Vec::new();
        };
        if rest.is_empty() || serial {
            let mut results = Vec::with_capacity(plan.batches.len());
            for batch in &plan.batches {
                let r = self.issue_gpu(batch, disable, started);
                let failed = r.is_err();
                results.push((batch.slot, r));
                if failed && disable {
                    break;
                }
            }
            return results;
        }
        let barrier = Barrier::new(plan.batches.len());
        std::thread::scope(|s| {
            let handles: Vec<_> = rest
                .iter()
                .map(|batch| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        barrier.wait();
                        (batch.slot, self.issue_gpu(batch, disable, started))
                    })
                })
                .collect();
            barrier.wait();
            let mut results = Vec::with_capacity(plan.batches.len());
            results.push((first.slot, self.issue_gpu(first, disable, started)));
            results.extend(
                handles
                    .into_iter()
                    .map(|h| h.join().expect("GPU issue thread panicked")),
            );
            results
        })
    }
}

impl<D: RmDriver> Drop for Controller<D> {
    fn drop(&mut self) {
        // Freeing the client frees its devices and subdevices. Closing the fd would too.
        let _ = self
            .rm
            .free(self.client, ObjectHandle(0), self.client.into());
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
