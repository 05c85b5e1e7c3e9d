//! The scheduler's Prometheus metrics (`run --metrics-addr`): passes, placements, evictions,
//! engine errors, jobs by state, excluded nodes, pass time.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use valve_scheduler::cycle::{Phase, Plan, Snapshot};
use valve_scheduler::driver::Applied;

/// The metrics, served from their own thread.
pub struct SchedulerMetrics {
    passes: Counter,
    placements: Counter,
    evictions: Counter,
    action_failures: Counter,
    engine_errors: Counter,
    held: Gauge,
    running: Gauge,
    refused: Gauge,
    excluded_nodes: Gauge,
    pass_ms: Gauge,
}

impl SchedulerMetrics {
    /// Registers the metrics and serves `GET /metrics` on `addr`.
    pub fn serve(addr: SocketAddr) -> anyhow::Result<Arc<SchedulerMetrics>> {
        let m = Arc::new(SchedulerMetrics {
            passes: Counter::default(),
            placements: Counter::default(),
            evictions: Counter::default(),
            action_failures: Counter::default(),
            engine_errors: Counter::default(),
            held: Gauge::default(),
            running: Gauge::default(),
            refused: Gauge::default(),
            excluded_nodes: Gauge::default(),
            pass_ms: Gauge::default(),
        });
        let mut reg = Registry::with_prefix("valve_scheduler");
        reg.register("passes", "Scheduling passes completed", m.passes.clone());
        reg.register(
            "placements",
            "Jobs placed and released",
            m.placements.clone(),
        );
        reg.register(
            "evictions",
            "Jobs requeued for missing their SLA",
            m.evictions.clone(),
        );
        reg.register(
            "action_failures",
            "Placements or evictions the engine refused",
            m.action_failures.clone(),
        );
        reg.register(
            "engine_errors",
            "Passes that could not read the engine",
            m.engine_errors.clone(),
        );
        reg.register(
            "held_jobs",
            "Valve jobs waiting for a place",
            m.held.clone(),
        );
        reg.register("running_jobs", "Valve jobs running", m.running.clone());
        reg.register(
            "refused_jobs",
            "Valve jobs refused for their metadata",
            m.refused.clone(),
        );
        reg.register(
            "excluded_nodes",
            "Nodes left out of the last pass",
            m.excluded_nodes.clone(),
        );
        reg.register(
            "pass_milliseconds",
            "Wall time of the last pass",
            m.pass_ms.clone(),
        );
        let server = tiny_http::Server::http(addr)
            .map_err(|e| anyhow::anyhow!("cannot serve metrics on {addr}: {e}"))?;
        let reg = Mutex::new(reg);
        std::thread::spawn(move || {
            for req in server.incoming_requests() {
                let mut body = String::new();
                let reply = if req.url() == "/metrics" {
                    let reg = reg.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = encode(&mut body, &reg);
                    tiny_http::Response::from_string(body)
                } else {
                    tiny_http::Response::from_string("GET /metrics\n").with_status_code(404)
                };
                let _ = req.respond(reply);
            }
        });
        Ok(m)
    }

    /// A pass that could not read the engine.
    pub fn engine_error(&self) {
        self.engine_errors.inc();
    }

    /// A completed pass.
    pub fn record(&self, snap: &Snapshot, plan: &Plan, applied: &Applied, took: Duration) {
        self.passes.inc();
        self.placements.inc_by(applied.placed.len() as u64);
        self.evictions.inc_by(applied.evicted.len() as u64);
        self.action_failures.inc_by(applied.failed.len() as u64);
        let count = |f: fn(&Phase) -> bool| snap.jobs.iter().filter(|j| f(&j.phase)).count() as i64;
        self.held.set(count(|p| *p == Phase::Held));
        self.running.set(count(|p| matches!(p, Phase::Running(_))));
        self.refused.set(plan.refused.len() as i64);
        self.excluded_nodes.set(plan.excluded.len() as i64);
        self.pass_ms.set(took.as_millis() as i64);
    }
}
