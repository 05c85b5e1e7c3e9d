//! The saved reservations file: what each online reservation learned, per GPU and online
//! process, kept across daemon restarts so that MIAD starts warm (docs/memory.md, "Warm start").

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use serde_json::Value;
use valve_protocol::pool::ReservationStart;

use crate::memory::reservation::Learned;

/// The file format's version; a file of another version is not read.
pub const FORMAT_VERSION: u32 = 1;
/// Where the daemon keeps the file unless told otherwise: on disk, so that it survives a reboot
/// (`/run` is a tmpfs).
pub const DEFAULT_PATH: &str = "/var/lib/valve/reservations.json";
/// How old a saved reservation may be and still start one warm.
pub const DEFAULT_MAX_AGE: Duration = Duration::from_secs(24 * 3600);
/// The most often the file is written while online clients run.
pub const SAVE_EVERY: Duration = Duration::from_secs(5);
/// A longer file is not read (a few hundred entries take a few tens of KiB).
const MAX_FILE_BYTES: u64 = 1 << 20;
/// The most reservations kept; past it the oldest is dropped.
const MAX_ENTRIES: usize = 256;
/// The longest GPU or online name kept (longer ones are cut, and refused when read).
pub const MAX_NAME_CHARS: usize = 200;
/// A reservation saved up to this far in the future counts as just saved (clock adjustments).
const CLOCK_SLACK_S: u64 = 300;

/// Where reservations are saved and how old one may be to be used (`valvectl daemon
/// --pool-reservation-state`, `--pool-warm-max-age`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WarmSettings {
    /// The file.
    pub path: PathBuf,
    /// Older saved reservations start cold.
    pub max_age: Duration,
}

