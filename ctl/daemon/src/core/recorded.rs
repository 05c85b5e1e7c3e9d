//! The state file as the core writes it: a write is skipped when the file already lists every
//! channel, so moving a process between the gate and a manual preempt costs no write on the
//! memory pool's reclaim path; the exact set is written at the loop's next turn.
//!
//! A file that lists more than is disabled is safe: a restart enables those channels too, and
//! enabling a channel that runs is a no-op. One that lists less is not, so anything new is
//! written before the call returns.

use std::cell::{Cell, RefCell};
use std::collections::BTreeSet;

use valve::state::{DisabledRecord, StateFile};

/// One channel as the state file names it: pid, RM device instance, client, channel.
type ChannelKey = (u32, u32, u32, u32);

fn keys(records: &[DisabledRecord]) -> BTreeSet<ChannelKey> {
    records
        .iter()
        .flat_map(|r| {
            r.channels
                .iter()
                .map(move |&c| (r.pid, r.device_instance, r.client, c))
        })
        .collect()
}

/// The state file and what its last write listed.
pub(crate) struct RecordedState {
    file: StateFile,
    written: RefCell<BTreeSet<ChannelKey>>,
    /// Set when the file lists more than is recorded now; cleared by the next exact write.
    stale: Cell<bool>,
    writes: Cell<u64>,
}

impl RecordedState {
    pub(crate) fn new(file: StateFile) -> Self {
        RecordedState {
            file,
            written: RefCell::new(BTreeSet::new()),
            stale: Cell::new(false),
            writes: Cell::new(0),
        }
    }

    pub(crate) fn file(&self) -> &StateFile {
        &self.file
    }

    /// Writes exactly `records`.
    pub(crate) fn write(&self, records: &[DisabledRecord]) -> valve::error::Result<()> {
        self.file.save(records)?;
        *self.written.borrow_mut() = keys(records);
        self.stale.set(false);
        self.writes.set(self.writes.get() + 1);
        Ok(())
    }

    /// Whether the file already lists every channel of `records` (then it is owed an exact
    /// write, which the caller leaves for later). Allocates nothing: this is on the reclaim path.
    pub(crate) fn covers<'a>(&self, mut records: impl Iterator<Item = &'a DisabledRecord>) -> bool {
        let written = self.written.borrow();
        let covered = records.all(|r| {
            r.channels
                .iter()
                .all(|&c| written.contains(&(r.pid, r.device_instance, r.client, c)))
        });
        if covered {
            self.stale.set(true);
        }
        covered
    }

    /// Whether the file lists more than is recorded now.
    pub(crate) fn is_stale(&self) -> bool {
        self.stale.get()
    }

    /// How many times the file was written (for tests).
    #[cfg(test)]
    pub(crate) fn writes(&self) -> u64 {
        self.writes.get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(pid: u32, channels: &[u32]) -> DisabledRecord {
        DisabledRecord {
            pid,
            device_instance: 0,
            client: 0xc1d0_0000 + pid,
            channels: channels.to_vec(),
        }
    }

    #[test]
    fn a_covered_set_needs_no_write_and_a_new_channel_does() {
        let dir = tempfile::tempdir().unwrap();
        let s = RecordedState::new(StateFile::in_dir(dir.path()));
        let both = [rec(7, &[1, 2]), rec(8, &[3])];
        s.write(&both).unwrap();
        // Process 7 moves (same channels, another owner in the core): nothing to write.
        assert!(s.covers([rec(7, &[1, 2])].iter()));
        assert_eq!(s.writes(), 1);
        assert!(s.is_stale());
        assert_eq!(s.file().load().unwrap(), both, "the file still lists both");
        // A channel the file lacks is not covered; the exact write clears the staleness.
        let grown = [rec(7, &[1, 2]), rec(9, &[4])];
        assert!(!s.covers(grown.iter()));
        s.write(&grown).unwrap();
        assert_eq!(s.writes(), 2);
        assert!(!s.is_stale());
        assert_eq!(s.file().load().unwrap(), grown);
        // The same channel under another client is not covered.
        let mut other = rec(9, &[4]);
        other.client += 1;
        assert!(!s.covers(std::slice::from_ref(&other).iter()));
    }
}
