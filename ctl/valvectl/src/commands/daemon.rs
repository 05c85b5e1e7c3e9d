//! `valvectl daemon`: runs the node daemon (root) in this process until SIGINT/SIGTERM/SIGHUP,
//! with settings from `--config FILE` overridden by flags; the daemon is the `valve-daemon` crate.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, ValueEnum};
use valve::Signals;
use valve_daemon::config::{
    check_node_name, harvest_windows, FileConfig, HarvestFileConfig, LogFormat,
};
use valve_daemon::harvest::HarvestSettings;
use valve_daemon::memory::server::warm::DEFAULT_PATH as DEFAULT_WARM_PATH;
use valve_daemon::memory::WarmSettings;
use valve_daemon::protocol::DEFAULT_STATE_DIR;
use valve_daemon::{DaemonConfig, PoolSettings};

use crate::args::{parse_duration, Globals};
use crate::error::CliError;

/// The arguments of `valvectl daemon`.
#[derive(Debug, Args)]
#[command(after_help = "\
Settings come from --config FILE (TOML; every key is optional), and a flag given here overrides
the file's key of the same meaning. Example file: deploy/kubernetes/valve.yaml (its ConfigMap);
keys: group, max_hold, state_dir, audit_log, log_format, [metrics] address, [gate] autostart,
online_label, offline_label, cooldown_floor, cooldown_ceiling, gap_factor, gap_memory, fixed_cooldown,
hold_budget (percent),
[offline] labels, uids, cgroups (who may ever be frozen), [kubernetes] pod_label, [harvest]
node_name, progress_dir, windows (a list, e.g. [\"60s\", \"10m\", \"1h\"]).

Examples:
  sudo valvectl daemon --group valve --max-hold 60s
  sudo valvectl daemon --config /etc/valve/valve.toml --metrics-addr 127.0.0.1:9401
  sudo valvectl daemon --config /etc/valve/valve.toml --log-format json --audit-log /var/log/valve/audit.jsonl")]
pub struct DaemonArgs {
    /// The daemon's TOML config file; flags override its keys.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Directory of the state file (disabled.json) [default: /run/valve].
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// Group whose members may use the socket besides root.
    #[arg(long)]
    pub group: Option<String>,
    /// Longest any preemption may last; longer ones are resumed by the daemon.
    #[arg(long, value_parser = parse_duration)]
    pub max_hold: Option<Duration>,
    /// Serve Prometheus metrics at http://ADDR:PORT/metrics (off unless given here or in the
    /// config); 127.0.0.1:9401 keeps them on the node.
    #[arg(long, value_name = "ADDR:PORT")]
    pub metrics_addr: Option<SocketAddr>,
    /// Also append audit records (JSON lines: preempt, resume, gate start/stop, refused callers,
    /// config) to this file; they are always in the log (target valve_audit).
    #[arg(long, value_name = "FILE")]
    pub audit_log: Option<PathBuf>,
    /// Log as text lines or as JSON objects (for log collectors) [default: text]. VALVE_LOG sets
    /// the level (default info).
    #[arg(long, value_enum)]
    pub log_format: Option<LogFormatArg>,
    /// Diagnostic: load no eBPF probes, so the daemon learns no process's channels (`ps` lists
    /// none, `preempt --pid` finds nothing). For measuring what the probes cost a CUDA process.
    #[arg(long)]
    pub no_discovery: bool,
    /// Keep a stopped gate's libcuda uprobes and arrival program this long for the next `gate
    /// start` with the same probe settings, so a restart is map updates instead of seconds of
    /// probing (each uprobe registration write-locks every process that maps libcuda). 0 (the
    /// default) starts fresh probes for every gate. Known limit: a new online process under
    /// reused probes went unprobed for seconds on an H200 (docs/gate.md, "Restarting a gate").
    #[arg(long, value_name = "SECONDS", default_value_t = 0)]
    pub gate_keep_watchers: u64,
    #[command(flatten)]
    pub harvest: HarvestArgs,
    #[command(flatten)]
    pub pool: PoolArgs,
}

/// The node harvest profile (docs/cluster.md): what this node leaves to offline work, served
/// to a cluster scheduler (`valvectl profile`, GET /v1/harvest, valve_harvest_* gauges).
#[derive(Debug, Args)]
#[command(next_help_heading = "Harvest profile")]
pub struct HarvestArgs {
    /// The node's name in the harvest document: the cluster's name for it (Slurm's NodeName)
    /// [default: the host name up to its first dot].
    #[arg(long, value_name = "NAME")]
    pub node_name: Option<String>,
    /// Where offline jobs append progress reports (`UNIX_MS UNITS_TOTAL` lines, one file per
    /// job id); created with mode 1777 [default: /run/valve/progress].
    #[arg(long, value_name = "DIR")]
    pub progress_dir: Option<PathBuf>,
    /// The trailing windows the profile reports, comma-separated [default: 60s,10m,1h].
    #[arg(long, value_delimiter = ',', value_parser = parse_duration, value_name = "DURATIONS")]
    pub harvest_windows: Option<Vec<Duration>>,
}

impl HarvestArgs {
    /// The flags over the config file's `[harvest]`, over the defaults.
    fn settings(&self, file: &HarvestFileConfig) -> Result<HarvestSettings, CliError> {
        let d = HarvestSettings::default();
        if let Some(n) = &self.node_name {
            check_node_name(n).map_err(|e| CliError::Usage(format!("--node-name: {e}")))?;
        }
        let windows_s = match &self.harvest_windows {
            Some(ws) => Some(
                harvest_windows(ws)
                    .map_err(|e| CliError::Usage(format!("--harvest-windows: {e}")))?,
            ),
            None => file.windows_s.clone(),
        };
        Ok(HarvestSettings {
            node_name: self.node_name.clone().or(file.node_name.clone()),
            progress_dir: self
                .progress_dir
                .clone()
                .or(file.progress_dir.clone())
                .unwrap_or(d.progress_dir),
            windows_s: windows_s.unwrap_or(d.windows_s),
        })
    }
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormatArg {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

impl From<LogFormatArg> for LogFormat {
    fn from(f: LogFormatArg) -> Self {
        match f {
            LogFormatArg::Text => LogFormat::Text,
            LogFormatArg::Json => LogFormat::Json,
        }
    }
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
    /// SCHED_FIFO priority (1-99) of the pool's thread, which an online grow wakes and a
    /// reclaim runs on; 0 keeps it on the normal scheduler (where a wake-up can wait ~4 ms for
    /// a busy CPU).
    #[arg(long, default_value_t = 10, value_name = "PRIORITY",
          value_parser = clap::value_parser!(u8).range(0..=99))]
    pub pool_realtime_priority: u8,
    /// Where each online reservation's MIAD state is saved (about every 5 s and at shutdown),
    /// per GPU and online process (its VALVE_LABEL, else its executable), so that after a
    /// restart it starts warm from it. On disk, not in /run: it is worth keeping across reboots.
    #[arg(long, default_value = DEFAULT_WARM_PATH, value_name = "FILE")]
    pub pool_reservation_state: PathBuf,
    /// A saved reservation older than this starts cold.
    #[arg(long, value_parser = parse_duration, default_value = "24h", value_name = "DURATION")]
    pub pool_warm_max_age: Duration,
    /// Start every online reservation cold (MIAD's initial headroom and T) and save nothing.
    #[arg(long)]
    pub pool_no_warm_start: bool,
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
            realtime: (self.pool_realtime_priority > 0).then_some(self.pool_realtime_priority),
            warm: (!self.pool_no_warm_start).then(|| WarmSettings {
                path: self.pool_reservation_state.clone(),
                max_age: self.pool_warm_max_age,
            }),
        }))
    }
}

