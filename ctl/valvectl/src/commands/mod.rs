//! One module per `valvectl` subcommand, in the shape of cargo's `commands/<name>.rs`: each
//! holds its clap arguments (`<Name>Args`) and its `exec`; `cli.rs` only parses and dispatches.
//!
//! Commands that act on channels directly (`gpus`, `preempt`, `resume`, `bench`) take a
//! [`valve::Controller`]; the rest talk to the daemon through [`crate::client`] or run it.

pub mod bench;
pub mod daemon;
pub mod demo;
pub mod doctor;
pub mod driver;
pub mod gate;
pub mod gpus;
pub mod pool;
pub mod preempt;
pub mod profile;
pub mod ps;
pub mod resume;
pub mod status;
pub mod test_load;
pub mod top;
