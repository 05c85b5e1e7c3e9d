//! Harvest documents for tests.

use valve_harvest::{GpuHarvest, GpuWindow, MemoryStats, NodeHarvest, QUANTILES, VERSION};

/// A node of `gpus` GPUs, each `busy` over every window with `memory` left to offline.
pub fn doc(name: &str, gpus: u32, busy: f64, memory: u64) -> NodeHarvest {
    NodeHarvest {
        version: VERSION,
        node: name.into(),
        generated_unix_ms: 0,
        source: "test".into(),
        gpus: (0..gpus)
            .map(|i| GpuHarvest {
                index: i,
                name: None,
                memory_total_bytes: 80 << 30,
                windows: [60, 600, 3600]
                    .iter()
                    .map(|&w| GpuWindow {
                        window_s: w,
                        covered_s: f64::from(w),
                        busy_fraction: busy,
                        offline_memory: MemoryStats {
                            samples: 10,
                            mean_bytes: memory,
                            quantiles_bytes: vec![memory; QUANTILES],
                        },
                    })
                    .collect(),
            })
            .collect(),
        pairs: vec![],
        jobs: vec![],
    }
}
