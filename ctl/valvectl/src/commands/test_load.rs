//! `valvectl test-load` (hidden): the CUDA test load `valvectl doctor` starts and preempts, so
//! the doctor needs no CUDA program of its own on the node.

use clap::Args;

use crate::doctor;
use crate::error::CliError;

/// `valvectl test-load` takes no arguments.
#[derive(Debug, Args)]
pub struct TestLoadArgs {}

/// Runs the test load until stdin closes; a failure exits with the load's code.
pub fn exec(_args: &TestLoadArgs) -> Result<(), CliError> {
    match doctor::test_load() {
        0 => Ok(()),
        code => Err(CliError::Daemon(code, "the CUDA test load failed".into())),
    }
}
