//! Memory left to offline per GPU, sampled for the harvest profile: with the memory pool, its
//! free, still-creatable and offline-held handles (and the bytes it reclaimed from offline);
//! without it, NVML's free memory plus offline's.
//!
//! The pool's numbers come from the snapshot its thread publishes about once a second
//! ([`UsageSnapshot`]), so sampling never waits for a reclaim. A GPU whose memory cannot be read
//! (no pool on it, no NVML) gets no sample, and the document then reports all of its memory.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use nvml_wrapper::enums::device::UsedGpuMemory;
use valve_harvest::Recorder;

use super::ProcessView;
use crate::memory::ledger::UsageSnapshot;

/// One GPU's device memory now, as NVML reports it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceUsage {
    /// Free bytes.
    pub free_bytes: u64,
    /// Compute processes and the bytes each uses (`None`: NVML does not say).
    pub processes: Vec<(u32, Option<u64>)>,
}

/// Device memory by GPU PCI address (NVML on a GPU host; tests use a fake).
pub trait DeviceMemory: Send {
    /// The GPU's memory in all.
    fn total_bytes(&self, pci_bus_id: &str) -> Option<u64>;
    /// Its free memory now, and with `processes` its compute processes (NVML asks RM for every
    /// process's memory for that, on RM's locks, so it is asked only when it matters).
    fn usage(&self, pci_bus_id: &str, processes: bool) -> Option<DeviceUsage>;
}

/// [`DeviceMemory`] through NVML.
pub struct NvmlMemory(nvml_wrapper::Nvml);

impl NvmlMemory {
    /// NVML, if its library loads and initialises.
    pub fn open() -> Result<NvmlMemory, String> {
        nvml_wrapper::Nvml::init()
            .map(NvmlMemory)
            .map_err(|e| e.to_string())
    }
}

impl DeviceMemory for NvmlMemory {
    fn total_bytes(&self, pci_bus_id: &str) -> Option<u64> {
        let dev = self.0.device_by_pci_bus_id(pci_bus_id).ok()?;
        dev.memory_info().ok().map(|m| m.total)
    }

    fn usage(&self, pci_bus_id: &str, processes: bool) -> Option<DeviceUsage> {
        let dev = self.0.device_by_pci_bus_id(pci_bus_id).ok()?;
        let free_bytes = dev.memory_info().ok()?.free;
        if !processes {
            return Some(DeviceUsage {
                free_bytes,
                processes: Vec::new(),
            });
        }
        let processes = dev
            .running_compute_processes()
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let used = match p.used_gpu_memory {
                    UsedGpuMemory::Used(b) => Some(b),
                    UsedGpuMemory::Unavailable => None,
                };
                (p.pid, used)
            })
            .collect();
        Some(DeviceUsage {
            free_bytes,
            processes,
        })
    }
}

/// A GPU as the sampler reads it.
struct SampledGpu {
    /// The recorder's position.
    position: usize,
    /// Valve's index (the pool's GPU number).
    index: usize,
    pci_bus_id: String,
}

/// Samples memory left to offline into a [`Recorder`].
pub struct MemorySampler {
    gpus: Vec<SampledGpu>,
    pool: Option<Arc<UsageSnapshot>>,
    devices: Option<Box<dyn DeviceMemory>>,
    offline_label: Option<String>,
    /// Whether a process has the offline label (looked up once per process).
    labelled: BTreeMap<u32, bool>,
    /// The pool's count of handles reclaimed from offline, per pool GPU, at the last sample.
    reclaimed_seen: BTreeMap<usize, u64>,
    /// Pool GPUs whose last sample saw a reclaim: the next one that does continues the same
    /// episode (one online burst often takes memory in several grows).
    reclaiming: BTreeSet<usize>,
}

