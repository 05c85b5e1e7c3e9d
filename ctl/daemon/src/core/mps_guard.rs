//! The daemon's side of CUDA MPS: `preempt` (and so the pool's freeze), `gate start` and the
//! gate's offline set refuse MPS clients and servers, and `ps` marks them ([`crate::mps`]).

use std::cell::RefCell;
use std::collections::{BTreeMap, BTreeSet};

use valve::driver::RmDriver;
use valve_ebpf::Registry;

use super::DaemonCore;
use crate::mps::{refusal, MpsLookup, MpsRole};
use crate::procfs::comm;
use crate::protocol::{ErrorCode, Reply};

/// The processes among which MPS servers are looked for: those with GPU objects, watched or
/// started before the daemon.
fn candidates(registry: &Registry, pre_existing: &BTreeSet<u32>) -> Vec<u32> {
    let mut v = registry.processes();
    v.extend(pre_existing.iter().copied());
    v
}

impl<D: RmDriver> DaemonCore<D> {
    /// Where MPS is looked for (tests point it at a fake `/proc`).
    pub fn set_mps_lookup(&mut self, lookup: MpsLookup) {
        self.mps = lookup;
        self.mps_cache.get_mut().clear();
        self.mps_none_at.set(None);
    }

    /// The MPS role of each of `pids` that has one, looked up now. When the last scan found no
    /// MPS server and no RM client has been opened since, none can have started (a server opens
    /// one before any client can use it), and `/proc` is not read again: the pool's freezes
    /// come with a steady stream of memory allocations, which do not count.
    pub(super) fn mps_roles(&self, pids: impl IntoIterator<Item = u32>) -> BTreeMap<u32, MpsRole> {
        if self.mps_none_at.get() == Some(self.rm_clients_opened) {
            return BTreeMap::new();
        }
        let scan = self
            .mps
            .scan(candidates(&self.registry, &self.pre_existing));
        if scan.daemons().is_empty() {
            self.mps_none_at.set(Some(self.rm_clients_opened));
            return BTreeMap::new();
        }
        self.mps_none_at.set(None);
        self.mps.roles_in(&scan, pids)
    }

    /// The refusal for freezing `pid` if it is an MPS client or server (looked up now, so a
    /// client that connected a moment ago is refused too).
    pub(super) fn mps_refusal(&self, pid: u32) -> Option<Reply> {
        let role = self.mps_roles([pid]).remove(&pid)?;
        Some(Reply::fail(
            ErrorCode::MpsProcess,
            refusal(pid, &comm(pid), &role),
        ))
    }
}

/// Whether the gate must leave `pid` out of its offline set because it takes part in MPS.
/// Looked up once per process that has GPU channels (`cache`, cleared when it exits); a
/// process left out is logged once.
pub(super) fn gate_leaves_out(
    lookup: &MpsLookup,
    cache: &RefCell<BTreeMap<u32, bool>>,
    registry: &Registry,
    pre_existing: &BTreeSet<u32>,
    pid: u32,
) -> bool {
    if let Some(&known) = cache.borrow().get(&pid) {
        return known;
    }
    // Before its first channel a process may not have reached MPS yet: ask again later.
    if registry
        .gpus(pid)
        .iter()
        .all(|g| g.channels().next().is_none())
    {
        return false;
    }
    let role = lookup
        .roles(candidates(registry, pre_existing), [pid])
        .remove(&pid);
    if let Some(role) = &role {
        tracing::warn!(
            "the gate leaves process {pid} out of its offline set: {}",
            refusal(pid, &comm(pid), role)
        );
    }
    cache.borrow_mut().insert(pid, role.is_some());
    role.is_some()
}
