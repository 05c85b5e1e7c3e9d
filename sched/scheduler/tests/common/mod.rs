//! Helpers shared by the scheduler's integration tests (`mod common;` in each test file).
pub mod slurm;
