use std::collections::HashMap;
use std::time::Duration;

use super::*;
use crate::agents::Agents;
use crate::cycle::{JobInfo, NodeInfo, Phase, Report};
use crate::job::tests::{profile, GIB};
use crate::monitor::MonitorParams;
use crate::testutil::doc;
use valve_harvest::{JobProgress, Rate};

/// An engine in memory: placing releases a job onto its node, evicting holds it again.
#[derive(Default)]
struct FakeEngine {
    nodes: Vec<String>,
    jobs: Vec<JobInfo>,
    places: Vec<String>,
    down: bool,
    fail_place: Option<String>,
}

impl FakeEngine {
    fn job(&mut self, id: &str) -> &mut JobInfo {
        self.jobs.iter_mut().find(|j| j.id == id).unwrap()
    }

    fn start_all(&mut self, at: u64) {
        for j in &mut self.jobs {
            if j.phase == Phase::Released {
                j.phase = Phase::Running(at);
            }
        }
    }
}

impl Engine for FakeEngine {
    fn snapshot(&mut self) -> Result<Snapshot, EngineError> {
        if self.down {
            return Err(EngineError {
                message: "down".into(),
                unreachable: true,
            });
        }
        Ok(Snapshot {
            nodes: self
                .nodes
                .iter()
                .map(|n| NodeInfo {
                    name: n.clone(),
                    closed: None,
                })
                .collect(),
            jobs: self.jobs.clone(),
        })
    }

