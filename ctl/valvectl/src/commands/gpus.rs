//! `valvectl gpus`: the GPUs as Valve sees them (index, name, PCI address, device-file minor, RM
//! device instance, UUID), after the driver's version.

use std::io::Write;

use clap::Args;
use valve::controller::Controller;
use valve::driver::{DriverInfo, RmDriver};

use crate::args::Globals;
use crate::error::CliError;
use crate::print;

/// `valvectl gpus` takes no arguments.
#[derive(Debug, Args)]
pub struct GpusArgs {}

/// Lists the controller's GPUs.
pub fn exec<D: RmDriver>(
    _args: &GpusArgs,
    ctl: &Controller<D>,
    g: Globals,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let gpus = ctl.gpus();
    if g.json {
        let driver = DriverInfo::read().ok();
        #[derive(serde::Serialize)]
        struct Report<'a> {
            driver: Option<DriverInfo>,
            gpus: &'a [valve::gpu::GpuInfo],
        }
        let report = Report {
            driver,
            gpus: &gpus,
        };
        writeln!(out, "{}", print::json(&report))?;
    } else {
        print::gpus(out, DriverInfo::read().ok().as_ref(), &gpus)?;
    }
    Ok(())
}
