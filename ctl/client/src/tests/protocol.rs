//! Registration, grow, shrink and usage for both roles, as the mock daemon sees them.

use super::*;
use crate::mock::Config;
use crate::FakeCall;

#[test]
fn offline_grow_maps_piece_i_of_each_handle_into_region_i_and_shrink_gives_it_back() {
    let mock = mock();
    let (mut c, fake, id) = offline(&mock, Selection::Greedy);
    let space = c.space().unwrap().clone();
    assert_eq!(
        (space.regions, space.slots, space.blocks_per_slot),
        (2, 8, 4)
    );
    assert_eq!(space.piece_bytes, 4 << 20);
    assert_eq!(
        c.region_ptr(1).unwrap() - c.region_ptr(0).unwrap(),
        space.region_bytes
    );
    assert_eq!(c.grow(3).unwrap(), vec![0, 1, 2]);
    assert_eq!(mock.held(id), vec![0, 1, 2]);
    let mapped = fake.mapped();
    for slot in 0..3 {
        for region in 0..2 {
            assert_eq!(mapped[&(region, slot)], (format!("pool-{slot}"), region));
        }
    }
    c.shrink(&[1]).unwrap();
    assert_eq!(mock.held(id), vec![0, 2]);
    assert!(!fake.mapped().contains_key(&(0, 1)));
    let st = c.stats();
    assert_eq!((st.held_slots, st.mapped_slots), (2, 2));
    // The wire: register names the role and GPU; attach echoes the client and its token.
    let log = mock.log();
    assert_eq!(log[0]["op"], "register");
    assert_eq!(
        (log[0]["role"].as_str(), log[0]["gpu"].as_u64()),
        (Some("offline"), Some(0))
    );
    assert!(log[0].get("premap").is_none(), "premap is an online field");
    assert_eq!(
        log[1],
        serde_json::json!({"op": "attach", "client": id, "token": format!("tok-{id}")})
    );
    assert_eq!(log.last().unwrap()["handles"], serde_json::json!([1]));
}

#[test]
fn online_premapped_maps_every_announced_handle_and_grow_only_lends() {
    let mock = mock();
    let (mut off, _, off_id) = offline(&mock, Selection::Greedy);
    off.grow(2).unwrap(); // handles 0 and 1 exist before online comes
    let (mut on, fake) = client(&mock, Role::Online, Options::default());
    let space = on.kv_space(2, 4 << 20, 1 << 20).unwrap();
    assert_eq!(
        space.slots, 8,
        "premapped online covers the whole pool whatever it asked"
    );
    assert_eq!(mock.log()[3]["premap"], true);
    assert!(
        eventually(|| fake.mapped().len() == 4),
        "handles 0 and 1 mapped at attach"
    );
    // Handles 2..4 are created for online: their descriptors come with the reply (`fds_for`).
    assert_eq!(on.grow(3).unwrap(), vec![2, 3, 4]);
    assert_eq!(fake.source_at(3).as_deref(), Some("pool-3"));
    let st = on.stats();
    assert_eq!((st.held_slots, st.mapped_slots), (3, 5));
    on.shrink(&[3]).unwrap();
    let on_id = mock.clients("online")[0];
    assert_eq!(mock.held(on_id), vec![2, 4]);
    assert_eq!(
        fake.source_at(3).as_deref(),
        Some("pool-3"),
        "premapped: mapping kept"
    );
    assert!(on.shrink(&[0]).is_err(), "handle 0 is offline's");
    assert_eq!(mock.held(off_id), vec![0, 1]);
    assert_eq!(on.usage(20 << 20).unwrap(), 4);
}