    fn place(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError> {
        if self.down || self.fail_place.as_deref() == Some(id) {
            return Err(EngineError {
                message: format!("cannot place {id}"),
                unreachable: self.down,
            });
        }
        self.places.push(id.into());
        let j = self.job(id);
        j.phase = Phase::Released;
        j.meta = Ok(meta.clone());
        Ok(())
    }

    fn evict(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError> {
        let j = self.job(id);
        j.phase = Phase::Held;
        j.meta = Ok(meta.clone());
        Ok(())
    }
}

fn held(id: &str, sla: f64) -> JobInfo {
    JobInfo {
        id: id.into(),
        phase: Phase::Held,
        meta: Ok(JobMeta {
            sla,
            profile: Some(profile(1)),
            placed: None,
            avoid: vec![],
            evictions: 0,
        }),
        order: id.parse().unwrap(),
    }
}

fn agents_with(docs: Vec<valve_harvest::NodeHarvest>, at: u64) -> Agents {
    let mut a = Agents::new(
        "http://127.0.0.1:9/{node}",
        HashMap::new(),
        Duration::from_millis(50),
    );
    for d in docs {
        a.reports.insert(
            d.node.clone(),
            Report {
                doc: d,
                received_unix_ms: at,
            },
        );
    }
    a
}

#[test]
fn a_restarted_scheduler_places_no_job_twice() {
    let mut engine = FakeEngine {
        nodes: vec!["a".into()],
        jobs: (1..=3).map(|i| held(&i.to_string(), 0.5)).collect(),
        ..FakeEngine::default()
    };
    let now = 1_000_000;
    let docs = || vec![doc("a", 2, 0.1, 32 * GIB)];
    let params = Params::default();
    let mut mon = Monitor::default();
    let mut ag = agents_with(docs(), now);
    let (_, _, applied) = pass(&mut engine, &mut ag, &mut mon, &params, &|| now, false).unwrap();
    assert_eq!(applied.placed.len(), 2, "two GPUs");
    // A new scheduler (fresh monitor, fresh agents) after the first one died.
    let mut mon = Monitor::default();
    let mut ag = agents_with(docs(), now + 10);
    let (_, plan, applied) =
        pass(&mut engine, &mut ag, &mut mon, &params, &|| now + 10, false).unwrap();
    assert!(applied.placed.is_empty(), "{:?}", plan.decisions);
    assert_eq!(engine.places.len(), 2, "each job placed once");
    let gpus: Vec<Vec<u32>> = engine
        .jobs
        .iter()
        .filter_map(|j| {
            j.meta
                .as_ref()
                .unwrap()
                .placed
                .as_ref()
                .map(|p| p.gpus.clone())
        })
        .collect();
    assert_eq!(gpus.len(), 2);
    assert_ne!(gpus[0], gpus[1], "no GPU given twice");
}

#[test]
fn a_job_that_keeps_missing_its_sla_is_evicted_and_placed_elsewhere() {
    let mut engine = FakeEngine {
        nodes: vec!["a".into(), "b".into()],
        jobs: vec![held("1", 0.5)],
        ..FakeEngine::default()
    };
    let params = Params {
        monitor: MonitorParams {
            window_s: 60,
            misses_to_evict: 2,
            ..MonitorParams::default()
        },
        ..Params::default()
    };
    let mut mon = Monitor::default();
    let t0 = 10_000_000;
    let mut ag = agents_with(
        vec![doc("a", 1, 0.0, 32 * GIB), doc("b", 1, 0.2, 32 * GIB)],
        t0,
    );
    pass(&mut engine, &mut ag, &mut mon, &params, &|| t0, false).unwrap();
    let first = engine.jobs[0]
        .meta
        .as_ref()
        .unwrap()
        .placed
        .clone()
        .unwrap()
        .node;
    assert_eq!(first, "a", "the idler node");
    engine.start_all(t0);
    let mut evicted = false;
    for k in 1..=3u64 {
        let now = t0 + k * 60_000;
        let mut d = doc("a", 1, 0.0, 32 * GIB);
        d.jobs.push(JobProgress {
            job: "1".into(),
            units_total: 0.0,
            last_report_unix_ms: now,
            rates: vec![Rate {
                window_s: 60,
                per_s: 10.0, // 0.1 of alone against an SLA of 0.5
                covered_s: 60.0,
            }],
        });
        let mut ag = agents_with(vec![d, doc("b", 1, 0.2, 32 * GIB)], now);
        let (_, _, applied) =
            pass(&mut engine, &mut ag, &mut mon, &params, &|| now, false).unwrap();
        if !applied.evicted.is_empty() {
            evicted = true;
            assert_eq!(applied.evicted, [("1".to_string(), "a".to_string())]);
            break;
        }
    }
    assert!(evicted);
    let meta = engine.jobs[0].meta.clone().unwrap();
    assert_eq!(
        (meta.evictions, meta.avoid.clone()),
        (1, vec!["a".to_string()])
    );
    let now = t0 + 10 * 60_000;
    let mut ag = agents_with(
        vec![doc("a", 1, 0.0, 32 * GIB), doc("b", 1, 0.2, 32 * GIB)],
        now,
    );
    pass(&mut engine, &mut ag, &mut mon, &params, &|| now, false).unwrap();
    let again = engine.jobs[0]
        .meta
        .as_ref()
        .unwrap()
        .placed
        .clone()
        .unwrap();
    assert_eq!(again.node, "b", "not back where it missed");
}

#[test]
fn an_unreachable_engine_is_an_error_and_nothing_is_dropped() {
    let mut engine = FakeEngine {
        nodes: vec!["a".into()],
        jobs: vec![held("1", 0.5), held("2", 0.5)],
        down: true,
        ..FakeEngine::default()
    };
    let mut ag = agents_with(vec![doc("a", 2, 0.0, 32 * GIB)], 0);
    let mut mon = Monitor::default();
    let e = pass(
        &mut engine,
        &mut ag,
        &mut mon,
        &Params::default(),
        &|| 0,
        false,
    )
    .unwrap_err();
    assert!(e.unreachable);
    engine.down = false;
    engine.fail_place = Some("1".into());
    let (_, _, applied) = pass(
        &mut engine,
        &mut ag,
        &mut mon,
        &Params::default(),
        &|| 0,
        false,
    )
    .unwrap();
    assert_eq!(applied.placed, [("2".to_string(), "a".to_string())]);
    assert_eq!(applied.failed.len(), 1);
    assert_eq!(
        engine.jobs[0].phase,
        Phase::Held,
        "still held: tried again next pass"
    );
    assert_eq!(backoff(0, Duration::from_secs(60)), Duration::from_secs(1));
    assert_eq!(backoff(3, Duration::from_secs(60)), Duration::from_secs(8));
    assert_eq!(
        backoff(30, Duration::from_secs(60)),
        Duration::from_secs(60)
    );
}

#[test]
fn a_dry_run_changes_nothing() {
    let mut engine = FakeEngine {
        nodes: vec!["a".into()],
        jobs: vec![held("1", 0.5)],
        ..FakeEngine::default()
    };
    let mut ag = agents_with(vec![doc("a", 1, 0.0, 32 * GIB)], 0);
    let (_, plan, applied) = pass(
        &mut engine,
        &mut ag,
        &mut Monitor::default(),
        &Params::default(),
        &|| 0,
        true,
    )
    .unwrap();
    assert!(matches!(plan.decisions[0].outcome, Outcome::Placed(_)));
    assert!(applied.placed.is_empty() && engine.places.is_empty());
}

#[test]
fn evicted_metadata_remembers_a_bounded_list_of_nodes() {
    let mut m = held("1", 0.5).meta.unwrap();
    m.placed = Some(PlacedOn {
        node: "x".into(),
        gpus: vec![0],
    });
    for k in 0..10 {
        m = evicted_meta(&m, &format!("n{k}"));
    }
    m = evicted_meta(&m, "n9");
    assert_eq!(m.avoid.len(), MAX_AVOID);
    assert_eq!(m.avoid.last().unwrap(), "n9");
    assert_eq!(m.evictions, 11);
    assert!(m.placed.is_none());
}

#[test]
fn the_state_file_round_trips_and_a_corrupt_one_names_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let f = StateFile::new(&dir.path().join("sub/state.json"));
    assert_eq!(f.load().unwrap(), Monitor::default(), "no file yet");
    let mut m = Monitor::default();
    m.tick(0, &[], |_| None, &MonitorParams::default());
    f.save(&m).unwrap();
    assert_eq!(f.load().unwrap(), m);
    std::fs::write(dir.path().join("sub/state.json"), "{garbage").unwrap();
    let e = f.load().unwrap_err();
    assert!(e.contains("corrupt") && e.contains("remove it"), "{e}");
}

#[test]
fn one_process_at_a_time_holds_a_state_file_and_the_second_learns_whose_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let f = StateFile::new(&dir.path().join("sub/state.json"));
    let first = f.lock().unwrap();
    assert_eq!(first.path, dir.path().join("sub/state.json.lock"));
    // flock locks belong to an open file: a second open in this process is refused as another
    // process's would be.
    match f.lock() {
        Err(LockError::Held { pid, lock, .. }) => {
            assert_eq!(pid, Some(std::process::id()));
            assert_eq!(lock, first.path);
        }
        other => panic!("a second lock was not refused: {other:?}"),
    }
    let msg = f.lock().unwrap_err().to_string();
    assert!(
        msg.contains(&format!("pid {}", std::process::id())) && msg.contains("--state"),
        "{msg}"
    );
    // Saving replaces the state file; the lock, on its own file, still holds.
    f.save(&Monitor::default()).unwrap();
    assert!(matches!(f.lock(), Err(LockError::Held { .. })));
    drop(first);
    let again = f.lock().expect("free once the holder is gone");
    drop(again);
}

