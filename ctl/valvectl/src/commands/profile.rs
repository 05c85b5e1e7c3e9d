//! `valvectl profile`: the node harvest profile the daemon measures (what this node leaves to
//! offline work), as tables, or with `--json` as the document a cluster scheduler reads.

use std::io::Write;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Args;
use valve_daemon::protocol::Request;
use valve_harvest::{GpuHarvest, NodeHarvest};

use crate::args::Globals;
use crate::client::daemon_call;
use crate::error::CliError;

const HELP: &str = "\
Every figure is measured over a trailing window that ends when the daemon made the document
(it rebuilds it every 5 s); the windows are the daemon's --harvest-windows (default 1m, 10m, 1h).

Per GPU and window:
  COVERED  how much of the window was measured (less than the window after the daemon started)
  BUSY     share of the measured time in which offline could not run on this GPU: a gate held it
           frozen for online work (from its disable's return to its enable). The gate is node-wide,
           so every GPU shows the same. Without a gate it is 0: offline could run all the time.
  PREEMPT/s  the gate's preemptions of offline per measured second (what each costs a job beyond
           the time it is held is its profile's costs.preemption_s)
  RECLAIM  GiB per minute the memory pool took back from offline (reclaimed work is redone: the
           job profile's costs.reclaim_s_per_gib)
  BURSTS   reclaim episodes per minute: runs of reclaims in consecutive seconds, one online burst
           each; RECLAIM over BURSTS is a burst's size, which sets what one costs a job (the
           profile's costs.reclaim_episodes)
  MEMORY   memory left to offline (GiB, time-weighted over the window): MEAN; P5, the level it
           was below 5% of the time (its dips); P50, the median. With the daemon's memory pool:
           free + still creatable + offline-held pool handles; without: NVML's free memory plus
           what offline processes use. A GPU never sampled shows all of its memory.
  READINGS readings in the window that changed the value (taken about once a second)

ALIGNMENT, for each pair of GPUs over the longest window, of the online processes' busy time
(from their first kernel launch after an idle gap to their last launch before the next one):
  OVERLAP  share of the time both GPUs were busy;  UNION  share either was
  SCORE    overlap / union: 1 in step (or both idle), 0 never busy together. A multi-GPU offline
           job only runs when all of its GPUs are free, so it wants pairs that score high.

JOBS: each offline job's own progress reports (one line `UNIX_MS UNITS_TOTAL` appended to
$VALVE_PROGRESS_DIR/<job id>, default /run/valve/progress), in its own units per second over
each window; TOTAL is the last total it reported. A job silent for the longest window drops out.

--json prints the document itself (valve_harvest::NodeHarvest, version 1), exactly as the
daemon's GET /v1/harvest serves it. docs/cluster.md explains every field.

Examples:
  valvectl profile
  valvectl --json profile | jq '.gpus[0].windows[0].busy_fraction'
  curl -s 127.0.0.1:9401/v1/harvest";

/// `valvectl profile` takes no arguments of its own.
#[derive(Debug, Args)]
#[command(after_help = HELP)]
pub struct ProfileArgs {}

/// Asks the daemon for its harvest document and prints it.
pub fn exec(_args: &ProfileArgs, g: Globals, out: &mut dyn Write) -> Result<(), CliError> {
    let data: serde_json::Value = daemon_call(g.socket, &Request::Harvest)?;
    let doc = document(data)?;
    if g.json {
        let text = serde_json::to_string(&doc).expect("the document serialises");
        writeln!(out, "{text}")?;
    } else {
        let now_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64);
        table(out, &doc, now_ms)?;
    }
    Ok(())
}

/// The daemon's reply as a validated document.
fn document(data: serde_json::Value) -> Result<NodeHarvest, CliError> {
    let bad = |e: String| {
        CliError::Daemon(
            1,
            format!(
                "the daemon's harvest document is not valid: {e} (are valvectl and the daemon \
                 the same version?)"
            ),
        )
    };
    let doc: NodeHarvest = serde_json::from_value(data).map_err(|e| bad(e.to_string()))?;
    doc.validate().map_err(|e| bad(e.to_string()))?;
    Ok(doc)
}

