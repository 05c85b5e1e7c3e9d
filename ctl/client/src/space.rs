//! A KV space's slots and what backs each one (pool memory, the quarantine, or nothing), and the
//! changes the client makes to them: grants, giving back, reclaim and collecting invalidations.
//!
//! No sockets here: the client and the callback thread call these methods under one lock, and
//! the tests drive them through a fake mapper.

use std::os::fd::{AsFd, OwnedFd};

use crate::layout::Layout;
use crate::mapper::Mapper;
use crate::owners::Owners;
use crate::select::{Candidate, Selection, Selector};
use crate::{Error, Result};

/// What backs a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// Nothing is mapped.
    Free,
    /// Pool handle `handle` is mapped; `ours`: lent to this client (a premapped online client
    /// maps handles it does not hold); `seq`: grant order, for FIFO.
    Pool { handle: u32, ours: bool, seq: u64 },
    /// The quarantine is mapped (the handle went back in a reclaim); where the slot is on its
    /// way back to being refillable.
    Quarantine(Quarantined),
}

/// A quarantined slot's progress: its blocks are collected by the framework, then (with
/// explicit release) the framework says no kernel can touch the slot any more.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Quarantined {
    /// Its invalidated blocks are not collected yet.
    Uncollected,
    /// Collected; waiting for `release_quarantined` (a kernel still in flight may use it).
    Collected,
    /// Empty: a grant may unmap the quarantine and place a handle here.
    Refillable,
}

/// Counters for [`crate::Stats`].
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Counters {
    pub reclaims: u64,
    pub reclaimed_handles: u64,
    pub invalidated_blocks: u64,
    pub pool_handle_events: u64,
    pub unmappable_handles: u64,
    pub callback_errors: u64,
    /// Online: `grow` replies for which the daemon took memory from offline.
    pub grows_with_reclaim: u64,
    /// Online: handles the last `grow` reply took from offline.
    pub last_grow_reclaimed: u64,
}

/// The slots, the block owners and the invalidations of one KV space.
pub(crate) struct Space {
    pub layout: Layout,
    mapper: Box<dyn Mapper>,
    slots: Vec<Slot>,
    pub owners: Owners,
    selector: Selector,
    policy: Selection,
    invalidated: Vec<u32>,
    seq: u64,
    candidates: Vec<Candidate>,
    chosen: Vec<u32>,
    /// Handles a grow reply lent that are not placed yet (a reclaim may take them first).
    incoming: Vec<u32>,
    /// Handles given back here whose `shrink` the daemon has not confirmed yet (it still counts
    /// them as this client's, so a reclaim may ask for them).
    releasing: Vec<u32>,
    /// A `grow` is out and its reply not registered yet.
    growing: bool,
    /// Quarantined slots wait for [`Space::release_quarantined`] after being collected.
    explicit_release: bool,
    pub counters: Counters,
}

impl Space {
    pub fn new(
        layout: Layout,
        mapper: Box<dyn Mapper>,
        policy: Selection,
        explicit_release: bool,
    ) -> Space {
        Space {
            layout,
            mapper,
            slots: vec![Slot::Free; layout.slots],
            owners: Owners::new(layout.blocks()),
            selector: Selector::default(),
            policy,
            invalidated: Vec::new(),
            seq: 0,
            candidates: Vec::with_capacity(layout.slots),
            chosen: Vec::with_capacity(layout.slots),
            incoming: Vec::new(),
            releasing: Vec::new(),
            growing: false,
            explicit_release,
            counters: Counters::default(),
        }
    }

