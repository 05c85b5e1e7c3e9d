//! What `valvectl top` reads each refresh: the daemon's `status` (GPUs, the gate, what is
//! preempted by hand) and `ps` (processes per GPU) on its control socket, its metrics text
//! (per-GPU counters, harvested and frozen time) where it keeps metrics, its harvest profile,
//! and the memory pool's `status` on the pool socket. Only `status` and `ps` are required.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use valve_daemon::protocol::{LoopRequest, MetricsReply, PsReply, Request, StatusReply};
use valve_harvest::NodeHarvest;
use valve_protocol::pool::{PoolRequest, PoolStatus};

use crate::client::{daemon_call_within, pool_call};
use crate::error::CliError;

/// How long one request may take: a stuck daemon must not freeze the view.
const REPLY_TIMEOUT: Duration = Duration::from_secs(2);

/// Where the data comes from.
#[derive(Clone, Debug)]
pub struct Sources {
    /// The daemon's control socket.
    pub socket: PathBuf,
    /// The memory pool's socket.
    pub pool_socket: PathBuf,
}

/// One reading of everything `top` shows, as the daemon and the pool answered.
#[derive(Clone, Debug)]
pub struct Sample {
    /// When it was taken (rates are per second of this clock).
    pub at: Instant,
    /// The same moment as Unix time, milliseconds.
    pub unix_ms: u64,
    /// The daemon's `status` reply.
    pub status: StatusReply,
    /// The daemon's `ps` reply.
    pub ps: PsReply,
    /// The counters from the daemon's metrics, or why there are none.
    pub metrics: Result<Counters, String>,
    /// The daemon's harvest profile (`valvectl profile --json`), where it serves one.
    pub harvest: Option<NodeHarvest>,
    /// The pool's `status`, or why there is none.
    pub pool: Result<PoolStatus, String>,
}

/// Takes one sample. Fails only when the daemon does not answer `status` or `ps` (not running,
/// no permission): the error names the socket and how to start the daemon.
pub fn take(src: &Sources) -> Result<Sample, CliError> {
    let status = daemon_call_within(&src.socket, &Request::Status, REPLY_TIMEOUT)?;
    let ps = daemon_call_within(&src.socket, &Request::Ps, REPLY_TIMEOUT)?;
    let metrics =
        daemon_call_within::<MetricsReply>(&src.socket, &LoopRequest::Metrics, REPLY_TIMEOUT)
            .map(|m| Counters::parse(&m.text))
            .map_err(|e| e.to_string());
    let harvest = daemon_call_within(&src.socket, &Request::Harvest, REPLY_TIMEOUT).ok();
    let pool = pool_call(&src.pool_socket, &PoolRequest::Status)
        .map_err(|e| pool_error(&src.pool_socket, e));
    Ok(Sample {
        at: Instant::now(),
        unix_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        status,
        ps,
        metrics,
        harvest,
        pool,
    })
}

fn pool_error(socket: &Path, e: CliError) -> String {
    match e {
        // The usual case: the daemon runs without --pool.
        CliError::Daemon(7, _) => format!("not running (nothing answers on {})", socket.display()),
        e => e.to_string(),
    }
}

/// A histogram from the metrics text: cumulative bucket counts by upper bound.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Histogram {
    /// (upper bound, cumulative count), ascending; the last bound may be infinite.
    pub buckets: Vec<(f64, f64)>,
    /// Sum of the observations.
    pub sum: f64,
    /// Number of observations.
    pub count: f64,
}

impl Histogram {
    /// The `q` quantile, interpolated linearly inside its bucket (as Prometheus'
    /// `histogram_quantile` does); `None` without observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        if self.count <= 0.0 {
            return None;
        }
        let rank = q * self.count;
        let mut below = (0.0, 0.0);
        for &(le, n) in &self.buckets {
            if n >= rank {
                if le.is_infinite() {
                    return Some(below.0);
                }
                let inside = n - below.1;
                let frac = if inside > 0.0 {
                    (rank - below.1) / inside
                } else {
                    1.0
                };
                return Some(below.0 + (le - below.0) * frac);
            }
            below = (le, n);
        }
        Some(below.0)
    }
}

/// The counters `top` takes from the daemon's metrics, summed over workload labels and sources
/// where it shows them per GPU.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    /// Freezes per GPU index (by hand and by the gate).
    pub preemptions: BTreeMap<usize, f64>,
    /// Releases per GPU index.
    pub resumes: BTreeMap<usize, f64>,
    /// The disable call's time per GPU index, seconds.
    pub disable: BTreeMap<usize, Histogram>,
    /// Offline time a gate let run, per offline label, seconds.
    pub harvested_s: BTreeMap<String, f64>,
    /// Offline time spent frozen, per offline label (gate and by hand), seconds.
    pub frozen_s: BTreeMap<String, f64>,
}

