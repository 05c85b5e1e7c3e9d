//! The harvest profile as Prometheus gauges, read from the cached document at each scrape:
//! busy fraction, offline memory (mean, p5, p50), pair alignment and job rates, per window.
//!
//! Job ids are labels: the first [`MAX_JOB_LABELS`] jobs of the document (by id) get their own,
//! and the rates of the rest are summed under `job="other"`, so a node that runs many small
//! jobs cannot blow up the scrape.

use std::collections::BTreeMap;
use std::sync::Arc;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Unit;
use valve_harvest::NodeHarvest;

use super::HarvestShared;

/// Jobs with a label of their own on `valve_harvest_job_rate`; the rest are `other`.
pub const MAX_JOB_LABELS: usize = 32;

/// The `valve_harvest_*` gauges of the cached document (none before the first one).
pub struct ProfileGauges(pub Arc<HarvestShared>);

impl std::fmt::Debug for ProfileGauges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProfileGauges")
    }
}

/// A window as a label value: `60s`.
fn window_label(window_s: u32) -> String {
    format!("{window_s}s")
}

impl Collector for ProfileGauges {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Ok(profile) = self.0.profile() else {
            return Ok(());
        };
        let doc = &profile.doc;
        encode_busy(doc, &mut encoder)?;
        encode_memory(doc, &mut encoder)?;
        encode_alignment(doc, &mut encoder)?;
        encode_jobs(doc, &mut encoder)
    }
}

fn encode_busy(doc: &NodeHarvest, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(
        "valve_harvest_busy_fraction",
        "Share of the measured window in which offline could not run on the GPU (the gate held it frozen)",
        None,
        MetricType::Gauge,
    )?;
    for g in &doc.gpus {
        for w in &g.windows {
            let labels = [
                ("gpu", g.index.to_string()),
                ("window", window_label(w.window_s)),
            ];
            ConstGauge::new(w.busy_fraction).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

fn encode_memory(doc: &NodeHarvest, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(
        "valve_harvest_offline_memory",
        "Memory left to offline on the GPU over the window: time-weighted mean, 5th and 50th percentile",
        Some(&Unit::Bytes),
        MetricType::Gauge,
    )?;
    for g in &doc.gpus {
        for w in &g.windows {
            let m = &w.offline_memory;
            let q = |i: usize| m.quantiles_bytes.get(i).copied();
            for (stat, v) in [("mean", Some(m.mean_bytes)), ("p5", q(1)), ("p50", q(10))] {
                let Some(v) = v else { continue };
                let labels = [
                    ("gpu", g.index.to_string()),
                    ("window", window_label(w.window_s)),
                    ("stat", stat.to_string()),
                ];
                ConstGauge::new(v as f64).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    Ok(())
}

fn encode_alignment(doc: &NodeHarvest, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    let mut family = encoder.encode_descriptor(
        "valve_harvest_alignment_score",
        "Overlap over union of two GPUs' online busy time over the window (1: in step, or both idle)",
        None,
        MetricType::Gauge,
    )?;
    for p in &doc.pairs {
        let labels = [
            ("gpu_a", p.gpus[0].to_string()),
            ("gpu_b", p.gpus[1].to_string()),
            ("window", window_label(p.window_s)),
        ];
        ConstGauge::new(p.score).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}

fn encode_jobs(doc: &NodeHarvest, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
    // (job label, window) -> units per second; jobs past the cap add up under `other`.
    let mut rates: BTreeMap<(String, u32), f64> = BTreeMap::new();
    for (k, j) in doc.jobs.iter().enumerate() {
        let job = if k < MAX_JOB_LABELS {
            j.job.clone()
        } else {
            "other".to_string()
        };
        for r in &j.rates {
            *rates.entry((job.clone(), r.window_s)).or_default() += r.per_s;
        }
    }
    let mut family = encoder.encode_descriptor(
        "valve_harvest_job_rate",
        "An offline job's progress over the window, in its own units per second (from its reports)",
        None,
        MetricType::Gauge,
    )?;
    for ((job, window_s), per_s) in rates {
        let labels = [("job", job), ("window", window_label(window_s))];
        ConstGauge::new(per_s).encode(family.encode_family(&labels)?)?;
    }
    Ok(())
}