    #[cfg(test)]
    pub fn slot(&self, slot: usize) -> Slot {
        self.slots[slot]
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// Premapped online: maps each announced pool handle at slot = its id (not ours yet).
    /// Handles already mapped are skipped; ids beyond the space are counted, not mapped.
    pub fn map_announced(&mut self, ids: &[u32], fds: &[OwnedFd]) -> Result<()> {
        if ids.len() != fds.len() {
            return Err(Error::Protocol(format!(
                "pool_handles names {} handles but carries {} descriptors",
                ids.len(),
                fds.len()
            )));
        }
        self.counters.pool_handle_events += 1;
        for (&id, fd) in ids.iter().zip(fds) {
            let s = id as usize;
            match self.slots.get(s) {
                None => self.counters.unmappable_handles += 1,
                Some(Slot::Pool { .. }) => {}
                Some(_) => {
                    self.mapper.map_pool(s, fd.as_fd())?;
                    self.slots[s] = Slot::Pool {
                        handle: id,
                        ours: false,
                        seq: 0,
                    };
                }
            }
        }
        Ok(())
    }

    /// Premapped online: the ids of `ids` not mapped yet.
    pub fn unmapped_of(&self, ids: &[u32]) -> Vec<u32> {
        ids.iter()
            .copied()
            .filter(|&h| !matches!(self.slots.get(h as usize), Some(Slot::Pool { handle, .. }) if *handle == h))
            .collect()
    }

    /// Premapped online: the daemon lent `ids` (all mapped): they are ours to use.
    pub fn lend_premapped(&mut self, ids: &[u32]) {
        for &h in ids {
            let seq = self.next_seq();
            if let Some(Slot::Pool { ours, seq: s, .. }) = self.slots.get_mut(h as usize) {
                *ours = true;
                *s = seq;
            }
        }
    }

    /// Empty slots to place `n` handles in: refillable quarantined slots first, then free ones.
    pub fn empty_slots(&self, n: usize) -> Result<Vec<u32>> {
        let refillable = Slot::Quarantine(Quarantined::Refillable);
        let quarantined = (0..self.slots.len()).filter(|&s| self.slots[s] == refillable);
        let free = (0..self.slots.len()).filter(|&s| self.slots[s] == Slot::Free);
        let found: Vec<u32> = quarantined.chain(free).take(n).map(|s| s as u32).collect();
        if found.len() < n {
            return Err(Error::NoSpace {
                empty: found.len() as u32,
                asked: n as u32,
            });
        }
        Ok(found)
    }

    /// A `grow` request is about to go out.
    pub fn begin_grow(&mut self) {
        self.growing = true;
    }

    /// Its reply lent `ids` (to be placed one by one), or it failed (`None`).
    pub fn end_grow(&mut self, lent: Option<&[u32]>) {
        self.growing = false;
        self.incoming.extend(lent.unwrap_or_default());
    }

    /// Whether a `grow` reply may still bring handles a reclaim could ask for.
    pub fn growing(&self) -> bool {
        self.growing
    }

    /// Lent handles not placed yet (a reclaim may have taken some); they are the caller's to
    /// return.
    pub fn drain_incoming(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.incoming)
    }

    /// Maps lent handle `handle` at the next empty slot and returns the slot; `None` if a
    /// reclaim gave the handle back before it was placed.
    pub fn place_next(&mut self, handle: u32, fd: &OwnedFd) -> Result<Option<u32>> {
        let Some(i) = self.incoming.iter().position(|&h| h == handle) else {
            return Ok(None);
        };
        self.incoming.swap_remove(i);
        let slot = match self.empty_slots(1) {
            Ok(s) => s[0],
            Err(e) => {
                self.releasing.push(handle);
                return Err(e);
            }
        };
        if let Err(e) = self.place(slot, handle, fd) {
            self.releasing.push(handle);
            return Err(e);
        }
        Ok(Some(slot))
    }

    /// Handles about to be returned with `shrink` (a reclaim may hand some over first).
    pub fn start_release(&mut self, handles: &[u32]) {
        self.releasing.extend(handles);
    }

    /// The handles still being returned.
    pub fn releasing(&self) -> Vec<u32> {
        self.releasing.clone()
    }

    /// The daemon has answered the `shrink`.
    pub fn end_release(&mut self) {
        self.releasing.clear();
    }

    /// How many handles a reclaim could give back now.
    pub fn reclaimable(&self) -> usize {
        let mapped = self.slots.iter();
        let ours = mapped.filter(|s| matches!(s, Slot::Pool { ours: true, .. }));
        ours.count() + self.incoming.len() + self.releasing.len()
    }

    /// Maps pool handle `handle` (its descriptor `fd`) at the empty slot `slot`, replacing the
    /// quarantine if it is there.
    pub fn place(&mut self, slot: u32, handle: u32, fd: &OwnedFd) -> Result<()> {
        let s = slot as usize;
        match self.slots[s] {
            Slot::Quarantine(Quarantined::Refillable) => {
                self.mapper.unmap(s)?;
                self.slots[s] = Slot::Free;
            }
            Slot::Free => {}
            other => {
                return Err(Error::Invalid(format!(
                    "slot {slot} is not empty ({other:?})"
                )))
            }
        }
        self.mapper.map_pool(s, fd.as_fd())?;
        let seq = self.next_seq();
        self.slots[s] = Slot::Pool {
            handle,
            ours: true,
            seq,
        };
        Ok(())
    }

