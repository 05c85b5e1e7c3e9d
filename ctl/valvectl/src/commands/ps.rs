//! `valvectl ps`: the GPU processes the daemon knows, with their GPUs, client, TSGs, channels and
//! whether they are preempted; processes started before the daemon are listed as such.

use std::io::Write;

use clap::Args;
use valve_daemon::protocol::{PsReply, Request};

use crate::args::Globals;
use crate::client::daemon_call;
use crate::error::CliError;
use crate::print;

/// `valvectl ps` takes no arguments.
#[derive(Debug, Args)]
pub struct PsArgs {}

/// Asks the daemon and prints its answer.
pub fn exec(_args: &PsArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let data: PsReply = daemon_call(g.socket, &Request::Ps)?;
    if g.json {
        writeln!(out, "{}", crate::print::json(&data))?;
        return Ok(());
    }
    print::processes(out, &data)?;
    Ok(())
}
