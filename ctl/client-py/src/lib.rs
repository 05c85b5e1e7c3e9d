//! The Python module `valve`: Valve's client library (`valve-client`) for Python frameworks.
//!
//! A framework's KV allocator makes a [`PyClient`] (`valve.Client(role, gpu)`), asks for a KV
//! space (`kv_space`), grows and shrinks it by pool handles, reports block owners (offline) or
//! usage (online), and collects the blocks that reclaims invalidated. Region `i` of the space is a
//! [`RegionView`] (`client.region(i)`) exposing `__cuda_array_interface__` (version 3), so
//! `torch.as_tensor(view, device="cuda")` is a uint8 tensor over the region without a copy.
//!
//! Failures raise `valve.ValveError` (with `.code`: the daemon's protocol code below 100, the
//! library's from 100) or `valve.PoolExhausted`, which is also a `MemoryError`, for codes 11 and
//! 12. Messages are the Rust library's; they name the fix. Calls that talk to the daemon (or map
//! GPU memory) release the GIL.
//!
//! Built with PyO3's stable ABI (`abi3-py38`): one wheel serves CPython 3.8 and later.

use std::ffi::CStr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};
use valve_client::{
    Backend, Client, Error, FakeGpu, KvSpace, Options, Role, Selection, DEFAULT_SOCKET,
};

/// The library status code for "called in the wrong order" (`valve_client` `code::STATE`).
const CODE_STATE: i32 = 107;

/// The exception classes, written in Python so that `PoolExhausted` can derive from both
/// `ValveError` and `MemoryError`.
const ERRORS_PY: &CStr = cr#"
class ValveError(Exception):
    """A Valve client call failed. `code` is the status: the daemon's protocol code (below 100)
    for its refusals, the library's own (100 and up) for the rest. The message names the fix."""

    __module__ = "valve"

    def __init__(self, message, code):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), (str(self), self.code))


class PoolExhausted(ValveError, MemoryError):
    """The pool cannot lend what was asked: code 11 (more than the GPU holds) or 12 (nothing free
    for this client). Also a MemoryError, so allocators that retry smaller catch it as one."""

    __module__ = "valve"
"#;

/// `(ValveError, PoolExhausted)`, set when the module is imported.
static ERRORS: PyOnceLock<(Py<PyType>, Py<PyType>)> = PyOnceLock::new();

/// A Python exception for code `code` with `message`.
fn valve_err(py: Python<'_>, code: i32, message: String) -> PyErr {
    match ERRORS.get(py) {
        Some((valve_error, pool_exhausted)) => {
            let ty = match code {
                11 | 12 => pool_exhausted,
                _ => valve_error,
            };
            PyErr::from_type(ty.bind(py).clone(), (message, code))
        }
        None => PyRuntimeError::new_err(format!("{message} (code {code})")),
    }
}

/// Why a call on the client did not return.
enum Fail {
    /// The library's error.
    Valve(Error),
    /// `close()` was called.
    Closed,
}

impl Fail {
    fn into_py(self, py: Python<'_>) -> PyErr {
        match self {
            Fail::Valve(e) => valve_err(py, e.code(), e.to_string()),
            Fail::Closed => valve_err(
                py,
                CODE_STATE,
                "this valve.Client is closed: make a new one".into(),
            ),
        }
    }
}