/// The daemon's settings: the config file's, overridden by the flags given.
pub fn settings(args: &DaemonArgs, socket: &Path) -> Result<(DaemonConfig, LogFormat), CliError> {
    let file = match &args.config {
        Some(path) => FileConfig::load(path).map_err(|e| CliError::Usage(e.to_string()))?,
        None => FileConfig::default(),
    };
    let harvest = args.harvest.settings(&file.harvest)?;
    let log = args
        .log_format
        .map(LogFormat::from)
        .or(file.log_format)
        .unwrap_or(LogFormat::Text);
    let cfg = DaemonConfig {
        socket: socket.to_path_buf(),
        state_dir: args
            .state_dir
            .clone()
            .or(file.state_dir)
            .unwrap_or_else(|| DEFAULT_STATE_DIR.into()),
        group: args.group.clone().or(file.group),
        max_hold: args.max_hold.or(file.max_hold),
        audit_log: args.audit_log.clone().or(file.audit_log),
        metrics_addr: args.metrics_addr.or(file.metrics_addr),
        offline: file.offline,
        gate_defaults: file.gate_defaults,
        gate_autostart: file.gate_autostart,
        pod_labels: file.pod_labels,
        config_file: args.config.clone(),
        harvest,
        discovery: !args.no_discovery,
        gate_keep_watchers: std::time::Duration::from_secs(args.gate_keep_watchers),
    };
    Ok((cfg, log))
}

