//! `valvectl daemon`: runs the node daemon (root) in this process until SIGINT/SIGTERM/SIGHUP;
//! the daemon itself is the `valve-daemon` crate, entered through [`valve_daemon::run()`].

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use valve::Signals;
use valve_daemon::protocol::DEFAULT_STATE_DIR;
use valve_daemon::{DaemonConfig, PoolSettings};

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
    #[command(flatten)]
    pub pool: PoolArgs,
}

/// The GPU memory pool (docs/memory.md): online and offline processes linked with Valve's
/// client library share each GPU's memory; offline's is taken back when online needs it.
#[derive(Debug, Args)]
#[command(next_help_heading = "Memory pool")]
pub struct PoolArgs {
    /// Serve the GPU memory pool.
    #[arg(long)]
    pub pool: bool,
    /// The pool's socket.
    #[arg(long, default_value = "/run/valve/pool.sock", value_name = "PATH")]
    pub pool_socket: PathBuf,
    /// GPUs to pool, by index from `valvectl gpus` (default: all).
    #[arg(long, value_delimiter = ',', value_name = "INDEX")]
    pub pool_gpus: Option<Vec<usize>>,
    /// Size of one handle, the unit of lending and reclaiming (a multiple of 2 MiB). 64 MiB
    /// reclaims 1 GiB in under 6 ms on an H100; smaller handles cost ~80 us each.
    #[arg(long, default_value_t = 64, value_name = "MIB")]
    pub pool_handle_mib: usize,
    /// The most each GPU's pool may hold (default: the whole GPU, less --pool-keep-free-mib).
    #[arg(long, value_name = "GIB")]
    pub pool_max_gib: Option<u64>,
    /// Device memory the pool always leaves to everything else (CUDA contexts, weights and
    /// activations allocated outside the pool).
    #[arg(long, default_value_t = 4096, value_name = "MIB")]
    pub pool_keep_free_mib: u64,
    /// How long an offline process has to give memory back before it is killed.
    #[arg(long, value_parser = parse_duration, default_value = "100ms", value_name = "DURATION")]
    pub pool_reclaim_deadline: Duration,
    /// Reclaims per minute that MIAD reservation steers each online process to: online keeps a
    /// headroom of mapped memory that grows on pressure and shrinks by one handle per interval,
    /// and the interval adapts so that pressure (a reclaim) happens about this often.
    #[arg(long, default_value_t = 2.0, value_name = "PER_MIN")]
    pub pool_target_reclaims_per_min: f64,
}

impl PoolArgs {
    fn settings(&self) -> Result<Option<PoolSettings>, CliError> {
        if !self.pool {
            return Ok(None);
        }
        if self.pool_handle_mib == 0 || self.pool_handle_mib % 2 != 0 {
            return Err(CliError::Usage(format!(
                "--pool-handle-mib {} is not a positive multiple of 2 (the GPU's mapping granularity is 2 MiB)",
                self.pool_handle_mib
            )));
        }
        Ok(Some(PoolSettings {
            socket: self.pool_socket.clone(),
            gpus: self.pool_gpus.clone(),
            handle_bytes: self.pool_handle_mib << 20,
            max_bytes: self.pool_max_gib.map_or(u64::MAX, |g| g << 30),
            keep_free_bytes: self.pool_keep_free_mib << 20,
            reclaim_deadline: self.pool_reclaim_deadline,
            target_reclaims_per_min: self.pool_target_reclaims_per_min,
        }))
    }
}

/// Runs the daemon on the global `--socket`.
pub fn exec(args: &DaemonArgs, g: Globals, signals: &Signals) -> Result<(), CliError> {
    let pool = args.pool.settings()?;
    valve_daemon::run_with_pool(
        &DaemonConfig {
            socket: g.socket.to_path_buf(),
            state_dir: args.state_dir.clone(),
            group: args.group.clone(),
            max_hold: args.max_hold,
            audit_log: None,
        },
        pool.as_ref(),
        signals,
    )
    .map_err(|e| CliError::Daemon(e.code, e.message))
}