impl Counters {
    /// Reads the exposition text (`# ` lines are skipped; unknown series are ignored).
    pub fn parse(text: &str) -> Counters {
        let mut c = Counters::default();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let Some((name, labels, value)) = series(line) else {
                continue;
            };
            let gpu = || labels.get("gpu").and_then(|g| g.parse::<usize>().ok());
            let label = || labels.get("label").cloned().unwrap_or_default();
            match name {
                "valve_preemptions_total" => {
                    if let Some(g) = gpu() {
                        *c.preemptions.entry(g).or_default() += value;
                    }
                }
                "valve_resumes_total" => {
                    if let Some(g) = gpu() {
                        *c.resumes.entry(g).or_default() += value;
                    }
                }
                "valve_disable_seconds_bucket" => {
                    let le = labels.get("le").and_then(|l| parse_value(l));
                    if let (Some(g), Some(le)) = (gpu(), le) {
                        c.disable.entry(g).or_default().buckets.push((le, value));
                    }
                }
                "valve_disable_seconds_sum" => {
                    if let Some(g) = gpu() {
                        c.disable.entry(g).or_default().sum = value;
                    }
                }
                "valve_disable_seconds_count" => {
                    if let Some(g) = gpu() {
                        c.disable.entry(g).or_default().count = value;
                    }
                }
                "valve_offline_harvested_seconds_total" => {
                    *c.harvested_s.entry(label()).or_default() += value;
                }
                "valve_offline_frozen_seconds_total" => {
                    *c.frozen_s.entry(label()).or_default() += value;
                }
                _ => {}
            }
        }
        for h in c.disable.values_mut() {
            h.buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        c
    }
}

/// One sample line: `name{k="v",...} value [timestamp]` or `name value`.
fn series(line: &str) -> Option<(&str, BTreeMap<String, String>, f64)> {
    let line = line.trim();
    let (head, rest) = match line.find('{') {
        Some(open) => {
            let close = open + line[open..].find('}')?;
            (&line[..close + 1], &line[close + 1..])
        }
        None => line.split_at(line.find(' ')?),
    };
    let value = parse_value(rest.split_whitespace().next()?)?;
    let Some(open) = head.find('{') else {
        return Some((head, BTreeMap::new(), value));
    };
    let mut labels = BTreeMap::new();
    let mut body = &head[open + 1..head.len() - 1];
    while let Some(eq) = body.find("=\"") {
        let key = body[..eq].trim_start_matches(',').trim();
        let after = &body[eq + 2..];
        // Label values here are GPU indices, labels and sources: no escaped quotes.
        let end = after.find('"')?;
        labels.insert(key.to_string(), after[..end].to_string());
        body = &after[end + 1..];
    }
    Some((&head[..open], labels, value))
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        s => s.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = r#"# HELP valve_preemptions Offline freezes, per GPU, workload label and source.
# TYPE valve_preemptions counter
valve_preemptions_total{gpu="0",label="batch",source="gate"} 10
valve_preemptions_total{gpu="0",label="batch",source="manual"} 2
valve_preemptions_total{gpu="1",label="batch",source="gate"} 7
valve_resumes_total{gpu="0",label="batch",source="gate"} 9
valve_disable_seconds_sum{gpu="0"} 0.004
valve_disable_seconds_count{gpu="0"} 4
valve_disable_seconds_bucket{le="0.00064",gpu="0"} 0
valve_disable_seconds_bucket{le="0.00128",gpu="0"} 4
valve_disable_seconds_bucket{le="+Inf",gpu="0"} 4
valve_offline_harvested_seconds_total{label="batch"} 12.5
valve_offline_frozen_seconds_total{label="batch",source="gate"} 3.0
valve_offline_frozen_seconds_total{label="batch",source="manual"} 1.5
valve_processes_known 3
# EOF
"#;

    #[test]
    fn the_metrics_text_gives_per_gpu_counters_and_offline_time() {
        let c = Counters::parse(TEXT);
        assert_eq!(c.preemptions, BTreeMap::from([(0, 12.0), (1, 7.0)]));
        assert_eq!(c.resumes, BTreeMap::from([(0, 9.0)]));
        assert_eq!(c.harvested_s["batch"], 12.5);
        assert_eq!(c.frozen_s["batch"], 4.5);
        let d = &c.disable[&0];
        assert_eq!((d.sum, d.count), (0.004, 4.0));
        assert_eq!(d.buckets.len(), 3);
        // Every observation in (0.64, 1.28] ms: the median is interpolated to its middle.
        let p50 = d.quantile(0.5).unwrap();
        assert!((p50 - 0.00096).abs() < 1e-9, "{p50}");
        assert_eq!(Histogram::default().quantile(0.5), None);
    }
}
