//! Broker-level tests: flows that cross the log, the transaction
//! coordinator and the group coordinator.

use super::*;
use crate::sim::broker::log::{read_committed_records, EntryBody};

fn broker() -> Broker {
    let mut b = Broker::new(BrokerConfig {
        session_bounds: SessionBounds { min_ms: 10, max_ms: 100_000 },
        ..BrokerConfig::default()
    });
    b.create_topic("out", 2).unwrap();
    b.create_topic("in", 2).unwrap();
    b
}

fn tp(p: i32) -> TopicPartition {
    TopicPartition::new("out", p)
}

fn rec(v: &str) -> Record {
    Record { key: Some(b"k".to_vec()), value: Some(v.as_bytes().to_vec()), headers: vec![], timestamp_ms: 0 }
}

fn batch(pid: ProducerIdAndEpoch, seq: i32, txn: bool, values: &[&str]) -> ProduceBatch {
    ProduceBatch {
        producer_id: pid.producer_id,
        producer_epoch: pid.epoch,
        base_sequence: seq,
        transactional: txn,
        records: values.iter().map(|v| rec(v)).collect(),
    }
}

fn committed_values(b: &mut Broker, now: i64, p: i32) -> Vec<String> {
    let fetch = b.fetch(now, &tp(p), 0, 1_000, Isolation::ReadCommitted).unwrap();
    read_committed_records(&fetch)
        .into_iter()
        .map(|(_, r)| String::from_utf8_lossy(r.value.as_deref().unwrap_or_default()).into_owned())
        .collect()
}

#[test]
fn an_idempotent_retry_returns_the_original_offset_and_appends_nothing() {
    let mut b = broker();
    let pid = b.init_producer_id(0, None, 0).unwrap();
    let first = b.produce(0, &tp(0), batch(pid, 0, false, &["a", "b"])).unwrap();
    let retry = b.produce(1, &tp(0), batch(pid, 0, false, &["a", "b"])).unwrap();
    assert_eq!((retry.base_offset, retry.duplicate), (first.base_offset, true));
    assert_eq!(b.partition(&tp(0)).unwrap().high_watermark(), 2);
    assert_eq!(b.produce(1, &tp(0), batch(pid, 5, false, &["c"])), Err(ErrorCode::OutOfOrderSequence));
    assert_eq!(
        b.produce(1, &tp(0), batch(ProducerIdAndEpoch { producer_id: 77, epoch: 0 }, 0, false, &["c"])),
        Err(ErrorCode::UnknownProducerId)
    );
}

#[test]
fn a_committed_transaction_becomes_readable_with_its_offsets() {
    let mut b = broker();
    let pid = b.init_producer_id(0, Some("tx"), 60_000).unwrap();
    b.add_partitions_to_txn(0, "tx", pid, &[tp(0), tp(1)]).unwrap();
    b.produce(1, &tp(0), batch(pid, 0, true, &["a"])).unwrap();
    b.produce(1, &tp(1), batch(pid, 0, true, &["b"])).unwrap();
    b.add_offsets_to_txn(2, "tx", pid, "g").unwrap();
    let in0 = TopicPartition::new("in", 0);
    b.txn_offset_commit(2, "tx", pid, "g", &GroupMetadata::simple(), &[(in0.clone(), 42)]).unwrap();
    assert!(committed_values(&mut b, 3, 0).is_empty());
    assert_eq!(b.offset_fetch(3, "g", std::slice::from_ref(&in0), false), vec![(in0.clone(), Ok(None))]);
    b.end_txn(4, "tx", pid, true).unwrap();
    assert_eq!(committed_values(&mut b, 4, 0), vec!["a"]);
    assert_eq!(committed_values(&mut b, 4, 1), vec!["b"]);
    assert_eq!(b.offset_fetch(4, "g", std::slice::from_ref(&in0), true), vec![(in0, Ok(Some(42)))]);
    b.check_invariants();
}