/// What a [`PyClient`] and its [`RegionView`]s share.
struct Inner {
    /// `None` once closed (and no region view was left).
    client: Mutex<Option<Client>>,
    /// `close()` was called: calls fail, and the client goes when the last view does.
    closed: AtomicBool,
    /// Live [`RegionView`]s: while any lives, the regions stay reserved and mapped.
    views: AtomicUsize,
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, Option<Client>> {
        self.client.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Drops the client (its mappings, then the daemon connection) if it was closed and no view
    /// is left.
    fn release_if_unused(&self) {
        if self.closed.load(Ordering::SeqCst) && self.views.load(Ordering::SeqCst) == 0 {
            let client = self.lock().take();
            drop(client);
        }
    }
}

/// A process's connection to the Valve daemon's memory pool on one GPU, and its KV space.
///
/// `valve.Client(role, gpu="0", socket="/run/valve/pool.sock", premap=True, fifo=False,
/// cuda_ordinal=None, grant_timeout_s=10.0, explicit_release=False)` connects and registers.
/// `role` is "online" or "offline"; `gpu` an index, UUID or PCI id as the daemon knows it;
/// `premap` (online) maps the whole pool ahead of time; `fifo` (offline) gives back the oldest
/// grants in a reclaim instead of Algorithm 1's choice; `explicit_release` (offline) refills a
/// reclaimed slot only after `release_quarantined()`, for frameworks with a step in flight when
/// they collect invalidated blocks. `_fake=True` is for tests only: no GPU is touched and the region
/// addresses are made up (a daemon, or a stand-in, is still needed).
#[pyclass(module = "valve", name = "Client", frozen)]
pub struct PyClient {
    inner: Inner,
    role: Role,
}

impl PyClient {
    /// Runs `f` on the client with the GIL released.
    fn call<T, F>(&self, py: Python<'_>, f: F) -> PyResult<T>
    where
        F: FnOnce(&mut Client) -> valve_client::Result<T> + Send,
        T: Send,
    {
        py.detach(|| {
            if self.inner.closed.load(Ordering::SeqCst) {
                return Err(Fail::Closed);
            }
            match self.inner.lock().as_mut() {
                Some(c) => f(c).map_err(Fail::Valve),
                None => Err(Fail::Closed),
            }
        })
        .map_err(|e| e.into_py(py))
    }
}

fn parse_gpu(gpu: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(i) = gpu.extract::<u64>() {
        return Ok(i.to_string());
    }
    gpu.extract::<String>().map_err(|_| {
        PyTypeError::new_err("gpu is a GPU index (int or str), a GPU UUID or a PCI id (str)")
    })
}

fn kv_space_dict<'py>(py: Python<'py>, s: &KvSpace) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("regions", s.regions)?;
    d.set_item("slots", s.slots)?;
    d.set_item("piece_bytes", s.piece_bytes)?;
    d.set_item("block_bytes", s.block_bytes)?;
    d.set_item("blocks_per_slot", s.blocks_per_slot)?;
    d.set_item("region_bytes", s.region_bytes)?;
    d.set_item("tail_bytes", s.tail_bytes)?;
    d.set_item("handle_bytes", s.handle_bytes)?;
    d.set_item("region_ptrs", s.region_ptrs.clone())?;
    Ok(d)
}

