//! `valvectl daemon`: runs the node daemon (root) in this process until SIGINT/SIGTERM/SIGHUP;
//! the daemon itself is the `valve-daemon` crate, entered through [`valve_daemon::run`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use valve::Signals;
use valve_daemon::protocol::DEFAULT_STATE_DIR;
use valve_daemon::DaemonConfig;

use crate::args::{parse_duration, Globals};
use crate::error::CliError;

/// The arguments of `valvectl daemon`.
#[derive(Debug, Args)]
pub struct DaemonArgs {
    /// Directory of the state file (disabled.json).
    #[arg(long, default_value = DEFAULT_STATE_DIR)]
    pub state_dir: PathBuf,
    /// Group whose members may use the socket besides root.
    #[arg(long)]
    pub group: Option<String>,
    /// Longest any preemption may last; longer ones are resumed by the daemon.
    #[arg(long, value_parser = parse_duration)]
    pub max_hold: Option<Duration>,
}

/// Runs the daemon on the global `--socket`.
pub fn exec(args: &DaemonArgs, g: Globals, signals: &Signals) -> Result<(), CliError> {
    valve_daemon::run(
        &DaemonConfig {
            socket: g.socket.to_path_buf(),
            state_dir: args.state_dir.clone(),
            group: args.group.clone(),
            max_hold: args.max_hold,
        },
        signals,
    )
    .map_err(|e| CliError::Daemon(e.code, e.message))
}
