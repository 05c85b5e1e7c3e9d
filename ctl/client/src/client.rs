//! The [`Client`]: registration on the control connection, the KV space with its callback
//! thread, and the calls a framework's KV allocator makes.

use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::Value;
use valve_protocol::pool::{self as protocol, GpuRef, PoolRequest};

use crate::callback::{self, Shared};
use crate::layout::{KvSpace, Layout};
use crate::mapper::{self, Backend};
use crate::space::Space;
use crate::{conn, Error, Result, Role, Selection};

/// How a client behaves beyond its role.
#[derive(Clone, Debug)]
pub struct Options {
    /// Online only: map the whole pool ahead of time (the default; `docs/memory.md` says why).
    /// `false` is the `serial` mode: handles arrive with `grow` and are unmapped by `shrink`.
    pub premap: bool,
    /// Offline only: how a reclaim picks the handles it gives back.
    pub selection: Selection,
    /// The GPU access: CUDA, or a fake for tests.
    pub backend: Backend,
    /// The CUDA ordinal of the daemon's GPU in this process; default: the `gpu_index` the daemon
    /// replies (right unless CUDA_VISIBLE_DEVICES or CUDA_DEVICE_ORDER renumber the GPUs).
    pub cuda_ordinal: Option<u32>,
    /// How long a premapped online `grow` waits for the descriptors of the handles it was lent.
    pub grant_timeout: Duration,
    /// Offline: a reclaimed slot becomes refillable only after
    /// [`Client::release_quarantined`], not as soon as its blocks are collected. For frameworks
    /// that keep a step in flight past the point where they collect (async batching).
    pub explicit_release: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            premap: true,
            selection: Selection::Greedy,
            backend: Backend::Cuda,
            cuda_ordinal: None,
            grant_timeout: Duration::from_secs(10),
            explicit_release: false,
        }
    }
}

/// What the daemon said at `register`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    /// The client's id, as the daemon wrote it (JSON text).
    pub client: String,
    /// Bytes per pool handle.
    pub handle_bytes: u64,
    /// The GPU the pool is on, as the daemon numbers it.
    pub gpu_index: u32,
    /// The most handles the GPU's pool may hold (`pool_capacity_handles`; absent from daemons
    /// that do not send it).
    pub pool_capacity_handles: Option<u32>,
    /// The GPU's PCI address (`gpu_pci`), which finds it in CUDA whatever the process's
    /// `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER`.
    pub gpu_pci: Option<String>,
}

/// Numbers about a client, cheap to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stats {
    /// The role.
    pub role: Role,
    /// Online and mapping the whole pool.
    pub premap: bool,
    /// The KV space (None before `kv_space`).
    pub space: Option<KvSpace>,
    /// Slots backed by pool memory lent to this client.
    pub held_slots: u32,
    /// Slots with pool memory mapped (premapped online: every pool handle mapped so far).
    pub mapped_slots: u32,
    /// Slots with the quarantine mapped.
    pub quarantined_slots: u32,
    /// Invalidated blocks the framework has not collected.
    pub pending_invalidated: u32,
    /// Framework requests that own blocks now.
    pub requests: u32,
    /// Reclaim requests answered.
    pub reclaims: u64,
    /// Handles given back in reclaims.
    pub reclaimed_handles: u64,
    /// Blocks invalidated by reclaims.
    pub invalidated_blocks: u64,
    /// `pool_handles` events handled.
    pub pool_handle_events: u64,
    /// Announced handles beyond this space's slots (not mapped).
    pub unmappable_handles: u64,
    /// Callback messages that failed (malformed, unknown, or a failed swap or send).
    pub callback_errors: u64,
    /// The daemon closed the callback connection.
    pub daemon_closed: bool,
    /// Online: `grow` calls for which the daemon reclaimed memory from offline.
    pub grows_with_reclaim: u64,
    /// Online: handles the last `grow` took from offline (0: it was served from free memory).
    pub last_grow_reclaimed: u64,
}

