use super::*;

#[test]
fn trace_records_keep_their_field_names() {
    let e = TraceEntry {
        seq: 4,
        t_ns: 100,
        event: TraceEvent::Arrival {
            port: 8000,
            recv_ns: 110,
            idle_ns: 5,
            read_ns: 0,
        },
    };
    let v = serde_json::to_value(e).unwrap();
    assert_eq!(v["event"], "arrival");
    assert_eq!(v["port"], 8000);
    assert_eq!(serde_json::from_value::<TraceEntry>(v).unwrap(), e);
    let c = TraceEntry {
        seq: 5,
        t_ns: 200,
        event: TraceEvent::Cooldown {
            last_activity_ns: 150,
            cooldown_ns: 40,
            waits_ignored: false,
        },
    };
    let line = serde_json::to_string(&c).unwrap();
    assert_eq!(serde_json::from_str::<TraceEntry>(&line).unwrap(), c);
    assert!(line.contains(r#""event":"cooldown""#), "{line}");
}

#[test]
fn probe_states_are_lowercase() {
    assert_eq!(
        serde_json::to_string(&ProbeState::Attaching).unwrap(),
        r#""attaching""#
    );
    assert_eq!(
        serde_json::from_str::<ProbeState>(r#""failed""#).unwrap(),
        ProbeState::Failed
    );
}