#[pymethods]
impl PyClient {
    /// Connects to the daemon's pool socket and registers (see the class docstring).
    #[new]
    #[pyo3(signature = (role, gpu = None, socket = DEFAULT_SOCKET.to_string(), premap = true,
                        fifo = false, cuda_ordinal = None, grant_timeout_s = 10.0,
                        explicit_release = false, _fake = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        role: &str,
        gpu: Option<&Bound<'_, PyAny>>,
        socket: String,
        premap: bool,
        fifo: bool,
        cuda_ordinal: Option<u32>,
        grant_timeout_s: f64,
        explicit_release: bool,
        _fake: bool,
    ) -> PyResult<PyClient> {
        let role: Role = role
            .parse()
            .map_err(|e: Error| PyValueError::new_err(e.to_string()))?;
        let gpu = gpu
            .map(parse_gpu)
            .transpose()?
            .unwrap_or_else(|| "0".into());
        if !(grant_timeout_s.is_finite() && grant_timeout_s > 0.0) {
            return Err(PyValueError::new_err(
                "grant_timeout_s is a number of seconds above 0",
            ));
        }
        let options = Options {
            premap,
            selection: if fifo {
                Selection::Fifo
            } else {
                Selection::Greedy
            },
            backend: if _fake {
                Backend::Fake(FakeGpu::new())
            } else {
                Backend::Cuda
            },
            cuda_ordinal,
            grant_timeout: Duration::from_secs_f64(grant_timeout_s),
            explicit_release,
        };
        let client = py
            .detach(|| Client::connect_with(&socket, role, &gpu, options))
            .map_err(|e| valve_err(py, e.code(), e.to_string()))?;
        Ok(PyClient {
            inner: Inner {
                client: Mutex::new(Some(client)),
                closed: AtomicBool::new(false),
                views: AtomicUsize::new(0),
            },
            role,
        })
    }

    /// "online" or "offline".
    #[getter]
    fn role(&self) -> &'static str {
        self.role.as_str()
    }

    /// Whether `close()` was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }

    /// What the daemon said at registration: `client`, `handle_bytes`, `gpu_index`,
    /// `pool_capacity_handles` and `gpu_pci` (None where the daemon did not send them).
    fn registration<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let r = self.call(py, |c| Ok(c.registration().clone()))?;
        let d = PyDict::new(py);
        d.set_item("client", r.client)?;
        d.set_item("handle_bytes", r.handle_bytes)?;
        d.set_item("gpu_index", r.gpu_index)?;
        d.set_item("pool_capacity_handles", r.pool_capacity_handles)?;
        d.set_item("gpu_pci", r.gpu_pci)?;
        Ok(d)
    }

    /// Creates the KV space (once per client): `regions` virtual ranges of
    /// `capacity_bytes_per_region` bytes each (0: the whole pool; premapped online always covers
    /// the whole pool) holding blocks of `block_bytes`. Returns the geometry: regions, slots,
    /// piece_bytes, block_bytes, blocks_per_slot, region_bytes, tail_bytes, handle_bytes,
    /// region_ptrs. `tail_bytes` of the process's own zeroed memory (whole pages) follow each
    /// region's slots and are never reclaimed: a framework's padding blocks go there.
    #[pyo3(signature = (regions, capacity_bytes_per_region, block_bytes, tail_bytes = 0))]
    fn kv_space<'py>(
        &self,
        py: Python<'py>,
        regions: u32,
        capacity_bytes_per_region: u64,
        block_bytes: u64,
        tail_bytes: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let s = self.call(py, |c| {
            c.kv_space_with_tail(regions, capacity_bytes_per_region, block_bytes, tail_bytes)
        })?;
        kv_space_dict(py, &s)
    }

    /// The KV space's geometry as `kv_space` returned it, or None before `kv_space`.
    fn space<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let s = self.call(py, |c| Ok(c.space().cloned()))?;
        s.map(|s| kv_space_dict(py, &s)).transpose()
    }

    /// Region `i` of the KV space as a `RegionView` (`__cuda_array_interface__`, uint8, the
    /// region's slots and its tail). The view keeps this client, and so the region, alive.
    fn region(slf: &Bound<'_, PyClient>, i: u32) -> PyResult<RegionView> {
        let py = slf.py();
        let me = slf.get();
        let (ptr, bytes) = me.call(py, |c| {
            let ptr = c.region_ptr(i)?;
            Ok((ptr, c.space().map_or(0, |s| s.region_bytes + s.tail_bytes)))
        })?;
        me.inner.views.fetch_add(1, Ordering::SeqCst);
        Ok(RegionView {
            client: slf.clone().unbind(),
            index: i,
            ptr,
            bytes,
        })
    }

    /// Asks the pool for `n` more handles; returns the slots they back now (premapped online:
    /// the handle ids). Online may wait while the daemon reclaims from offline. Raises
    /// `PoolExhausted` when the pool cannot lend them.
    fn grow(&self, py: Python<'_>, n: u32) -> PyResult<Vec<u32>> {
        self.call(py, |c| c.grow(n))
    }

    /// Gives `slots` back to the pool.
    fn shrink(&self, py: Python<'_>, slots: Vec<u32>) -> PyResult<()> {
        self.call(py, |c| c.shrink(&slots))
    }

    /// Online: reports the KV bytes in use; returns how many handles the daemon wants this
    /// client to hold (its MIAD target).
    fn usage(&self, py: Python<'_>, used_bytes: u64) -> PyResult<u64> {
        self.call(py, |c| c.usage(used_bytes))
    }

    /// Offline, after each step: the blocks of every slot reclaimed since the last call. Their
    /// slots become refillable once collected.
    fn take_invalidated(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.call(py, |c| Ok(c.take_invalidated()))
    }

    /// Offline, with `explicit_release=True`: slots whose invalidated blocks were collected may
    /// be refilled now (no kernel of this process can still touch them). Returns how many.
    fn release_quarantined(&self, py: Python<'_>) -> PyResult<usize> {
        self.call(py, |c| Ok(c.release_quarantined()))
    }

    /// The slots backed by pool memory lent to this client now (a reclaim's slots leave at
    /// once, before `take_invalidated`).
    fn held_slots(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        self.call(py, |c| Ok(c.held_slots()))
    }

    /// Offline: request `request` owns `block` and costs `tokens` to recompute.
    fn set_block_owner(
        &self,
        py: Python<'_>,
        block: u32,
        request: u64,
        tokens: u64,
    ) -> PyResult<()> {
        self.call(py, |c| c.set_block_owner(block, request, tokens))
    }

    /// `set_block_owner` for several blocks at once.
    fn set_blocks_owner(
        &self,
        py: Python<'_>,
        blocks: Vec<u32>,
        request: u64,
        tokens: u64,
    ) -> PyResult<()> {
        self.call(py, |c| c.set_blocks_owner(&blocks, request, tokens))
    }

    /// Offline: nobody owns `block` now.
    fn clear_block(&self, py: Python<'_>, block: u32) -> PyResult<()> {
        self.call(py, |c| c.clear_block(block))
    }

    /// `clear_block` for several blocks at once.
    fn clear_blocks(&self, py: Python<'_>, blocks: Vec<u32>) -> PyResult<()> {
        self.call(py, |c| c.clear_blocks(&blocks))
    }

    /// Numbers about this client: role, premap, space (the geometry or None), held_slots,
    /// mapped_slots, quarantined_slots, pending_invalidated, requests, reclaims,
    /// reclaimed_handles, invalidated_blocks, pool_handle_events, unmappable_handles,
    /// callback_errors, daemon_closed, grows_with_reclaim, last_grow_reclaimed (online: how many
    /// handles the last `grow` took from offline).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.call(py, |c| Ok(c.stats()))?;
        let d = PyDict::new(py);
        d.set_item("role", s.role.as_str())?;
        d.set_item("premap", s.premap)?;
        d.set_item("space", s.space.map(|s| kv_space_dict(py, &s)).transpose()?)?;
        d.set_item("held_slots", s.held_slots)?;
        d.set_item("mapped_slots", s.mapped_slots)?;
        d.set_item("quarantined_slots", s.quarantined_slots)?;
        d.set_item("pending_invalidated", s.pending_invalidated)?;
        d.set_item("requests", s.requests)?;
        d.set_item("reclaims", s.reclaims)?;
        d.set_item("reclaimed_handles", s.reclaimed_handles)?;
        d.set_item("invalidated_blocks", s.invalidated_blocks)?;
        d.set_item("pool_handle_events", s.pool_handle_events)?;
        d.set_item("unmappable_handles", s.unmappable_handles)?;
        d.set_item("callback_errors", s.callback_errors)?;
        d.set_item("daemon_closed", s.daemon_closed)?;
        d.set_item("grows_with_reclaim", s.grows_with_reclaim)?;
        d.set_item("last_grow_reclaimed", s.last_grow_reclaimed)?;
        Ok(d)
    }

    /// The daemon's pool numbers (its `status` reply), as a dict.
    fn pool_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let v = self.call(py, |c| c.pool_status())?;
        py.import("json")?.call_method1("loads", (v.to_string(),))
    }

    /// Disconnects: the KV space is unmapped and its handles go back to the pool, at once if no
    /// `RegionView` is alive, else when the last one goes. Later calls raise `ValveError`.
    /// Calling it again does nothing.
    fn close(&self, py: Python<'_>) {
        self.inner.closed.store(true, Ordering::SeqCst);
        py.detach(|| self.inner.release_if_unused());
    }

    fn __enter__(slf: Py<PyClient>) -> Py<PyClient> {
        slf
    }

    #[pyo3(signature = (*_args))]
    fn __exit__(&self, py: Python<'_>, _args: &Bound<'_, pyo3::types::PyTuple>) {
        self.close(py);
    }

    fn __repr__(&self) -> String {
        let state = if self.closed() { ", closed" } else { "" };
        format!("valve.Client(role={:?}{state})", self.role.as_str())
    }
}