/// A KV space and its callback thread. Dropped before the control connection closes.
struct Kv {
    info: KvSpace,
    shared: Arc<Shared>,
    callback: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Kv {
    fn drop(&mut self) {
        // Wakes the thread's recv with end-of-file; after the join, `shared` is ours alone and
        // dropping it unmaps every slot and frees the addresses.
        let _ = self.callback.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A process's connection to the Valve daemon's memory pool on one GPU.
pub struct Client {
    /// Declared first so it drops first: mappings go before the daemon gets the handles back.
    kv: Option<Kv>,
    control: UnixStream,
    path: PathBuf,
    role: Role,
    premap: bool,
    options: Options,
    registration: Registration,
    ids: (u64, String),
}

impl Client {
    /// Connects to the pool socket at `path` and registers as `role` on `gpu` (an index, a GPU
    /// UUID or a PCI id), with default [`Options`].
    pub fn connect(path: impl AsRef<Path>, role: Role, gpu: &str) -> Result<Client> {
        Client::connect_with(path, role, gpu, Options::default())
    }

    /// [`Client::connect`] with options.
    pub fn connect_with(
        path: impl AsRef<Path>,
        role: Role,
        gpu: &str,
        options: Options,
    ) -> Result<Client> {
        let path = path.as_ref().to_path_buf();
        let control = conn::connect(&path)?;
        let premap = role == Role::Online && options.premap;
        let req = PoolRequest::Register {
            role: match role {
                Role::Online => protocol::Role::Online,
                Role::Offline => protocol::Role::Offline,
            },
            gpu: match gpu.parse::<u64>() {
                Ok(i) => GpuRef::Index(i),
                Err(_) => GpuRef::Text(gpu.into()),
            },
            premap: (role == Role::Online).then_some(premap),
        };
        let (reply, _) = conn::call(&control, &req)?;
        let (registration, ids) = parse_registration(&reply)?;
        Ok(Client {
            kv: None,
            control,
            path,
            role,
            premap,
            options,
            registration,
            ids,
        })
    }

    /// What the daemon said at registration.
    pub fn registration(&self) -> &Registration {
        &self.registration
    }

    /// The role.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Creates the KV space: `regions` virtual ranges (one per KV tensor) of
    /// `capacity_bytes_per_region` each, rounded down to whole pieces (0: as much as the pool
    /// holds; a premapped online client always covers the whole pool), holding KV blocks of
    /// `block_bytes` per region. Then opens the callback connection. Once per client.
    pub fn kv_space(
        &mut self,
        regions: u32,
        capacity_bytes_per_region: u64,
        block_bytes: u64,
    ) -> Result<KvSpace> {
        self.kv_space_with_tail(regions, capacity_bytes_per_region, block_bytes, 0)
    }

    /// [`Client::kv_space`], with `tail_bytes` of the process's own memory (rounded up to
    /// whole pages, zeroed) mapped right after each region's slots and never reclaimed: the
    /// place for a framework's padding blocks (transformers keeps two after its real blocks).
    /// One private block backs the tail of every region.
    pub fn kv_space_with_tail(
        &mut self,
        regions: u32,
        capacity_bytes_per_region: u64,
        block_bytes: u64,
        tail_bytes: u64,
    ) -> Result<KvSpace> {
        if self.kv.is_some() {
            return Err(Error::KvSpaceExists);
        }
        let reg = &self.registration;
        let ordinal = match (
            &self.options.cuda_ordinal,
            &reg.gpu_pci,
            &self.options.backend,
        ) {
            (Some(o), _, _) => *o,
            (None, Some(pci), mapper::Backend::Cuda) => valve_vmm::Gpu::open_pci(pci)?.ordinal(),
            _ => reg.gpu_index,
        };
        let granularity = mapper::granularity(&self.options.backend, ordinal)?;
        let layout = Layout::plan(
            regions,
            capacity_bytes_per_region,
            block_bytes,
            reg.handle_bytes,
            granularity,
            reg.pool_capacity_handles,
            self.premap,
        )?
        .with_tail(tail_bytes, granularity)?;
        let quarantine = self.role == Role::Offline;
        let mapper = mapper::open(&self.options.backend, ordinal, &layout, quarantine)?;
        let info = KvSpace {
            regions,
            slots: layout.slots as u32,
            piece_bytes: layout.piece as u64,
            block_bytes,
            blocks_per_slot: layout.blocks_per_slot as u32,
            region_bytes: layout.region_bytes() as u64,
            tail_bytes: layout.tail as u64,
            handle_bytes: reg.handle_bytes,
            region_ptrs: (0..layout.regions).map(|r| mapper.region_ptr(r)).collect(),
        };
        let explicit = self.options.explicit_release;
        let space = Space::new(layout, mapper, self.options.selection, explicit);
        let shared = Arc::new(Shared::new(space, self.role, self.premap));
        let sock = callback::attach(&self.path, self.ids.0, &self.ids.1, &shared)?;
        let callback = sock
            .try_clone()
            .map_err(|e| Error::Invalid(format!("duplicating the callback socket: {e}")))?;
        let thread = callback::spawn(sock, shared.clone())?;
        self.kv = Some(Kv {
            info: info.clone(),
            shared,
            callback,
            thread: Some(thread),
        });
        Ok(info)
    }

    fn kv(&self) -> Result<&Kv> {
        self.kv.as_ref().ok_or(Error::NoKvSpace)
    }

    /// The KV space, if made.
    pub fn space(&self) -> Option<&KvSpace> {
        self.kv.as_ref().map(|k| &k.info)
    }

    /// The first address of region `region`.
    pub fn region_ptr(&self, region: u32) -> Result<u64> {
        let kv = self.kv()?;
        kv.info
            .region_ptrs
            .get(region as usize)
            .copied()
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "region {region} does not exist: the space has {} regions",
                    kv.info.regions
                ))
            })
    }

    /// Asks the daemon for `count` more handles and returns the slots they back now (premapped
    /// online: the handle ids). Online may wait while the daemon reclaims from offline;
    /// offline gets free memory only ([`Error::PoolExhausted`] otherwise). Offline: a reclaim
    /// that arrives while the reply is being mapped may take some of it, so fewer slots than
    /// asked can come back.
    pub fn grow(&mut self, count: u32) -> Result<Vec<u32>> {
        let shared = self.kv()?.shared.clone();
        if count == 0 {
            return Ok(Vec::new());
        }
        if !self.premap {
            // Only this thread makes slots empty or fills them: the check stays true.
            shared.lock().empty_slots(count as usize)?;
        }
        let (ids, fds_for, fds) = self.request_grow(&shared, count)?;
        let placed = match (self.premap, fds_for) {
            (_, Err(e)) => Err(e),
            (true, Ok(fds_for)) => self.lend_premapped(&shared, &ids, &fds_for, &fds),
            (false, Ok(fds_for)) if fds_for != ids => Err(Error::Protocol(format!(
                "the grow reply lends {ids:?} but sends descriptors for {fds_for:?}"
            ))),
            (false, Ok(_)) => place_all(&shared, &ids, &fds),
        };
        let e = match placed {
            Ok(slots) => return Ok(slots),
            Err(e) => e,
        };
        // All or nothing: what was lent goes back (best effort: the daemon frees it anyway
        // when this client goes). Offline: what place_all unmapped is in `releasing` already.
        let back = match self.premap {
            true => ids,
            false => {
                let mut sp = shared.lock();
                let unplaced = sp.drain_incoming();
                sp.start_release(&unplaced);
                sp.releasing()
            }
        };
        let _ = self.send_shrink(&shared, back);
        Err(e)
    }

    /// Sends `grow` and reads the reply: the lent handle ids, those the descriptors belong to,
    /// and the descriptors. Offline and serial online: the ids are registered as incoming (a
    /// reclaim may take them) before the callback thread is told the grow is over.
    #[allow(clippy::type_complexity)]
    fn request_grow(
        &self,
        shared: &Shared,
        count: u32,
    ) -> Result<(Vec<u32>, Result<Vec<u32>>, Vec<std::os::fd::OwnedFd>)> {
        shared.lock().begin_grow();
        let mut reply_reclaimed = 0;
        let got = conn::call(
            &self.control,
            &PoolRequest::Grow {
                count: count as usize,
            },
        )
        .and_then(|(r, fds)| {
            reply_reclaimed = r.get("reclaimed").and_then(Value::as_u64).unwrap_or(0);
            let ids = conn::handle_ids("grow", &r)?;
            // The descriptors belong to `fds_for` where the daemon says so (a premapped client
            // is sent only handles it has not had yet); else to every handle (premapped: none).
            let fds_for = match r.get("fds_for") {
                Some(_) => conn::id_list("grow", &r, "fds_for"),
                None if self.premap => Ok(Vec::new()),
                None => Ok(ids.clone()),
            };
            Ok((ids, fds_for, fds))
        });
        let lent = match &got {
            Ok((ids, _, _)) if !self.premap => Some(ids.as_slice()),
            _ => None,
        };
        let reclaimed = match &got {
            Ok(_) => reply_reclaimed,
            Err(_) => 0,
        };
        let mut sp = shared.lock();
        sp.end_grow(lent);
        sp.counters.last_grow_reclaimed = reclaimed;
        sp.counters.grows_with_reclaim += (reclaimed > 0) as u64;
        drop(sp);
        shared.changed.notify_all();
        got
    }

    /// Premapped online: maps the descriptors that came with the reply (`fds_for`), waits
    /// until every lent handle is mapped (the rest come as `pool_handles` events), and marks
    /// them ours.
    fn lend_premapped(
        &self,
        shared: &Shared,
        ids: &[u32],
        fds_for: &[u32],
        fds: &[std::os::fd::OwnedFd],
    ) -> Result<Vec<u32>> {
        let slots = self.kv.as_ref().map_or(0, |k| k.info.slots);
        if let Some(&h) = ids.iter().find(|&&h| h >= slots) {
            let e = Error::Protocol(format!(
                "the daemon lent handle {h}, beyond this space's {slots} slots (pool_capacity_handles was {:?})",
                self.registration.pool_capacity_handles
            ));
            return Err(e);
        }
        let deadline = Instant::now() + self.options.grant_timeout;
        let mut sp = shared.lock();
        if !fds_for.is_empty() || !fds.is_empty() {
            sp.map_announced(fds_for, fds)?;
            shared.changed.notify_all();
        }
        loop {
            let missing = sp.unmapped_of(ids);
            if missing.is_empty() {
                sp.lend_premapped(ids);
                return Ok(ids.to_vec());
            }
            let now = Instant::now();
            let e = if shared.closed.load(Ordering::SeqCst) {
                Error::Closed
            } else if now >= deadline {
                let ms = self.options.grant_timeout.as_millis() as u64;
                Error::GrantTimeout { ids: missing, ms }
            } else {
                sp = shared
                    .changed
                    .wait_timeout(sp, deadline - now)
                    .map_or_else(|e| e.into_inner().0, |r| r.0);
                continue;
            };
            return Err(e);
        }
    }

    /// Gives `slots` back to the pool. Offline and serial online: they are unmapped (so no
    /// kernel may touch them any more). Premapped online: they stay mapped and stop being this
    /// client's. Quarantined slots (reclaimed earlier) are only unmapped.
    pub fn shrink(&mut self, slots: &[u32]) -> Result<()> {
        let shared = self.kv()?.shared.clone();
        let given = shared.lock().give_back(slots, self.premap);
        // Offline and serial: what was unmapped is in `releasing` even if a later slot failed.
        let handles = match (&given, self.premap) {
            (Ok(h), true) => h.clone(),
            (Err(_), true) => Vec::new(),
            (_, false) => shared.lock().releasing(),
        };
        let sent = self.send_shrink(&shared, handles);
        given?;
        sent
    }

    /// Returns `handles` to the daemon. Offline: they are in the space's `releasing` list, from
    /// which a reclaim may hand some to the daemon first; the daemon then refuses the `shrink`
    /// (code 14, nothing released) and it is sent again with what is left.
    fn send_shrink(&self, shared: &Shared, mut handles: Vec<u32>) -> Result<()> {
        let mut result = Ok(());
        for _ in 0..4 {
            if handles.is_empty() {
                break;
            }
            let req = PoolRequest::Shrink {
                handles: handles.clone(),
            };
            result = conn::call(&self.control, &req).map(|_| ());
            let left = shared.lock().releasing();
            match &result {
                Err(Error::NotHeld { .. }) if !left.is_empty() && left.len() < handles.len() => {
                    handles = left;
                }
                _ => break,
            }
        }
        shared.lock().end_release();
        result
    }

    /// Online: reports the KV bytes in use; returns how many handles the daemon's reservation
    /// wants this client to hold.
    pub fn usage(&mut self, used_bytes: u64) -> Result<u64> {
        let (reply, _) = conn::call(&self.control, &PoolRequest::Usage { used_bytes })?;
        conn::u64_field("usage", &reply, "target_handles")
    }

    /// The daemon's pool numbers (`status`), as it sends them.
    pub fn pool_status(&mut self) -> Result<Value> {
        Ok(conn::call(&self.control, &PoolRequest::Status)?.0)
    }

    /// Offline: `request` owns `block` now and costs `tokens` to recompute (its prompt and
    /// generated tokens so far; the latest call for a request sets its cost).
    pub fn set_block_owner(&self, block: u32, request: u64, tokens: u64) -> Result<()> {
        self.kv()?.shared.lock().owners.set(block, request, tokens)
    }

    /// [`Client::set_block_owner`] for several blocks under one lock.
    pub fn set_blocks_owner(&self, blocks: &[u32], request: u64, tokens: u64) -> Result<()> {
        let kv = self.kv()?;
        let mut sp = kv.shared.lock();
        blocks
            .iter()
            .try_for_each(|&b| sp.owners.set(b, request, tokens))
    }

    /// Offline: nobody owns `block` now (the framework freed it).
    pub fn clear_block(&self, block: u32) -> Result<()> {
        self.kv()?.shared.lock().owners.clear(block)
    }

    /// [`Client::clear_block`] for several blocks under one lock.
    pub fn clear_blocks(&self, blocks: &[u32]) -> Result<()> {
        let kv = self.kv()?;
        let mut sp = kv.shared.lock();
        blocks.iter().try_for_each(|&b| sp.owners.clear(b))
    }

    /// Offline, once after each step: every block of every slot reclaimed since the last call,
    /// owned or not. The framework drops the requests owning any of them (to recompute them)
    /// and stops handing those blocks out until `grow` returns their slots again.
    pub fn take_invalidated(&self) -> Vec<u32> {
        let Some(kv) = self.kv.as_ref() else {
            return Vec::new();
        };
        let mut sp = kv.shared.lock();
        let mut out = vec![0; sp.pending_invalidated()];
        sp.take_invalidated_into(&mut out);
        out
    }

    /// [`Client::take_invalidated`] into `buf`: returns how many were written; call again while
    /// it fills `buf` (the slots become refillable only when all are collected).
    pub fn take_invalidated_into(&self, buf: &mut [u32]) -> usize {
        self.kv
            .as_ref()
            .map_or(0, |kv| kv.shared.lock().take_invalidated_into(buf))
    }

    /// Offline with [`Options::explicit_release`]: the slots whose invalidated blocks were
    /// collected may be refilled now (the framework knows no kernel of its own can still
    /// touch them). Returns how many became refillable. Without explicit release, a no-op.
    pub fn release_quarantined(&self) -> usize {
        self.kv
            .as_ref()
            .map_or(0, |kv| kv.shared.lock().release_quarantined())
    }

    /// The slots backed by pool memory lent to this client now (a reclaim's slots leave at
    /// once, before [`Client::take_invalidated`]); empty before `kv_space`.
    pub fn held_slots(&self) -> Vec<u32> {
        self.kv
            .as_ref()
            .map_or_else(Vec::new, |kv| kv.shared.lock().held_slots())
    }

    /// Numbers about this client.
    pub fn stats(&self) -> Stats {
        let mut st = Stats {
            role: self.role,
            premap: self.premap,
            space: None,
            held_slots: 0,
            mapped_slots: 0,
            quarantined_slots: 0,
            pending_invalidated: 0,
            requests: 0,
            reclaims: 0,
            reclaimed_handles: 0,
            invalidated_blocks: 0,
            pool_handle_events: 0,
            unmappable_handles: 0,
            callback_errors: 0,
            daemon_closed: false,
            grows_with_reclaim: 0,
            last_grow_reclaimed: 0,
        };
        let Some(kv) = self.kv.as_ref() else {
            return st;
        };
        st.space = Some(kv.info.clone());
        st.daemon_closed = kv.shared.closed.load(Ordering::SeqCst);
        let sp = kv.shared.lock();
        (st.held_slots, st.mapped_slots, st.quarantined_slots) = sp.census();
        st.pending_invalidated = sp.pending_invalidated() as u32;
        st.requests = sp.owners.live_requests() as u32;
        let c = sp.counters;
        st.reclaims = c.reclaims;
        st.reclaimed_handles = c.reclaimed_handles;
        st.invalidated_blocks = c.invalidated_blocks;
        st.pool_handle_events = c.pool_handle_events;
        st.unmappable_handles = c.unmappable_handles;
        st.callback_errors = c.callback_errors;
        st.grows_with_reclaim = c.grows_with_reclaim;
        st.last_grow_reclaimed = c.last_grow_reclaimed;
        st
    }
}

