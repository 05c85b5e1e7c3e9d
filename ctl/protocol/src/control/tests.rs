use super::*;
use crate::gate::{GateStatus, ProbeHits, TraceEntry, TraceEvent};
use serde::de::DeserializeOwned;

/// Serialises `x`, checks the JSON is `wire`, and that it reads back as `x`.
fn round_trip<T: Serialize + DeserializeOwned + PartialEq + std::fmt::Debug>(x: &T, wire: &str) {
    let s = serde_json::to_string(x).unwrap();
    assert_eq!(s, wire);
    assert_eq!(&serde_json::from_str::<T>(&s).unwrap(), x);
}

/// A reply built as the daemon builds it (`Reply<Data>`) reads back as the client's type.
fn reply_round_trip<T>(data: T)
where
    T: Into<Data> + Serialize + DeserializeOwned + PartialEq + std::fmt::Debug + Clone,
{
    let sent: Reply = Reply::ok(data.clone());
    let line = serde_json::to_string(&sent).unwrap();
    let got: Reply<T> = serde_json::from_str(&line).unwrap();
    assert_eq!(got.error, None, "{line}");
    assert_eq!(got.data, Some(data), "{line}");
}

#[test]
fn every_request_has_a_stable_wire_form() {
    let cases: Vec<(Request, &str)> = vec![
        (
            Request::Hello {
                protocol_version: 1,
            },
            r#"{"op":"hello","protocol_version":1}"#,
        ),
        (Request::Ps, r#"{"op":"ps"}"#),
        (Request::Status, r#"{"op":"status"}"#),
        (
            Request::Preempt {
                pid: 42,
                gpu: Some("0".into()),
                max_hold_ms: None,
                confirm: false,
            },
            r#"{"op":"preempt","pid":42,"gpu":"0","max_hold_ms":null}"#,
        ),
        (
            Request::Preempt {
                pid: 42,
                gpu: None,
                max_hold_ms: Some(1000),
                confirm: true,
            },
            r#"{"op":"preempt","pid":42,"gpu":null,"max_hold_ms":1000,"confirm":true}"#,
        ),
        (Request::Resume { pid: 7 }, r#"{"op":"resume","pid":7}"#),
        (Request::ResumeAll, r#"{"op":"resume_all"}"#),
        (Request::GateStop, r#"{"op":"gate_stop"}"#),
        (Request::GateStatus, r#"{"op":"gate_status"}"#),
        (Request::OnlineBusy, r#"{"op":"online_busy"}"#),
        (Request::OnlineIdle, r#"{"op":"online_idle"}"#),
        (
            Request::GateTrace {
                after: 3,
                limit: Some(5),
            },
            r#"{"op":"gate_trace","after":3,"limit":5}"#,
        ),
        (Request::Harvest, r#"{"op":"harvest"}"#),
    ];
    for (r, wire) in &cases {
        round_trip(r, wire);
        let op = serde_json::to_value(r).unwrap()["op"]
            .as_str()
            .unwrap()
            .to_string();
        assert!(Request::OPS.contains(&op.as_str()), "{op} missing from OPS");
    }
    let g: Request =
        serde_json::from_str(r#"{"op":"gate_start","online":[1],"offline_label":"batch"}"#)
            .unwrap();
    assert_eq!(
        g,
        Request::GateStart(Box::new(GateSpec {
            online: vec![1],
            offline_label: Some("batch".into()),
            ..GateSpec::default()
        }))
    );
    assert_eq!(
        serde_json::from_str::<LoopRequest>(r#"{"op":"metrics"}"#).unwrap(),
        LoopRequest::Metrics
    );
    assert!(serde_json::from_str::<Request>(r#"{"op":"metrics"}"#).is_err());
}

#[test]
fn an_unknown_op_and_bad_fields_get_their_named_errors() {
    let line = br#"{"op":"frobnicate"}"#;
    let why = serde_json::from_slice::<Request>(line)
        .unwrap_err()
        .to_string();
    let e = classify_bad_request(line, &why);
    assert_eq!(e.kind, ErrorCode::UnknownOp);
    assert_eq!(e.code, 2);
    assert!(
        e.message.contains("frobnicate") && e.message.contains("gate_start"),
        "{}",
        e.message
    );
    let line = br#"{"op":"preempt","pid":"x"}"#;
    let why = serde_json::from_slice::<Request>(line)
        .unwrap_err()
        .to_string();
    assert_eq!(classify_bad_request(line, &why).kind, ErrorCode::BadRequest);
    assert_eq!(
        classify_bad_request(b"[1]", "not an object").kind,
        ErrorCode::BadRequest
    );
}

#[test]
fn errors_carry_their_exit_code_and_name() {
    let r: Reply = Reply::fail(ErrorCode::Process, "no such process: 9");
    let line = serde_json::to_string(&r).unwrap();
    assert_eq!(
        line,
        r#"{"data":null,"error":{"code":8,"kind":"process","message":"no such process: 9"}}"#
    );
    let back: Reply<PsReply> = serde_json::from_str(&line).unwrap();
    assert_eq!(back.into_result().unwrap_err().kind, ErrorCode::Process);
    // An older daemon sends no kind; a newer one a kind this side does not know.
    let old: ErrorReply = serde_json::from_str(r#"{"code":5,"message":"m"}"#).unwrap();
    assert_eq!((old.kind, old.code), (ErrorCode::Failed, 5));
    let newer: ErrorReply =
        serde_json::from_str(r#"{"code":11,"kind":"from_the_future","message":"m"}"#).unwrap();
    assert_eq!((newer.kind, newer.code), (ErrorCode::Other, 11));
    for k in [
        ErrorCode::Failed,
        ErrorCode::BadRequest,
        ErrorCode::Permission,
        ErrorCode::Rm,
        ErrorCode::NoSuchGpu,
        ErrorCode::NoDaemon,
        ErrorCode::Process,
        ErrorCode::Bpf,
        ErrorCode::MpsProcess,
        ErrorCode::VersionMismatch,
    ] {
        assert_eq!(ErrorCode::of_exit_code(k.exit_code()), k);
    }
}

#[test]
fn error_kinds_with_their_own_meaning_have_their_own_exit_code() {
    let kinds = [
        ErrorCode::Failed,
        ErrorCode::BadRequest,
        ErrorCode::Permission,
        ErrorCode::Rm,
        ErrorCode::NoSuchGpu,
        ErrorCode::NoDaemon,
        ErrorCode::Process,
        ErrorCode::Bpf,
        ErrorCode::MpsProcess,
        ErrorCode::VersionMismatch,
    ];
    let mut codes: Vec<i32> = kinds.iter().map(|k| k.exit_code()).collect();
    codes.sort_unstable();
    codes.dedup();
    assert_eq!(codes.len(), kinds.len(), "shared exit codes: {codes:?}");
    // The two kinds that share a code share it on purpose: both are usage errors.
    assert_eq!(
        ErrorCode::UnknownOp.exit_code(),
        ErrorCode::BadRequest.exit_code()
    );
    assert_eq!((EXIT_MPS, EXIT_VERSION), (10, 11));
    let wire = |k: ErrorCode| serde_json::to_value(k).unwrap();
    assert_eq!(wire(ErrorCode::MpsProcess), "mps_process");
    assert_eq!(wire(ErrorCode::VersionMismatch), "version_mismatch");
}

#[test]
fn ps_entries_carry_their_mps_role_by_name() {
    let line = r#"{"pid":7,"comm":"mps","discoverable":false,"mps":"server"}"#;
    let p: ProcessEntry = serde_json::from_str(line).unwrap();
    assert_eq!(p.mps, Some(MpsRole::Server));
    // An older daemon sends no `mps`: the process is read as outside MPS.
    let old: ProcessEntry =
        serde_json::from_str(r#"{"pid":7,"comm":"x","discoverable":false}"#).unwrap();
    assert_eq!(old.mps, None);
    let v = serde_json::to_value(ProcessEntry {
        mps: Some(MpsRole::Client),
        ..ProcessEntry::default()
    })
    .unwrap();
    assert_eq!(v["mps"], "client");
}

#[test]
fn state_replies_read_back_as_their_types() {
    // Small enough to return as an error without boxing it.
    assert!(
        std::mem::size_of::<Reply>() <= 128,
        "{}",
        std::mem::size_of::<Reply>()
    );
    reply_round_trip(Hello {
        protocol_version: 1,
        daemon_version: "0.1.0".into(),
    });
    reply_round_trip(PsReply {
        processes: vec![
            ProcessEntry {
                pid: 5,
                comm: "python".into(),
                discoverable: true,
                preempted: Some(false),
                gpus: vec![ProcessGpu {
                    gpu: Some(0),
                    device_instance: Some(0),
                    client: "0xc1d00001".into(),
                    tsgs: vec![TsgEntry {
                        handle: "0x5c000001".into(),
                        channels: vec!["0x5c000002".into()],
                        compute: true,
                    }],
                    channels: 1,
                }],
                note: None,
                mps: Some(MpsRole::Client),
            },
            ProcessEntry {
                pid: 6,
                comm: "old".into(),
                discoverable: false,
                preempted: None,
                gpus: vec![],
                note: Some("not discoverable: started before the daemon".into()),
                mps: None,
            },
        ],
    });
    reply_round_trip(StatusReply {
        uptime_s: 1.5,
        events: 3,
        discovery: true,
        processes: 1,
        preempted: vec![5],
        max_hold_ms: Some(100),
        state_file: "/run/valve/state.json".into(),
        recovered_at_start: 0,
        recovery_failures: vec![],
        restored_from_journal: vec![],
        state_file_moved_aside: None,
        gpus: vec![],
        gate: Some(GateReply::idle(false)),
        freeze_checks: FreezeCounts {
            confirmed: 3,
            running: 1,
            ..FreezeCounts::default()
        },
    });
}

#[test]
fn preempt_and_resume_replies_read_back_as_their_types() {
    let timing = BatchTiming {
        gpus: vec![GpuBatchTiming {
            gpu: 0,
            channels: 4,
            start_offset: 1.0,
            ioctl: 30.5,
        }],
        wall: 31.0,
    };
    reply_round_trip(PreemptReply {
        pid: 5,
        channels: 4,
        gpus: 1,
        disable: Some(timing.clone()),
        max_hold_ms: Some(2000),
        timing_us: Some(PreemptTiming {
            record: 1,
            gate: 2,
            disable: 3,
            drain: Some(4),
            queued: None,
        }),
        ..PreemptReply::default()
    });
    reply_round_trip(PreemptReply {
        pid: 5,
        already_preempted: true,
        ..PreemptReply::default()
    });
    reply_round_trip(ResumeReply {
        pid: 5,
        enable: Some(timing),
        held_ms: Some(3.5),
        ..ResumeReply::default()
    });
    reply_round_trip(ResumeAllReply {
        resumed: vec![1, 2],
    });
}

#[test]
fn gate_signal_and_metrics_replies_read_back_as_their_types() {
    reply_round_trip(SignalReply {
        signal: "busy".into(),
        queued: true,
    });
    reply_round_trip(MetricsReply {
        text: "valve_up 1\n".into(),
    });
    reply_round_trip(GateReply::idle(true));
    reply_round_trip(GateReply::from(GateStatus {
        running: true,
        online_pids: vec![1],
        // Numeric map keys: they must read back as a running gate, not as an idle one.
        online_probes: [(1, crate::gate::ProbeState::Attached)].into(),
        online_probe_hits: ProbeHits {
            kernel_launches: 9,
            graph_launches: 0,
            syncs: 2,
        },
        note: Some("pid 3 not gated yet".into()),
        ..GateStatus::default()
    }));
    reply_round_trip(crate::gate::TraceReply {
        head: 2,
        records: vec![
            TraceEntry {
                seq: 1,
                t_ns: 10,
                event: TraceEvent::Busy,
            },
            TraceEntry {
                seq: 2,
                t_ns: 20,
                event: TraceEvent::Disable {
                    pid: 0,
                    end_ns: 25,
                    ok: true,
                },
            },
        ],
    });
}

#[test]
fn an_idle_gate_keeps_its_short_wire_form() {
    round_trip(&GateReply::idle(false), r#"{"running":false}"#);
    round_trip(
        &GateReply::idle(true),
        r#"{"running":false,"starting":true}"#,
    );
    let stopped = GateReply::from(GateStatus {
        preemptions: 3,
        ..GateStatus::default()
    });
    let line = serde_json::to_string(&stopped).unwrap();
    assert!(line.contains(r#""preemptions":3"#), "{line}");
    assert_eq!(serde_json::from_str::<GateReply>(&line).unwrap(), stopped);
    // A running gate whose status does not read is an error, never an idle gate.
    let odd = r#"{"running":true,"preemptions":"three"}"#;
    let e = serde_json::from_str::<GateReply>(odd).unwrap_err();
    assert!(e.to_string().starts_with("gate status:"), "{e}");
}