#[test]
fn online_premapped_also_takes_handles_from_events_after_the_replies() {
    // docs/memory.md read literally: no descriptors in replies, `{"op": "pool_handles"}` events
    // after them; grow waits for its handles to be mapped.
    let mock = Mock::start(Config {
        fds_in_replies: false,
        ..Config::default()
    });
    let (mut off, _, _) = offline(&mock, Selection::Greedy);
    off.grow(1).unwrap();
    let (mut on, fake) = client(&mock, Role::Online, Options::default());
    on.kv_space(1, 0, 1 << 20).unwrap();
    assert_eq!(on.grow(2).unwrap(), vec![1, 2]);
    assert_eq!(fake.mapped().len(), 3);
    assert_eq!(fake.source_at(0).as_deref(), Some("pool-0"));
    // A second premapped client hears of handles created for the first as events either way.
    let (mut on2, fake2) = client(&mock, Role::Online, Options::default());
    on2.kv_space(1, 0, 1 << 20).unwrap();
    on.grow(1).unwrap();
    assert!(eventually(|| fake2.mapped().len() == 4));
    assert_eq!(on2.grow(0).unwrap(), Vec::<u32>::new());
}

#[test]
fn a_second_premapped_client_is_sent_new_handles_as_events() {
    let mock = mock();
    let (mut a, _) = client(&mock, Role::Online, Options::default());
    a.kv_space(1, 0, 1 << 20).unwrap();
    let (mut b, fake_b) = client(&mock, Role::Online, Options::default());
    b.kv_space(1, 0, 1 << 20).unwrap();
    assert_eq!(a.grow(2).unwrap(), vec![0, 1]);
    assert!(eventually(|| fake_b.mapped().len() == 2));
    assert_eq!(b.stats().held_slots, 0, "mapped, not lent");
}

#[test]
fn serial_online_gets_descriptors_with_grow_and_unmaps_on_shrink() {
    let mock = mock();
    let opts = Options {
        premap: false,
        ..Options::default()
    };
    let (mut on, fake) = client(&mock, Role::Online, opts);
    on.kv_space(2, 16 << 20, 1 << 20).unwrap();
    assert_eq!(mock.log()[0]["premap"], false);
    assert_eq!(on.space().unwrap().slots, 4);
    assert_eq!(on.grow(2).unwrap(), vec![0, 1]);
    assert_eq!(fake.source_at(1).as_deref(), Some("pool-1"));
    on.shrink(&[0]).unwrap();
    assert_eq!(fake.source_at(0), None);
    assert_eq!(on.stats().pool_handle_events, 0);
}

#[test]
fn online_grow_takes_memory_from_offline_through_its_reclaim() {
    let mock = Mock::start(Config {
        max_handles: 4,
        ..Config::default()
    });
    let (mut off, off_fake, off_id) = offline(&mock, Selection::Greedy);
    assert_eq!(off.grow(4).unwrap(), vec![0, 1, 2, 3]);
    // Slot 1 is the cheapest to lose, then slot 3.
    off.set_block_owner(0, 7, 500).unwrap();
    off.set_block_owner(5, 8, 10).unwrap();
    off.set_block_owner(9, 9, 300).unwrap();
    off.set_block_owner(13, 10, 20).unwrap();
    let (mut on, on_fake) = client(&mock, Role::Online, Options::default());
    on.kv_space(2, 0, 1 << 20).unwrap();
    assert!(eventually(|| on_fake.mapped().len() == 8));
    assert_eq!(on.grow(2).unwrap(), vec![1, 3]);
    let st = on.stats();
    assert_eq!((st.grows_with_reclaim, st.last_grow_reclaimed), (1, 2));
    assert_eq!(mock.held(off_id), vec![0, 2]);
    assert_eq!(off_fake.source_at(1).as_deref(), Some("quarantine"));
    assert_eq!(off.take_invalidated(), vec![4, 5, 6, 7, 12, 13, 14, 15]);
    let st = off.stats();
    assert_eq!(
        (st.reclaims, st.reclaimed_handles, st.quarantined_slots),
        (1, 2, 2)
    );
}

#[test]
fn dropping_a_client_unmaps_everything_then_the_daemon_frees_its_handles() {
    let mock = mock();
    let (mut c, fake, id) = offline(&mock, Selection::Greedy);
    c.grow(3).unwrap();
    drop(c);
    assert_eq!(
        fake.calls().last(),
        Some(&FakeCall::Dropped { unmapped: 6 })
    );
    assert!(fake.mapped().is_empty());
    assert!(eventually(|| mock.held(id).is_empty()));
    assert!(eventually(|| mock.clients("offline").is_empty()));
}
