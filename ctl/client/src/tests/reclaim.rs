//! The daemon's `reclaim` answered by the callback thread: Algorithm 1 or FIFO, the quarantine,
//! the invalidated blocks, and refilling quarantined slots.

use serde_json::json;

use super::*;
use crate::FakeCall;

#[test]
fn reclaim_answers_with_algorithm_1_quarantines_and_records_the_blocks() {
    let mock = mock();
    let (mut c, fake, id) = offline(&mock, Selection::Greedy);
    assert_eq!(c.grow(5).unwrap(), vec![0, 1, 2, 3, 4]);
    // Slot 0: request 1 (100). Slot 1: request 1 and request 2 (10). Slot 2: nothing.
    // Slot 3: request 3 (30). Slot 4: request 4 (25) in two blocks.
    c.set_block_owner(0, 1, 100).unwrap();
    c.set_blocks_owner(&[4], 1, 100).unwrap();
    c.set_block_owner(5, 2, 10).unwrap();
    c.set_block_owner(12, 3, 30).unwrap();
    c.set_blocks_owner(&[16, 17], 4, 25).unwrap();
    let reply = mock.reclaim(id, 3);
    assert_eq!(reply["ok"], true);
    // Free slot 2 (0), then slot 4 (25), then slot 3 (30); slot 1 would cost 110.
    assert_eq!(reply["handles"], json!([2, 4, 3]));
    assert_eq!(mock.held(id), vec![0, 1]);
    for slot in [2, 3, 4] {
        assert_eq!(fake.source_at(slot).as_deref(), Some("quarantine"));
        assert_eq!(fake.mapped()[&(1, slot)], ("quarantine".into(), 1));
    }
    let st = c.stats();
    assert_eq!(
        (st.reclaims, st.reclaimed_handles, st.pending_invalidated),
        (1, 3, 12)
    );
    assert_eq!(
        c.take_invalidated(),
        vec![8, 9, 10, 11, 16, 17, 18, 19, 12, 13, 14, 15]
    );
    assert!(c.take_invalidated().is_empty());
    assert_eq!(
        c.stats().requests,
        2,
        "requests 3 and 4 were dropped with their blocks"
    );
    // Quarantined slots are empty now and refilled first.
    assert_eq!(c.grow(2).unwrap(), vec![2, 3]);
    assert_eq!(fake.source_at(2).as_deref(), Some("pool-2"));
    assert_eq!(fake.source_at(4).as_deref(), Some("quarantine"));
}

#[test]
fn quarantined_slots_are_not_refilled_before_the_framework_collects_them() {
    let mock = mock();
    let (mut c, fake, id) = offline(&mock, Selection::Greedy);
    c.grow(2).unwrap();
    assert_eq!(mock.reclaim(id, 1)["handles"], json!([0]));
    assert_eq!(c.grow(1).unwrap(), vec![2], "slot 0 is still pending");
    let blocks = c.take_invalidated();
    assert_eq!(blocks, vec![0, 1, 2, 3]);
    assert_eq!(c.grow(1).unwrap(), vec![0]);
    // Giving back a quarantined slot unmaps it without asking the daemon.
    assert_eq!(mock.reclaim(id, 1)["handles"].as_array().unwrap().len(), 1);
    let quarantined = (0..4)
        .find(|&s| fake.source_at(s).as_deref() == Some("quarantine"))
        .unwrap();
    let requests = mock.log().len();
    c.shrink(&[quarantined as u32]).unwrap();
    assert_eq!(mock.log().len(), requests);
    assert_eq!(fake.source_at(quarantined), None);
}

#[test]
fn fifo_gives_back_the_oldest_grants_whatever_they_cost() {
    let mock = mock();
    let (mut c, _, id) = offline(&mock, Selection::Fifo);
    c.grow(2).unwrap();
    c.grow(2).unwrap();
    c.set_block_owner(0, 1, 1_000_000).unwrap(); // slot 0 is the most expensive
    assert_eq!(mock.reclaim(id, 2)["handles"], json!([0, 1]));
}

#[test]
fn a_second_reclaim_before_collection_counts_doomed_requests_as_free() {
    let mock = mock();
    let (mut c, _, id) = offline(&mock, Selection::Greedy);
    c.grow(4).unwrap();
    // Slot 0: A (50). Slot 1: A and D (10). Slot 2: B (55). Slot 3: C (58).
    c.set_block_owner(0, 0xA, 50).unwrap();
    c.set_block_owner(4, 0xA, 50).unwrap();
    c.set_block_owner(5, 0xD, 10).unwrap();
    c.set_block_owner(8, 0xB, 55).unwrap();
    c.set_block_owner(12, 0xC, 58).unwrap();
    assert_eq!(mock.reclaim(id, 1)["handles"], json!([0]));
    // A is being recomputed: slot 1 costs only D now (not 60), so it goes before slot 2 (55).
    assert_eq!(mock.reclaim(id, 1)["handles"], json!([1]));
}

#[test]
fn a_reclaim_for_more_than_held_gives_everything_and_zero_gives_nothing() {
    let mock = mock();
    let (mut c, _, id) = offline(&mock, Selection::Greedy);
    c.grow(2).unwrap();
    assert_eq!(mock.reclaim(id, 0)["handles"], json!([]));
    let reply = mock.reclaim(id, 10);
    assert_eq!(
        (
            reply["ok"].as_bool(),
            reply["handles"].as_array().unwrap().len()
        ),
        (Some(true), 2)
    );
    assert_eq!(c.stats().held_slots, 0);
}

