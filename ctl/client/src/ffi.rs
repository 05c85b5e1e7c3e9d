//! The C ABI (`include/valve_client.h`): an opaque client pointer, integer status codes (0; the
//! daemon's codes below 100; the library's from 100) and the calling thread's last error message.
//!
//! No panic crosses the boundary: every entry point runs inside `catch_unwind`. Calls on one
//! client must not overlap (the library's own callback thread is internal and needs nothing).
#![deny(unsafe_op_in_unsafe_fn)]

use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::code;
use crate::{Backend, Client, Error, FakeGpu, Options, Result, Role, Selection};

/// The opaque client C code holds.
pub struct ValveClient(Client);

/// Success.
pub const VALVE_OK: c_int = 0;
/// `role` for an online server.
pub const VALVE_ROLE_ONLINE: c_int = 0;
/// `role` for offline batch work.
pub const VALVE_ROLE_OFFLINE: c_int = 1;
/// Flag: online maps handles only when granted (serial mode) instead of the whole pool.
pub const VALVE_CLIENT_NO_PREMAP: u32 = 1;
/// Flag: offline reclaims pick the oldest grants (FIFO) instead of Algorithm 1.
pub const VALVE_CLIENT_FIFO: u32 = 2;
/// Flag, tests only: no GPU; addresses are made up and nothing is mapped.
pub const VALVE_CLIENT_FAKE_GPU: u32 = 1 << 31;
/// Flag: offline reclaimed slots wait for `valve_client_release_quarantined` before refill.
pub const VALVE_CLIENT_EXPLICIT_RELEASE: u32 = 4;

/// A KV space's geometry (see [`crate::KvSpace`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ValveKvSpaceInfo {
    /// Virtual ranges.
    pub regions: u32,
    /// Slots per region.
    pub slots: u32,
    /// KV blocks per slot.
    pub blocks_per_slot: u32,
    /// Always 0.
    pub reserved: u32,
    /// Bytes of one handle in one region.
    pub piece_bytes: u64,
    /// Bytes of one block in one region.
    pub block_bytes: u64,
    /// Bytes of each region.
    pub region_bytes: u64,
    /// Bytes per pool handle.
    pub handle_bytes: u64,
}

/// Numbers about a client (see [`crate::Stats`]).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ValveStats {
    /// Slots backed by pool memory lent to this client.
    pub held_slots: u32,
    /// Slots with pool memory mapped.
    pub mapped_slots: u32,
    /// Slots with the quarantine mapped.
    pub quarantined_slots: u32,
    /// Invalidated blocks not collected yet.
    pub pending_invalidated: u32,
    /// Reclaims answered.
    pub reclaims: u64,
    /// Handles given back in reclaims.
    pub reclaimed_handles: u64,
    /// Blocks invalidated by reclaims.
    pub invalidated_blocks: u64,
    /// Failed callback messages.
    pub callback_errors: u64,
    /// 1 when the daemon closed the callback connection.
    pub daemon_closed: u32,
    /// Always 0.
    pub reserved: u32,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_last_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|l| *l.borrow_mut() = c);
}

/// Runs `f` with panics caught; an error sets the thread's last error and becomes its code.
fn run<T>(f: impl FnOnce() -> Result<T>) -> std::result::Result<T, c_int> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => {
            set_last_error("");
            Ok(v)
        }
        Ok(Err(e)) => {
            set_last_error(&e.to_string());
            Err(e.code())
        }
        Err(_) => {
            set_last_error("valve-client panicked (a bug in the library; please report it)");
            Err(code::PANIC)
        }
    }
}

fn status(r: std::result::Result<(), c_int>) -> c_int {
    r.err().unwrap_or(VALVE_OK)
}

fn null(what: &str) -> Error {
    Error::Invalid(format!("{what} is NULL"))
}

/// # Safety
/// `p` is NULL or a pointer from [`valve_client_connect`] not yet closed, used by no other
/// thread during the call.
unsafe fn client<'a>(p: *mut ValveClient) -> Result<&'a mut Client> {
    // SAFETY: by this function's contract `p` is NULL (refused by as_mut) or a live, exclusive
    // ValveClient made by Box::into_raw in valve_client_connect.
    unsafe { p.as_mut() }
        .map(|c| &mut c.0)
        .ok_or_else(|| null("the client"))
}

/// # Safety
/// `p` is NULL or points to `n` readable `T`s that stay valid during the call.
unsafe fn slice<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T]> {
    match (p.is_null(), n) {
        (_, 0) => Ok(&[]),
        (true, _) => Err(null(what)),
        // SAFETY: non-NULL with `n` readable elements, by this function's contract.
        (false, n) => Ok(unsafe { std::slice::from_raw_parts(p, n) }),
    }
}

