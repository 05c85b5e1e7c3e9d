//! The client library frameworks link for shared KV memory: a KV space on one GPU whose slots are
//! backed by handles of the Valve daemon's memory pool (`docs/memory.md`, "The pool protocol").
//!
//! A framework's KV allocator connects with a [`Role`], asks for a KV space ([`Client::kv_space`]:
//! `regions` equal virtual ranges, one per KV tensor), and grows and shrinks it by pool handles.
//! One handle backs one **slot**: piece `i` of the handle (`handle_bytes / regions` bytes) is
//! mapped into region `i` at the slot's offset, so a slot holds the same KV blocks in every region.
//! On CUDA a space has **one region** (cuMemMap maps a handle only from offset 0, so a handle
//! cannot be split): a framework lays its per-layer tensors out side by side in it, as strided
//! views (`integrations/transformers` does); several regions work with the fake GPU only.
//!
//! - **Online** (premapped by default) maps every pool handle at slot = handle id as the daemon
//!   announces it; [`Client::grow`] says which slots are now online's to use.
//! - **Offline** maps what it is lent. When online needs memory, the daemon freezes offline and
//!   asks this library's callback thread to give back handles: it picks them with Algorithm 1
//!   ([`Selection::Greedy`], over the block owners the framework reports), maps the process's
//!   quarantine in their place and records their blocks, which [`Client::take_invalidated`]
//!   returns after the framework's step.
//!
//! All CUDA work goes through `valve-vmm` behind an internal mapper, so the protocol and
//! bookkeeping are tested without a GPU ([`Backend::Fake`]). The C ABI is in [`ffi`] and
//! `include/valve_client.h`.

mod callback;
mod client;
mod conn;
mod error;
pub mod ffi;
mod layout;
mod mapper;
mod owners;
mod select;
mod space;

#[cfg(test)]
mod mock;
#[cfg(test)]
mod tests;

pub use client::{Client, Options, Registration, Stats};
pub use error::Error;
pub use layout::KvSpace;
pub use mapper::{Backend, FakeCall, FakeGpu};
pub use select::Selection;

/// `Result` with [`Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// The daemon's pool socket when none is given (`valvectl daemon --pool-socket`).
pub const DEFAULT_SOCKET: &str = "/run/valve/pool.sock";

/// What a process is to the pool.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    /// The latency-critical server: may take memory back from offline.
    Online,
    /// Preemptible batch work: gets free memory only, and gives it back on demand.
    Offline,
}

impl Role {
    /// The protocol's name for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Online => "online",
            Role::Offline => "offline",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = Error;

    fn from_str(s: &str) -> Result<Role> {
        match s {
            "online" => Ok(Role::Online),
            "offline" => Ok(Role::Offline),
            other => Err(Error::Invalid(format!(
                "role {other:?} is neither `online` nor `offline`"
            ))),
        }
    }
}
