//! What the gate reports: the status `valvectl gate status` prints, and the latency samples
//! behind its summaries, as the gate thread shares them with the daemon.

pub use valve_protocol::gate::{GateStatus, ProbeState};

#[derive(Clone, Default)]
pub(super) struct Samples {
    pub(super) disable: Vec<f64>,
    pub(super) enable: Vec<f64>,
    pub(super) reaction: Vec<f64>,
    pub(super) edge_to_disable: Vec<f64>,
    pub(super) arrival_to_disable: Vec<f64>,
}

/// Samples kept per series; older ones are dropped (status then covers the latest ones). Small
/// enough that copying them out for a status holds the lock for microseconds.
const MAX_SAMPLES: usize = 10_000;

pub(super) fn push(v: &mut Vec<f64>, x: f64) {
    if v.len() >= MAX_SAMPLES {
        v.drain(..MAX_SAMPLES / 2);
    }
    v.push(x);
}

/// The status and samples the gate thread shares with the daemon.
#[derive(Default)]
pub(super) struct SharedStatus {
    pub(super) status: GateStatus,
    pub(super) samples: Samples,
}