impl Default for WarmSettings {
    fn default() -> Self {
        WarmSettings {
            path: DEFAULT_PATH.into(),
            max_age: DEFAULT_MAX_AGE,
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileV1 {
    version: u32,
    reservations: Vec<Saved>,
}

/// One saved reservation.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Saved {
    /// The GPU: its PCI address, else `index N` ([`gpu_name`]).
    pub gpu: String,
    /// The online process ([`online_name`]).
    pub online: String,
    /// When it was saved, in seconds since the Unix epoch.
    pub saved_unix_s: u64,
    /// What the reservation had learned.
    pub learned: Learned,
}

/// How an online reservation started, for `pool status` and the log.
#[derive(Clone, Debug, PartialEq)]
pub enum Start {
    /// From a saved reservation.
    Warm {
        /// The file it came from.
        file: PathBuf,
        /// How long before it had been saved, in seconds.
        age_s: u64,
        /// The values that had to be clamped or left cold.
        notes: Vec<String>,
    },
    /// From scratch (MIAD's initial headroom and T), and why.
    Cold(String),
}

impl Start {
    /// The `start` object of a reservation in `pool status`.
    pub fn wire(&self) -> ReservationStart {
        match self {
            Start::Warm { file, age_s, notes } => ReservationStart {
                warm: true,
                from: Some(file.display().to_string()),
                saved_s_ago: Some(*age_s),
                adjusted: Some(notes.clone()),
                why: None,
            },
            Start::Cold(why) => ReservationStart {
                warm: false,
                from: None,
                saved_s_ago: None,
                adjusted: None,
                why: Some(why.clone()),
            },
        }
    }
}

/// The GPU part of a reservation's key: its PCI address (stable across reboots, unlike indices),
/// else `index N`.
pub fn gpu_name(pci_bus_id: Option<String>, index: usize) -> String {
    match pci_bus_id {
        Some(p) if !p.is_empty() => cut(&p.to_ascii_lowercase()),
        _ => format!("index {index}"),
    }
}

/// The online part of a reservation's key, as an operator names the process: `label:NAME` from
/// its workload label (`VALVE_LABEL`, else the pod label where configured), else
/// `exe:PATH` of its executable, else `comm:NAME`.
pub fn online_name(pid: u32) -> String {
    if let Some(l) = crate::workload::label_of(pid).filter(|l| !l.is_empty()) {
        return cut(&format!("label:{l}"));
    }
    match std::fs::read_link(format!("/proc/{pid}/exe")) {
        Ok(p) => {
            let p = p.display().to_string();
            cut(&format!("exe:{}", p.trim_end_matches(" (deleted)")))
        }
        Err(_) => cut(&format!("comm:{}", crate::procfs::comm(pid))),
    }
}

fn cut(s: &str) -> String {
    s.chars().take(MAX_NAME_CHARS).collect()
}

/// Seconds since the Unix epoch now (0 if the clock is before it).
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The saved reservations: read once at start, updated from the live controllers, written by a
/// writer thread.
///
/// The pool thread only copies the controllers' state and serialises it, at most every
/// [`SAVE_EVERY`] and at shutdown, between requests; the writer thread writes the file
/// ([`write_atomic`]), so a slow disk never holds up an online grow. Nothing read from the file
/// is trusted: a file that is unreadable, truncated, of another version or too large is moved
/// aside with a warning and every reservation starts cold; values are clamped by
/// [`ReservationController::warm_from`](crate::memory::reservation::ReservationController::warm_from).
pub struct WarmStore {
    settings: Option<WarmSettings>,
    entries: BTreeMap<(String, String), Saved>,
    dirty: bool,
    /// When the live reservations were last looked at for saving.
    last_check: Option<Instant>,
    writer: Option<Writer>,
}

impl WarmStore {
    /// No warm start: nothing is read or saved (`--pool-no-warm-start`, and tests).
    pub fn off() -> Self {
        WarmStore {
            settings: None,
            entries: BTreeMap::new(),
            dirty: false,
            last_check: None,
            writer: None,
        }
    }

    /// Reads the file of `settings` (at `now_unix_s`). A problem with it is logged as a warning
    /// and returned: the file is moved aside where it can be, and every reservation starts cold.
    pub fn open(settings: WarmSettings, now_unix_s: u64) -> (Self, Option<String>) {
        let (entries, problem) = match read(&settings.path) {
            Ok(saved) => (saved, None),
            Err(problem) => (Vec::new(), Some(problem)),
        };
        let warning = problem.map(|p| warn_cold(&settings.path, &p));
        let mut store = WarmStore {
            entries: BTreeMap::new(),
            ..WarmStore::off()
        };
        let max_age = settings.max_age.as_secs();
        for s in entries {
            // Too old to start anything warm: not kept.
            if now_unix_s.saturating_sub(s.saved_unix_s) <= max_age {
                store.entries.insert((s.gpu.clone(), s.online.clone()), s);
            }
        }
        store.settings = Some(settings);
        (store, warning)
    }

    /// What a new reservation of `online` on `gpu` starts from at `now_unix_s`: the saved state
    /// and its age in seconds, or why it starts cold.
    pub fn start(
        &self,
        gpu: &str,
        online: &str,
        now_unix_s: u64,
    ) -> Result<(&Learned, u64), String> {
        let Some(settings) = &self.settings else {
            return Err("warm start is off (--pool-no-warm-start)".into());
        };
        let key = (gpu.to_string(), online.to_string());
        let Some(s) = self.entries.get(&key) else {
            return Err(format!(
                "nothing saved for {online} on GPU {gpu} in {} (fresh for {})",
                settings.path.display(),
                human(settings.max_age.as_secs())
            ));
        };
        if s.saved_unix_s > now_unix_s.saturating_add(CLOCK_SLACK_S) {
            return Err(format!(
                "saved {} in the future (the clock moved back?)",
                human(s.saved_unix_s - now_unix_s)
            ));
        }
        let age = now_unix_s.saturating_sub(s.saved_unix_s);
        if age > settings.max_age.as_secs() {
            return Err(format!(
                "saved {} ago, more than --pool-warm-max-age {}",
                human(age),
                human(settings.max_age.as_secs())
            ));
        }
        Ok((&s.learned, age))
    }

    /// Keeps what the reservation of `online` on `gpu` has learned, to be saved.
    pub fn record(&mut self, gpu: &str, online: &str, learned: Learned, now_unix_s: u64) {
        if self.settings.is_none() {
            return;
        }
        let key = (gpu.to_string(), online.to_string());
        if self.entries.get(&key).is_some_and(|s| s.learned == learned) {
            return;
        }
        let saved = Saved {
            gpu: key.0.clone(),
            online: key.1.clone(),
            saved_unix_s: now_unix_s,
            learned,
        };
        self.entries.insert(key, saved);
        while self.entries.len() > MAX_ENTRIES {
            let oldest = self.entries.iter().min_by_key(|(_, s)| s.saved_unix_s);
            let Some(k) = oldest.map(|(k, _)| k.clone()) else {
                break;
            };
            self.entries.remove(&k);
        }
        self.dirty = true;
    }

    /// The file, unless warm start is off.
    pub fn path(&self) -> Option<&Path> {
        self.settings.as_ref().map(|s| s.path.as_path())
    }

    /// Whether it is time to look at the live reservations for a save: on, and [`SAVE_EVERY`]
    /// since the last time this said so.
    pub fn due(&mut self, now: Instant) -> bool {
        let due = self.settings.is_some()
            && self
                .last_check
                .is_none_or(|t| now.duration_since(t) >= SAVE_EVERY);
        if due {
            self.last_check = Some(now);
        }
        due
    }

    /// Hands the file to the writer if something changed since the last save.
    pub fn save(&mut self) {
        let Some(settings) = &self.settings else {
            return;
        };
        if !self.dirty {
            return;
        }
        let file = FileV1 {
            version: FORMAT_VERSION,
            reservations: self.entries.values().cloned().collect(),
        };
        let mut text = serde_json::to_vec_pretty(&file).expect("the file serialises");
        text.push(b'\n');
        let path = settings.path.clone();
        let writer = self.writer.get_or_insert_with(|| Writer::spawn(path));
        writer.send(text);
        self.dirty = false;
    }
}

/// `secs` as an operator reads it: 45 s, 12 min, 3.5 h.
fn human(secs: u64) -> String {
    match secs {
        s if s < 120 => format!("{s} s"),
        s if s < 7200 => format!("{} min", s / 60),
        s => format!("{:.1} h", s as f64 / 3600.0),
    }
}

/// The warning for a file that cannot be used, naming the file and the fix; also logged.
fn warn_cold(path: &Path, problem: &str) -> String {
    let w = format!(
        "the saved MIAD reservations file {} {problem}: online reservations start cold this \
         time (MIAD learns again from its initial headroom and T); it is replaced at the next \
         save. To stop using saved reservations, delete the file or start the daemon with \
         --pool-no-warm-start",
        path.display()
    );
    tracing::warn!("{w}");
    w
}

/// The saved reservations in `path` (none if there is no file), or what is wrong with it; a file
/// that is there but bad is moved aside to `<path>.bad`, which the error says.
fn read(path: &Path) -> Result<Vec<Saved>, String> {
    let problem = match read_text(path) {
        Ok(None) => return Ok(Vec::new()),
        Ok(Some(text)) => match parse(&text) {
            Ok(saved) => return Ok(saved),
            Err(p) => p,
        },
        Err(p) => return Err(p), // unreadable: left where it is
    };
    let mut aside = path.as_os_str().to_owned();
    aside.push(".bad");
    let aside = PathBuf::from(aside);
    Err(match std::fs::rename(path, &aside) {
        Ok(()) => format!("{problem} (moved aside to {})", aside.display()),
        Err(e) => format!("{problem} (could not move it aside: {e})"),
    })
}

/// The file's first [`MAX_FILE_BYTES`] + 1 bytes, none if there is no file.
fn read_text(path: &Path) -> Result<Option<Vec<u8>>, String> {
    use std::io::Read;
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot be read ({e})")),
    };
    let mut bytes = Vec::new();
    file.take(MAX_FILE_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| format!("cannot be read ({e})"))?;
    Ok(Some(bytes))
}

/// The entries of a file's `bytes`, checked: the size, the version, the format, the count and
/// the names.
fn parse(bytes: &[u8]) -> Result<Vec<Saved>, String> {
    if bytes.len() as u64 > MAX_FILE_BYTES {
        return Err(format!(
            "is larger than {} KiB, far more than {MAX_ENTRIES} reservations take",
            MAX_FILE_BYTES >> 10
        ));
    }
    let v: Value = serde_json::from_slice(bytes)
        .map_err(|e| format!("is not JSON (truncated or corrupted? {e})"))?;
    match v.get("version").and_then(Value::as_u64) {
        Some(n) if n == FORMAT_VERSION as u64 => {}
        Some(n) => {
            return Err(format!(
                "has format version {n}; this daemon reads version {FORMAT_VERSION}"
            ))
        }
        None => return Err("has no format version: not a reservations file".into()),
    }
    let file: FileV1 = serde_json::from_value(v)
        .map_err(|e| format!("does not match format version {FORMAT_VERSION} ({e})"))?;
    if file.reservations.len() > MAX_ENTRIES {
        return Err(format!(
            "holds {} reservations, more than the {MAX_ENTRIES} the daemon keeps",
            file.reservations.len()
        ));
    }
    let long = |s: &str| s.is_empty() || s.chars().count() > MAX_NAME_CHARS;
    if let Some(s) = file
        .reservations
        .iter()
        .find(|s| long(&s.gpu) || long(&s.online))
    {
        return Err(format!(
            "has a GPU or online name that is empty or over {MAX_NAME_CHARS} characters ({:?})",
            cut(&s.online)
        ));
    }
    Ok(file.reservations)
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, flushed to disk, renamed
/// over it, and the directory flushed, so that a reader (or a crash at any point) sees the old
/// file or the new one, never a part.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(dir) = dir {
        std::fs::create_dir_all(dir)?;
    }
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path)?;
    if let Some(d) = dir.and_then(|d| std::fs::File::open(d).ok()) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The thread that writes the file, off the pool thread; it writes only the latest of what
