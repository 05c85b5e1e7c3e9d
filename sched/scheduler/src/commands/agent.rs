//! `valve-scheduler agent`: a node agent serving a recorded harvest document (for clusters
//! without GPUs, tests, replays) with the node's jobs' live progress.

use std::process::ExitCode;

use clap::Args;

use super::common::duration;
use crate::error::usage;
use valve_harvest::progress::DEFAULT_DIR;
use valve_scheduler::replay::{unix_ms, Replay};

/// Serves GET /v1/harvest for one node from a recorded document.
///
/// On a GPU node the Valve daemon is the agent (`valvectl daemon --metrics-addr ...` serves the
/// live document); this stands in for it where no daemon runs. The file is re-read on every
/// request; the node name and time are replaced, and `jobs` comes from --progress-dir.
#[derive(Args, Debug)]
pub struct AgentArgs {
    /// The node this agent speaks for.
    #[arg(long)]
    node: String,
    /// The recorded harvest document (`valvectl --json profile > FILE` on a node).
    #[arg(long)]
    harvest: std::path::PathBuf,
    /// Where to listen.
    #[arg(long, default_value = "127.0.0.1:9401")]
    listen: std::net::SocketAddr,
    /// Where this node's jobs report progress.
    #[arg(long, default_value = DEFAULT_DIR)]
    progress_dir: std::path::PathBuf,
    /// Windows of the jobs' rates (default: the document's windows), e.g. 10s,1m.
    #[arg(long, value_delimiter = ',', value_parser = duration)]
    rate_windows: Vec<std::time::Duration>,
    /// Jobs that have not reported for this long are left out.
    #[arg(long, default_value = "10m", value_parser = duration)]
    stale: std::time::Duration,
}

/// Checks the document once, then serves until killed.
pub fn exec(a: &AgentArgs, _json: bool) -> anyhow::Result<ExitCode> {
    let replay = Replay {
        node: a.node.clone(),
        harvest: a.harvest.clone(),
        progress_dir: a.progress_dir.clone(),
        rate_windows_s: a
            .rate_windows
            .iter()
            .map(|d| d.as_secs().max(1) as u32)
            .collect(),
        stale_ms: a.stale.as_millis() as u64,
    };
    replay.document(unix_ms()).map_err(usage)?;
    let server = tiny_http::Server::http(a.listen)
        .map_err(|e| usage(format!("cannot listen on {}: {e}", a.listen)))?;
    eprintln!(
        "valve-scheduler agent: node {} on http://{}/v1/harvest",
        a.node, a.listen
    );
    replay.serve(&server);
    Ok(ExitCode::SUCCESS)
}
