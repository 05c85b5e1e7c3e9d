//! Offline jobs' progress reports: a job appends `UNIX_MS UNITS_TOTAL` lines to a file named
//! after its job id in the node's progress directory; the node reads rates over windows from them.
//!
//! Any job can report with one shell line, and nothing is lost when the reader restarts:
//! `echo "$(date +%s%3N) $tokens" >> "$VALVE_PROGRESS_DIR/$SLURM_JOB_ID"`.

use std::fs::{self, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::doc::{JobProgress, Rate};

/// The directory jobs report into unless `VALVE_PROGRESS_DIR` says otherwise.
pub const DEFAULT_DIR: &str = "/run/valve/progress";

/// The most of a progress file that is read (its tail): a job that reports every second for a
/// day writes about 2 MB.
const MAX_READ: u64 = 256 * 1024;

/// How far a file's modification time may lag the reports in it (clocks, slow writers) before a
/// stale file is skipped unread.
const MTIME_SLACK_MS: u64 = 60_000;

/// Why a report could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ProgressError {
    /// A job id that cannot be a file name.
    #[error("job id {0:?} is not valid: use 1-64 letters, digits, '.', '_' or '-' (a Slurm job id such as 1234 or 1234_7)")]
    BadJobId(String),
    /// The count is not a number or went backwards.
    #[error("progress {0} is not valid: report the total work done so far, a finite number >= 0")]
    BadUnits(f64),
    /// The file could not be written.
    #[error("cannot write progress to {path}: {source} (is VALVE_PROGRESS_DIR set to a writable directory?)")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
}

/// Whether `id` is usable as a job id (and so as a file name).
pub fn valid_job_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 64
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Appends one report for `job` to `dir` (created if missing).
pub fn report(dir: &Path, job: &str, unix_ms: u64, units_total: f64) -> Result<(), ProgressError> {
    if !valid_job_id(job) {
        return Err(ProgressError::BadJobId(job.into()));
    }
    if !units_total.is_finite() || units_total < 0.0 {
        return Err(ProgressError::BadUnits(units_total));
    }
    let path = dir.join(job);
    let io = |source| ProgressError::Io {
        path: path.clone(),
        source,
    };
    fs::create_dir_all(dir).map_err(io)?;
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(io)?;
    writeln!(f, "{unix_ms} {units_total}").map_err(io)
}

/// Reads every job's reports in `dir` and turns them into rates over `windows_s` ending at
/// `now_unix_ms`. Files that are not job ids, and lines that do not parse, are skipped; a job
/// whose last report is older than `stale_ms` is left out (it ended or moved). A file not
/// modified for longer than that (and a minute) is not even read, so the files of jobs long
/// gone cost a directory entry each.
pub fn read_all(
    dir: &Path,
    now_unix_ms: u64,
    windows_s: &[u32],
    stale_ms: u64,
) -> Vec<JobProgress> {
    let Ok(entries) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut jobs: Vec<JobProgress> = entries
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            if !valid_job_id(&name) || !e.file_type().ok()?.is_file() {
                return None;
            }
            let modified = e.metadata().ok()?.modified().ok()?;
            let modified_ms = modified
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            if modified_ms.saturating_add(stale_ms.saturating_add(MTIME_SLACK_MS)) < now_unix_ms {
                return None;
            }
            let points = read_points(&e.path())?;
            let last = *points.last()?;
            if now_unix_ms.saturating_sub(last.0) > stale_ms {
                return None;
            }
            Some(progress(&name, &points, now_unix_ms, windows_s))
        })
        .collect();
    jobs.sort_by(|a, b| a.job.cmp(&b.job));
    jobs
}

/// The `(unix_ms, units_total)` points of one file, in time order.
fn read_points(path: &Path) -> Option<Vec<(u64, f64)>> {
    let mut f = fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    let skip_first = len > MAX_READ;
    if skip_first {
        f.seek(SeekFrom::Start(len - MAX_READ)).ok()?;
    }
    let mut text = String::new();
    f.take(MAX_READ).read_to_string(&mut text).ok()?;
    let mut points: Vec<(u64, f64)> = text
        .lines()
        .skip(usize::from(skip_first)) // a partial line
        .filter_map(|l| {
            let mut it = l.split_whitespace();
            let t = it.next()?.parse::<u64>().ok()?;
            let u = it.next()?.parse::<f64>().ok().filter(|u| u.is_finite())?;
            Some((t, u))
        })
        .collect();
    points.sort_by_key(|p| p.0);
    (!points.is_empty()).then_some(points)
}

