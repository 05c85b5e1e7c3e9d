//! The daemon's GPU memory pool (issue 10): its place in the daemon, not built yet.
//!
//! Nothing is here until it is built. The pool will own each GPU's shareable physical memory in
//! fixed-size handles, hand them to registered online and offline processes over the socket
//! (new [`crate::protocol`] requests), and take memory back from offline, coordinated with its
//! preemption, when online needs more. Like [`crate::gate`], it will be driven from
//! [`crate::DaemonCore`]; the CUDA memory primitives it builds on are `valve-vmm` (`ctl/vmm`).
