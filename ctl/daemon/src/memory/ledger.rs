//! The pool's books: which physical handles exist on each GPU, who holds each one (free, an
//! online process or an offline process), and the rules for handing them out and taking them back.
//!
//! Pure bookkeeping over a [`Backing`] (the real one creates CUDA memory; tests use memfds): no
//! sockets, no preemption. The server drives it; every change happens through these methods.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, PoisonError};

use serde::Serialize;

/// A pool handle's number on its GPU (dense from 0: a premapped online client maps handle `h`
/// at slot `h`).
pub type HandleId = u32;
/// A registered client process.
pub type ClientId = u64;

pub use valve_protocol::pool::{GpuUsage, PoolErrorCode, Role};

/// Where one GPU's physical memory comes from.
pub trait Backing: Send {
    /// Bytes per handle.
    fn handle_bytes(&self) -> usize;
    /// Creates one handle and returns a descriptor that keeps it alive and can be sent to clients.
    fn create(&mut self) -> Result<OwnedFd, String>;
    /// Device memory free now, if known (NVML on a GPU).
    fn free_bytes(&self) -> Option<u64>;
    /// Device memory in all, if known.
    fn total_bytes(&self) -> Option<u64> {
        None
    }
    /// The GPU's PCI address, if it has one (clients find the device in CUDA by it).
    fn pci_bus_id(&self) -> Option<String> {
        None
    }
}

/// Why a pool request was refused; `code()` is the protocol's error code.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PoolError {
    /// More than the GPU could ever give.
    #[error("{asked} handles of {handle_mib} MiB is more than GPU {gpu} holds ({limit} handles): ask for less, or raise --pool-max")]
    TooLarge {
        /// GPU index.
        gpu: usize,
        /// Handles asked for.
        asked: usize,
        /// The most the pool can hold on that GPU.
        limit: usize,
        /// Handle size.
        handle_mib: usize,
    },
    /// Offline would hold more than the operator's cap on this GPU (`valvectl pool cap`).
    #[error("offline processes on GPU {gpu} hold {held} handle(s) and may hold at most {cap} (valvectl pool cap); {asked} more asked")]
    Capped {
        /// GPU index.
        gpu: usize,
        /// The cap, in handles.
        cap: usize,
        /// Handles offline holds on the GPU now.
        held: usize,
        /// Handles asked for.
        asked: usize,
    },
    /// Nothing free and nothing this client may take.
    #[error("the pool on GPU {gpu} has {free} free handle(s), {asked} asked: offline gets only free memory; try again later or shrink elsewhere")]
    Exhausted {
        /// GPU index.
        gpu: usize,
        /// Free handles.
        free: usize,
        /// Handles asked for.
        asked: usize,
    },
    /// Unknown client (not registered, or already gone).
    #[error("client {0} is not registered: send `register` first")]
    NotRegistered(ClientId),
    /// A handle the client does not hold.
    #[error("handle {handle} is not held by this client")]
    NotHeld {
        /// The handle.
        handle: HandleId,
    },
    /// No pool on that GPU.
    #[error("GPU {0} has no pool: the daemon was started with --pool for other GPUs")]
    NoSuchGpu(usize),
    /// The backing could not create memory.
    #[error("creating GPU memory failed: {0}")]
    Backing(String),
}

impl PoolError {
    /// The protocol's code for it.
    pub fn code(&self) -> PoolErrorCode {
        match self {
            PoolError::TooLarge { .. } => PoolErrorCode::TooLarge,
            PoolError::Exhausted { .. } | PoolError::Capped { .. } | PoolError::Backing(_) => {
                PoolErrorCode::Exhausted
            }
            PoolError::NotRegistered(_) => PoolErrorCode::NotRegistered,
            PoolError::NotHeld { .. } => PoolErrorCode::NotHeld,
            PoolError::NoSuchGpu(_) => PoolErrorCode::NoSuchGpu,
        }
    }
}

struct Entry {
    fd: OwnedFd,
    holder: Option<ClientId>,
}

/// One GPU's handles.
pub struct GpuPool {
    backing: Box<dyn Backing>,
    entries: Vec<Entry>,
    max_handles: usize,
    keep_free_bytes: u64,
    /// The most all offline processes together may hold (`valvectl pool cap`).
    offline_cap: Option<usize>,
    /// Handles taken back from offline since the pool started.
    reclaimed_total: u64,
}