/// A window's length as people write it: 90s, 10m, 1h.
fn window_name(s: u32) -> String {
    match s {
        s if s % 3600 == 0 => format!("{}h", s / 3600),
        s if s % 60 == 0 => format!("{}m", s / 60),
        s => format!("{s}s"),
    }
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1u32 << 30)
}

/// The document as tables; `now_ms` (Unix) dates it.
pub fn table(out: &mut dyn Write, doc: &NodeHarvest, now_ms: u64) -> std::io::Result<()> {
    writeln!(
        out,
        "node {} ({}), made {:.0} s ago: {} GPU(s), {} job(s) reporting",
        doc.node,
        doc.source,
        now_ms.saturating_sub(doc.generated_unix_ms) as f64 / 1e3,
        doc.gpus.len(),
        doc.jobs.len()
    )?;
    for g in &doc.gpus {
        gpu_table(out, g)?;
    }
    pairs_table(out, doc)?;
    jobs_table(out, doc)
}

fn gpu_table(out: &mut dyn Write, g: &GpuHarvest) -> std::io::Result<()> {
    writeln!(
        out,
        "\nGPU {} {}, {:.1} GiB",
        g.index,
        g.name.as_deref().unwrap_or("(unnamed)"),
        gib(g.memory_total_bytes)
    )?;
    writeln!(
        out,
        "  {:<7} {:>8} {:>7} {:>9} {:>9} {:>8}  {:>10} {:>8} {:>8} {:>8}",
        "WINDOW",
        "COVERED",
        "BUSY",
        "PREEMPT/s",
        "RECLAIM",
        "BURSTS",
        "MEMORY GiB",
        "P5",
        "P50",
        "READINGS"
    )?;
    for w in &g.windows {
        let m = &w.offline_memory;
        let q = |i: usize| m.quantiles_bytes.get(i).map_or(0.0, |&b| gib(b));
        let per_s = |n: f64| n / w.covered_s.max(1.0);
        writeln!(
            out,
            "  {:<7} {:>7.0}s {:>6.1}% {:>9.2} {:>5.2}G/m {:>6.1}/m  {:>10.1} {:>8.1} {:>8.1} {:>8}",
            window_name(w.window_s),
            w.covered_s,
            w.busy_fraction * 100.0,
            per_s(w.preemptions as f64),
            per_s(gib(w.reclaimed_bytes)) * 60.0,
            per_s(w.reclaim_episodes as f64) * 60.0,
            gib(m.mean_bytes),
            q(1),
            q(10),
            m.samples
        )?;
    }
    Ok(())
}

fn pairs_table(out: &mut dyn Write, doc: &NodeHarvest) -> std::io::Result<()> {
    let Some(longest) = doc.pairs.iter().map(|p| p.window_s).max() else {
        return Ok(());
    };
    writeln!(
        out,
        "\nALIGNMENT of online busy time over {}",
        window_name(longest)
    )?;
    writeln!(
        out,
        "  {:<7} {:>8} {:>8} {:>6}",
        "GPUS", "OVERLAP", "UNION", "SCORE"
    )?;
    for p in doc.pairs.iter().filter(|p| p.window_s == longest) {
        writeln!(
            out,
            "  {:<7} {:>7.1}% {:>7.1}% {:>6.2}",
            format!("{}-{}", p.gpus[0], p.gpus[1]),
            p.overlap_fraction * 100.0,
            p.union_fraction * 100.0,
            p.score
        )?;
    }
    Ok(())
}