/// Rates of one job from its points: work done in the window over the window's measured time.
/// Time after the last report counts as time without progress.
pub fn progress(
    job: &str,
    points: &[(u64, f64)],
    now_unix_ms: u64,
    windows_s: &[u32],
) -> JobProgress {
    let (last_t, last_u) = points[points.len() - 1];
    let rates = windows_s
        .iter()
        .map(|&w| {
            let from = now_unix_ms.saturating_sub(u64::from(w) * 1000);
            let start = from.max(points[0].0);
            let covered_ms = now_unix_ms.saturating_sub(start);
            let done = last_u - units_at(points, start);
            Rate {
                window_s: w,
                per_s: if covered_ms == 0 {
                    0.0
                } else {
                    (done / (covered_ms as f64 / 1000.0)).max(0.0)
                },
                covered_s: covered_ms as f64 / 1000.0,
            }
        })
        .collect();
    JobProgress {
        job: job.into(),
        units_total: last_u,
        last_report_unix_ms: last_t,
        rates,
    }
}

/// Units done at `t`, interpolated between reports (flat before the first and after the last).
fn units_at(points: &[(u64, f64)], t: u64) -> f64 {
    let i = points.partition_point(|p| p.0 <= t);
    match (i.checked_sub(1).map(|k| points[k]), points.get(i)) {
        (Some(a), Some(b)) if b.0 > a.0 => {
            a.1 + (b.1 - a.1) * (t - a.0) as f64 / (b.0 - a.0) as f64
        }
        (Some(a), _) => a.1,
        (None, Some(b)) => b.1,
        (None, None) => 0.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_come_from_work_done_inside_each_window() {
        // 10 units/s for 100 s, reported every 10 s, read 10 s after the last report.
        let points: Vec<(u64, f64)> = (0..=10).map(|k| (k * 10_000, k as f64 * 100.0)).collect();
        let p = progress("7", &points, 110_000, &[20, 60, 600]);
        assert_eq!(p.units_total, 1000.0);
        let r20 = p.rate(20).unwrap();
        assert!(
            (r20.per_s - 5.0).abs() < 1e-9,
            "100 units in the last 20 s: {r20:?}"
        );
        assert!((p.rate(60).unwrap().per_s - 500.0 / 60.0).abs() < 1e-9);
        let r600 = p.rate(600).unwrap();
        assert_eq!(r600.covered_s, 110.0, "only since the first report");
        assert!((r600.per_s - 1000.0 / 110.0).abs() < 1e-9);
    }

    #[test]
    fn reports_round_trip_through_the_directory_and_stale_jobs_drop_out() {
        let dir = tempfile::tempdir().unwrap();
        report(dir.path(), "41", 1_000, 0.0).unwrap();
        report(dir.path(), "41", 11_000, 50.0).unwrap();
        report(dir.path(), "42_3", 1_000, 5.0).unwrap();
        fs::write(dir.path().join("41.tmp~"), "junk").unwrap();
        fs::write(dir.path().join("43"), "garbage\n12 x\n").unwrap();
        let jobs = read_all(dir.path(), 11_000, &[10], 5_000);
        assert_eq!(jobs.len(), 1, "42_3 is stale, 43 has no points: {jobs:?}");
        assert_eq!(jobs[0].job, "41");
        assert!((jobs[0].rate(10).unwrap().per_s - 5.0).abs() < 1e-9);
        assert!(read_all(&dir.path().join("none"), 0, &[10], 1).is_empty());
    }

    #[test]
    fn files_untouched_for_longer_than_stale_are_not_read() {
        let dir = tempfile::tempdir().unwrap();
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        report(dir.path(), "5", now_ms - 1_000, 10.0).unwrap();
        report(dir.path(), "6", now_ms - 1_000, 10.0).unwrap();
        // Job 6's file says it reported a second ago, but nobody wrote it for an hour.
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
        fs::File::options()
            .append(true)
            .open(dir.path().join("6"))
            .unwrap()
            .set_modified(hour_ago)
            .unwrap();
        let jobs = read_all(dir.path(), now_ms, &[60], 600_000);
        let ids: Vec<&str> = jobs.iter().map(|j| j.job.as_str()).collect();
        assert_eq!(ids, ["5"]);
        let jobs = read_all(dir.path(), now_ms, &[60], 7_200_000);
        assert_eq!(jobs.len(), 2, "within a longer stale time both are read");
    }

    #[test]
    fn bad_reports_are_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        for bad in ["", "..", "a/b", "x y", &"9".repeat(65)] {
            assert!(matches!(
                report(dir.path(), bad, 0, 1.0),
                Err(ProgressError::BadJobId(_))
            ));
        }
        assert!(matches!(
            report(dir.path(), "1", 0, f64::NAN),
            Err(ProgressError::BadUnits(_))
        ));
        let e = report(Path::new("/proc/valve-nowhere"), "1", 0, 1.0).unwrap_err();
        assert!(e.to_string().contains("VALVE_PROGRESS_DIR"), "{e}");
    }

    #[test]
    fn a_huge_file_is_read_from_its_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut text = String::new();
        for k in 0..40_000u64 {
            text.push_str(&format!("{} {}\n", k * 1000, k));
        }
        fs::write(dir.path().join("9"), &text).unwrap();
        let jobs = read_all(dir.path(), 40_000_000, &[60], 10_000);
        assert_eq!(jobs[0].units_total, 39_999.0);
        assert!((jobs[0].rate(60).unwrap().per_s - 59.0 / 60.0).abs() < 0.02);
    }
}