/// queued up, and finishes what it was given when dropped.
struct Writer {
    tx: Option<mpsc::Sender<Vec<u8>>>,
    thread: Option<JoinHandle<()>>,
}

impl Writer {
    fn spawn(path: PathBuf) -> Writer {
        let (tx, rx) = mpsc::channel::<Vec<u8>>();
        let thread = std::thread::Builder::new()
            .name("valve-pool-save".into())
            .spawn(move || write_loop(&path, &rx))
            .map_err(|e| tracing::warn!("reservations are not saved: no writer thread ({e})"))
            .ok();
        Writer {
            tx: thread.is_some().then_some(tx),
            thread,
        }
    }

    fn send(&self, bytes: Vec<u8>) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(bytes);
        }
    }
}

fn write_loop(path: &Path, rx: &mpsc::Receiver<Vec<u8>>) {
    let mut failing = false;
    while let Ok(mut bytes) = rx.recv() {
        while let Ok(newer) = rx.try_recv() {
            bytes = newer;
        }
        match write_atomic(path, &bytes) {
            Ok(()) if failing => {
                tracing::info!("saved MIAD reservations to {} again", path.display());
                failing = false;
            }
            Ok(()) => {}
            Err(e) if !failing => {
                tracing::warn!(
                    "cannot save MIAD reservations to {} ({e}): the next daemon starts them \
                     cold; fix the directory or choose another --pool-reservation-state",
                    path.display()
                );
                failing = true;
            }
            Err(_) => {}
        }
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_800_000_000;

    fn learned(target: u64) -> Learned {
        Learned {
            handle_bytes: 64 << 20,
            target_rate_per_min: 6.0,
            target_handles: target,
            headroom_handles: 40,
            interval_ms: 800,
            balance_events: -0.5,
            prev_event_headroom: Some(20),
            event_rate_per_min: 5.0,
            events: 12,
        }
    }

    fn settings(dir: &tempfile::TempDir) -> WarmSettings {
        WarmSettings {
            path: dir.path().join("state/reservations.json"),
            max_age: DEFAULT_MAX_AGE,
        }
    }

    /// A store of `settings` that saved `target` for `label:chat` on GPU `0000:01:00.0` at `at`,
    /// dropped (its writer finished).
    fn saved(settings: &WarmSettings, target: u64, at: u64) {
        let (mut store, warning) = WarmStore::open(settings.clone(), at);
        assert_eq!(warning, None);
        store.record("0000:01:00.0", "label:chat", learned(target), at);
        store.save();
    }

    fn cold_why(store: &WarmStore, online: &str, now: u64) -> String {
        store.start("0000:01:00.0", online, now).unwrap_err()
    }

    #[test]
    fn a_saved_reservation_starts_the_same_online_process_on_the_same_gpu_warm() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(&dir);
        saved(&s, 150, NOW);
        let (store, warning) = WarmStore::open(s.clone(), NOW + 30);
        assert_eq!(warning, None);
        let (got, age) = store.start("0000:01:00.0", "label:chat", NOW + 30).unwrap();
        assert_eq!((got, age), (&learned(150), 30));
        let why = cold_why(&store, "label:other", NOW + 30);
        assert!(
            why.starts_with("nothing saved for label:other on GPU 0000:01:00.0"),
            "{why}"
        );
        assert!(
            store.start("index 1", "label:chat", NOW).is_err(),
            "another GPU"
        );
        let text = std::fs::read_to_string(&s.path).unwrap();
        assert!(text.contains("\"version\": 1"), "{text}");
        let why = WarmStore::off()
            .start("0000:01:00.0", "label:chat", NOW)
            .unwrap_err();
        assert!(why.contains("--pool-no-warm-start"), "{why}");
    }

    #[test]
    fn an_old_or_future_reservation_starts_cold() {
        let dir = tempfile::tempdir().unwrap();
        let s = WarmSettings {
            max_age: Duration::from_secs(3600),
            ..settings(&dir)
        };
        saved(&s, 150, NOW);
        let (store, _) = WarmStore::open(s.clone(), NOW);
        let why = cold_why(&store, "label:chat", NOW + 3601);
        assert!(
            why.contains("more than --pool-warm-max-age 60 min"),
            "{why}"
        );
        let why = cold_why(&store, "label:chat", NOW - 3600);
        assert!(why.contains("in the future"), "{why}");
        assert!(
            store.start("0000:01:00.0", "label:chat", NOW - 60).is_ok(),
            "slack"
        );
        let (store, _) = WarmStore::open(s, NOW + 7200);
        assert!(cold_why(&store, "label:chat", NOW + 7200).starts_with("nothing saved"));
    }

    /// Opens `text` as the file: the warning, and whether the file was moved aside.
    fn open_bad(text: &[u8]) -> (String, WarmStore, bool) {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(&dir);
        std::fs::create_dir_all(s.path.parent().unwrap()).unwrap();
        std::fs::write(&s.path, text).unwrap();
        let (store, warning) = WarmStore::open(s.clone(), NOW);
        let warning = warning.expect("a bad file is warned about");
        assert!(
            warning.contains(&*s.path.to_string_lossy()),
            "names the file: {warning}"
        );
        assert!(warning.contains("start cold"), "{warning}");
        assert!(
            warning.contains("delete the file"),
            "says the fix: {warning}"
        );
        let aside = s.path.with_extension("json.bad");
        (warning, store, aside.exists() && !s.path.exists())
    }

    #[test]
    fn a_corrupted_truncated_foreign_or_hostile_file_starts_everything_cold() {
        let good = serde_json::to_string(&FileV1 {
            version: FORMAT_VERSION,
            reservations: vec![Saved {
                gpu: "0000:01:00.0".into(),
                online: "label:chat".into(),
                saved_unix_s: NOW,
                learned: learned(150),
            }],
        })
        .unwrap();
        let entry = &good[good.find("{\"gpu\"").unwrap()..good.rfind(']').unwrap()];
        let many = format!(
            "{{\"version\":1,\"reservations\":[{}]}}",
            vec![entry; 300].join(",")
        );
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"\x00\x01garbage".to_vec(), "is not JSON"),
            (good.as_bytes()[..good.len() / 2].to_vec(), "truncated"),
            (
                good.replace("\"version\":1", "\"version\":2").into(),
                "format version 2",
            ),
            (b"[1, 2]".to_vec(), "no format version"),
            (
                good.replace("\"events\":12", "\"events\":-12").into(),
                "does not match",
            ),
            (
                good.replace("\"events\":12", "\"events\":12,\"x\":1")
                    .into(),
                "does not match",
            ),
            (
                good.replace("label:chat", &"x".repeat(300)).into(),
                "over 200 characters",
            ),
            (good.replace("label:chat", "").into(), "empty"),
            (many.into(), "300 reservations"),
            (
                vec![b' '; (MAX_FILE_BYTES + 10) as usize],
                "larger than 1024 KiB",
            ),
        ];
        for (text, expect) in cases {
            let (warning, store, moved) = open_bad(&text);
            assert!(warning.contains(expect), "{expect}: {warning}");
            assert!(moved, "{expect}: moved aside");
            assert!(cold_why(&store, "label:chat", NOW).starts_with("nothing saved"));
        }
    }

    #[test]
    fn an_unreadable_file_is_warned_about_and_left_where_it_is() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(&dir);
        std::fs::create_dir_all(&s.path).unwrap(); // a directory where the file should be
        let (store, warning) = WarmStore::open(s.clone(), NOW);
        assert!(warning.unwrap().contains("cannot be read"));
        assert!(s.path.is_dir());
        assert!(store.start("0000:01:00.0", "label:chat", NOW).is_err());
    }

    #[test]
    fn the_file_is_replaced_whole_never_rewritten_in_place() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(&dir);
        saved(&s, 150, NOW);
        let before = std::fs::read_to_string(&s.path).unwrap();
        // A second name for the old file: rewriting it in place would change what it shows.
        let old = dir.path().join("old.json");
        std::fs::hard_link(&s.path, &old).unwrap();
        saved(&s, 90, NOW + 10);
        assert_eq!(
            std::fs::read_to_string(&old).unwrap(),
            before,
            "old file untouched"
        );
        let (store, _) = WarmStore::open(s.clone(), NOW + 10);
        let (got, _) = store.start("0000:01:00.0", "label:chat", NOW + 10).unwrap();
        assert_eq!(got.target_handles, 90, "the new file is complete");
        let names: Vec<_> = std::fs::read_dir(s.path.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names, ["reservations.json"], "no temporary file left");
    }

    #[test]
    fn saves_wait_for_the_interval_and_skip_what_did_not_change() {
        let dir = tempfile::tempdir().unwrap();
        let (mut store, _) = WarmStore::open(settings(&dir), NOW);
        let t0 = Instant::now();
        assert!(store.due(t0));
        assert!(!store.due(t0 + SAVE_EVERY / 2));
        assert!(store.due(t0 + SAVE_EVERY));
        store.record("g", "o", learned(5), NOW);
        assert!(store.dirty);
        store.save();
        store.record("g", "o", learned(5), NOW + 1);
        assert!(!store.dirty, "nothing new to write");
        for i in 0..(MAX_ENTRIES as u64 + 20) {
            store.record("g", &format!("label:{i}"), learned(i), NOW + i);
        }
        assert_eq!(store.entries.len(), MAX_ENTRIES, "the oldest are dropped");
        assert!(!store.entries.contains_key(&("g".into(), "o".into())));
        assert!(WarmStore::off().path().is_none() && !WarmStore::off().due(t0));
    }

    #[test]
    fn names_are_the_pci_address_and_the_label_or_executable() {
        assert_eq!(gpu_name(Some("0000:3B:00.0".into()), 2), "0000:3b:00.0");
        assert_eq!(gpu_name(None, 2), "index 2");
        let me = online_name(std::process::id());
        assert!(me.starts_with("label:") || me.starts_with("exe:/"), "{me}");
        assert_eq!(online_name(u32::MAX), "comm:", "a process that is gone");
        assert_eq!(cut(&"é".repeat(500)).chars().count(), MAX_NAME_CHARS);
    }
}