/// A registered process.
#[derive(Clone, Debug, Serialize)]
pub struct ClientInfo {
    /// Its pid (SO_PEERCRED).
    pub pid: u32,
    /// Its role.
    pub role: Role,
    /// The GPU index its memory is on.
    pub gpu: usize,
    /// Whether it maps the whole pool (online, premapped).
    pub premapped: bool,
    /// Handles it holds now.
    pub held: BTreeSet<HandleId>,
    /// Handles whose descriptors it has been sent (it maps each once).
    pub sent: BTreeSet<HandleId>,
}

/// Handles given to a client by [`Ledger::take`], and those created for it.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// The handles now the client's.
    pub handles: Vec<HandleId>,
    /// Handles that did not exist before this call (premapped clients must be sent them).
    pub created: Vec<HandleId>,
    /// How many more the client asked for than were free (online: reclaim these from offline).
    pub short: usize,
}

/// All GPUs' pools and the registered clients.
#[derive(Default)]
pub struct Ledger {
    gpus: BTreeMap<usize, GpuPool>,
    clients: BTreeMap<ClientId, ClientInfo>,
    next_client: ClientId,
}

/// The pool's per-GPU numbers as its thread last published them (about once a second), for
/// readers on other threads (the harvest profile): reading never waits for the pool's work.
#[derive(Debug, Default)]
pub struct UsageSnapshot {
    latest: Mutex<Vec<GpuUsage>>,
}

impl UsageSnapshot {
    /// Replaces the numbers (the pool thread, between requests).
    pub fn publish(&self, usage: Vec<GpuUsage>) {
        *self.latest.lock().unwrap_or_else(PoisonError::into_inner) = usage;
    }