#[test]
fn a_state_file_in_a_directory_that_cannot_exist_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, "").unwrap();
    let f = StateFile::new(&blocker.join("state.json"));
    let e = f.lock().unwrap_err();
    assert!(matches!(e, LockError::Io { .. }), "{e:?}");
    assert!(e.to_string().contains("--state"), "{e}");
}

/// An engine whose snapshot takes `takes_ms` of a test clock, as one does while slurmctld is
/// slow or going down.
struct SlowEngine<'a> {
    inner: FakeEngine,
    clock: &'a std::cell::Cell<u64>,
    takes_ms: u64,
}

impl Engine for SlowEngine<'_> {
    fn snapshot(&mut self) -> Result<Snapshot, EngineError> {
        self.clock.set(self.clock.get() + self.takes_ms);
        self.inner.snapshot()
    }

    fn place(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError> {
        self.inner.place(id, meta)
    }

    fn evict(&mut self, id: &str, meta: &JobMeta) -> Result<(), EngineError> {
        self.inner.evict(id, meta)
    }
}

/// A live agent for `node` serving `doc` (the recorded-document agent); its URL.
fn serve(dir: &std::path::Path, node: &str, doc: &valve_harvest::NodeHarvest) -> String {
    let harvest = dir.join(format!("{node}.json"));
    std::fs::write(&harvest, serde_json::to_string(doc).unwrap()).unwrap();
    let replay = crate::replay::Replay {
        node: node.into(),
        harvest,
        progress_dir: dir.join("progress"),
        rate_windows_s: vec![],
        stale_ms: 60_000,
    };
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let url = format!(
        "http://{}/v1/harvest",
        server.server_addr().to_ip().unwrap()
    );
    std::thread::spawn(move || replay.serve(&server));
    url
}

#[test]
fn a_pass_that_blocked_past_the_node_timeout_keeps_the_nodes_that_answered_in_it() {
    let dir = tempfile::tempdir().unwrap();
    let t0 = 1_000_000_000;
    let clock = std::cell::Cell::new(t0);
    // Both nodes answered 10 s before the pass; then the snapshot blocks for 90 s (the node
    // timeout is 60 s). "a" answers in the pass, "b" (the idler one) is silent by then.
    let url_a = serve(dir.path(), "a", &doc("a", 1, 0.5, 32 * GIB));
    let mut ag = Agents::new(
        "http://127.0.0.1:9/{node}",
        HashMap::from([("a".to_string(), url_a)]),
        Duration::from_secs(5),
    );
    for (node, busy) in [("a", 0.5), ("b", 0.0)] {
        let r = Report {
            doc: doc(node, 1, busy, 32 * GIB),
            received_unix_ms: t0 - 10_000,
        };
        ag.reports.insert(node.into(), r);
    }
    let mut engine = SlowEngine {
        inner: FakeEngine {
            nodes: vec!["a".into(), "b".into()],
            jobs: vec![held("1", 0.3)],
            ..FakeEngine::default()
        },
        clock: &clock,
        takes_ms: 90_000,
    };
    let params = Params::default();
    let mut mon = Monitor::default();
    let (_, plan, applied) = pass(
        &mut engine,
        &mut ag,
        &mut mon,
        &params,
        &|| clock.get(),
        false,
    )
    .unwrap();
    assert_eq!(
        ag.reports["a"].received_unix_ms,
        t0 + 90_000,
        "stamped after the block"
    );
    let excluded: Vec<_> = plan.excluded.iter().map(|e| e.node.as_str()).collect();
    assert_eq!(excluded, ["b"], "{:?}", plan.excluded);
    assert!(
        plan.excluded[0]
            .why
            .contains("not reported for 100.0 s (timeout 60 s)"),
        "silent since before the block: {}",
        plan.excluded[0].why
    );
    assert_eq!(applied.placed, [("1".to_string(), "a".to_string())]);
}
