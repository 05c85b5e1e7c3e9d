//! What the daemon has disabled, persisted in `/run/valve/` before each disable, so that a
//! restarted daemon (or `valvectl resume --all`) re-enables it after a crash.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use valve_ioctl_bindings::{ChannelHandle, ClientHandle};

use crate::controller::{ChannelTarget, Controller, PreemptMode};
use crate::driver::RmDriver;
use crate::error::{Error, Result};

/// Channels of one process on one GPU that Valve disabled.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisabledRecord {
    /// The process.
    pub pid: u32,
    /// RM device instance of the GPU (stable while the driver is loaded).
    pub device_instance: u32,
    /// The process's client.
    pub client: u32,
    /// Its channels.
    pub channels: Vec<u32>,
}

/// The state file: `<dir>/disabled.json`, replaced atomically on every change.
#[derive(Clone, Debug)]
pub struct StateFile {
    path: PathBuf,
}

impl StateFile {
    /// The state file in `dir` (created on first save).
    pub fn in_dir(dir: &Path) -> Self {
        StateFile {
            path: dir.join("disabled.json"),
        }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The records, or none if there is no file.
    pub fn load(&self) -> Result<Vec<DisabledRecord>> {
        match std::fs::read_to_string(&self.path) {
            Ok(text) => serde_json::from_str(&text).map_err(|e| Error::Os {
                op: format!("parsing {}", self.path.display()),
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(Error::Os {
                op: format!("reading {}", self.path.display()),
                source: e,
            }),
        }
    }

    /// The records, or, if the file does not parse (truncated by a crash or a full disk,
    /// corrupted, or written by something else), the records that can still be read from it.
    /// The bad file is moved aside to `disabled.json.corrupt-<unix seconds>` so that it is kept
    /// for inspection and the next save starts clean. Only an unreadable file (I/O, permissions)
    /// is an error: a daemon must start and re-enable what it can rather than refuse to run.
    pub fn load_or_salvage(&self) -> Result<Loaded> {
        let text = match std::fs::read(&self.path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Loaded::default()),
            Err(e) => {
                return Err(Error::Os {
                    op: format!("reading {}", self.path.display()),
                    source: e,
                })
            }
        };
        let reason = match serde_json::from_slice::<Vec<DisabledRecord>>(&text) {
            Ok(records) => {
                return Ok(Loaded {
                    records,
                    salvage: None,
                })
            }
            Err(e) => e.to_string(),
        };
        let (records, dropped) = salvage_records(&text);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let aside = self.path.with_extension(format!("json.corrupt-{stamp}"));
        std::fs::rename(&self.path, &aside).map_err(|e| Error::Os {
            op: format!(
                "moving the unreadable {} aside to {}",
                self.path.display(),
                aside.display()
            ),
            source: e,
        })?;
        Ok(Loaded {
            records,
            salvage: Some(Salvage {
                moved_to: aside,
                reason,
                dropped,
            }),
        })
    }

    /// Replaces the records (write to a temporary file, rename). No fsync: the file guards
    /// against a daemon crash, which the page cache survives; a machine crash resets the GPUs,
    /// so records from before it are moot (and `/run` is a tmpfs). The write is on the memory
    /// pool's reclaim path, where a disk flush would be the slowest step.
    pub fn save(&self, records: &[DisabledRecord]) -> Result<()> {
        use std::io::Write;
        let os = |op: &str, e: std::io::Error| Error::Os {
            op: format!("{op} {}", self.path.display()),
            source: e,
        };
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| os("creating the directory of", e))?;
        }
        let tmp = self.path.with_extension("json.tmp");
        let mut f = std::fs::File::create(&tmp).map_err(|e| os("writing", e))?;
        f.write_all(
            serde_json::to_string_pretty(records)
                .expect("records serialise")
                .as_bytes(),
        )
        .map_err(|e| os("writing", e))?;
        std::fs::rename(&tmp, &self.path).map_err(|e| os("replacing", e))
    }
}