fn jobs_table(out: &mut dyn Write, doc: &NodeHarvest) -> std::io::Result<()> {
    if doc.jobs.is_empty() {
        return writeln!(
            out,
            "\nJOBS: none reporting (a job appends `UNIX_MS UNITS_TOTAL` lines to \
             $VALVE_PROGRESS_DIR/<job id>)"
        );
    }
    let mut windows: Vec<u32> = doc
        .jobs
        .iter()
        .flat_map(|j| j.rates.iter().map(|r| r.window_s))
        .collect();
    windows.sort_unstable();
    windows.dedup();
    write!(
        out,
        "\nJOBS (units per second)\n  {:<16} {:>12}",
        "JOB", "TOTAL"
    )?;
    for &w in &windows {
        write!(out, " {:>10}", format!("RATE {}", window_name(w)))?;
    }
    writeln!(out)?;
    for j in &doc.jobs {
        write!(out, "  {:<16} {:>12.0}", j.job, j.units_total)?;
        for &w in &windows {
            match j.rate(w) {
                Some(r) => write!(out, " {:>10.2}", r.per_s)?,
                None => write!(out, " {:>10}", "-")?,
            }
        }
        writeln!(out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use valve_harvest::{
        GpuWindow, JobProgress, MemoryStats, PairAlignment, Rate, QUANTILES, VERSION,
    };

    const GIB: u64 = 1 << 30;

    /// A recorded two-GPU document with one job; the floats are ones a plain parser may round.
    fn recorded() -> NodeHarvest {
        let window = |window_s: u32, busy: f64, mean_gib: u64| GpuWindow {
            window_s,
            covered_s: f64::from(window_s),
            busy_fraction: busy,
            preemptions: u64::from(window_s) / 2,
            reclaimed_bytes: u64::from(window_s) * GIB / 120,
            reclaim_episodes: u64::from(window_s) / 60,
            offline_memory: MemoryStats {
                samples: 7,
                mean_bytes: mean_gib * GIB,
                quantiles_bytes: (0..QUANTILES as u64).map(|k| k * GIB).collect(),
            },
        };
        NodeHarvest {
            version: VERSION,
            node: "gpu001".into(),
            generated_unix_ms: 1_000_000,
            source: "daemon".into(),
            gpus: (0..2)
                .map(|i| GpuHarvest {
                    index: i,
                    name: Some("NVIDIA H100 80GB HBM3".into()),
                    memory_total_bytes: 80 * GIB,
                    windows: vec![window(60, 0.1 + 0.2, 40), window(3600, 1.0 / 3.0, 30)],
                })
                .collect(),
            pairs: [60, 3600]
                .iter()
                .map(|&w| PairAlignment {
                    gpus: [0, 1],
                    window_s: w,
                    overlap_fraction: 0.25,
                    union_fraction: 0.5,
                    score: if w == 3600 { 0.5 } else { 0.9 },
                })
                .collect(),
            jobs: vec![JobProgress {
                job: "1234_7".into(),
                units_total: 5000.0,
                last_report_unix_ms: 999_000,
                rates: vec![
                    Rate {
                        window_s: 60,
                        per_s: 12.5,
                        covered_s: 60.0,
                    },
                    Rate {
                        window_s: 3600,
                        per_s: 2.0 / 3.0,
                        covered_s: 100.0,
                    },
                ],
            }],
        }
    }

    #[test]
    fn the_table_shows_each_gpu_window_the_longest_windows_pairs_and_the_jobs() {
        let mut out = Vec::new();
        table(&mut out, &recorded(), 3_000_000).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert!(lines[0].starts_with("node gpu001 (daemon), made 2000 s ago: 2 GPU(s), 1 job(s)"));
        assert!(
            text.contains("GPU 1 NVIDIA H100 80GB HBM3, 80.0 GiB"),
            "{text}"
        );
        // 1m: busy 30%, 0.5 preemptions/s, 0.5 GiB reclaimed/min in 1 burst/min, mean 40 GiB,
        // p5 1 GiB, p50 10 GiB, 7 readings.
        let row = lines
            .iter()
            .find(|l| l.trim_start().starts_with("1m"))
            .unwrap();
        let cells: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(
            cells,
            ["1m", "60s", "30.0%", "0.50", "0.50G/m", "1.0/m", "40.0", "1.0", "10.0", "7"],
            "{row}"
        );
        assert!(lines
            .iter()
            .any(|l| l.trim_start().starts_with("1h") && l.contains("33.3%")));
        assert!(
            text.contains("ALIGNMENT of online busy time over 1h"),
            "{text}"
        );
        let pair: Vec<&str> = lines
            .iter()
            .filter(|l| l.trim_start().starts_with("0-1"))
            .flat_map(|l| l.split_whitespace())
            .collect();
        assert_eq!(
            pair,
            ["0-1", "25.0%", "50.0%", "0.50"],
            "only the longest window"
        );
        let job = lines.iter().find(|l| l.contains("1234_7")).unwrap();
        let cells: Vec<&str> = job.split_whitespace().collect();
        assert_eq!(cells, ["1234_7", "5000", "12.50", "0.67"], "{job}");
        assert!(text.contains("RATE 1m") && text.contains("RATE 1h"));
    }

    /// A daemon on a socket in a temporary directory that answers one request with `reply`;
    /// the thread returns the request line it got.
    fn fake_daemon(
        reply: serde_json::Value,
    ) -> (
        tempfile::TempDir,
        std::path::PathBuf,
        std::thread::JoinHandle<String>,
    ) {
        use std::io::{BufRead, BufReader};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("valve.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line).unwrap();
            (&s).write_all(format!("{reply}\n").as_bytes()).unwrap();
            line
        });
        (dir, path, server)
    }

    fn run_profile(json: bool, reply: serde_json::Value) -> (Result<String, CliError>, String) {
        let (_dir, path, server) = fake_daemon(reply);
        let mut out = Vec::new();
        let g = Globals {
            json,
            socket: &path,
        };
        let r = exec(&ProfileArgs {}, g, &mut out).map(|()| String::from_utf8(out).unwrap());
        (r, server.join().unwrap())
    }

    #[test]
    fn json_prints_the_document_exactly_as_the_daemon_serves_it() {
        let doc = recorded();
        // GET /v1/harvest serves this text; the socket reply carries the same document.
        let served = serde_json::to_string(&doc).unwrap();
        let reply = json!({"data": serde_json::to_value(&doc).unwrap(), "error": null});
        let (out, request) = run_profile(true, reply.clone());
        assert_eq!(request.trim(), r#"{"op":"harvest"}"#);
        assert_eq!(out.unwrap(), format!("{served}\n"));
        let (out, _) = run_profile(false, reply);
        assert!(out
            .unwrap()
            .contains("ALIGNMENT of online busy time over 1h"));
    }

    #[test]
    fn a_daemon_without_a_profile_is_its_error() {
        let reply = json!({"data": null, "error": {"code": 1,
            "message": "the harvest profile is not built yet: ask again in a second"}});
        let (out, _) = run_profile(false, reply);
        let e = out.unwrap_err();
        assert_eq!(e.exit_code(), 1);
        assert!(e.to_string().contains("not built yet"), "{e}");
    }

    #[test]
    fn an_invalid_document_is_refused_by_name() {
        let mut v = serde_json::to_value(recorded()).unwrap();
        v["gpus"][0]["windows"][0]["busy_fraction"] = json!(1.5);
        let e = document(v).unwrap_err();
        assert_eq!(e.exit_code(), 1);
        assert!(e.to_string().contains("busy_fraction = 1.5"), "{e}");
        let e = document(json!({"version": 1})).unwrap_err();
        assert!(e.to_string().contains("not valid"), "{e}");
    }

    #[test]
    fn window_names_are_as_people_write_them() {
        assert_eq!(window_name(60), "1m");
        assert_eq!(window_name(600), "10m");
        assert_eq!(window_name(3600), "1h");
        assert_eq!(window_name(90), "90s");
    }
}
