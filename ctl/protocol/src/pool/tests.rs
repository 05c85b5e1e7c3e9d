use super::*;

fn round_trip(r: &PoolRequest, wire: &str) {
    let s = serde_json::to_string(r).unwrap();
    assert_eq!(s, wire);
    assert_eq!(&serde_json::from_str::<PoolRequest>(&s).unwrap(), r);
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&s).unwrap()["op"],
        r.op()
    );
}

#[test]
fn every_pool_request_has_a_stable_wire_form() {
    round_trip(
        &PoolRequest::Register {
            role: Role::Online,
            gpu: GpuRef::Index(0),
            premap: Some(false),
        },
        r#"{"op":"register","role":"online","gpu":0,"premap":false}"#,
    );
    round_trip(
        &PoolRequest::Attach {
            client: 3,
            token: "99".into(),
        },
        r#"{"op":"attach","client":3,"token":"99"}"#,
    );
    round_trip(&PoolRequest::Status, r#"{"op":"status"}"#);
    round_trip(
        &PoolRequest::Cap {
            gpu: 1,
            offline_mib: None,
        },
        r#"{"op":"cap","gpu":1,"offline_mib":null}"#,
    );
    round_trip(
        &PoolRequest::Reclaim { gpu: 0, mib: 64 },
        r#"{"op":"reclaim","gpu":0,"mib":64}"#,
    );
    round_trip(
        &PoolRequest::Grow { count: 2 },
        r#"{"op":"grow","count":2}"#,
    );
    round_trip(
        &PoolRequest::Shrink {
            handles: vec![1, 2],
        },
        r#"{"op":"shrink","handles":[1,2]}"#,
    );
    round_trip(
        &PoolRequest::Usage { used_bytes: 5 },
        r#"{"op":"usage","used_bytes":5}"#,
    );
    // The GPU as an environment variable gives it.
    let r: PoolRequest =
        serde_json::from_str(r#"{"op":"register","role":"offline","gpu":"1"}"#).unwrap();
    assert!(matches!(r, PoolRequest::Register { gpu, .. } if gpu.index() == Some(1)));
}

#[test]
fn replies_read_back_as_their_types_and_failures_by_name() {
    let grow = GrowReply {
        handles: vec![1],
        fds_for: vec![1],
        reclaimed: 0,
        short: 0,
        elapsed_us: 9,
    };
    let v = ok_json(grow.clone());
    assert_eq!(v["ok"], true);
    assert_eq!(parse_reply::<GrowReply>(v).unwrap(), grow);
    let f = PoolFailure::new(PoolErrorCode::NotRegistered, "not registered");
    let v = f.to_json();
    assert_eq!(v["code"], 13);
    assert_eq!(parse_reply::<GrowReply>(v).unwrap_err(), f);
    for n in [1, 2, 6, 11, 12, 13, 14, 15, 99] {
        assert_eq!(i32::from(PoolErrorCode::from(n)), n);
    }
    assert_eq!(PoolErrorCode::from(99), PoolErrorCode::Other(99));
    let bad = parse_reply::<GrowReply>(serde_json::json!({"ok": true})).unwrap_err();
    assert_eq!(bad.code, PoolErrorCode::BadRequest);
    let status = PoolStatus {
        gpus: vec![GpuUsage {
            gpu: 0,
            handle_bytes: 2 << 20,
            ..GpuUsage::default()
        }],
        clients: vec![ClientEntry {
            client: 1,
            pid: 5,
            role: Role::Offline,
            gpu: 0,
            handles: 3,
            reservation: None,
        }],
        reclaims: ReclaimStats::default(),
    };
    assert_eq!(
        parse_reply::<PoolStatus>(ok_json(status.clone())).unwrap(),
        status
    );
}

#[test]
fn callbacks_round_trip() {
    let c = Callback::Reclaim { rid: 4, count: 2 };
    let s = serde_json::to_string(&c).unwrap();
    assert_eq!(s, r#"{"op":"reclaim","rid":4,"count":2}"#);
    assert_eq!(serde_json::from_str::<Callback>(&s).unwrap(), c);
    let a = CallbackReply {
        rid: 4,
        ok: false,
        handles: vec![],
        code: Some(PoolErrorCode::WrongRole),
        error: Some("online".into()),
    };
    let s = serde_json::to_string(&a).unwrap();
    assert!(s.contains(r#""code":15"#), "{s}");
    assert_eq!(serde_json::from_str::<CallbackReply>(&s).unwrap(), a);
}