    /// The latest numbers (empty before the first publication).
    pub fn latest(&self) -> Vec<GpuUsage> {
        self.latest
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

impl Ledger {
    /// Adds a GPU whose pool may grow to `max_bytes`, always leaving `keep_free_bytes` of device
    /// memory to everything else (contexts, other allocations).
    pub fn add_gpu(
        &mut self,
        gpu: usize,
        backing: Box<dyn Backing>,
        max_bytes: u64,
        keep_free_bytes: u64,
    ) {
        // Never more than the device could hold beside what is kept free.
        let device = backing
            .total_bytes()
            .map_or(u64::MAX, |t| t.saturating_sub(keep_free_bytes));
        let max_handles = (max_bytes.min(device) / backing.handle_bytes().max(1) as u64) as usize;
        self.gpus.insert(
            gpu,
            GpuPool {
                backing,
                entries: Vec::new(),
                max_handles,
                keep_free_bytes,
                offline_cap: None,
                reclaimed_total: 0,
            },
        );
    }

    fn pool(&self, gpu: usize) -> Result<&GpuPool, PoolError> {
        self.gpus.get(&gpu).ok_or(PoolError::NoSuchGpu(gpu))
    }

    /// Bytes per handle on `gpu`.
    pub fn handle_bytes(&self, gpu: usize) -> Result<usize, PoolError> {
        Ok(self.pool(gpu)?.backing.handle_bytes())
    }

    /// The PCI address of `gpu`, if known.
    pub fn pci_bus_id(&self, gpu: usize) -> Option<String> {
        self.gpus.get(&gpu)?.backing.pci_bus_id()
    }

    /// The most handles `gpu`'s pool may hold.
    pub fn max_handles(&self, gpu: usize) -> Result<usize, PoolError> {
        Ok(self.pool(gpu)?.max_handles)
    }

    /// Registers a process; it holds nothing yet.
    pub fn register(
        &mut self,
        pid: u32,
        role: Role,
        gpu: usize,
        premapped: bool,
    ) -> Result<ClientId, PoolError> {
        self.pool(gpu)?;
        self.next_client += 1;
        let premapped = premapped && role == Role::Online;
        let info = ClientInfo {
            pid,
            role,
            gpu,
            premapped,
            held: BTreeSet::new(),
            sent: BTreeSet::new(),
        };
        self.clients.insert(self.next_client, info);
        Ok(self.next_client)
    }

    /// A registered client.
    pub fn client(&self, id: ClientId) -> Result<&ClientInfo, PoolError> {
        self.clients.get(&id).ok_or(PoolError::NotRegistered(id))
    }

    /// Forgets a client (its process exited or closed its connection); everything it held is
    /// free again. Returns those handles.
    pub fn unregister(&mut self, id: ClientId) -> Vec<HandleId> {
        let Some(info) = self.clients.remove(&id) else {
            return Vec::new();
        };
        if let Some(pool) = self.gpus.get_mut(&info.gpu) {
            for &h in &info.held {
                pool.entries[h as usize].holder = None;
            }
        }
        info.held.into_iter().collect()
    }

    /// Gives `count` handles to `id`: free ones first, then new ones while the GPU has room.
    /// Offline gets all or nothing. Online gets what there is and learns how many are short,
    /// to be reclaimed from offline ([`Ledger::reclaim_plan`], then [`Ledger::transfer`]).
    pub fn take(&mut self, id: ClientId, count: usize) -> Result<Taken, PoolError> {
        let info = self.client(id)?.clone();
        let pool = self
            .gpus
            .get_mut(&info.gpu)
            .ok_or(PoolError::NoSuchGpu(info.gpu))?;
        let handle_mib = pool.backing.handle_bytes() >> 20;
        if count + info.held.len() > pool.max_handles {
            return Err(PoolError::TooLarge {
                gpu: info.gpu,
                asked: count,
                limit: pool.max_handles,
                handle_mib,
            });
        }
        if let (Role::Offline, Some(cap)) = (info.role, pool.offline_cap) {
            let held = pool
                .entries
                .iter()
                .filter(|e| {
                    e.holder
                        .and_then(|c| self.clients.get(&c))
                        .is_some_and(|c| c.role == Role::Offline)
                })
                .count();
            if held + count > cap {
                return Err(PoolError::Capped {
                    gpu: info.gpu,
                    cap,
                    held,
                    asked: count,
                });
            }
        }
        let mut taken = Taken::default();
        let free: Vec<HandleId> = (0..pool.entries.len() as HandleId)
            .filter(|&h| pool.entries[h as usize].holder.is_none())
            .take(count)
            .collect();
        taken.handles.extend(&free);
        while taken.handles.len() < count && pool.can_create() {
            let fd = pool.backing.create().map_err(PoolError::Backing)?;
            let h = pool.entries.len() as HandleId;
            pool.entries.push(Entry { fd, holder: None });
            taken.handles.push(h);
            taken.created.push(h);
        }
        taken.short = count - taken.handles.len();
        if taken.short > 0 && info.role == Role::Offline {
            let free = taken.handles.len();
            return Err(PoolError::Exhausted {
                gpu: info.gpu,
                free,
                asked: count,
            });
        }
        for &h in &taken.handles {
            pool.entries[h as usize].holder = Some(id);
        }
        self.clients
            .get_mut(&id)
            .expect("checked above")
            .held
            .extend(&taken.handles);
        Ok(taken)
    }

    /// Caps what all offline processes on `gpu` may hold together (`None`: no cap). A lower
    /// cap stops offline's growth; it takes nothing back.
    pub fn set_offline_cap(&mut self, gpu: usize, cap: Option<usize>) -> Result<(), PoolError> {
        let pool = self.gpus.get_mut(&gpu).ok_or(PoolError::NoSuchGpu(gpu))?;
        pool.offline_cap = cap;
        Ok(())
    }

    /// Counts `handles` taken back from offline on `gpu`.
    pub fn note_reclaimed(&mut self, gpu: usize, handles: usize) {
        if let Some(p) = self.gpus.get_mut(&gpu) {
            p.reclaimed_total += handles as u64;
        }
    }

    /// Which offline clients on `gpu` give back how many handles so that `short` are freed:
    /// the largest holders first, so that as few processes as possible are disturbed.
    pub fn reclaim_plan(&self, gpu: usize, short: usize) -> Vec<(ClientId, usize)> {
        let mut holders: Vec<(ClientId, usize)> = self
            .clients
            .iter()
            .filter(|(_, c)| c.gpu == gpu && c.role == Role::Offline && !c.held.is_empty())
            .map(|(&id, c)| (id, c.held.len()))
            .collect();
        holders.sort_by_key(|&(id, n)| (std::cmp::Reverse(n), id));
        let mut left = short;
        let mut plan = Vec::new();
        for (id, n) in holders {
            if left == 0 {
                break;
            }
            let k = n.min(left);
            plan.push((id, k));
            left -= k;
        }
        plan
    }

    /// Moves `handles` from `from` (which gave them back) to `to`.
    pub fn transfer(
        &mut self,
        from: ClientId,
        handles: &[HandleId],
        to: ClientId,
    ) -> Result<(), PoolError> {
        self.release(from, handles)?;
        let gpu = self.client(to)?.gpu;
        let pool = self.gpus.get_mut(&gpu).ok_or(PoolError::NoSuchGpu(gpu))?;
        for &h in handles {
            pool.entries[h as usize].holder = Some(to);
        }
        self.clients
            .get_mut(&to)
            .expect("checked above")
            .held
            .extend(handles);
        Ok(())
    }

    /// `id` gives `handles` back; they are free. Nothing changes if one is not `id`'s.
    pub fn release(&mut self, id: ClientId, handles: &[HandleId]) -> Result<(), PoolError> {
        let info = self.client(id)?;
        if let Some(&handle) = handles.iter().find(|h| !info.held.contains(h)) {
            return Err(PoolError::NotHeld { handle });
        }
        let gpu = info.gpu;
        let pool = self.gpus.get_mut(&gpu).ok_or(PoolError::NoSuchGpu(gpu))?;
        for &h in handles {
            pool.entries[h as usize].holder = None;
        }
        let held = &mut self.clients.get_mut(&id).expect("checked above").held;
        for h in handles {
            held.remove(h);
        }
        Ok(())
    }

    /// The descriptors of `handles` on `gpu`, to send (the pool keeps its own).
    pub fn fds(&self, gpu: usize, handles: &[HandleId]) -> Result<Vec<BorrowedFd<'_>>, PoolError> {
        let pool = self.pool(gpu)?;
        handles
            .iter()
            .map(|&h| {
                pool.entries
                    .get(h as usize)
                    .map(|e| e.fd.as_fd())
                    .ok_or(PoolError::NotHeld { handle: h })
            })
            .collect()
    }

    /// Every handle that exists on `gpu` (what a premapped online client maps).
    pub fn all_handles(&self, gpu: usize) -> Result<Vec<HandleId>, PoolError> {
        Ok((0..self.pool(gpu)?.entries.len() as HandleId).collect())
    }

    /// Of `handles`, those `id` has not been sent yet; they are marked sent.
    pub fn mark_sent(&mut self, id: ClientId, handles: &[HandleId]) -> Vec<HandleId> {
        let Some(c) = self.clients.get_mut(&id) else {
            return Vec::new();
        };
        handles
            .iter()
            .copied()
            .filter(|&h| c.sent.insert(h))
            .collect()
    }

    /// Premapped online clients on `gpu` (they are sent every newly created handle).
    pub fn premapped_clients(&self, gpu: usize) -> Vec<ClientId> {
        self.clients
            .iter()
            .filter(|(_, c)| c.gpu == gpu && c.premapped)
            .map(|(&id, _)| id)
            .collect()
    }

    /// Handles `gpu`'s pool can lend without reclaiming from offline: free ones, and ones it may
    /// still create (below its maximum, with the device's free memory above what it keeps free).
    pub fn spare_handles(&self, gpu: usize) -> Result<usize, PoolError> {
        let p = self.gpus.get(&gpu).ok_or(PoolError::NoSuchGpu(gpu))?;
        Ok(p.free() + p.creatable())
    }

    /// Per-GPU numbers.
    pub fn usage(&self) -> Vec<GpuUsage> {
        self.gpus
            .iter()
            .map(|(&gpu, p)| {
                let held_by = |role: Role| {
                    p.entries
                        .iter()
                        .filter(|e| {
                            e.holder
                                .and_then(|c| self.clients.get(&c))
                                .is_some_and(|c| c.role == role)
                        })
                        .count()
                };
                GpuUsage {
                    gpu,
                    handle_bytes: p.backing.handle_bytes(),
                    handles: p.entries.len(),
                    max_handles: p.max_handles,
                    free: p.free(),
                    online: held_by(Role::Online),
                    offline: held_by(Role::Offline),
                    creatable: p.creatable(),
                    offline_cap: p.offline_cap,
                    reclaimed_total: p.reclaimed_total,
                }
            })
            .collect()
    }

    /// Registered clients.
    pub fn clients(&self) -> impl Iterator<Item = (ClientId, &ClientInfo)> {
        self.clients.iter().map(|(&id, c)| (id, c))
    }
}

impl GpuPool {
    /// Handles created and lent to no one.
    fn free(&self) -> usize {
        self.entries.iter().filter(|e| e.holder.is_none()).count()
    }

