//! `valvectl status`: the daemon's own state (uptime, RM events seen, processes known, what is
//! preempted, the hold limit, the state file).

use std::io::Write;

use clap::Args;
use valve_daemon::protocol::{Request, StatusReply};

use crate::args::Globals;
use crate::client::daemon_call;
use crate::error::CliError;
use crate::print;

/// `valvectl status` takes no arguments.
#[derive(Debug, Args)]
pub struct StatusArgs {}

/// Asks the daemon and prints its answer.
pub fn exec(_args: &StatusArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let data: StatusReply = daemon_call(g.socket, &Request::Status)?;
    if g.json {
        writeln!(out, "{}", print::json(&data))?;
    } else {
        print::daemon_status(out, &data)?;
    }
    Ok(())
}