#[test]
fn callback_messages_the_client_cannot_serve_are_refused_or_counted() {
    let mock = mock();
    let (mut on, _) = client(&mock, Role::Online, Options::default());
    on.kv_space(1, 0, 1 << 20).unwrap();
    let on_id = mock.clients("online")[0];
    let r = mock
        .callback_call(on_id, &json!({"op": "reclaim", "rid": 9, "count": 1}), true)
        .unwrap();
    assert_eq!(
        (r["rid"].as_u64(), r["ok"].as_bool(), r["code"].as_i64()),
        (Some(9), Some(false), Some(15))
    );
    let (_off, _, off_id) = offline(&mock, Selection::Greedy);
    let r = mock
        .callback_call(off_id, &json!({"op": "reclaim", "rid": 3}), true)
        .unwrap();
    assert_eq!(r["code"], 2);
    let r = mock
        .callback_call(off_id, &json!({"op": "dance", "rid": 4}), true)
        .unwrap();
    assert_eq!((r["rid"].as_u64(), r["code"].as_i64()), (Some(4), Some(2)));
    // An event without rid gets no reply, only a count; the thread keeps serving.
    mock.callback_call(on_id, &json!({"op": "dance"}), false);
    assert!(eventually(|| on.stats().callback_errors == 1));
    assert_eq!(mock.reclaim(off_id, 1)["ok"], true);
}

#[test]
fn a_reclaim_while_a_shrink_is_in_flight_is_answered_in_full_and_the_shrink_resent() {
    let mock = Mock::start(crate::mock::Config {
        reclaim_before_shrink: 2,
        ..crate::mock::Config::default()
    });
    let (mut c, _, id) = offline(&mock, Selection::Greedy);
    c.grow(3).unwrap();
    // Slots 0 and 1 are unmapped and their shrink is out when the daemon, still counting them,
    // asks for 2: slot 2 and one of the released handles. The shrink is refused (code 14:
    // handle 0 went to the reclaim) and sent again with handle 1 alone.
    c.shrink(&[0, 1]).unwrap();
    assert!(mock.held(id).is_empty());
    let shrinks: Vec<_> = mock
        .log()
        .into_iter()
        .filter(|m| m["op"] == "shrink")
        .collect();
    assert_eq!(shrinks.len(), 2);
    assert_eq!(shrinks[1]["handles"], json!([1]));
    let st = c.stats();
    assert_eq!(
        (st.held_slots, st.reclaimed_handles, st.quarantined_slots),
        (0, 2, 1)
    );
}

#[test]
fn a_reclaim_right_after_a_grow_reply_takes_lent_handles_and_grow_returns_the_rest() {
    let mock = Mock::start(crate::mock::Config {
        reclaim_after_grow: 2,
        ..crate::mock::Config::default()
    });
    let (mut c, _, id) = offline(&mock, Selection::Greedy);
    let slots = c.grow(3).unwrap();
    // Whether the reclaim came before or after the handles were placed, offline holds one.
    assert!(eventually(|| mock.held(id).len() == 1));
    assert!(eventually(|| c.stats().reclaims == 1));
    assert_eq!(c.stats().held_slots, 1);
    assert_eq!(c.stats().reclaimed_handles, 2);
    let quarantined = c.stats().quarantined_slots as usize;
    assert_eq!(
        slots.len(),
        1 + quarantined,
        "slots grow returned: held or quarantined"
    );
}

#[test]
fn with_explicit_release_a_collected_slot_is_refilled_only_after_release() {
    let mock = mock();
    let (mut c, fake) = client(
        &mock,
        Role::Offline,
        Options {
            explicit_release: true,
            ..Options::default()
        },
    );
    c.kv_space(2, 0, 1 << 20).unwrap();
    let id = *mock.clients("offline").last().unwrap();
    c.grow(2).unwrap();
    assert_eq!(mock.reclaim(id, 1)["handles"], json!([0]));
    assert_eq!(c.take_invalidated(), vec![0, 1, 2, 3]);
    // Collected, but an async framework's next batch may still write the quarantine.
    assert_eq!(c.grow(1).unwrap(), vec![2]);
    assert_eq!(fake.source_at(0).as_deref(), Some("quarantine"));
    assert_eq!(c.release_quarantined(), 1);
    assert_eq!(c.release_quarantined(), 0, "nothing left to release");
    assert_eq!(c.grow(1).unwrap(), vec![0]);
    assert_ne!(fake.source_at(0).as_deref(), Some("quarantine"));
}

#[test]
fn a_tail_is_mapped_after_every_region_and_the_space_says_how_long() {
    let mock = mock();
    let (mut c, fake) = client(&mock, Role::Offline, Options::default());
    let s = c.kv_space_with_tail(2, 0, 1 << 20, 3 << 19).unwrap();
    assert_eq!(s.tail_bytes, 2 << 20, "1.5 MiB rounds up to a 2 MiB page");
    let tails: Vec<_> = fake
        .calls()
        .into_iter()
        .filter(|c| matches!(c, FakeCall::MapTail { .. }))
        .collect();
    assert_eq!(
        tails,
        vec![
            FakeCall::MapTail {
                region: 0,
                bytes: 2 << 20
            },
            FakeCall::MapTail {
                region: 1,
                bytes: 2 << 20
            }
        ]
    );
    // Regions are reserved for their slots and the tail: they do not overlap.
    assert!(s.region_ptrs[1] >= s.region_ptrs[0] + s.region_bytes + s.tail_bytes);
    // A reclaim never reaches the tail: it only ever hands out slots.
    c.grow(2).unwrap();
    let id = *mock.clients("offline").last().unwrap();
    assert_eq!(mock.reclaim(id, 2)["handles"].as_array().unwrap().len(), 2);
    assert_eq!(c.kv_space(1, 0, 1 << 20).unwrap_err().code(), 107);
}
