//! The daemon's protocol: the control socket's types from `valve-protocol` (one JSON request
//! line per connection, one reply line), as the daemon's modules and its users name them.

pub use valve_protocol::control::*;
pub use valve_protocol::gate::{GateReply, TraceReply};
pub use valve_protocol::PROTOCOL_VERSION;

use valve::controller::BatchReport;
use valve::gpu::GpuInfo;

/// A disable's or enable's report as the protocol carries it (us).
pub fn batch_timing(r: &BatchReport) -> BatchTiming {
    BatchTiming {
        gpus: r
            .gpus
            .iter()
            .map(|g| GpuBatchTiming {
                gpu: g.gpu,
                channels: g.channels,
                start_offset: g.start_offset.as_secs_f64() * 1e6,
                ioctl: g.ioctl.as_secs_f64() * 1e6,
            })
            .collect(),
        wall: r.wall.as_secs_f64() * 1e6,
    }
}

/// A GPU as the protocol carries it.
pub fn gpu_entry(g: &GpuInfo) -> GpuEntry {
    GpuEntry {
        index: g.index,
        gpu_id: g.gpu_id,
        device_instance: g.device_instance,
        minor: g.minor,
        pci_bus_id: g.pci_bus_id.clone(),
        pci_device_id: g.pci_device_id,
        uuid: g.uuid.clone(),
        name: g.name.clone(),
    }
}
