//! The gate's runtime: one thread that owns its own RM client, turns arrival and launch edges and
//! busy/idle signals into disables and enables of the offline channels, and re-enables them on
//! every exit. Each decision is recorded in the gate's trace ([`super::trace`]).
//!
//! The daemon starts it ([`spawn`], `thread.rs`), feeds it the online and offline sets as
//! discovery learns them (`sets.rs`), and reads its [`GateStatus`] (`status.rs`, `shared.rs`).
//! The thread waits on one channel of [`GateInput`]s (`input.rs`), with a timeout that ends
//! exactly when the policy's cooldown would (`decide.rs`), or spins (`busy_poll.rs`); the
//! disables and enables are `channels.rs`. [`GateRuntime`] (`state.rs`) is the same logic
//! without the thread, for tests.

mod busy_poll;
mod channels;
mod decide;
#[cfg(test)]
mod fixtures;
mod input;
mod sets;
mod shared;
mod state;
mod status;
mod thread;

pub use input::{probe_hits, GateInput, LaunchSource, ProbeHits};
pub(crate) use shared::channel_set;
pub use shared::{ChannelSet, GateShared};
pub use state::GateRuntime;
pub use status::{GateStatus, ProbeState};
pub use thread::{spawn, GateHandle, GateParts};
pub use valve::stats::monotonic_ns;
