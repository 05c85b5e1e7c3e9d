//! Prometheus metrics of the daemon: preemptions, resumes and errors, disable/enable/edge/hold
//! latency histograms, processes known and frozen, offline time frozen and harvested.
//!
//! Recording is lock-free where it follows a disable: per-GPU and per-cause metrics are created
//! up front and kept as clones (atomics); a workload label is looked up in a [`Family`] only
//! after the disable has returned. [`serve_http`] answers scrapes on its own thread, so a slow
//! scraper never holds up the daemon. The memory pool registers its own metrics through
//! [`Metrics::with_registry`]; the harvest profile ([`Metrics::serve_profile`]) adds its gauges
//! and `GET /v1/harvest`, both read from the harvest thread's cached document.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, RwLock};
use std::time::{Duration, Instant};

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric, LabelValueEncoder,
    MetricEncoder, NoLabelSet,
};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::{Registry, Unit};
use valve::controller::BatchReport;

use crate::harvest::gauges::ProfileGauges;
use crate::harvest::HarvestShared;

/// Distinct workload labels kept as metric labels; later ones are counted as `other`, so a
/// user who sets random `VALVE_LABEL`s cannot blow up the scrape.
pub const MAX_WORKLOAD_LABELS: usize = 32;

/// Who froze or released offline work.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum Source {
    /// `preempt --pid` / `resume --pid` (and the hold limit).
    Manual,
    /// The gate.
    Gate,
}

/// What started an offline stop: an online kernel launch (uprobe) or, with the arrival
/// trigger, an online request's arrival.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum EdgeKind {
    /// The first kernel launch after an idle gap.
    Launch,
    /// An online request arriving (the arrival trigger).
    Arrival,
}

/// Why something failed, for `valve_errors_total{cause}`.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq, PartialOrd, Ord)]
pub enum ErrorCause {
    /// The driver refused a disable or enable (exit code 5).
    Rm,
    /// No such process, no channels, not discoverable (exit code 8).
    Process,
    /// Bad arguments in a request (exit code 2, or no such GPU, 6).
    Usage,
    /// A caller that may not use Valve.
    Permission,
    /// A request line over the size limit.
    Oversized,
    /// A line that is not a request.
    Malformed,
    /// No request within the deadline.
    Timeout,
    /// A connection closed to make room for a new one.
    Evicted,
    /// The gate thread's own failures.
    Gate,
    /// Anything else (state file, BPF).
    Other,
}

impl Source {
    fn as_str(self) -> &'static str {
        match self {
            Source::Manual => "manual",
            Source::Gate => "gate",
        }
    }
}

impl EdgeKind {
    const ALL: [EdgeKind; 2] = [EdgeKind::Launch, EdgeKind::Arrival];
    fn as_str(self) -> &'static str {
        match self {
            EdgeKind::Launch => "launch",
            EdgeKind::Arrival => "arrival",
        }
    }
}

impl ErrorCause {
    const ALL: [ErrorCause; 10] = [
        ErrorCause::Rm,
        ErrorCause::Process,
        ErrorCause::Usage,
        ErrorCause::Permission,
        ErrorCause::Oversized,
        ErrorCause::Malformed,
        ErrorCause::Timeout,
        ErrorCause::Evicted,
        ErrorCause::Gate,
        ErrorCause::Other,
    ];
    fn as_str(self) -> &'static str {
        match self {
            ErrorCause::Rm => "rm",
            ErrorCause::Process => "process",
            ErrorCause::Usage => "usage",
            ErrorCause::Permission => "permission",
            ErrorCause::Oversized => "oversized",
            ErrorCause::Malformed => "malformed",
            ErrorCause::Timeout => "timeout",
            ErrorCause::Evicted => "evicted",
            ErrorCause::Gate => "gate",
            ErrorCause::Other => "other",
        }
    }

    /// The cause of a failed reply, from its exit code.
    pub fn of_exit_code(code: i32) -> Self {
        match code {
            crate::protocol::EXIT_RM => ErrorCause::Rm,
            crate::protocol::EXIT_PROCESS => ErrorCause::Process,
            2 | 6 => ErrorCause::Usage,
            4 => ErrorCause::Permission,
            _ => ErrorCause::Other,
        }
    }
}

