//! Harvest documents for tests.

use valve_harvest::{NodeHarvest, QUANTILES, VERSION};

use crate::bench::steady_gpu;

/// A node of `gpus` GPUs, each `busy` over every window with `memory` left to offline.
pub fn doc(name: &str, gpus: u32, busy: f64, memory: u64) -> NodeHarvest {
    NodeHarvest {
        version: VERSION,
        node: name.into(),
        generated_unix_ms: 0,
        source: "test".into(),
        gpus: (0..gpus)
            .map(|i| steady_gpu(i, busy, vec![memory; QUANTILES]))
            .collect(),
        pairs: vec![],
        jobs: vec![],
    }
}