/// One region of a KV space as a 1-D uint8 device array: exposes `__cuda_array_interface__`
/// (version 3), so `torch.as_tensor(view, device="cuda")` (or CuPy, Numba) sees the region's
/// memory without a copy. The view holds its client: the region stays reserved while the view,
/// or a tensor made from it, lives.
#[pyclass(module = "valve", name = "RegionView", frozen)]
pub struct RegionView {
    client: Py<PyClient>,
    index: u32,
    ptr: u64,
    bytes: u64,
}

#[pymethods]
impl RegionView {
    /// The CUDA Array Interface, version 3: `shape` (region bytes,), `typestr` "|u1",
    /// `data` (address, False), no strides, and no stream (nothing to synchronise with).
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.bytes,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.ptr, false))?;
        d.set_item("version", 3)?;
        d.set_item("strides", py.None())?;
        d.set_item("stream", py.None())?;
        Ok(d)
    }

    /// The client the region belongs to.
    #[getter]
    fn client(&self, py: Python<'_>) -> Py<PyClient> {
        self.client.clone_ref(py)
    }

    /// The region's index in the KV space.
    #[getter]
    fn index(&self) -> u32 {
        self.index
    }

    /// The region's first device address.
    #[getter]
    fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The region's size in bytes.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.bytes
    }

    fn __len__(&self) -> usize {
        self.bytes as usize
    }

    fn __repr__(&self) -> String {
        format!(
            "valve.RegionView(index={}, ptr={:#x}, nbytes={})",
            self.index, self.ptr, self.bytes
        )
    }
}

impl Drop for RegionView {
    fn drop(&mut self) {
        let inner = &self.client.get().inner;
        inner.views.fetch_sub(1, Ordering::SeqCst);
        inner.release_if_unused();
    }
}

/// Valve's client library for the shared GPU memory pool: `Client`, `RegionView`, `ValveError`,
/// `PoolExhausted`.
#[pymodule]
#[pyo3(name = "valve")]
fn valve_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let errors = PyModule::from_code(py, ERRORS_PY, c"valve/_errors.py", c"valve._errors")?;
    let valve_error = errors.getattr("ValveError")?.cast_into::<PyType>()?;
    let pool_exhausted = errors.getattr("PoolExhausted")?.cast_into::<PyType>()?;
    let (valve_error, pool_exhausted) =
        ERRORS.get_or_init(py, || (valve_error.unbind(), pool_exhausted.unbind()));
    m.add("ValveError", valve_error.clone_ref(py))?;
    m.add("PoolExhausted", pool_exhausted.clone_ref(py))?;
    m.add_class::<PyClient>()?;
    m.add_class::<RegionView>()?;
    m.add("DEFAULT_SOCKET", DEFAULT_SOCKET)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