    /// Handles that may still be created: below the maximum, and each leaving the device's
    /// free memory above what the pool keeps free (the maximum alone where that is unknown).
    fn creatable(&self) -> usize {
        let below_max = self.max_handles.saturating_sub(self.entries.len());
        match self.backing.free_bytes() {
            Some(bytes) => {
                let hs = self.backing.handle_bytes() as u64;
                below_max.min((bytes.saturating_sub(self.keep_free_bytes) / hs) as usize)
            }
            None => below_max,
        }
    }

    fn can_create(&self) -> bool {
        self.creatable() > 0
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;

    /// A GPU with `free` bytes of device memory; each handle is a /dev/null descriptor.
    pub(crate) struct FakeBacking {
        pub(crate) handle_bytes: usize,
        pub(crate) free: Arc<AtomicU64>,
    }

    impl Backing for FakeBacking {
        fn handle_bytes(&self) -> usize {
            self.handle_bytes
        }
        fn create(&mut self) -> Result<OwnedFd, String> {
            let b = self.handle_bytes as u64;
            self.free
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |f| f.checked_sub(b))
                .map_err(|_| "out of device memory".to_string())?;
            std::fs::File::open("/dev/null")
                .map(OwnedFd::from)
                .map_err(|e| e.to_string())
        }
        fn free_bytes(&self) -> Option<u64> {
            Some(self.free.load(Ordering::SeqCst))
        }
    }