    /// Gives `slots` back. Premapped (online): they stay mapped and stop being ours. Otherwise
    /// they are unmapped and their handles join those being released; quarantined slots (their
    /// handle already went back in a reclaim) are just unmapped. Returns the pool handle ids to
    /// tell the daemon. Checks every slot before changing any.
    pub fn give_back(&mut self, slots: &[u32], premapped: bool) -> Result<Vec<u32>> {
        for (i, &s) in slots.iter().enumerate() {
            let ok = match self.slots.get(s as usize) {
                Some(Slot::Pool { ours, .. }) => *ours,
                Some(Slot::Quarantine(_)) => !premapped,
                _ => false,
            };
            if !ok || slots[..i].contains(&s) {
                return Err(Error::Invalid(format!(
                    "slot {s} holds no memory lent to this client (or is named twice): give back only slots grow returned"
                )));
            }
        }
        let mut handles = Vec::with_capacity(slots.len());
        for &s in slots {
            let s = s as usize;
            match self.slots[s] {
                Slot::Pool { handle, .. } if premapped => {
                    self.slots[s] = Slot::Pool {
                        handle,
                        ours: false,
                        seq: 0,
                    };
                    handles.push(handle);
                }
                Slot::Pool { handle, .. } => {
                    self.mapper.unmap(s)?;
                    self.slots[s] = Slot::Free;
                    self.releasing.push(handle);
                    handles.push(handle);
                }
                _ => {
                    self.mapper.unmap(s)?;
                    self.slots[s] = Slot::Free;
                }
            }
        }
        Ok(handles)
    }

    /// The reclaim: gives back `count` handles and appends their ids to `handles`. Lent handles
    /// not placed yet go first (they cost nothing); then Algorithm 1 (or FIFO) picks mapped
    /// slots, each swapped to the quarantine with its blocks recorded as invalidated; then, if
    /// still short, handles whose `shrink` the daemon has not seen. Stops at the first mapping
    /// error (the handles done so far are in `handles`).
    pub fn reclaim(&mut self, count: usize, handles: &mut Vec<u32>) -> Result<()> {
        self.counters.reclaims += 1;
        let start = handles.len();
        let n = count.min(self.incoming.len());
        handles.extend(self.incoming.drain(..n));
        self.reclaim_mapped(count - n, handles)?;
        let n = (count - (handles.len() - start)).min(self.releasing.len());
        handles.extend(self.releasing.drain(..n));
        self.counters.reclaimed_handles += (handles.len() - start) as u64;
        Ok(())
    }

    fn reclaim_mapped(&mut self, count: usize, handles: &mut Vec<u32>) -> Result<()> {
        let before = handles.len();
        self.candidates.clear();
        for (s, slot) in self.slots.iter().enumerate() {
            if let Slot::Pool {
                ours: true, seq, ..
            } = *slot
            {
                self.candidates.push(Candidate {
                    slot: s as u32,
                    seq,
                });
            }
        }
        self.chosen.clear();
        self.selector.choose(
            self.policy,
            &self.candidates,
            count,
            self.layout.blocks_per_slot,
            &self.owners,
            &mut self.chosen,
        );
        for i in 0..self.chosen.len() {
            let s = self.chosen[i] as usize;
            let Slot::Pool { handle, .. } = self.slots[s] else {
                unreachable!("candidates are pool slots")
            };
            self.mapper.unmap(s)?;
            self.slots[s] = Slot::Free;
            handles.push(handle);
            self.mapper.map_quarantine(s)?;
            self.slots[s] = Slot::Quarantine(Quarantined::Uncollected);
            let blocks = self.layout.slot_blocks(s);
            self.invalidated.extend(blocks.clone());
            self.owners.invalidate(blocks);
            self.counters.invalidated_blocks += self.layout.blocks_per_slot as u64;
        }
        debug_assert!(handles.len() - before <= count);
        Ok(())
    }

    /// Moves up to `buf.len()` invalidated block ids into `buf`. When none are left, the
    /// framework has dropped their requests: doomed requests are forgotten, and quarantined
    /// slots are collected (refillable at once unless release is explicit).
    pub fn take_invalidated_into(&mut self, buf: &mut [u32]) -> usize {
        let n = buf.len().min(self.invalidated.len());
        buf[..n].copy_from_slice(&self.invalidated[..n]);
        self.invalidated.drain(..n);
        if self.invalidated.is_empty() {
            let next = match self.explicit_release {
                true => Quarantined::Collected,
                false => Quarantined::Refillable,
            };
            self.advance_quarantine(Quarantined::Uncollected, next);
            self.owners.drop_doomed();
        }
        n
    }