impl MemorySampler {
    /// A sampler of `gpus` (the recorder's positions are their order), reading the pool's
    /// numbers where it covers a GPU, and counting processes labelled `offline_label` as
    /// offline while no gate runs.
    pub fn new(
        gpus: &[valve::gpu::GpuInfo],
        pool: Option<Arc<UsageSnapshot>>,
        offline_label: Option<String>,
    ) -> MemorySampler {
        MemorySampler {
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(position, g)| SampledGpu {
                    position,
                    index: g.index,
                    pci_bus_id: g.pci_bus_id.clone(),
                })
                .collect(),
            pool,
            devices: None,
            offline_label,
            labelled: BTreeMap::new(),
            reclaimed_seen: BTreeMap::new(),
            reclaiming: BTreeSet::new(),
        }
    }

    /// Reads device memory from `devices` (NVML), where the pool does not cover a GPU.
    pub fn with_devices(mut self, devices: Option<Box<dyn DeviceMemory>>) -> MemorySampler {
        self.devices = devices;
        self
    }

    /// One sample per GPU at `now_ns`, where its memory can be read.
    pub fn sample(&mut self, rec: &mut Recorder, now_ns: u64, view: &ProcessView) {
        let pooled = self.pool.as_ref().map(|p| p.latest()).unwrap_or_default();
        let mut seen = Vec::new();
        for i in 0..self.gpus.len() {
            let (position, index) = (self.gpus[i].position, self.gpus[i].index);
            let bytes = match pooled.iter().find(|u| u.gpu == index) {
                Some(u) => {
                    // The first sample only sets the baseline; a smaller count is a new pool.
                    let last = self.reclaimed_seen.insert(index, u.reclaimed_total);
                    let new = last.map_or(0, |l| {
                        u.reclaimed_total
                            .checked_sub(l)
                            .unwrap_or(u.reclaimed_total)
                    });
                    rec.reclaimed
                        .add(position, now_ns, new * u.handle_bytes as u64);
                    let episode_goes_on = self.reclaiming.contains(&index);
                    if new > 0 && !episode_goes_on {
                        rec.reclaim_episodes.add(position, now_ns, 1);
                        self.reclaiming.insert(index);
                    } else if new == 0 && episode_goes_on {
                        self.reclaiming.remove(&index);
                    }
                    Some(u.offline_available_bytes())
                }
                None => self.device_bytes(i, view, &mut seen),
            };
            if let Some(b) = bytes {
                rec.memory.sample(position, now_ns, b);
            }
        }
        if self.devices.is_some() {
            self.labelled.retain(|pid, _| seen.contains(pid));
        }
    }

    /// NVML's free memory on GPU `i` plus what offline processes use there; `seen` collects the
    /// pids NVML lists. The process list is asked for only if some process may be offline.
    fn device_bytes(&mut self, i: usize, view: &ProcessView, seen: &mut Vec<u32>) -> Option<u64> {
        let list = self.may_have_offline(view);
        let usage = self
            .devices
            .as_ref()?
            .usage(&self.gpus[i].pci_bus_id, list)?;
        let mut bytes = usage.free_bytes;
        for (pid, used) in usage.processes {
            seen.push(pid);
            if self.is_offline(pid, view) {
                bytes = bytes.saturating_add(used.unwrap_or(0));
            }
        }
        Some(bytes)
    }

    /// Whether any process can count as offline now: the running gate freezes some, or, with no
    /// gate, an offline label is configured.
    fn may_have_offline(&self, view: &ProcessView) -> bool {
        match view.gate_running {
            true => !view.offline.is_empty(),
            false => self.offline_label.is_some(),
        }
    }

    /// Offline: frozen by the running gate, or, with no gate, labelled as the gate's offline.
    fn is_offline(&mut self, pid: u32, view: &ProcessView) -> bool {
        if view.gate_running {
            return view.offline.contains(&pid);
        }
        let Some(label) = &self.offline_label else {
            return false;
        };
        *self
            .labelled
            .entry(pid)
            .or_insert_with(|| crate::workload::label_of(pid).as_deref() == Some(label.as_str()))
    }
}