macro_rules! label_value {
    ($($t:ty),*) => {$(
        impl EncodeLabelValue for $t {
            fn encode(&self, e: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
                e.write_str(self.as_str())
            }
        }
    )*};
}
/// The arrivals a gate with a hold counts: after idle time, and of them those it caught.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
enum ArrivalKind {
    Idle,
    Caught,
}

impl ArrivalKind {
    fn as_str(self) -> &'static str {
        match self {
            ArrivalKind::Idle => "idle",
            ArrivalKind::Caught => "caught",
        }
    }
}

label_value!(Source, EdgeKind, ErrorCause, ArrivalKind);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ArrivalLabels {
    label: String,
    kind: ArrivalKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkloadLabels {
    gpu: String,
    label: String,
    source: Source,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LabelSource {
    label: String,
    source: Source,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CauseLabels {
    cause: ErrorCause,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EdgeLabels {
    edge: EdgeKind,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    source: Source,
}

/// A histogram whose `observe` is a few atomic adds (prometheus-client's own takes a mutex).
#[derive(Clone, Debug)]
pub struct AtomicHistogram {
    inner: Arc<HistogramInner>,
}

#[derive(Debug)]
struct HistogramInner {
    /// Upper bounds, ascending; one more count than bounds holds the +Inf bucket.
    bounds: Vec<f64>,
    counts: Vec<AtomicU64>,
    /// f64 bits of the sum.
    sum: AtomicU64,
    count: AtomicU64,
}

impl AtomicHistogram {
    /// A histogram with these ascending upper bounds.
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> Self {
        let bounds: Vec<f64> = bounds.into_iter().collect();
        let counts = (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect();
        AtomicHistogram {
            inner: Arc::new(HistogramInner {
                bounds,
                counts,
                sum: AtomicU64::new(0f64.to_bits()),
                count: AtomicU64::new(0),
            }),
        }
    }

    /// Records one value.
    pub fn observe(&self, v: f64) {
        let h = &self.inner;
        let i = h.bounds.partition_point(|&b| b < v);
        h.counts[i].fetch_add(1, Ordering::Relaxed);
        let _ = h
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
        h.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.inner.count.load(Ordering::Relaxed)
    }
}

impl TypedMetric for AtomicHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for AtomicHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let h = &self.inner;
        let mut buckets: Vec<(f64, u64)> = h
            .bounds
            .iter()
            .zip(&h.counts)
            .map(|(&b, c)| (b, c.load(Ordering::Relaxed)))
            .collect();
        let over = h.counts[h.bounds.len()].load(Ordering::Relaxed);
        buckets.push((f64::INFINITY, over));
        // The count is the buckets' sum, so a scrape during an observe stays consistent.
        let count = buckets.iter().map(|b| b.1).sum();
        let sum = f64::from_bits(h.sum.load(Ordering::Relaxed));
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// 10 us to 10 s, doubling: disable, enable and edge-to-stopped times.
fn latency_histogram() -> AtomicHistogram {
    AtomicHistogram::new((0..21).map(|k| 10e-6 * f64::powi(2.0, k)))
}

/// 1 ms to about 4.6 h, x4: how long offline stays frozen.
fn hold_histogram() -> AtomicHistogram {
    AtomicHistogram::new((0..13).map(|k| 1e-3 * f64::powi(4.0, k)))
}

/// The metric handles the gate thread records into, made when a gate starts.
struct GateHandles {
    label: String,
    preemptions: Vec<Counter>,
    resumes: Vec<Counter>,
    hold: AtomicHistogram,
    frozen_s: Counter<f64, AtomicU64>,
    idle_arrivals: Counter,
    caught_arrivals: Counter,
}

/// The daemon's metrics and the registry they are exposed from.
pub struct Metrics {
    registry: Mutex<Registry>,
    gpus: usize,
    preemptions: Family<WorkloadLabels, Counter>,
    resumes: Family<WorkloadLabels, Counter>,
    errors: Vec<Counter>,
    disable: Vec<AtomicHistogram>,
    enable: Vec<AtomicHistogram>,
    edge_to_stopped: Vec<AtomicHistogram>,
    hold: HistogramFamily<LabelSource>,
    processes_known: Gauge,
    processes_frozen: Family<SourceLabels, Gauge>,
    frozen_s: Family<LabelSource, Counter<f64, AtomicU64>>,
    gate_arrivals: Family<ArrivalLabels, Counter>,
    labels_seen: Mutex<Vec<String>>,
    gate: RwLock<Option<GateHandles>>,
    harvest: Arc<Harvest>,
    /// The harvest profile, once the daemon serves it.
    profile: OnceLock<Arc<HarvestShared>>,
}

/// Offline time that a gate let run (harvested), per offline label: what finished gates and
/// finished spans of the running gate added, plus the span in progress at scrape time.
#[derive(Debug, Default)]
struct Harvest {
    done_s: Mutex<BTreeMap<String, f64>>,
    /// The running gate's label, if one runs.
    label: Mutex<Option<String>>,
    /// Nanoseconds since `epoch` when offline last became runnable under the gate; 0: frozen
    /// or no gate.
    runnable_since_ns: AtomicU64,
    frozen: AtomicBool,
    /// The gate has offline channels to stop (without them nothing is harvested).
    offline_present: AtomicBool,
    epoch: OnceLock<Instant>,
}

impl Harvest {
    fn now_ns(&self) -> u64 {
        // 1, not 0, at the epoch itself: 0 means "not runnable".
        self.epoch.get_or_init(Instant::now).elapsed().as_nanos() as u64 + 1
    }

    /// Ends the runnable span in progress (if any) and books it.
    fn close_span(&self) {
        let since = self.runnable_since_ns.swap(0, Ordering::AcqRel);
        if since == 0 {
            return;
        }
        let span = (self.now_ns() - since) as f64 / 1e9;
        let label = self.label.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(l) = label.as_ref() {
            *self
                .done_s
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry(l.clone())
                .or_default() += span;
        }
    }
}

impl Collector for Harvest {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let mut totals = self
            .done_s
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let since = self.runnable_since_ns.load(Ordering::Acquire);
        if let Some(l) = self
            .label
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            let running = if since == 0 {
                0.0
            } else {
                (self.now_ns().saturating_sub(since)) as f64 / 1e9
            };
            *totals.entry(l.clone()).or_default() += running;
        }
        let mut family = encoder.encode_descriptor(
            "valve_offline_harvested",
            "Time offline work ran under a gate (online idle time it used)",
            Some(&Unit::Seconds),
            MetricType::Counter,
        )?;
        for (label, s) in totals {
            let labels = [("label", label)];
            ConstCounter::new(s).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").field("gpus", &self.gpus).finish()
    }
}

/// A histogram family whose histograms a plain function makes.
type HistogramFamily<L> = Family<L, AtomicHistogram, fn() -> AtomicHistogram>;

fn gpu_labels(gpu: usize) -> GpuLabels {
    GpuLabels {
        gpu: gpu.to_string(),
    }
}

impl Metrics {
    /// Metrics for a node with `gpus` GPUs (Valve's indices `0..gpus`); the per-GPU and
    /// per-cause series exist from the start, at zero.
    pub fn new(gpus: usize) -> Arc<Self> {
        let errors = Family::<CauseLabels, Counter>::default();
        let disable = HistogramFamily::<GpuLabels>::new_with_constructor(latency_histogram);
        let enable = HistogramFamily::<GpuLabels>::new_with_constructor(latency_histogram);
        let edges = HistogramFamily::<EdgeLabels>::new_with_constructor(latency_histogram);
        let m = Metrics {
            gpus,
            errors: ErrorCause::ALL
                .iter()
                .map(|&cause| errors.get_or_create_owned(&CauseLabels { cause }))
                .collect(),
            disable: (0..gpus)
                .map(|g| disable.get_or_create_owned(&gpu_labels(g)))
                .collect(),
            enable: (0..gpus)
                .map(|g| enable.get_or_create_owned(&gpu_labels(g)))
                .collect(),
            edge_to_stopped: EdgeKind::ALL
                .iter()
                .map(|&edge| edges.get_or_create_owned(&EdgeLabels { edge }))
                .collect(),
            preemptions: Family::default(),
            resumes: Family::default(),
            hold: HistogramFamily::new_with_constructor(hold_histogram),
            processes_known: Gauge::default(),
            processes_frozen: Family::default(),
            frozen_s: Family::default(),
            gate_arrivals: Family::default(),
            labels_seen: Mutex::new(Vec::new()),
            gate: RwLock::new(None),
            harvest: Arc::new(Harvest::default()),
            profile: OnceLock::new(),
            registry: Mutex::new(Registry::default()),
        };
        for source in [Source::Manual, Source::Gate] {
            let _ = m.processes_frozen.get_or_create(&SourceLabels { source });
        }
        m.register(errors, disable, enable, edges);
        Arc::new(m)
    }

    /// Registers every series with its name and help: those this holds, and the families of
    /// the per-cause, per-GPU and per-edge ones it holds handles into.
    fn register(
        &self,
        errors: Family<CauseLabels, Counter>,
        disable: HistogramFamily<GpuLabels>,
        enable: HistogramFamily<GpuLabels>,
        edges: HistogramFamily<EdgeLabels>,
    ) {
        let mut r = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        r.register(
            "valve_preemptions",
            "Offline freezes, per GPU, workload label and source",
            self.preemptions.clone(),
        );
        r.register(
            "valve_resumes",
            "Offline releases, per GPU, workload label and source",
            self.resumes.clone(),
        );
        r.register(
            "valve_errors",
            "Failures by cause (refused requests, driver errors, gate errors)",
            errors,
        );
        r.register_with_unit(
            "valve_disable",
            "FIFO_DISABLE_CHANNELS time per GPU (all of a freeze's ioctls on it)",
            Unit::Seconds,
            disable,
        );
        r.register_with_unit("valve_enable", "Enable time per GPU", Unit::Seconds, enable);
        r.register_with_unit(
            "valve_edge_to_stopped",
            "From an online launch or arrival to offline stopped (the disable returned)",
            Unit::Seconds,
            edges,
        );
        r.register_with_unit(
            "valve_hold",
            "How long offline stayed frozen, per workload label and source",
            Unit::Seconds,
            self.hold.clone(),
        );
        r.register(
            "valve_processes_known",
            "CUDA processes the daemon knows the channels of",
            self.processes_known.clone(),
        );
        r.register(
            "valve_processes_frozen",
            "Processes frozen now, by source",
            self.processes_frozen.clone(),
        );
        r.register_with_unit(
            "valve_offline_frozen",
            "Time offline work spent frozen, per workload label and source",
            Unit::Seconds,
            self.frozen_s.clone(),
        );
        r.register(
            "valve_gate_arrivals",
            "Under a gate with a hold: online arrivals after idle time (kind idle) and those that \
             found offline frozen already (kind caught), per workload label",
            self.gate_arrivals.clone(),
        );
        r.register_collector(Box::new(self.harvest.clone()));
    }

    /// Lets another part of the daemon (the memory pool) register its metrics here; they are
    /// exposed on the same endpoint.
    pub fn with_registry<R>(&self, f: impl FnOnce(&mut Registry) -> R) -> R {
        f(&mut self.registry.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Serves the harvest profile from `shared`: the `valve_harvest_*` gauges and
    /// `GET /v1/harvest` (later calls are ignored).
    pub fn serve_profile(&self, shared: Arc<HarvestShared>) {
        if self.profile.set(shared.clone()).is_ok() {
            self.with_registry(|r| r.register_collector(Box::new(ProfileGauges(shared))));
        }
    }

    /// The harvest document's JSON for `GET /v1/harvest`; the error is the 404's one line.
    fn profile_json(&self) -> Result<String, String> {
        let Some(shared) = self.profile.get() else {
            return Err("the harvest thread is not running in this daemon".into());
        };
        shared.profile().map(|p| p.json.clone())
    }

    /// The exposition (OpenMetrics text, which Prometheus reads).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        let reg = self.registry.lock().unwrap_or_else(PoisonError::into_inner);
        prometheus_client::encoding::text::encode(&mut out, &reg).expect("writing to a String");
        out
    }

    /// The metric label of a workload label: itself, `none`, or `other` past
    /// [`MAX_WORKLOAD_LABELS`]. Takes a lock: call it after the disable, not before.
    pub fn workload_label(&self, label: Option<&str>) -> String {
        let Some(l) = label.filter(|l| !l.is_empty()) else {
            return "none".into();
        };
        let mut seen = self
            .labels_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if seen.iter().any(|s| s == l) {
            return l.to_string();
        }
        if seen.len() < MAX_WORKLOAD_LABELS {
            seen.push(l.to_string());
            return l.to_string();
        }
        "other".into()
    }

    fn workload(&self, gpu: usize, label: &str, source: Source) -> WorkloadLabels {
        WorkloadLabels {
            gpu: gpu.to_string(),
            label: label.to_string(),
            source,
        }
    }

    /// A disable on `gpu` took `ioctl` (lock-free).
    pub fn record_disable(&self, gpu: usize, ioctl: Duration) {
        if let Some(h) = self.disable.get(gpu) {
            h.observe(ioctl.as_secs_f64());
        }
    }

    /// An enable on `gpu` took `ioctl` (lock-free).
    pub fn record_enable(&self, gpu: usize, ioctl: Duration) {
        if let Some(h) = self.enable.get(gpu) {
            h.observe(ioctl.as_secs_f64());
        }
    }

    /// Offline was stopped `dur` after the online edge that asked for it (lock-free).
    pub fn record_edge_to_stopped(&self, kind: EdgeKind, dur: Duration) {
        self.edge_to_stopped[kind as usize].observe(dur.as_secs_f64());
    }

    /// A failure (lock-free).
    pub fn record_error(&self, cause: ErrorCause) {
        self.errors[cause as usize].inc();
    }

    /// A manual freeze of a process labelled `label` (see [`Metrics::workload_label`]):
    /// per-GPU disable times and one preemption per GPU. Call after the disable returned.
    pub fn record_preemption(&self, report: &BatchReport, label: &str) {
        for g in &report.gpus {
            self.record_disable(g.gpu, g.ioctl);
            self.preemptions
                .get_or_create(&self.workload(g.gpu, label, Source::Manual))
                .inc();
        }
    }

    /// A manual release after `held`.
    pub fn record_resume(&self, report: &BatchReport, label: &str, held: Duration) {
        for g in &report.gpus {
            self.record_enable(g.gpu, g.ioctl);
            self.resumes
                .get_or_create(&self.workload(g.gpu, label, Source::Manual))
                .inc();
        }
        let ls = LabelSource {
            label: label.to_string(),
            source: Source::Manual,
        };
        self.hold.get_or_create(&ls).observe(held.as_secs_f64());
        self.frozen_s.get_or_create(&ls).inc_by(held.as_secs_f64());
    }

    /// Processes known, and frozen by hand and by the gate, now.
    pub fn set_processes(&self, known: usize, frozen_manual: usize, frozen_gate: usize) {
        self.processes_known.set(known as i64);
        for (source, n) in [(Source::Manual, frozen_manual), (Source::Gate, frozen_gate)] {
            self.processes_frozen
                .get_or_create(&SourceLabels { source })
                .set(n as i64);
        }
    }

    /// Whether the gate holds offline frozen now.
    pub fn gate_frozen(&self) -> bool {
        self.harvest.frozen.load(Ordering::Acquire)
    }
}

/// The gate's side: a gate starts and stops (from the daemon), and its thread freezes and
/// releases offline (the recording calls in `gate/runtime/channels.rs`).
impl Metrics {
    /// A gate started with offline label `label` (already passed through
    /// [`Metrics::workload_label`]): its handles are made now, off the gate thread.
    pub fn gate_started(&self, label: &str) {
        let handles = |family: &Family<WorkloadLabels, Counter>| {
            (0..self.gpus)
                .map(|g| family.get_or_create_owned(&self.workload(g, label, Source::Gate)))
                .collect()
        };
        let ls = LabelSource {
            label: label.to_string(),
            source: Source::Gate,
        };
        *self.gate.write().unwrap_or_else(PoisonError::into_inner) = Some(GateHandles {
            label: label.to_string(),
            preemptions: handles(&self.preemptions),
            resumes: handles(&self.resumes),
            hold: self.hold.get_or_create_owned(&ls),
            frozen_s: self.frozen_s.get_or_create_owned(&ls),
            idle_arrivals: self.arrivals(label, ArrivalKind::Idle),
            caught_arrivals: self.arrivals(label, ArrivalKind::Caught),
        });
        let h = &self.harvest;
        *h.label.lock().unwrap_or_else(PoisonError::into_inner) = Some(label.to_string());
        h.frozen.store(false, Ordering::Release);
        h.offline_present.store(false, Ordering::Release);
        h.runnable_since_ns.store(0, Ordering::Release);
    }

    /// Whether the running gate has offline channels now (the daemon tells after each change
    /// of the offline set): harvest counts only while it has.
    pub fn gate_offline_present(&self, present: bool) {
        let h = &self.harvest;
        h.offline_present.store(present, Ordering::Release);
        if !present {
            h.close_span();
        } else if !h.frozen.load(Ordering::Acquire) {
            let _ = h.runnable_since_ns.compare_exchange(
                0,
                h.now_ns(),
                Ordering::AcqRel,
                Ordering::Acquire,
            );
        }
    }

    /// The gate stopped (offline runs on, no longer harvested).
    pub fn gate_stopped(&self) {
        let h = &self.harvest;
        h.close_span();
        h.frozen.store(false, Ordering::Release);
        h.offline_present.store(false, Ordering::Release);
        *h.label.lock().unwrap_or_else(PoisonError::into_inner) = None;
        *self.gate.write().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The gate thread froze offline: `report` of the disable, and the time from the online
    /// edge to the disable's return if an edge asked for it. Call after the disable returned.
    pub fn gate_disabled(
        &self,
        report: &BatchReport,
        edge_to_stopped: Option<(EdgeKind, Duration)>,
    ) {
        if let Some((kind, d)) = edge_to_stopped {
            self.record_edge_to_stopped(kind, d);
        }
        for g in &report.gpus {
            self.record_disable(g.gpu, g.ioctl);
        }
        let h = &self.harvest;
        h.close_span();
        h.frozen.store(true, Ordering::Release);
        let gate = self.gate.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(gate) = gate.as_ref() {
            for g in &report.gpus {
                if let Some(c) = gate.preemptions.get(g.gpu) {
                    c.inc();
                }
            }
        }
    }

    /// The gate thread released offline after `held`; `report` of the enable, if it had one.
    pub fn gate_enabled(&self, report: Option<&BatchReport>, held: Duration) {
        let h = &self.harvest;
        h.frozen.store(false, Ordering::Release);
        if h.offline_present.load(Ordering::Acquire) {
            h.runnable_since_ns.store(h.now_ns(), Ordering::Release);
        }
        let gate = self.gate.read().unwrap_or_else(PoisonError::into_inner);
        for g in report.map(|r| r.gpus.as_slice()).unwrap_or_default() {
            self.record_enable(g.gpu, g.ioctl);
            if let Some(c) = gate.as_ref().and_then(|gate| gate.resumes.get(g.gpu)) {
                c.inc();
            }
        }
        if let Some(gate) = gate.as_ref() {
            gate.hold.observe(held.as_secs_f64());
            gate.frozen_s.inc_by(held.as_secs_f64());
        }
    }

    fn arrivals(&self, label: &str, kind: ArrivalKind) -> Counter {
        self.gate_arrivals.get_or_create_owned(&ArrivalLabels {
            label: label.to_string(),
            kind,
        })
    }

    /// An arrival under a gate with a hold: after idle time, and whether offline was frozen
    /// already (caught). Nothing for one that is neither.
    pub fn gate_arrival(&self, idle: bool, caught: bool) {
        let gate = self.gate.read().unwrap_or_else(PoisonError::into_inner);
        if let Some(gate) = gate.as_ref() {
            if idle {
                gate.idle_arrivals.inc();
            }
            if caught {
                gate.caught_arrivals.inc();
            }
        }
    }

    /// The running gate's offline label, if a gate runs.
    pub fn gate_label(&self) -> Option<String> {
        let gate = self.gate.read().unwrap_or_else(PoisonError::into_inner);
        gate.as_ref().map(|g| g.label.clone())
    }
}

static GATE_METRICS: OnceLock<Arc<Metrics>> = OnceLock::new();

/// Makes `m` the metrics the gate thread records into (the daemon does this once, at start;
/// later calls are ignored).
pub fn install_for_gate(m: Arc<Metrics>) {
    let _ = GATE_METRICS.set(m);
}

/// The metrics the gate thread records into, if the daemon serves metrics.
pub fn for_gate() -> Option<&'static Metrics> {
    GATE_METRICS.get().map(|m| &**m)
}

/// Serves `GET /metrics` (and `GET /v1/harvest`, see [`Metrics::serve_profile`]) on `addr` from
/// a thread of its own; returns the bound address (for port 0) once it listens. A plain std
/// listener: one scraper every few seconds needs no HTTP stack, and each connection gets 2 s to
/// send its request head (at most 8 KiB).
pub fn serve_http(addr: SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("valve-metrics".into())
        .spawn(move || {
            for stream in listener.incoming().flatten() {
                if let Err(e) = answer_scrape(stream, &metrics) {
                    tracing::debug!("metrics scrape: {e}");
                }
            }
        })?;
    Ok(bound)
}

fn answer_scrape(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    let mut head = Vec::new();
    let mut chunk = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&chunk[..n]);
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    // The query string, if any, changes nothing.
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    let (status, kind, body) = match (method, path) {
        (b"GET", b"/metrics") => (
            "200 OK",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            metrics.encode(),
        ),
        (b"GET", b"/v1/harvest") => match metrics.profile_json() {
            Ok(json) => ("200 OK", "application/json", json),
            Err(why) => (
                "404 Not Found",
                "text/plain",
                format!("no harvest profile: {why}\n"),
            ),
        },
        (b"GET", _) => (
            "404 Not Found",
            "text/plain",
            "Valve serves /metrics and /v1/harvest\n".into(),
        ),
        _ => (
            "405 Method Not Allowed",
            "text/plain",
            "GET /metrics\n".into(),
        ),
    };
    let mut out = String::new();
    let _ = write!(
        out,
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(out.as_bytes())?;
    stream.write_all(body.as_bytes())
}

#[cfg(test)]
pub(crate) mod tests;