/// What [`StateFile::load_or_salvage`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Loaded {
    /// The records (all of them, or those salvaged from a bad file).
    pub records: Vec<DisabledRecord>,
    /// Set when the file did not parse and was moved aside.
    pub salvage: Option<Salvage>,
}

/// A state file that did not parse: where it went and what was lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Salvage {
    /// Where the bad file was moved.
    pub moved_to: PathBuf,
    /// Why it did not parse (serde_json's message, with line and column).
    pub reason: String,
    /// Record-like objects in it that could not be read as records.
    pub dropped: usize,
}

/// The records that can be read from a state file that does not parse as a whole: every
/// complete `{...}` object in it that is a valid record (records hold no nested objects, so
/// a brace scan finds them even in a truncated array). Returns (records, objects dropped).
fn salvage_records(text: &[u8]) -> (Vec<DisabledRecord>, usize) {
    let mut records = Vec::new();
    let mut dropped = 0;
    let mut start = None;
    let mut in_string = false;
    let mut escaped = false;
    for (i, &b) in text.iter().enumerate() {
        if in_string {
            match (escaped, b) {
                (true, _) => escaped = false,
                (false, b'\\') => escaped = true,
                (false, b'"') => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' => start = Some(i),
            b'}' => {
                if let Some(s) = start.take() {
                    match serde_json::from_slice::<DisabledRecord>(&text[s..=i]) {
                        Ok(r) if !r.channels.is_empty() => records.push(r),
                        _ => dropped += 1,
                    }
                }
            }
            _ => {}
        }
    }
    // An object cut off by the end of the file.
    dropped += usize::from(start.is_some());
    (records, dropped)
}

/// Channel targets of records, on the controller's GPUs; records of GPUs it does not have are
/// returned separately.
pub fn targets_of<D: RmDriver>(
    ctl: &Controller<D>,
    records: &[DisabledRecord],
) -> (Vec<ChannelTarget>, Vec<DisabledRecord>) {
    let gpus = ctl.gpus();
    let mut targets = Vec::new();
    let mut unknown = Vec::new();
    for r in records {
        match gpus.iter().find(|g| g.device_instance == r.device_instance) {
            Some(g) => targets.extend(r.channels.iter().map(|&c| ChannelTarget {
                gpu: g.index,
                client: ClientHandle(r.client),
                channel: ChannelHandle(c),
            })),
            None => unknown.push(r.clone()),
        }
    }
    (targets, unknown)
}

/// Re-enables recorded channels record by record, so one exited process does not stop the
/// others. Returns (re-enabled channel count, per-record failures as text).
pub fn reenable<D: RmDriver>(
    ctl: &Controller<D>,
    records: &[DisabledRecord],
) -> (usize, Vec<String>) {
    let mut done = 0;
    let mut failures = Vec::new();
    for r in records {
        let (targets, unknown) = targets_of(ctl, std::slice::from_ref(r));
        if !unknown.is_empty() {
            failures.push(format!(
                "pid {}: no GPU with RM instance {} on this node",
                r.pid, r.device_instance
            ));
            continue;
        }
        let res = ctl
            .plan(&targets, PreemptMode::Preempt)
            .and_then(|p| ctl.enable(&p));
        match res {
            Ok(_) => done += targets.len(),
            // The process is gone: its channels went with it, nothing is left frozen.
            Err(e)
                if matches!(
                    e.rm_status(),
                    Some(valve_ioctl_bindings::NV_ERR_INVALID_CLIENT)
                        | Some(valve_ioctl_bindings::NV_ERR_INVALID_CHANNEL)
                ) => {}
            Err(e) => failures.push(format!("pid {}: {e}", r.pid)),
        }
    }
    (done, failures)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fake::FakeRm;

    fn rec(pid: u32, inst: u32, chans: &[u32]) -> DisabledRecord {
        DisabledRecord {
            pid,
            device_instance: inst,
            client: 0xc1d0_0042,
            channels: chans.to_vec(),
        }
    }

    #[test]
    fn save_load_roundtrip_and_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        let sf = StateFile::in_dir(&dir.path().join("valve"));
        assert!(sf.load().unwrap().is_empty());
        let recs = vec![rec(1, 0, &[5, 6]), rec(2, 1, &[7])];
        sf.save(&recs).unwrap();
        assert_eq!(sf.load().unwrap(), recs);
        std::fs::write(sf.path(), "not json").unwrap();
        assert!(sf.load().unwrap_err().to_string().contains("parsing"));
    }

    #[test]
    fn a_truncated_or_corrupt_state_file_is_moved_aside_and_what_is_whole_is_kept() {
        let dir = tempfile::tempdir().unwrap();
        let sf = StateFile::in_dir(dir.path());
        let recs = vec![rec(1, 0, &[5, 6]), rec(2, 1, &[7]), rec(3, 0, &[8])];
        sf.save(&recs).unwrap();
        let whole = std::fs::read_to_string(sf.path()).unwrap();
        // Cut inside the third record, as a crash during a non-atomic write would.
        let cut = whole.find("\"pid\": 3").unwrap() + 4;
        std::fs::write(sf.path(), &whole[..cut]).unwrap();
        let loaded = sf.load_or_salvage().unwrap();
        assert_eq!(loaded.records, recs[..2].to_vec());
        let salvage = loaded.salvage.expect("the file did not parse");
        assert_eq!(salvage.dropped, 1, "{salvage:?}");
        assert!(salvage.reason.contains("EOF"), "{}", salvage.reason);
        assert!(!sf.path().exists(), "the bad file is moved aside");
        assert_eq!(
            std::fs::read_to_string(&salvage.moved_to).unwrap(),
            &whole[..cut]
        );
        // Garbage and a record of the wrong shape: nothing recovered, nothing invented.
        std::fs::write(sf.path(), "\u{0}\u{0}{\"pid\": \"x\"} not json").unwrap();
        let loaded = sf.load_or_salvage().unwrap();
        assert!(loaded.records.is_empty());
        assert_eq!(loaded.salvage.unwrap().dropped, 1);
        // A good file is read as it is and left in place.
        sf.save(&recs).unwrap();
        assert_eq!(
            sf.load_or_salvage().unwrap(),
            Loaded {
                records: recs,
                salvage: None
            }
        );
        assert!(sf.path().exists());
    }

    #[test]
    fn reenable_recovers_disabled_channels_and_skips_gone_processes() {
        let ctl = Controller::with_driver(FakeRm::host(2)).unwrap();
        let inst = ctl.gpus()[1].device_instance;
        let chans = [ChannelHandle(0x5c00_0010), ChannelHandle(0x5c00_0011)];
        ctl.driver()
            .add_channels(ClientHandle(0xc1d0_0042), inst, &chans);
        // Freeze them as a crashed daemon would have left them.
        let (t, _) = targets_of(&ctl, &[rec(9, inst, &[0x5c00_0010, 0x5c00_0011])]);
        let plan = ctl.plan(&t, PreemptMode::Preempt).unwrap();
        ctl.disable(&plan).unwrap().keep_disabled();
        assert_eq!(ctl.driver().disabled().len(), 2);
        let gone = DisabledRecord {
            client: 0xdead,
            ..rec(10, inst, &[1])
        };
        let (n, failures) = reenable(
            &ctl,
            &[
                rec(9, inst, &[0x5c00_0010, 0x5c00_0011]),
                gone,
                rec(11, 77, &[1]),
            ],
        );
        assert_eq!(n, 2);
        assert!(ctl.driver().disabled().is_empty());
        assert_eq!(failures.len(), 1, "{failures:?}");
        assert!(failures[0].contains("RM instance 77"));
    }
}
