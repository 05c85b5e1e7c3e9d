//! Valve's control library: opens the NVIDIA driver, enumerates GPUs and disables/enables other
//! processes' GPU channels on many GPUs at once, timing each step.
//!
//! The path from a call to the GPU: [`Controller`] owns an RM root client and one device +
//! subdevice per GPU; [`Controller::plan`] turns (GPU, client, channel) targets into prebuilt
//! FIFO_DISABLE_CHANNELS parameter blocks (64 channels each); [`Controller::disable`] issues them,
//! one thread per GPU, and returns a [`DisabledChannels`] guard whose `Drop` re-enables them.
//! The ioctls sit behind the [`RmDriver`] trait: [`NvDriver`] is the real device files.

pub mod cli;
pub mod controller;
pub mod daemon;
pub mod doctor;
pub mod driver;
pub mod error;
pub mod gate;
pub mod gpu;
pub mod ipc;
pub mod journal;
pub mod state;
pub mod stats;

#[cfg(test)]
pub(crate) mod fake;

pub use controller::{
    BatchReport, ChannelTarget, Controller, DisabledChannels, GpuTiming, PreemptMode, PreemptPlan,
};
pub use driver::{DriverInfo, NvDriver, RmCallError, RmDriver};
pub use error::Error;
pub use gpu::{GpuInfo, GpuSelector};
pub use valve_ioctl_bindings as bindings;
