//! Refusals and failures: each is a named error with the daemon's code, and none leaves
//! handles lent to a client that cannot use them.

use super::*;
use crate::mock::Config;
use crate::{conn, Error};

#[test]
fn a_missing_socket_names_the_path_and_the_daemon_to_start() {
    let e = Client::connect("/nonexistent/valve/pool.sock", Role::Online, "0")
        .err()
        .unwrap();
    assert!(matches!(e, Error::NoSocket { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("/nonexistent/valve/pool.sock") && msg.contains("valvectl daemon --pool"),
        "{msg}"
    );
    assert_eq!(e.code(), crate::error::code::CONNECT);
}

#[test]
fn requests_before_register_are_refused_with_code_13() {
    let mock = mock();
    let sock = conn::connect(&mock.path).unwrap();
    let e = conn::call(&sock, &valve_protocol::pool::PoolRequest::Grow { count: 1 }).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    assert_eq!(e.code(), 13);
    assert!(e.to_string().contains("send `register` first"), "{e}");
}

#[test]
fn a_wrong_token_fails_kv_space_and_frees_the_addresses() {
    let mock = Mock::start(Config {
        refuse_attach: true,
        ..Config::default()
    });
    let (mut c, fake) = client(&mock, Role::Offline, Options::default());
    let e = c.kv_space(2, 0, 1 << 20).unwrap_err();
    assert!(
        matches!(e, Error::NotRegistered { ref op, .. } if op == "attach"),
        "{e}"
    );
    assert!(e.to_string().contains("wrong token"), "{e}");
    assert_eq!(fake.calls(), vec![crate::FakeCall::Dropped { unmapped: 0 }]);
    assert!(matches!(c.grow(1), Err(Error::NoKvSpace)));
}

#[test]
fn a_client_the_daemon_forgot_is_told_to_connect_again() {
    let mock = mock();
    let (mut c, _, id) = offline(&mock, Selection::Greedy);
    mock.forget(id);
    let e = c.grow(1).unwrap_err();
    assert!(matches!(e, Error::NotRegistered { .. }), "{e}");
    assert!(e.to_string().contains("connect again"), "{e}");
}

#[test]
fn daemon_refusals_keep_their_codes_and_words() {
    let mock = mock();
    let (mut c, _, _) = offline(&mock, Selection::Greedy);
    let e = c.usage(1).unwrap_err();
    assert_eq!(e.code(), 15, "{e}");
    assert!(matches!(e, Error::WrongRole { .. }));
    let (mut other, _, _) = offline(&mock, Selection::Greedy);
    other.grow(6).unwrap();
    let e = c.grow(3).unwrap_err();
    assert!(matches!(e, Error::PoolExhausted { .. }), "{e}");
    assert!(e.to_string().contains("2 free handle(s), 3 asked"), "{e}");
    let e = c.grow(9).unwrap_err();
    assert!(matches!(e, Error::NoSpace { empty: 8, asked: 9 }), "{e}");
    for (code, want) in [
        (2, "malformed"),
        (11, "more than the GPU"),
        (14, "does not hold"),
        (42, "code 42"),
    ] {
        let e = Error::refusal("grow", code, "x".into());
        assert_eq!(e.code(), code);
        assert!(e.to_string().contains(want), "{e}");
    }
}

#[test]
fn a_request_over_the_gpu_is_too_large() {
    let mock = Mock::start(Config {
        max_handles: 8,
        ..Config::default()
    });
    let (mut c, fake) = client(&mock, Role::Offline, Options::default());
    c.kv_space(2, 80 << 20, 1 << 20).unwrap(); // 20 slots: more room than the pool
    let e = c.grow(9).unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    assert!(fake.mapped().is_empty());
}

#[test]
fn layout_and_argument_errors_are_named_before_asking_the_daemon() {
    let mock = mock();
    let (mut c, _) = client(&mock, Role::Offline, Options::default());
    assert!(matches!(c.region_ptr(0), Err(Error::NoKvSpace)));
    assert!(matches!(c.set_block_owner(0, 1, 1), Err(Error::NoKvSpace)));
    let e = c.kv_space(8, 0, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("--pool-handle-mib 16"), "{e}");
    c.kv_space(2, 0, 1 << 20).unwrap();
    assert!(matches!(
        c.kv_space(2, 0, 1 << 20),
        Err(Error::KvSpaceExists)
    ));
    assert!(matches!(c.region_ptr(2), Err(Error::Invalid(_))));
    assert!(matches!(c.shrink(&[3]), Err(Error::Invalid(_))));
    assert!(matches!(
        c.set_block_owner(32, 1, 1),
        Err(Error::Invalid(_))
    ));
    assert_eq!(c.grow(0).unwrap(), Vec::<u32>::new());
}

#[test]
fn the_daemon_closing_the_connections_is_named() {
    let mock = mock();
    let (mut c, _, id) = offline(&mock, Selection::Greedy);
    c.grow(1).unwrap();
    mock.kick(id);
    assert!(matches!(c.grow(1), Err(Error::Closed)));
    assert!(eventually(|| c.stats().daemon_closed));
    assert_eq!(c.stats().held_slots, 1, "what was mapped stays mapped");
}

#[test]
fn a_failed_mapping_gives_every_lent_handle_back() {
    let mock = mock();
    let (mut c, fake, id) = offline(&mock, Selection::Greedy);
    c.grow(1).unwrap();
    fake.fail_next_map();
    let e = c.grow(3).unwrap_err();
    assert!(matches!(e, Error::Vmm(_)), "{e}");
    assert_eq!(mock.held(id), vec![0]);
    assert_eq!(c.stats().held_slots, 1);
}

#[test]
fn a_premapped_grant_beyond_the_space_is_refused_and_given_back() {
    // A daemon that does not tell its capacity: online sizes its space itself (2 slots).
    let mock = Mock::start(Config {
        send_capacity: false,
        ..Config::default()
    });
    let (mut on, _) = client(&mock, Role::Online, Options::default());
    assert!(on
        .kv_space(2, 0, 1 << 20)
        .unwrap_err()
        .to_string()
        .contains("pool_capacity_handles"));
    drop(on);
    let (mut on, _) = client(&mock, Role::Online, Options::default());
    on.kv_space(2, 8 << 20, 1 << 20).unwrap();
    let e = on.grow(3).unwrap_err();
    assert!(e.to_string().contains("beyond this space's 2 slots"), "{e}");
    let id = *mock.clients("online").last().unwrap();
    assert!(mock.held(id).is_empty());
}

#[test]
fn a_premapped_grant_whose_descriptors_never_come_times_out_and_is_given_back() {
    let mock = Mock::start(Config {
        fds_in_replies: false,
        announce: false,
        ..Config::default()
    });
    let opts = Options {
        grant_timeout: std::time::Duration::from_millis(50),
        ..Options::default()
    };
    let (mut on, _) = client(&mock, Role::Online, opts);
    on.kv_space(1, 0, 1 << 20).unwrap();
    let e = on.grow(2).unwrap_err();
    assert!(
        matches!(e, Error::GrantTimeout { ref ids, .. } if ids == &[0, 1]),
        "{e}"
    );
    assert_eq!(e.code(), crate::error::code::TIMEOUT);
    assert!(mock.held(mock.clients("online")[0]).is_empty());
}

#[test]
fn cuda_refuses_to_split_a_handle_over_several_regions_before_touching_the_gpu() {
    let mock = mock();
    let (mut c, _) = client(&mock, Role::Offline, Options::default());
    // The test client is on the fake GPU; a CUDA one is refused at planning, with no CUDA call.
    let layout =
        crate::layout::Layout::plan(2, 0, 1 << 20, 8 << 20, 2 << 20, Some(4), false).unwrap();
    let e = crate::mapper::open(&Backend::Cuda, 0, &layout, true)
        .err()
        .unwrap();
    assert_eq!(e.code(), 105);
    assert!(e.to_string().contains("cuMemMap's offset must be 0"), "{e}");
    assert!(e.to_string().contains("one region"), "{e}");
    c.kv_space(2, 0, 1 << 20).unwrap(); // the fake maps pieces (tests of the bookkeeping only)
}