/// # Safety
/// `p` is NULL or points to `n` writable `T`s that nothing else uses during the call.
unsafe fn slice_mut<'a, T>(p: *mut T, n: usize, what: &str) -> Result<&'a mut [T]> {
    match (p.is_null(), n) {
        (_, 0) => Ok(&mut []),
        (true, _) => Err(null(what)),
        // SAFETY: non-NULL with `n` writable elements used by nothing else, by the contract.
        (false, n) => Ok(unsafe { std::slice::from_raw_parts_mut(p, n) }),
    }
}

/// # Safety
/// `p` is NULL or a NUL-terminated string valid during the call.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<Option<&'a str>> {
    if p.is_null() {
        return Ok(None);
    }
    // SAFETY: non-NULL and NUL-terminated, by this function's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(Some)
        .map_err(|_| Error::Invalid(format!("{what} is not UTF-8")))
}

fn options(flags: u32) -> Options {
    Options {
        premap: flags & VALVE_CLIENT_NO_PREMAP == 0,
        selection: match flags & VALVE_CLIENT_FIFO {
            0 => Selection::Greedy,
            _ => Selection::Fifo,
        },
        backend: match flags & VALVE_CLIENT_FAKE_GPU {
            0 => Backend::Cuda,
            _ => Backend::Fake(FakeGpu::new()),
        },
        explicit_release: flags & VALVE_CLIENT_EXPLICIT_RELEASE != 0,
        ..Options::default()
    }
}

/// Connects to the daemon's pool socket and registers. See `valve_client.h`.
///
/// # Safety
/// `socket_path` (NULL: the default socket) and `gpu` are NUL-terminated strings; `out` points
/// to writable storage for one pointer.
#[no_mangle]
pub unsafe extern "C" fn valve_client_connect(
    socket_path: *const c_char,
    role: c_int,
    gpu: *const c_char,
    flags: u32,
    out: *mut *mut ValveClient,
) -> c_int {
    status(run(|| {
        // SAFETY: the caller passes a string or NULL, per this function's contract.
        let path = unsafe { text(socket_path, "socket_path") }?.unwrap_or(crate::DEFAULT_SOCKET);
        // SAFETY: as above.
        let gpu = unsafe { text(gpu, "gpu") }?.ok_or_else(|| null("gpu"))?;
        // SAFETY: `out` is NULL (refused by as_mut) or writable, per the contract.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null("out"))?;
        let role = match role {
            VALVE_ROLE_ONLINE => Role::Online,
            VALVE_ROLE_OFFLINE => Role::Offline,
            r => {
                return Err(Error::Invalid(format!(
                    "role {r} is neither VALVE_ROLE_ONLINE nor VALVE_ROLE_OFFLINE"
                )))
            }
        };
        let c = Client::connect_with(path, role, gpu, options(flags))?;
        *out = Box::into_raw(Box::new(ValveClient(c)));
        Ok(())
    }))
}

/// Creates the KV space. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `info` is NULL or points to a writable `valve_kv_space_info`.
#[no_mangle]
pub unsafe extern "C" fn valve_client_kv_space(
    c: *mut ValveClient,
    regions: u32,
    capacity_bytes_per_region: u64,
    block_bytes: u64,
    info: *mut ValveKvSpaceInfo,
) -> c_int {
    // SAFETY: the same contract as this function's.
    unsafe {
        valve_client_kv_space_tail(c, regions, capacity_bytes_per_region, block_bytes, 0, info)
    }
}

/// Creates the KV space with a private tail after each region. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `info` is NULL or points to a writable `valve_kv_space_info`.
#[no_mangle]
pub unsafe extern "C" fn valve_client_kv_space_tail(
    c: *mut ValveClient,
    regions: u32,
    capacity_bytes_per_region: u64,
    block_bytes: u64,
    tail_bytes: u64,
    info: *mut ValveKvSpaceInfo,
) -> c_int {
    status(run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        let s =
            c.kv_space_with_tail(regions, capacity_bytes_per_region, block_bytes, tail_bytes)?;
        // SAFETY: `info` is NULL (skipped) or writable, per the contract.
        if let Some(info) = unsafe { info.as_mut() } {
            *info = ValveKvSpaceInfo {
                regions: s.regions,
                slots: s.slots,
                blocks_per_slot: s.blocks_per_slot,
                reserved: 0,
                piece_bytes: s.piece_bytes,
                block_bytes: s.block_bytes,
                region_bytes: s.region_bytes,
                handle_bytes: s.handle_bytes,
            };
        }
        Ok(())
    }))
}

/// Grows the space by `count` handles. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `slots_out` has room for `cap` values; `n_out` is writable.
#[no_mangle]
pub unsafe extern "C" fn valve_client_grow(
    c: *mut ValveClient,
    count: u32,
    slots_out: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> c_int {
    status(run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        // SAFETY: `slots_out` has `cap` writable values, per the contract.
        let buf = unsafe { slice_mut(slots_out, cap, "slots_out") }?;
        // SAFETY: `n_out` is NULL (refused by as_mut) or writable, per the contract.
        let n_out = unsafe { n_out.as_mut() }.ok_or_else(|| null("n_out"))?;
        if (count as usize) > buf.len() {
            return Err(Error::Invalid(format!(
                "slots_out holds {cap} slots and {count} were asked for: pass cap >= count"
            )));
        }
        let slots = c.grow(count)?;
        buf[..slots.len()].copy_from_slice(&slots);
        *n_out = slots.len();
        Ok(())
    }))
}