    pub(crate) const MIB: usize = 1 << 20;

    /// GPU 0 with 64 MiB handles, `device_mib` of free device memory, a pool capped at `max_mib`
    /// and 64 MiB kept free for others.
    pub(crate) fn ledger(device_mib: u64, max_mib: u64) -> Ledger {
        let mut l = Ledger::default();
        let free = Arc::new(AtomicU64::new(device_mib << 20));
        l.add_gpu(
            0,
            Box::new(FakeBacking {
                handle_bytes: 64 * MIB,
                free,
            }),
            max_mib << 20,
            64 << 20,
        );
        l
    }

    #[test]
    fn offline_gets_free_memory_all_or_nothing_and_never_from_online() {
        let mut l = ledger(64 * 11, 4096); // room for 10 handles (one kept free)
        let on = l.register(1, Role::Online, 0, true).unwrap();
        let off = l.register(2, Role::Offline, 0, false).unwrap();
        assert_eq!(l.take(on, 4).unwrap().handles, vec![0, 1, 2, 3]);
        let t = l.take(off, 6).unwrap();
        assert_eq!((t.handles.len(), t.created.len(), t.short), (6, 6, 0));
        let e = l.take(off, 1).unwrap_err();
        assert_eq!(
            e,
            PoolError::Exhausted {
                gpu: 0,
                free: 0,
                asked: 1
            }
        );
        assert_eq!(i32::from(e.code()), 12);
        assert_eq!(
            l.client(off).unwrap().held.len(),
            6,
            "a refused grow changes nothing"
        );
    }

