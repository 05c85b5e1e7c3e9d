//! Valve's control library: opens the NVIDIA driver, enumerates GPUs and disables/enables other
//! processes' GPU channels on many GPUs at once, timing each step.
//!
//! The path from a call to the GPU: [`Controller`] owns an RM root client and one device +
//! subdevice per GPU; [`Controller::plan`] turns (GPU, client, channel) targets into prebuilt
//! FIFO_DISABLE_CHANNELS parameter blocks (64 channels each); [`Controller::disable`] issues them,
//! serially or on persistent per-GPU workers ([`issue`]), and returns a [`DisabledChannels`] guard whose `Drop` re-enables them.
//! The ioctls sit behind the [`RmDriver`] trait: [`NvDriver`] is the real device files.
//!
//! Besides that: the state file of what was disabled ([`state`]), latency summaries ([`stats`])
//! and the signalfd that ends a hold ([`signals`]). No CLI, socket or BPF code lives here: the
//! daemon is `valve-daemon`, the command line `valvectl`. With the `fake` feature, `fake` is an
//! in-memory RM for other crates' tests and `valvectl demo`.

pub mod channel_state;
pub mod controller;
pub mod driver;
pub mod error;
pub mod gpu;
pub mod issue;
pub mod signals;
pub mod state;
pub mod stats;

#[cfg(any(test, feature = "fake"))]
pub mod fake;

pub use controller::{
    BatchReport, ChannelTarget, Controller, DisabledChannels, GpuTiming, PreemptMode, PreemptPlan,
};
pub use driver::{DriverInfo, NvDriver, RmCallError, RmDriver};
pub use error::Error;
pub use gpu::{GpuInfo, GpuSelector};
pub use issue::{IssueMode, IssueSetting, LockProbe};
pub use signals::Signals;
pub use valve_ioctl_bindings as bindings;