/// Offline and serial online: maps each lent handle at an empty slot (skipping any a reclaim
/// took meanwhile) and returns the slots. On failure, everything this call placed is unmapped
/// again and joins the space's `releasing` list; the unplaced handles stay incoming.
fn place_all(shared: &Shared, ids: &[u32], fds: &[std::os::fd::OwnedFd]) -> Result<Vec<u32>> {
    if ids.len() != fds.len() {
        return Err(Error::Protocol(format!(
            "the grow reply names {} handles but carries {} descriptors",
            ids.len(),
            fds.len()
        )));
    }
    let mut slots = Vec::with_capacity(ids.len());
    for (&h, fd) in ids.iter().zip(fds) {
        // One lock per handle: a reclaim may come in between.
        let placed = shared.lock().place_next(h, fd);
        match placed {
            Ok(Some(slot)) => slots.push(slot),
            Ok(None) => {}
            Err(e) => {
                let _ = shared.lock().give_back(&slots, false);
                return Err(e);
            }
        }
    }
    Ok(slots)
}

fn parse_registration(reply: &Value) -> Result<(Registration, (u64, String))> {
    let client = reply
        .get("client")
        .and_then(Value::as_u64)
        .ok_or_else(|| Error::Protocol(format!("the register reply has no `client`: {reply}")))?;
    let Some(token) = reply.get("token").and_then(Value::as_str) else {
        return Err(Error::Protocol(format!(
            "the register reply has no `token`: {reply}"
        )));
    };
    let gpu_index = conn::u64_field("register", reply, "gpu_index")?;
    let cap = reply.get("pool_capacity_handles");
    let registration = Registration {
        client: client.to_string(),
        handle_bytes: conn::u64_field("register", reply, "handle_bytes")?,
        gpu_index: u32::try_from(gpu_index)
            .map_err(|_| Error::Protocol(format!("gpu_index {gpu_index} is out of range")))?,
        pool_capacity_handles: cap
            .and_then(Value::as_u64)
            .map(|n| n.min(u32::MAX as u64) as u32),
        gpu_pci: reply
            .get("gpu_pci")
            .and_then(Value::as_str)
            .map(str::to_string),
    };
    Ok((registration, (client, token.to_string())))
}
