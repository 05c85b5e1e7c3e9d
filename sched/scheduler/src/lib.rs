//! Valve's cluster scheduler (paper section 6): predicts an offline job's throughput on GPUs that
//! online inference leaves idle, places jobs where the prediction meets their SLA, and evicts
//! jobs that keep missing it.
//!
//! - [`job`]: job profiles (T_alone and T(m)) and SLAs.
//! - [`predict`]: the throughput model over a node's harvest document.
//! - [`calibrate`]: each node's speed factor, learned from its running jobs.
//! - [`profiling`]: a job's profile from runs at several memory caps.
//! - [`place`]: the placement pass.
//! - [`monitor`]: the SLA monitor and its evictions.
//! - [`meta`]: what the scheduler stores with each job in the engine.
//! - [`cycle`]: one engine-independent pass: snapshot + documents -> placements, evictions.
//! - [`driver`]: the loop against a real engine: plan, apply, back off, keep state.
//! - [`agents`] / [`replay`]: fetching nodes' harvest documents / serving a recorded one.
//! - [`slurm`]: the Slurm adapter (its CLIs' JSON output, placement by update + release,
//!   eviction by requeue-hold).
//!
//! The cluster simulator, which drives [`cycle::plan`] too, is the `valve-sim` crate.

pub mod agents;
pub mod bench;
pub mod calibrate;
pub mod cycle;
pub mod driver;
pub mod job;
pub mod meta;
pub mod monitor;
pub mod place;
pub mod predict;
pub mod profiling;
pub mod replay;
pub mod slurm;

#[cfg(test)]
mod testutil;