    #[test]
    fn a_cap_bounds_what_offline_holds_together_and_never_online() {
        let mut l = ledger(64 * 21, 4096);
        let on = l.register(1, Role::Online, 0, true).unwrap();
        let a = l.register(2, Role::Offline, 0, false).unwrap();
        let b = l.register(3, Role::Offline, 0, false).unwrap();
        l.set_offline_cap(0, Some(5)).unwrap();
        l.take(a, 3).unwrap();
        let e = l.take(b, 3).unwrap_err();
        assert_eq!(
            e,
            PoolError::Capped {
                gpu: 0,
                cap: 5,
                held: 3,
                asked: 3
            }
        );
        assert_eq!(
            i32::from(e.code()),
            12,
            "offline's clients treat it as a full pool"
        );
        l.take(b, 2).unwrap();
        assert_eq!(
            l.take(on, 8).unwrap().handles.len(),
            8,
            "online is not capped"
        );
        let u = &l.usage()[0];
        assert_eq!(
            (u.offline_cap, u.offline_available_bytes()),
            (Some(5), (5 * 64) << 20)
        );
        l.set_offline_cap(0, None).unwrap();
        l.take(b, 3).unwrap();
        assert_eq!(l.set_offline_cap(7, Some(1)), Err(PoolError::NoSuchGpu(7)));
    }

    #[test]
    fn online_learns_what_is_short_and_the_plan_takes_from_the_largest_offline_holder() {
        let mut l = ledger(64 * 11, 4096);
        let on = l.register(1, Role::Online, 0, true).unwrap();
        let a = l.register(2, Role::Offline, 0, false).unwrap();
        let b = l.register(3, Role::Offline, 0, false).unwrap();
        l.take(a, 3).unwrap();
        l.take(b, 7).unwrap();
        let t = l.take(on, 8).unwrap();
        assert_eq!((t.handles.len(), t.short), (0, 8));
        assert_eq!(l.reclaim_plan(0, 8), vec![(b, 7), (a, 1)]);
        let from_b: Vec<HandleId> = l.client(b).unwrap().held.iter().copied().collect();
        l.transfer(b, &from_b, on).unwrap();
        assert_eq!(l.client(on).unwrap().held.len(), 7);
        assert!(l.client(b).unwrap().held.is_empty());
        let u = &l.usage()[0];
        assert_eq!((u.handles, u.free, u.online, u.offline), (10, 0, 7, 3));
    }

    #[test]
    fn a_client_that_goes_away_gives_everything_back() {
        let mut l = ledger(4096, 4096);
        let off = l.register(2, Role::Offline, 0, false).unwrap();
        l.take(off, 5).unwrap();
        let freed = l.unregister(off);
        assert_eq!(freed, vec![0, 1, 2, 3, 4]);
        assert_eq!(l.usage()[0].free, 5);
        assert_eq!(i32::from(l.client(off).unwrap_err().code()), 13);
        assert_eq!(l.take(off, 1).unwrap_err(), PoolError::NotRegistered(off));
        let other = l.register(3, Role::Offline, 0, false).unwrap();
        let t = l.take(other, 5).unwrap();
        assert!(
            t.created.is_empty(),
            "freed handles are reused, not created again"
        );
    }

    #[test]
    fn more_than_the_gpu_holds_or_foreign_handles_are_named_errors() {
        let mut l = ledger(4096, 1024); // the pool may hold 16 handles
        let on = l.register(1, Role::Online, 0, true).unwrap();
        let off = l.register(2, Role::Offline, 0, false).unwrap();
        let e = l.take(on, 17).unwrap_err();
        assert_eq!(i32::from(e.code()), 11);
        assert!(
            e.to_string().contains("more than GPU 0 holds (16 handles)"),
            "{e}"
        );
        l.take(off, 2).unwrap();
        assert_eq!(
            l.release(on, &[0]).unwrap_err(),
            PoolError::NotHeld { handle: 0 }
        );
        assert_eq!(
            l.transfer(on, &[1], off).unwrap_err(),
            PoolError::NotHeld { handle: 1 }
        );
        assert_eq!(
            l.client(off).unwrap().held.len(),
            2,
            "failed release/transfer changed nothing"
        );
        assert_eq!(
            l.register(3, Role::Online, 5, true).unwrap_err(),
            PoolError::NoSuchGpu(5)
        );
        assert!(l.fds(0, &[99]).is_err());
    }

    #[test]
    fn only_online_clients_are_premapped() {
        let mut l = ledger(4096, 4096);
        let on = l.register(1, Role::Online, 0, true).unwrap();
        let _off = l.register(2, Role::Offline, 0, true).unwrap();
        assert_eq!(l.premapped_clients(0), vec![on]);
    }
}