    /// Explicit release: collected quarantined slots become refillable (no kernel of the
    /// framework can touch them any more). Returns how many.
    pub fn release_quarantined(&mut self) -> usize {
        self.advance_quarantine(Quarantined::Collected, Quarantined::Refillable)
    }

    fn advance_quarantine(&mut self, from: Quarantined, to: Quarantined) -> usize {
        let mut n = 0;
        for s in self
            .slots
            .iter_mut()
            .filter(|s| **s == Slot::Quarantine(from))
        {
            *s = Slot::Quarantine(to);
            n += 1;
        }
        n
    }

    /// Invalidated blocks not collected yet.
    pub fn pending_invalidated(&self) -> usize {
        self.invalidated.len()
    }

    /// The slots backed by pool memory lent to this client, in order.
    pub fn held_slots(&self) -> Vec<u32> {
        (0..self.slots.len() as u32)
            .filter(|&s| matches!(self.slots[s as usize], Slot::Pool { ours: true, .. }))
            .collect()
    }

    /// `(held, mapped, quarantined)` slot counts.
    pub fn census(&self) -> (u32, u32, u32) {
        let mut c = (0, 0, 0);
        for s in &self.slots {
            match s {
                Slot::Pool { ours, .. } => {
                    c.1 += 1;
                    c.0 += *ours as u32;
                }
                Slot::Quarantine(_) => c.2 += 1,
                Slot::Free => {}
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mapper::{self, Backend, FakeCall, FakeGpu};

    fn memfd(name: &str) -> OwnedFd {
        crate::mock::memfd(name)
    }

    /// 2 regions, 4 slots, 2 blocks per slot.
    fn space(policy: Selection) -> (Space, FakeGpu) {
        let fake = FakeGpu::new();
        let layout = Layout::plan(2, 0, 2 << 20, 8 << 20, 2 << 20, Some(4), false).unwrap();
        let m = mapper::open(&Backend::Fake(fake.clone()), 0, &layout, true).unwrap();
        (Space::new(layout, m, policy, false), fake)
    }

    #[test]
    fn a_reclaimed_slot_is_quarantined_then_refilled_first_once_collected() {
        let (mut sp, fake) = space(Selection::Greedy);
        for (slot, h) in [(0, 10), (1, 11), (2, 12)] {
            sp.place(slot, h, &memfd(&format!("h{h}"))).unwrap();
        }
        sp.owners.set(0, 1, 100).unwrap(); // slot 0
        sp.owners.set(2, 2, 1).unwrap(); // slot 1
        sp.owners.set(5, 3, 50).unwrap(); // slot 2
        let mut handles = Vec::new();
        sp.reclaim(2, &mut handles).unwrap();
        assert_eq!(handles, vec![11, 12]);
        assert_eq!(fake.source_at(1).as_deref(), Some("quarantine"));
        let mapped = fake.mapped();
        assert_eq!(
            mapped[&(1, 2)],
            ("quarantine".to_string(), 1),
            "piece 1 in region 1"
        );
        // Until collected, pending quarantined slots are not refilled.
        assert_eq!(sp.empty_slots(1).unwrap(), vec![3]);
        let mut buf = [0u32; 3];
        assert_eq!(sp.take_invalidated_into(&mut buf), 3);
        assert_eq!(buf, [2, 3, 4]);
        assert_eq!(
            sp.slot(1),
            Slot::Quarantine(Quarantined::Uncollected),
            "one block still to collect"
        );
        assert_eq!(sp.take_invalidated_into(&mut buf), 1);
        assert_eq!(buf[0], 5);
        assert_eq!(sp.empty_slots(3).unwrap(), vec![1, 2, 3]);
        fake.clear_calls();
        sp.place(1, 20, &memfd("h20")).unwrap();
        let calls = fake.calls();
        assert_eq!(calls[0], FakeCall::Unmap { region: 0, slot: 1 });
        assert!(
            matches!(&calls[3], FakeCall::Map { region: 1, slot: 1, piece: 1, source } if source == "h20")
        );
    }

    #[test]
    fn with_explicit_release_a_collected_slot_waits_for_release_before_refill() {
        let fake = FakeGpu::new();
        let layout = Layout::plan(2, 0, 2 << 20, 8 << 20, 2 << 20, Some(4), false).unwrap();
        let m = mapper::open(&Backend::Fake(fake.clone()), 0, &layout, true).unwrap();
        let mut sp = Space::new(layout, m, Selection::Fifo, true);
        sp.place(0, 10, &memfd("h10")).unwrap();
        sp.place(1, 11, &memfd("h11")).unwrap();
        let mut handles = Vec::new();
        sp.reclaim(1, &mut handles).unwrap();
        assert_eq!(handles, vec![10], "FIFO: the oldest grant");
        assert_eq!(sp.release_quarantined(), 0, "not collected yet");
        let mut buf = [0u32; 8];
        assert_eq!(sp.take_invalidated_into(&mut buf), 2);
        assert_eq!(sp.slot(0), Slot::Quarantine(Quarantined::Collected));
        assert_eq!(
            sp.empty_slots(2).unwrap(),
            vec![2, 3],
            "a collected slot is not refilled: a kernel in flight may still write it"
        );
        assert_eq!(sp.release_quarantined(), 1);
        assert_eq!(sp.empty_slots(1).unwrap(), vec![0]);
        sp.place(0, 12, &memfd("h12")).unwrap();
        assert_eq!(fake.source_at(0).as_deref(), Some("h12"));
    }

    #[test]
    fn giving_back_checks_every_slot_before_touching_any() {
        let (mut sp, fake) = space(Selection::Fifo);
        sp.place(0, 10, &memfd("h10")).unwrap();
        sp.place(1, 11, &memfd("h11")).unwrap();
        assert!(sp.give_back(&[0, 2], false).is_err());
        assert!(sp.give_back(&[0, 0], false).is_err());
        assert_eq!(fake.mapped().len(), 4, "nothing was unmapped");
        assert_eq!(sp.give_back(&[1, 0], false).unwrap(), vec![11, 10]);
        assert!(fake.mapped().is_empty());
        assert_eq!(sp.census(), (0, 0, 0));
    }

    #[test]
    fn announced_handles_map_at_their_id_and_become_ours_when_lent() {
        let fake = FakeGpu::new();
        let layout = Layout::plan(1, 0, 1 << 20, 2 << 20, 2 << 20, Some(3), true).unwrap();
        let m = mapper::open(&Backend::Fake(fake.clone()), 0, &layout, false).unwrap();
        let mut sp = Space::new(layout, m, Selection::Greedy, false);
        let fds = vec![memfd("p0"), memfd("p2"), memfd("p7")];
        sp.map_announced(&[0, 2, 7], &fds).unwrap();
        assert_eq!(sp.counters.unmappable_handles, 1);
        assert_eq!(fake.source_at(2).as_deref(), Some("p2"));
        assert_eq!(sp.unmapped_of(&[0, 1, 2]), vec![1]);
        sp.lend_premapped(&[2]);
        assert_eq!(sp.census(), (1, 2, 0));
        assert_eq!(sp.give_back(&[2], true).unwrap(), vec![2]);
        assert_eq!(fake.source_at(2).as_deref(), Some("p2"), "mapping kept");
        assert!(sp.give_back(&[0], true).is_err(), "not lent");
    }

    #[test]
    fn a_reclaim_takes_lent_handles_first_and_released_ones_only_when_short() {
        let (mut sp, fake) = space(Selection::Greedy);
        sp.place(0, 10, &memfd("h10")).unwrap();
        sp.begin_grow();
        sp.end_grow(Some(&[11, 12]));
        assert_eq!(sp.reclaimable(), 3);
        let mut got = Vec::new();
        sp.reclaim(1, &mut got).unwrap();
        assert_eq!(got, vec![11], "a lent handle not placed yet costs nothing");
        assert_eq!(
            sp.place_next(11, &memfd("h11")).unwrap(),
            None,
            "taken by the reclaim"
        );
        assert_eq!(sp.place_next(12, &memfd("h12")).unwrap(), Some(1));
        // Slot 1 is given back locally; its shrink is not answered yet.
        assert_eq!(sp.give_back(&[1], false).unwrap(), vec![12]);
        assert_eq!(sp.releasing(), vec![12]);
        got.clear();
        sp.reclaim(1, &mut got).unwrap();
        assert_eq!(got, vec![10], "mapped slots before released handles");
        assert_eq!(fake.source_at(0).as_deref(), Some("quarantine"));
        got.clear();
        sp.reclaim(2, &mut got).unwrap();
        assert_eq!(got, vec![12]);
        assert!(sp.releasing().is_empty());
        assert_eq!(sp.counters.reclaimed_handles, 3);
    }
}
