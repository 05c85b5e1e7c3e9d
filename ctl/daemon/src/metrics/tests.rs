//! Tests of the metrics: the lock-free histogram, label limits, and a scrape of the HTTP
//! endpoint after a known sequence of requests through the socket (fake RM).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::sync::Arc;

use valve::fake::FakeRm;

use super::*;
use crate::audit::Audit;
use crate::core::tests::cuda_process;
use crate::server::tests::{fake_core, own_group, request, serve_until, QueuedEvents};
use crate::server::{bind, Server};

/// `name{labels}` -> value, from an exposition.
pub(crate) fn parse_exposition(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

fn scrape(addr: SocketAddr) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: valve\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200 OK"), "{head}");
    assert!(head.contains("application/openmetrics-text"), "{head}");
    body.to_string()
}

#[test]
fn histogram_buckets_hold_each_value_once_and_sum_them() {
    let h = AtomicHistogram::new([1.0, 2.0, 4.0]);
    for v in [0.5, 1.0, 1.5, 3.0, 9.0] {
        h.observe(v);
    }
    assert_eq!(h.count(), 5);
    let mut reg = Registry::default();
    reg.register("h", "test", h.clone());
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &reg).unwrap();
    let v = parse_exposition(&text);
    // Upper bounds are inclusive; buckets are cumulative.
    assert_eq!(v["h_bucket{le=\"1.0\"}"], 2.0, "{text}");
    assert_eq!(v["h_bucket{le=\"2.0\"}"], 3.0);
    assert_eq!(v["h_bucket{le=\"4.0\"}"], 4.0);
    assert_eq!(v["h_bucket{le=\"+Inf\"}"], 5.0);
    assert_eq!(v["h_count"], 5.0);
    assert_eq!(v["h_sum"], 15.0);
}

#[test]
fn a_gate_s_idle_and_caught_arrivals_are_counted_per_label_while_it_runs() {
    let m = Metrics::new(1);
    m.gate_arrival(true, true);
    m.gate_started("batch");
    m.gate_arrival(true, false);
    m.gate_arrival(true, true);
    m.gate_arrival(false, false);
    let v = parse_exposition(&m.encode());
    let l =
        |kind: &str| v[&format!("valve_gate_arrivals_total{{label=\"batch\",kind=\"{kind}\"}}")];
    assert_eq!(
        (l("idle"), l("caught")),
        (2.0, 1.0),
        "none before the gate started"
    );
    m.gate_stopped();
    m.gate_arrival(true, true);
    let v = parse_exposition(&m.encode());
    assert_eq!(
        v["valve_gate_arrivals_total{label=\"batch\",kind=\"idle\"}"],
        2.0
    );
}

#[test]
fn workload_labels_are_capped() {
    let m = Metrics::new(1);
    assert_eq!(m.workload_label(None), "none");
    assert_eq!(m.workload_label(Some("")), "none");
    for i in 0..MAX_WORKLOAD_LABELS {
        assert_eq!(m.workload_label(Some(&format!("l{i}"))), format!("l{i}"));
    }
    assert_eq!(m.workload_label(Some("one-too-many")), "other");
    assert_eq!(m.workload_label(Some("l0")), "l0", "known labels stay");
}

#[test]
fn a_scrape_shows_what_a_known_sequence_of_requests_did() {
    const PID: u32 = 4_100_001;
    let rm = Arc::new(FakeRm::host(2));
    let dir = tempfile::tempdir().unwrap();
    let mut core = fake_core(&rm, dir.path());
    let instances: Vec<u32> = core
        .controller()
        .gpus()
        .iter()
        .map(|g| g.device_instance)
        .collect();
    let m = Metrics::new(core.controller().gpus().len());
    core.set_metrics(m.clone());
    let addr = serve_http("127.0.0.1:0".parse().unwrap(), m.clone()).unwrap();
    let events = QueuedEvents::default();
    events
        .0
        .borrow_mut()
        .extend(cuda_process(&rm, PID, 0xc1d0_0077, &instances, 2));
    let socket = dir.path().join("valve.sock");
    let listener = bind(&socket, own_group()).unwrap();
    let audit = Audit::log_only();
    let mut server = Server::new(&listener, own_group(), &audit).on_error(|c| m.record_error(c));
    let t0 = Instant::now();
    let path = socket.clone();
    let client = std::thread::spawn(move || {
        let preempt = format!("{{\"op\":\"preempt\",\"pid\":{PID}}}\n");
        let replies = [
            request(&path, &preempt),
            request(&path, &format!("{{\"op\":\"resume\",\"pid\":{PID}}}\n")),
            request(&path, &preempt),
            request(&path, "{\"op\":\"preempt\",\"pid\":4100999}\n"),
            request(&path, "not json\n"),
        ];
        replies.map(|r| r.error.map(|e| e.code))
    });
    let (codes, _) = serve_until(&mut server, &mut core, &events, client);
    assert_eq!(codes, [None, None, None, Some(8), Some(2)]);
    let held_at_most = t0.elapsed().as_secs_f64();
    let text = scrape(addr);
    let v = parse_exposition(&text);
    let get = |k: &str| *v.get(k).unwrap_or_else(|| panic!("no {k} in\n{text}"));
    for gpu in ["0", "1"] {
        let l = format!("{{gpu=\"{gpu}\",label=\"none\",source=\"manual\"}}");
        assert_eq!(get(&format!("valve_preemptions_total{l}")), 2.0);
        assert_eq!(get(&format!("valve_resumes_total{l}")), 1.0);
        assert_eq!(
            get(&format!("valve_disable_seconds_count{{gpu=\"{gpu}\"}}")),
            2.0
        );
        assert_eq!(
            get(&format!("valve_enable_seconds_count{{gpu=\"{gpu}\"}}")),
            1.0
        );
    }
    let ls = "{label=\"none\",source=\"manual\"}";
    assert_eq!(get(&format!("valve_hold_seconds_count{ls}")), 1.0);
    let frozen = get(&format!("valve_offline_frozen_seconds_total{ls}"));
    assert!(frozen > 0.0 && frozen <= held_at_most, "{frozen}");
    assert_eq!(get("valve_errors_total{cause=\"process\"}"), 1.0);
    assert_eq!(get("valve_errors_total{cause=\"malformed\"}"), 1.0);
    assert_eq!(get("valve_errors_total{cause=\"rm\"}"), 0.0);
    assert_eq!(get("valve_processes_known"), 1.0);
    assert_eq!(get("valve_processes_frozen{source=\"manual\"}"), 1.0);
    assert_eq!(get("valve_processes_frozen{source=\"gate\"}"), 0.0);
    assert_eq!(
        get("valve_edge_to_stopped_seconds_count{edge=\"launch\"}"),
        0.0
    );
    assert!(text.ends_with("# EOF\n"));
    core.shutdown();
}