/// Whether stderr is a terminal: logs carry ANSI colours only then, never into a file, a pipe
/// or the journal.
pub fn stderr_is_terminal() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

/// The daemon's log: `VALVE_LOG` filters (default `info`, so audit records show), as text or
/// JSON lines on stderr, coloured only on a terminal.
fn init_logging(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("VALVE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(stderr_is_terminal())
        .with_env_filter(filter);
    let _ = match format {
        LogFormat::Json => fmt.json().try_init(),
        LogFormat::Text => fmt.try_init(),
    };
}

/// Runs the daemon on the global `--socket`.
pub fn exec(args: &DaemonArgs, g: Globals, signals: &Signals) -> Result<(), CliError> {
    let pool = args.pool.settings()?;
    let (cfg, log) = settings(args, g.socket)?;
    init_logging(log);
    valve_daemon::run_with_pool(&cfg, pool.as_ref(), signals)
        .map_err(|e| CliError::Daemon(e.code, e.message))
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Cmd {
        #[command(flatten)]
        args: DaemonArgs,
    }

    fn settings_of(argv: &[&str]) -> Result<(DaemonConfig, LogFormat), CliError> {
        let cmd =
            Cmd::try_parse_from(std::iter::once("daemon").chain(argv.iter().copied())).unwrap();
        settings(&cmd.args, Path::new("/run/valve/valve.sock"))
    }

    #[test]
    fn pool_flags_become_its_settings() {
        let pool = |argv: &[&str]| {
            let cmd = Cmd::try_parse_from(std::iter::once("daemon").chain(argv.iter().copied()));
            cmd.map(|c| c.args.pool.settings())
        };
        assert!(matches!(pool(&[]), Ok(Ok(None))), "no pool unless asked");
        let p = pool(&["--pool"]).unwrap().unwrap().unwrap();
        assert_eq!(
            (p.handle_bytes, p.realtime),
            (64 << 20, Some(10)),
            "64 MiB handles, SCHED_FIFO 10"
        );
        let p = pool(&["--pool", "--pool-realtime-priority", "0"])
            .unwrap()
            .unwrap()
            .unwrap();
        assert_eq!(p.realtime, None, "0: the normal scheduler");
        let warm = p.warm.expect("warm start is on by default");
        assert_eq!(
            (warm.path.to_str(), warm.max_age),
            (
                Some("/var/lib/valve/reservations.json"),
                Duration::from_secs(24 * 3600)
            )
        );
        let p = pool(&[
            "--pool",
            "--pool-warm-max-age",
            "2h",
            "--pool-reservation-state",
            "/x.json",
        ]);
        let warm = p.unwrap().unwrap().unwrap().warm.unwrap();
        assert_eq!(
            (warm.path.to_str(), warm.max_age.as_secs()),
            (Some("/x.json"), 7200)
        );
        let p = pool(&["--pool", "--pool-no-warm-start"])
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(p.warm.is_none());
        assert!(pool(&["--pool", "--pool-realtime-priority", "100"]).is_err());
        let odd = pool(&["--pool", "--pool-handle-mib", "3"])
            .unwrap()
            .unwrap_err();
        assert_eq!(odd.exit_code(), 2);
    }

    #[test]
    fn harvest_flags_override_the_config_files_harvest_table() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("valve.toml");
        std::fs::write(
            &file,
            "[harvest]\nnode_name = \"gpu001\"\nwindows = [\"30s\", \"5m\"]\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let (cfg, _) = settings_of(&[]).unwrap();
        assert_eq!(cfg.harvest, HarvestSettings::default());
        assert_eq!(cfg.harvest.windows_s, vec![60, 600, 3600]);
        assert_eq!(
            cfg.harvest.progress_dir,
            Path::new(valve_harvest::progress::DEFAULT_DIR)
        );
        let (cfg, _) = settings_of(&["--config", path]).unwrap();
        assert_eq!(cfg.harvest.node_name.as_deref(), Some("gpu001"));
        assert_eq!(cfg.harvest.windows_s, vec![30, 300]);
        let (cfg, _) = settings_of(&[
            "--config",
            path,
            "--node-name",
            "gpu002",
            "--progress-dir",
            "/tmp/progress",
            "--harvest-windows",
            "1h,10m,60",
        ])
        .unwrap();
        assert_eq!(cfg.harvest.node_name.as_deref(), Some("gpu002"));
        assert_eq!(cfg.harvest.progress_dir, Path::new("/tmp/progress"));
        assert_eq!(
            cfg.harvest.windows_s,
            vec![60, 600, 3600],
            "a bare number is seconds"
        );
        let e = settings_of(&["--harvest-windows", "60s,1m"]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert!(e.to_string().starts_with("--harvest-windows: "), "{e}");
        let e = settings_of(&["--node-name", "a b"]).unwrap_err();
        assert!(e.to_string().contains("not a node name"), "{e}");
    }

    #[test]
    fn flags_override_the_config_file_and_bad_files_are_usage_errors() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("valve.toml");
        std::fs::write(
            &file,
            "group = \"gpu\"\nmax_hold = \"60s\"\nlog_format = \"json\"\n\
             [metrics]\naddress = \"127.0.0.1:9401\"\n[offline]\nlabels = [\"batch\"]\n",
        )
        .unwrap();
        let path = file.to_str().unwrap();
        let (cfg, log) = settings_of(&["--config", path]).unwrap();
        assert_eq!(cfg.group.as_deref(), Some("gpu"));
        assert_eq!(cfg.max_hold, Some(Duration::from_secs(60)));
        assert_eq!(cfg.metrics_addr, Some("127.0.0.1:9401".parse().unwrap()));
        assert_eq!(cfg.offline.labels, vec!["batch"]);
        assert_eq!(cfg.state_dir, Path::new(DEFAULT_STATE_DIR));
        assert_eq!(log, LogFormat::Json);
        let (cfg, log) = settings_of(&[
            "--config",
            path,
            "--group",
            "valve",
            "--metrics-addr",
            "0.0.0.0:9500",
            "--log-format",
            "text",
        ])
        .unwrap();
        assert_eq!(cfg.group.as_deref(), Some("valve"));
        assert_eq!(
            cfg.max_hold,
            Some(Duration::from_secs(60)),
            "kept from the file"
        );
        assert_eq!(cfg.metrics_addr, Some("0.0.0.0:9500".parse().unwrap()));
        assert_eq!(log, LogFormat::Text);
        // No file: the defaults, metrics off, discovery on.
        let (cfg, _) = settings_of(&[]).unwrap();
        assert_eq!(cfg.metrics_addr, None);
        assert!(cfg.group.is_none());
        assert!(cfg.discovery);
        assert!(!settings_of(&["--no-discovery"]).unwrap().0.discovery);
        std::fs::write(&file, "max_hold = \"forever\"\n").unwrap();
        let e = settings_of(&["--config", path]).unwrap_err();
        assert_eq!(e.exit_code(), 2);
        assert_eq!(
            e.to_string(),
            format!("{path}: max_hold: 'forever' is not a duration (e.g. 500ms, 2s, 100us)")
        );
    }
}