#[test]
fn markers_land_after_the_marker_delay_and_the_producer_waits_meanwhile() {
    let mut b = broker();
    b.config.marker_delay_ms = 100;
    let pid = b.init_producer_id(0, Some("tx"), 60_000).unwrap();
    b.add_partitions_to_txn(0, "tx", pid, &[tp(0)]).unwrap();
    b.produce(0, &tp(0), batch(pid, 0, true, &["a"])).unwrap();
    b.end_txn(10, "tx", pid, true).unwrap();
    assert!(committed_values(&mut b, 50, 0).is_empty(), "decided but markers not written");
    assert_eq!(b.add_partitions_to_txn(50, "tx", pid, &[tp(0)]), Err(ErrorCode::ConcurrentTransactions));
    assert_eq!(b.end_txn(50, "tx", pid, true), Err(ErrorCode::ConcurrentTransactions));
    assert_eq!(committed_values(&mut b, 110, 0), vec!["a"]);
    assert_eq!(b.end_txn(111, "tx", pid, true), Ok(()), "a retried commit succeeds");
}

#[test]
fn a_new_producer_with_the_same_transactional_id_aborts_and_fences_the_zombie() {
    let mut b = broker();
    let zombie = b.init_producer_id(0, Some("tx"), 60_000).unwrap();
    b.add_partitions_to_txn(0, "tx", zombie, &[tp(0)]).unwrap();
    b.produce(0, &tp(0), batch(zombie, 0, true, &["z"])).unwrap();
    assert_eq!(b.init_producer_id(1, Some("tx"), 60_000), Err(ErrorCode::ConcurrentTransactions));
    let fresh = b.init_producer_id(2, Some("tx"), 60_000).unwrap();
    assert_eq!((fresh.producer_id, fresh.epoch), (zombie.producer_id, 2));
    assert_eq!(b.produce(3, &tp(0), batch(zombie, 1, true, &["z2"])), Err(ErrorCode::InvalidProducerEpoch));
    assert_eq!(b.add_partitions_to_txn(3, "tx", zombie, &[tp(1)]), Err(ErrorCode::ProducerFenced));
    assert_eq!(b.end_txn(3, "tx", zombie, true), Err(ErrorCode::ProducerFenced));
    assert_eq!(
        b.txn_offset_commit(3, "tx", zombie, "g", &GroupMetadata::simple(), &[]),
        Err(ErrorCode::ProducerFenced)
    );
    let log = b.partition(&tp(0)).unwrap();
    assert!(matches!(
        log.entries().last().map(|e| &e.body),
        Some(EntryBody::Control { marker: ControlMarker::Abort, producer_epoch: 1, .. })
    ));
    assert!(committed_values(&mut b, 4, 0).is_empty());
    b.check_invariants();
}

#[test]
fn a_transaction_open_past_its_timeout_is_aborted_and_its_epoch_fenced() {
    let mut b = broker();
    let pid = b.init_producer_id(0, Some("tx"), 1_000).unwrap();
    b.add_partitions_to_txn(0, "tx", pid, &[tp(0)]).unwrap();
    b.produce(0, &tp(0), batch(pid, 0, true, &["a"])).unwrap();
    assert_eq!(b.partition(&tp(0)).unwrap().last_stable_offset(), 0);
    b.advance(1_001);
    assert_eq!(b.partition(&tp(0)).unwrap().last_stable_offset(), 2, "abort marker written");
    assert_eq!(b.end_txn(1_002, "tx", pid, true), Err(ErrorCode::ProducerFenced));
    assert_eq!(b.produce(1_002, &tp(0), batch(pid, 1, true, &["b"])), Err(ErrorCode::InvalidProducerEpoch));
    assert!(committed_values(&mut b, 1_003, 0).is_empty());
}

#[test]
fn transactional_produce_to_a_partition_not_in_the_transaction_is_rejected() {
    let mut b = broker();
    let pid = b.init_producer_id(0, Some("tx"), 60_000).unwrap();
    assert_eq!(b.produce(0, &tp(0), batch(pid, 0, true, &["a"])), Err(ErrorCode::InvalidTxnState));
    b.add_partitions_to_txn(0, "tx", pid, &[tp(0)]).unwrap();
    assert_eq!(b.produce(0, &tp(1), batch(pid, 0, true, &["a"])), Err(ErrorCode::InvalidTxnState));
    assert_eq!(
        b.txn_offset_commit(0, "tx", pid, "g", &GroupMetadata::simple(), &[]),
        Err(ErrorCode::InvalidTxnState),
        "AddOffsetsToTxn must come first"
    );
}

