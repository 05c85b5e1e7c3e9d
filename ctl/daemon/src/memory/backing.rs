//! Real GPU memory for the pool: CUDA VMM handles created in the daemon without a CUDA context,
//! exported once, and NVML's view of how much device memory is still free.
//!
//! The daemon holds every handle here for as long as it runs; clients get duplicates of the
//! exported descriptors. Dropping a [`CudaBacking`] releases the daemon's references.

use std::os::fd::OwnedFd;

use valve_vmm::{Gpu, PhysicalHandle};

use super::ledger::Backing;

/// One GPU's pool memory, found by PCI address.
pub struct CudaBacking {
    gpu: Gpu,
    pci_bus_id: String,
    handle_bytes: usize,
    handles: Vec<PhysicalHandle>,
    nvml: Option<nvml_wrapper::Nvml>,
}

impl CudaBacking {
    /// Opens the GPU at `pci_bus_id` for handles of `handle_bytes` (a multiple of 2 MiB).
    pub fn open(pci_bus_id: &str, handle_bytes: usize) -> Result<CudaBacking, String> {
        let gpu = Gpu::open_pci(pci_bus_id).map_err(|e| e.to_string())?;
        let g = gpu.granularity().map_err(|e| e.to_string())?;
        if handle_bytes == 0 || handle_bytes % g != 0 {
            return Err(format!(
                "--pool-handle-mib must be a positive multiple of {} MiB on this GPU",
                g >> 20
            ));
        }
        let nvml = nvml_wrapper::Nvml::init().ok();
        Ok(CudaBacking {
            gpu,
            pci_bus_id: pci_bus_id.to_string(),
            handle_bytes,
            handles: Vec::new(),
            nvml,
        })
    }

    /// Device memory used now, as NVML reports it (for leak checks).
    pub fn used_bytes(&self) -> Option<u64> {
        let nvml = self.nvml.as_ref()?;
        let dev = nvml.device_by_pci_bus_id(self.pci_bus_id.as_str()).ok()?;
        dev.memory_info().ok().map(|m| m.used)
    }
}

impl Backing for CudaBacking {
    fn handle_bytes(&self) -> usize {
        self.handle_bytes
    }

    fn create(&mut self) -> Result<OwnedFd, String> {
        let h = PhysicalHandle::create(&self.gpu, self.handle_bytes).map_err(|e| e.to_string())?;
        let fd = h.export().map_err(|e| e.to_string())?;
        self.handles.push(h);
        Ok(fd)
    }

    fn total_bytes(&self) -> Option<u64> {
        let nvml = self.nvml.as_ref()?;
        let dev = nvml.device_by_pci_bus_id(self.pci_bus_id.as_str()).ok()?;
        dev.memory_info().ok().map(|m| m.total)
    }

    fn pci_bus_id(&self) -> Option<String> {
        Some(self.pci_bus_id.clone())
    }

    fn free_bytes(&self) -> Option<u64> {
        let nvml = self.nvml.as_ref()?;
        let dev = nvml.device_by_pci_bus_id(self.pci_bus_id.as_str()).ok()?;
        dev.memory_info().ok().map(|m| m.free)
    }
}