/// Gives slots back. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `slots` points to `n` readable values.
#[no_mangle]
pub unsafe extern "C" fn valve_client_shrink(
    c: *mut ValveClient,
    slots: *const u32,
    n: usize,
) -> c_int {
    status(run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        // SAFETY: `slots` has `n` readable values, per the contract.
        let slots = unsafe { slice(slots, n, "slots") }?;
        c.shrink(slots)
    }))
}

/// Reports online's KV usage. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `target_handles` is NULL or writable.
#[no_mangle]
pub unsafe extern "C" fn valve_client_usage(
    c: *mut ValveClient,
    used_bytes: u64,
    target_handles: *mut u64,
) -> c_int {
    status(run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        let target = c.usage(used_bytes)?;
        // SAFETY: NULL (skipped) or writable, per the contract.
        if let Some(t) = unsafe { target_handles.as_mut() } {
            *t = target;
        }
        Ok(())
    }))
}

/// The first address of a region, 0 on error. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client.
#[no_mangle]
pub unsafe extern "C" fn valve_client_region_ptr(c: *mut ValveClient, region: u32) -> u64 {
    run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        c.region_ptr(region)
    })
    .unwrap_or(0)
}

/// Collects invalidated block ids. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `buf` has room for `cap` values.
#[no_mangle]
pub unsafe extern "C" fn valve_client_take_invalidated(
    c: *mut ValveClient,
    buf: *mut u32,
    cap: usize,
) -> i64 {
    run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        // SAFETY: `buf` has `cap` writable values, per the contract.
        let buf = unsafe { slice_mut(buf, cap, "buf") }?;
        Ok(c.take_invalidated_into(buf) as i64)
    })
    .unwrap_or_else(|code| -(code as i64))
}

/// Makes collected quarantined slots refillable. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client.
#[no_mangle]
pub unsafe extern "C" fn valve_client_release_quarantined(c: *mut ValveClient) -> i64 {
    run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let c = unsafe { client(c) }?;
        Ok(c.release_quarantined() as i64)
    })
    .unwrap_or_else(|code| -(code as i64))
}

/// Records a block's owner. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client.
#[no_mangle]
pub unsafe extern "C" fn valve_client_set_block_owner(
    c: *mut ValveClient,
    block: u32,
    request: u64,
    tokens: u64,
) -> c_int {
    status(run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        unsafe { client(c) }?.set_block_owner(block, request, tokens)
    }))
}

/// Forgets a block's owner. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client.
#[no_mangle]
pub unsafe extern "C" fn valve_client_clear_block(c: *mut ValveClient, block: u32) -> c_int {
    // SAFETY: `c` is a live client used by this thread alone, per the contract.
    status(run(|| unsafe { client(c) }?.clear_block(block)))
}

/// Reads the client's numbers. See `valve_client.h`.
///
/// # Safety
/// `c` is a live client; `out` points to a writable `valve_stats`.
#[no_mangle]
pub unsafe extern "C" fn valve_client_stats(c: *mut ValveClient, out: *mut ValveStats) -> c_int {
    status(run(|| {
        // SAFETY: `c` is a live client used by this thread alone, per the contract.
        let s = unsafe { client(c) }?.stats();
        // SAFETY: `out` is NULL (refused by as_mut) or writable, per the contract.
        let out = unsafe { out.as_mut() }.ok_or_else(|| null("out"))?;
        *out = ValveStats {
            held_slots: s.held_slots,
            mapped_slots: s.mapped_slots,
            quarantined_slots: s.quarantined_slots,
            pending_invalidated: s.pending_invalidated,
            reclaims: s.reclaims,
            reclaimed_handles: s.reclaimed_handles,
            invalidated_blocks: s.invalidated_blocks,
            callback_errors: s.callback_errors,
            daemon_closed: s.daemon_closed as u32,
            reserved: 0,
        };
        Ok(())
    }))
}

/// The calling thread's last error message ("" after a success); valid until the thread's next
/// `valve_client_*` call.
#[no_mangle]
pub extern "C" fn valve_client_last_error() -> *const c_char {
    LAST_ERROR.with(|l| l.borrow().as_ptr())
}

/// Unmaps everything, closes the connections (the daemon takes the handles back) and frees the
/// client. NULL is ignored.
///
/// # Safety
/// `c` is NULL or a live client, not used again afterwards.
#[no_mangle]
pub unsafe extern "C" fn valve_client_close(c: *mut ValveClient) {
    if c.is_null() {
        return;
    }
    let _ = run(|| {
        // SAFETY: `c` came from Box::into_raw in valve_client_connect and is not used again,
        // per the contract, so the box is reclaimed exactly once.
        drop(unsafe { Box::from_raw(c) });
        Ok(())
    });
}