#[test]
fn init_producer_id_rejects_a_timeout_above_the_maximum() {
    let mut b = broker();
    assert_eq!(b.init_producer_id(0, Some("tx"), 900_001), Err(ErrorCode::InvalidTransactionTimeout));
}

#[test]
fn list_offsets_latest_is_the_lso_for_read_committed() {
    let mut b = broker();
    let pid = b.init_producer_id(0, Some("tx"), 60_000).unwrap();
    let plain = b.init_producer_id(0, None, 0).unwrap();
    b.produce(0, &tp(0), batch(plain, 0, false, &["p"])).unwrap();
    b.add_partitions_to_txn(0, "tx", pid, &[tp(0)]).unwrap();
    b.produce(0, &tp(0), batch(pid, 0, true, &["a"])).unwrap();
    assert_eq!(b.list_offsets(0, &tp(0), OffsetSpec::Latest, Isolation::ReadUncommitted), Ok(Some(2)));
    assert_eq!(b.list_offsets(0, &tp(0), OffsetSpec::Latest, Isolation::ReadCommitted), Ok(Some(1)));
    assert_eq!(b.list_offsets(0, &tp(0), OffsetSpec::Earliest, Isolation::ReadCommitted), Ok(Some(0)));
}

#[test]
fn time_retention_moves_the_log_start_on_advance() {
    let mut b = Broker::new(BrokerConfig { retention_ms: Some(100), segment_records: 2, ..BrokerConfig::default() });
    b.create_topic("out", 1).unwrap();
    let plain = b.init_producer_id(0, None, 0).unwrap();
    b.produce(0, &tp(0), batch(plain, 0, false, &["a", "b", "c"])).unwrap();
    b.advance(500);
    // Segments of two records: [0, 1] expired, [2] is still being written.
    assert_eq!(b.partition(&tp(0)).unwrap().log_start_offset(), 2);
    assert_eq!(b.fetch(500, &tp(0), 1, 10, Isolation::ReadCommitted), Err(ErrorCode::OffsetOutOfRange));
}

#[test]
fn handle_answers_each_request_with_its_own_response_variant() {
    let mut b = broker();
    let r = b.handle(0, api::Request::InitProducerId { transactional_id: None, transaction_timeout_ms: 0 });
    assert!(matches!(r, api::Response::InitProducerId(Ok(_))));
    let r = b.handle(0, api::Request::Heartbeat { group_id: "none".into(), member: GroupMetadata::simple() });
    assert_eq!(r.error(), Some(ErrorCode::UnknownMemberId));
}

#[test]
fn a_txn_offset_commit_from_a_member_of_an_old_generation_is_rejected() {
    let mut b = broker();
    let join = |member_id: &str| JoinGroupRequest {
        group_id: "g".into(),
        member_id: member_id.into(),
        group_instance_id: None,
        topics: BTreeSet::from(["in".to_owned()]),
        owned: BTreeSet::new(),
        session_timeout_ms: 10_000,
        rebalance_timeout_ms: 10_000,
    };
    let JoinOutcome::Joined { member_id: a, generation, .. } = b.join_group(0, join("")).unwrap() else {
        panic!("a single member joins at once");
    };
    let member = GroupMetadata { member_id: a.clone(), group_instance_id: None, generation };
    b.sync_group(0, "g", &member).unwrap();
    let pid = b.init_producer_id(0, Some("tx"), 60_000).unwrap();
    b.add_offsets_to_txn(1, "tx", pid, "g").unwrap();
    let in0 = TopicPartition::new("in", 0);
    b.txn_offset_commit(1, "tx", pid, "g", &member, &[(in0.clone(), 5)]).unwrap();
    // Another member joins: the group moves on, the old generation is stale.
    let _ = b.join_group(2, join(""));
    let _ = b.join_group(2, join(&a));
    assert_eq!(b.txn_offset_commit(3, "tx", pid, "g", &member, &[(in0.clone(), 6)]), Err(ErrorCode::IllegalGeneration));
    b.end_txn(4, "tx", pid, true).unwrap();
    assert_eq!(b.offset_fetch(5, "g", std::slice::from_ref(&in0), true), vec![(in0, Ok(Some(5)))]);
}
