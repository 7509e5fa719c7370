//! Property tests: random operation sequences against the model broker,
//! checked against invariants a Kafka user relies on and against a small
//! client-side model built from the answers alone.

use std::collections::{BTreeMap, BTreeSet};

use proptest::prelude::*;

use crate::sim::broker::group::{GroupMetadata, JoinGroupRequest, JoinOutcome, SessionBounds};
use crate::sim::broker::log::{read_committed_records, read_uncommitted_records, Isolation, Record, TopicPartition};
use crate::sim::broker::{Broker, BrokerConfig, ProduceBatch, ProducerIdAndEpoch};
use crate::sim::error::ErrorCode;

const TXN_IDS: [&str; 2] = ["tx-a", "tx-b"];
const PARTITIONS: i32 = 2;
const GROUP: &str = "g";

fn tp(p: i32) -> TopicPartition {
    TopicPartition::new("out", p)
}

fn in_tp(p: i32) -> TopicPartition {
    TopicPartition::new("in", p)
}

#[derive(Debug, Clone)]
enum TxnOp {
    Init {
        txn: usize,
    },
    /// Producer handle `handle % handles.len()`, including fenced ones.
    AddPartitions {
        handle: usize,
        mask: u8,
    },
    Produce {
        handle: usize,
        partition: i32,
        count: usize,
    },
    /// Resend a handle's last batch to a partition, as a client retry does.
    Retry {
        handle: usize,
        partition: i32,
    },
    PlainProduce {
        partition: i32,
    },
    PlainRetry {
        partition: i32,
    },
    CommitOffsets {
        handle: usize,
        offset: i64,
    },
    PlainOffsetCommit {
        offset: i64,
    },
    End {
        handle: usize,
        commit: bool,
    },
    Advance {
        ms: i64,
    },
    DeleteRecords {
        partition: i32,
        back: i64,
    },
}

fn txn_op() -> impl Strategy<Value = TxnOp> {
    prop_oneof![
        2 => (0..TXN_IDS.len()).prop_map(|txn| TxnOp::Init { txn }),
        3 => (any::<usize>(), 1u8..4).prop_map(|(handle, mask)| TxnOp::AddPartitions { handle, mask }),
        6 => (any::<usize>(), 0..PARTITIONS, 1usize..4).prop_map(|(handle, partition, count)| TxnOp::Produce { handle, partition, count }),
        2 => (any::<usize>(), 0..PARTITIONS).prop_map(|(handle, partition)| TxnOp::Retry { handle, partition }),
        2 => (0..PARTITIONS).prop_map(|partition| TxnOp::PlainProduce { partition }),
        1 => (0..PARTITIONS).prop_map(|partition| TxnOp::PlainRetry { partition }),
        2 => (any::<usize>(), 0i64..1_000).prop_map(|(handle, offset)| TxnOp::CommitOffsets { handle, offset }),
        1 => (0i64..1_000).prop_map(|offset| TxnOp::PlainOffsetCommit { offset }),
        3 => (any::<usize>(), any::<bool>()).prop_map(|(handle, commit)| TxnOp::End { handle, commit }),
        2 => (0i64..700).prop_map(|ms| TxnOp::Advance { ms }),
        1 => (0..PARTITIONS, 0i64..4).prop_map(|(partition, back)| TxnOp::DeleteRecords { partition, back }),
    ]
}

/// What a client knows of one producer incarnation.
#[derive(Debug, Clone)]
struct Handle {
    txn: usize,
    producer: ProducerIdAndEpoch,
    next_seq: BTreeMap<i32, i32>,
    last_batch: BTreeMap<i32, ProduceBatch>,
    /// Values written in the current transaction, and offsets committed in it.
    written: Vec<u64>,
    offsets: Vec<(TopicPartition, i64, u64)>,
}

/// The expected state, from answers alone.
#[derive(Default)]
struct Model {
    handles: Vec<Handle>,
    /// Highest epoch InitProducerId returned per transactional id.
    max_epoch: BTreeMap<usize, i16>,
    committed_values: BTreeSet<u64>,
    /// Every value's offset once appended (values are unique).
    offset_of: BTreeMap<u64, (i32, i64)>,
    committed_offsets: BTreeMap<TopicPartition, (i64, u64)>,
    next_value: u64,
    next_commit_seq: u64,
    plain: Option<ProducerIdAndEpoch>,
    plain_seq: BTreeMap<i32, i32>,
    plain_last: BTreeMap<i32, ProduceBatch>,
}

impl Model {
    fn values(&mut self, count: usize) -> Vec<Record> {
        (0..count)
            .map(|_| {
                self.next_value += 1;
                Record {
                    key: None,
                    value: Some(self.next_value.to_be_bytes().to_vec()),
                    headers: vec![],
                    timestamp_ms: 0,
                }
            })
            .collect()
    }

    fn fenced(&self, h: &Handle) -> bool {
        self.max_epoch.get(&h.txn).is_some_and(|max| h.producer.epoch < *max)
    }
}

fn value_of(r: &Record) -> u64 {
    let bytes: [u8; 8] = r.value.as_deref().and_then(|v| v.try_into().ok()).unwrap_or([0; 8]);
    u64::from_be_bytes(bytes)
}

fn record_appended(model: &mut Model, batch: &ProduceBatch, partition: i32, base_offset: i64) {
    for (i, r) in batch.records.iter().enumerate() {
        let offset = base_offset + i64::try_from(i).unwrap_or(0);
        let previous = model.offset_of.insert(value_of(r), (partition, offset));
        assert!(previous.is_none(), "value {} appended twice", value_of(r));
    }
}

fn check_reads(broker: &mut Broker, model: &Model, now: i64) {
    for p in 0..PARTITIONS {
        let log = broker.partition(&tp(p)).cloned().unwrap_or_default();
        let start = log.log_start_offset();
        let fetch = broker.fetch(now, &tp(p), start, usize::MAX, Isolation::ReadCommitted).unwrap();
        let seen: Vec<(i64, u64)> = read_committed_records(&fetch).into_iter().map(|(o, r)| (o, value_of(r))).collect();
        for (offset, value) in &seen {
            assert!(model.committed_values.contains(value), "read_committed returned {value}@{offset}, not committed");
            assert_eq!(model.offset_of.get(value), Some(&(p, *offset)));
        }
        // Every committed record below the LSO is seen, once, in order.
        let expected: Vec<(i64, u64)> = {
            let mut v: Vec<(i64, u64)> = model
                .committed_values
                .iter()
                .filter_map(|value| model.offset_of.get(value).map(|(pp, o)| (*pp, *o, *value)))
                .filter(|(pp, o, _)| *pp == p && *o >= start && *o < fetch.last_stable_offset)
                .map(|(_, o, value)| (o, value))
                .collect();
            v.sort();
            v
        };
        assert_eq!(seen, expected, "partition {p}");
        // A consumer reading page by page (each response filtered on its
        // own, as the Java consumer does per completed fetch) sees the same.
        for page in [1usize, 2, 3] {
            let mut paged = Vec::new();
            let mut position = start;
            loop {
                let fetch = broker.fetch(now, &tp(p), position, page, Isolation::ReadCommitted).unwrap();
                let Some(last) = fetch.entries.last() else { break };
                position = last.offset + 1;
                paged.extend(read_committed_records(&fetch).into_iter().map(|(o, r)| (o, value_of(r))));
            }
            assert_eq!(paged, seen, "partition {p} read in pages of {page}");
        }
        // Idempotence: no value twice in the whole log.
        let all = broker.fetch(now, &tp(p), start, usize::MAX, Isolation::ReadUncommitted).unwrap();
        let values: Vec<u64> = read_uncommitted_records(&all).into_iter().map(|(_, r)| value_of(r)).collect();
        let unique: BTreeSet<u64> = values.iter().copied().collect();
        assert_eq!(unique.len(), values.len(), "a batch was written twice");
        if start > 0 {
            assert_eq!(
                broker.fetch(now, &tp(p), start - 1, 10, Isolation::ReadCommitted),
                Err(ErrorCode::OffsetOutOfRange)
            );
        }
    }
}

fn check_offsets(broker: &mut Broker, model: &Model, now: i64) {
    // The model applies a commit's offsets at the decision; the broker when
    // the markers land. Compare only when no decision is in flight.
    let deciding = TXN_IDS.iter().filter_map(|id| broker.transaction(id)).any(|t| t.pending.is_some());
    if deciding {
        return;
    }
    let parts: Vec<TopicPartition> = (0..PARTITIONS).map(in_tp).collect();
    for (tp, got) in broker.offset_fetch(now, GROUP, &parts, false) {
        let expected = model.committed_offsets.get(&tp).map(|(o, _)| *o);
        assert_eq!(got, Ok(expected), "committed offset of {tp:?}");
    }
}

/// How often the interesting paths were taken, so a test can show the
/// random sequences reach them.
#[derive(Debug, Default, Clone, Copy)]
struct Coverage {
    committed_txn_records: usize,
    fenced_rejections: usize,
    duplicates: usize,
    broker_aborts: usize,
    log_start_moved: usize,
    txn_offsets_committed: usize,
}

fn run_txn_ops(ops: Vec<TxnOp>, marker_delay_ms: i64) -> Coverage {
    let mut coverage = Coverage::default();
    let mut broker = Broker::new(BrokerConfig { marker_delay_ms, ..BrokerConfig::default() });
    broker.create_topic("out", PARTITIONS).unwrap();
    broker.create_topic("in", PARTITIONS).unwrap();
    let mut model = Model::default();
    let mut now: i64 = 0;
    const TIMEOUT_MS: i64 = 1_000;
    for op in ops {
        now += 1;
        match op {
            TxnOp::Init { txn } => {
                // A client retries CONCURRENT_TRANSACTIONS; at most twice here.
                for _ in 0..3 {
                    match broker.init_producer_id(now, Some(TXN_IDS[txn]), TIMEOUT_MS) {
                        Ok(producer) => {
                            let max = model.max_epoch.entry(txn).or_insert(producer.epoch);
                            assert!(producer.epoch >= *max, "epochs never go back");
                            *max = producer.epoch;
                            model.handles.push(Handle {
                                txn,
                                producer,
                                next_seq: BTreeMap::new(),
                                last_batch: BTreeMap::new(),
                                written: vec![],
                                offsets: vec![],
                            });
                            break;
                        }
                        Err(ErrorCode::ConcurrentTransactions) => now += 1,
                        Err(e) => panic!("InitProducerId: {e}"),
                    }
                }
            }
            TxnOp::AddPartitions { handle, mask } => {
                if model.handles.is_empty() {
                    continue;
                }
                let h = model.handles[handle % model.handles.len()].clone();
                let parts: Vec<TopicPartition> = (0..PARTITIONS).filter(|p| mask & (1 << p) != 0).map(tp).collect();
                let r = broker.add_partitions_to_txn(now, TXN_IDS[h.txn], h.producer, &parts);
                if model.fenced(&h) {
                    assert!(r.is_err(), "a fenced epoch added partitions");
                }
            }
            TxnOp::Produce { handle, partition, count } => {
                if model.handles.is_empty() {
                    continue;
                }
                let i = handle % model.handles.len();
                let h = model.handles[i].clone();
                let seq = h.next_seq.get(&partition).copied().unwrap_or(0);
                let batch = ProduceBatch {
                    producer_id: h.producer.producer_id,
                    producer_epoch: h.producer.epoch,
                    base_sequence: seq,
                    transactional: true,
                    records: model.values(count),
                };
                let r = broker.produce(now, &tp(partition), batch.clone());
                if model.fenced(&h) {
                    assert!(r.is_err(), "a fenced epoch appended");
                    coverage.fenced_rejections += 1;
                }
                if let Ok(appended) = r {
                    assert!(!appended.duplicate);
                    record_appended(&mut model, &batch, partition, appended.base_offset);
                    let h = &mut model.handles[i];
                    h.next_seq.insert(partition, seq + i32::try_from(count).unwrap_or(0));
                    h.written.extend(batch.records.iter().map(value_of));
                    h.last_batch.insert(partition, batch);
                }
            }
            TxnOp::Retry { handle, partition } => {
                if model.handles.is_empty() {
                    continue;
                }
                let h = model.handles[handle % model.handles.len()].clone();
                let Some(batch) = h.last_batch.get(&partition).cloned() else { continue };
                if let Ok(appended) = broker.produce(now, &tp(partition), batch.clone()) {
                    assert!(appended.duplicate, "a retry was appended again");
                    coverage.duplicates += 1;
                    assert_eq!(
                        model.offset_of.get(&value_of(&batch.records[0])),
                        Some(&(partition, appended.base_offset))
                    );
                }
            }
            TxnOp::PlainProduce { partition } => {
                let producer = match model.plain {
                    Some(p) => p,
                    None => {
                        let p = broker.init_producer_id(now, None, 0).unwrap();
                        model.plain = Some(p);
                        p
                    }
                };
                let seq = model.plain_seq.get(&partition).copied().unwrap_or(0);
                let batch = ProduceBatch {
                    producer_id: producer.producer_id,
                    producer_epoch: producer.epoch,
                    base_sequence: seq,
                    transactional: false,
                    records: model.values(1),
                };
                let appended = broker.produce(now, &tp(partition), batch.clone()).unwrap();
                record_appended(&mut model, &batch, partition, appended.base_offset);
                model.committed_values.insert(value_of(&batch.records[0]));
                model.plain_seq.insert(partition, seq + 1);
                model.plain_last.insert(partition, batch);
            }
            TxnOp::PlainRetry { partition } => {
                let Some(batch) = model.plain_last.get(&partition).cloned() else { continue };
                let appended = broker.produce(now, &tp(partition), batch.clone()).unwrap();
                assert!(appended.duplicate);
            }
            TxnOp::CommitOffsets { handle, offset } => {
                if model.handles.is_empty() {
                    continue;
                }
                let i = handle % model.handles.len();
                let h = model.handles[i].clone();
                let add = broker.add_offsets_to_txn(now, TXN_IDS[h.txn], h.producer, GROUP);
                let commit = broker.txn_offset_commit(
                    now,
                    TXN_IDS[h.txn],
                    h.producer,
                    GROUP,
                    &GroupMetadata::simple(),
                    &[(in_tp(0), offset)],
                );
                if model.fenced(&h) {
                    assert!(add.is_err() && commit.is_err(), "a fenced epoch committed offsets");
                }
                if commit.is_ok() {
                    model.next_commit_seq += 1;
                    let seq = model.next_commit_seq;
                    model.handles[i].offsets.push((in_tp(0), offset, seq));
                }
            }
            TxnOp::PlainOffsetCommit { offset } => {
                let r = broker.offset_commit(
                    now,
                    GROUP,
                    &GroupMetadata::simple(),
                    &[(in_tp(1), offset), (in_tp(0), offset)],
                );
                r.unwrap();
                model.next_commit_seq += 1;
                let seq = model.next_commit_seq;
                model.committed_offsets.insert(in_tp(1), (offset, seq));
                model.committed_offsets.insert(in_tp(0), (offset, seq));
            }
            TxnOp::End { handle, commit } => {
                if model.handles.is_empty() {
                    continue;
                }
                let i = handle % model.handles.len();
                let h = model.handles[i].clone();
                let txn_before = broker.transaction(TXN_IDS[h.txn]).cloned();
                let r = broker.end_txn(now, TXN_IDS[h.txn], h.producer, commit);
                if model.fenced(&h) {
                    assert!(r.is_err(), "a fenced epoch ended a transaction");
                }
                // Ok on a completed transaction is a retry of its decision:
                // only an answer to an Ongoing transaction decides anything.
                let decided_now =
                    r.is_ok() && txn_before.is_some_and(|t| t.state == crate::sim::broker::txn::TxnState::Ongoing);
                if decided_now {
                    let h = &mut model.handles[i];
                    let written = std::mem::take(&mut h.written);
                    let offsets = std::mem::take(&mut h.offsets);
                    if commit {
                        coverage.committed_txn_records += written.len();
                        coverage.txn_offsets_committed += offsets.len();
                        model.committed_values.extend(written);
                        for (tp, offset, seq) in offsets {
                            let newer = model.committed_offsets.get(&tp).is_none_or(|(_, s)| *s < seq);
                            if newer {
                                model.committed_offsets.insert(tp, (offset, seq));
                            }
                        }
                    }
                }
            }
            TxnOp::Advance { ms } => now += ms,
            TxnOp::DeleteRecords { partition, back } => {
                let hwm = broker.partition(&tp(partition)).map(|l| l.high_watermark()).unwrap_or(0);
                let before = broker.partition(&tp(partition)).map(|l| l.log_start_offset()).unwrap_or(0);
                if broker.delete_records(now, &tp(partition), (hwm - back).max(0)).is_ok_and(|start| start > before) {
                    coverage.log_start_moved += 1;
                }
            }
        }
        // A transaction the broker aborted (timeout, fencing) loses what the
        // client wrote in it; the client learns it on its next call.
        for h in model.handles.iter_mut() {
            let txn = broker.transaction(TXN_IDS[h.txn]);
            if txn.is_none_or(|t| t.epoch != h.producer.epoch || t.state != crate::sim::broker::txn::TxnState::Ongoing)
            {
                if !h.written.is_empty() {
                    coverage.broker_aborts += 1;
                }
                h.written.clear();
                h.offsets.clear();
            }
        }
        broker.advance(now);
        broker.check_invariants();
        check_reads(&mut broker, &model, now);
        check_offsets(&mut broker, &model, now);
    }
    // Let every open transaction time out: then everything committed is
    // readable and nothing else.
    now += 10 * TIMEOUT_MS;
    broker.advance(now);
    for p in 0..PARTITIONS {
        let log = broker.partition(&tp(p)).cloned().unwrap_or_default();
        assert_eq!(log.last_stable_offset(), log.high_watermark(), "a transaction hangs on partition {p}");
    }
    broker.check_invariants();
    check_reads(&mut broker, &model, now);
    check_offsets(&mut broker, &model, now);
    coverage
}

#[derive(Debug, Clone)]
enum GroupOp {
    Join {
        client: usize,
    },
    Sync {
        client: usize,
    },
    Heartbeat {
        client: usize,
    },
    Leave {
        client: usize,
    },
    Restart {
        client: usize,
    },
    /// The previous incarnation of a restarted static member, still running,
    /// sends a heartbeat.
    Zombie {
        client: usize,
    },
    Advance {
        ms: i64,
    },
}

fn group_op() -> impl Strategy<Value = GroupOp> {
    prop_oneof![
        4 => (0usize..4).prop_map(|client| GroupOp::Join { client }),
        4 => (0usize..4).prop_map(|client| GroupOp::Sync { client }),
        3 => (0usize..4).prop_map(|client| GroupOp::Heartbeat { client }),
        1 => (0usize..4).prop_map(|client| GroupOp::Leave { client }),
        1 => (0usize..4).prop_map(|client| GroupOp::Restart { client }),
        1 => (0usize..4).prop_map(|client| GroupOp::Zombie { client }),
        1 => (0i64..400).prop_map(|ms| GroupOp::Advance { ms }),
    ]
}

/// A cooperative consumer as the answers make it: it keeps owned
/// partitions across generations, revokes what an assignment leaves out,
/// and forgets everything when told its membership is gone.
#[derive(Debug, Clone, Default)]
struct Consumer {
    member_id: String,
    instance_id: Option<String>,
    generation: i32,
    owned: BTreeSet<TopicPartition>,
}

impl Consumer {
    fn meta(&self) -> GroupMetadata {
        GroupMetadata {
            member_id: self.member_id.clone(),
            group_instance_id: self.instance_id.clone(),
            generation: self.generation,
        }
    }

    fn on_error(&mut self, e: ErrorCode) {
        match e {
            ErrorCode::UnknownMemberId | ErrorCode::FencedInstanceId => {
                // onPartitionsLost: the partitions may already be elsewhere.
                self.owned.clear();
                self.member_id.clear();
                self.generation = -1;
            }
            ErrorCode::IllegalGeneration => {
                self.owned.clear();
                self.generation = -1;
            }
            _ => {}
        }
    }
}

/// How often the group paths were taken.
#[derive(Debug, Default, Clone, Copy)]
struct GroupCoverage {
    shared_generations: usize,
    revocations: usize,
    lost: usize,
    fenced_instances: usize,
}

fn run_group_ops(ops: Vec<GroupOp>) -> GroupCoverage {
    let mut coverage = GroupCoverage::default();
    let mut broker = Broker::new(BrokerConfig {
        session_bounds: SessionBounds { min_ms: 10, max_ms: 10_000 },
        ..BrokerConfig::default()
    });
    broker.create_topic("in", 5).unwrap();
    let mut clients: Vec<Consumer> = (0..4)
        .map(|i| Consumer {
            instance_id: (i % 2 == 0).then(|| format!("static-{i}")),
            generation: -1,
            ..Consumer::default()
        })
        .collect();
    let mut zombies: Vec<Option<Consumer>> = vec![None; clients.len()];
    let mut now = 0;
    for op in ops {
        now += 1;
        match op {
            GroupOp::Join { client } => {
                let c = &mut clients[client];
                let req = JoinGroupRequest {
                    group_id: GROUP.into(),
                    member_id: c.member_id.clone(),
                    group_instance_id: c.instance_id.clone(),
                    topics: BTreeSet::from(["in".to_owned()]),
                    owned: c.owned.clone(),
                    session_timeout_ms: 500,
                    rebalance_timeout_ms: 1_000,
                };
                match broker.join_group(now, req) {
                    Ok(JoinOutcome::Pending { member_id }) => c.member_id = member_id,
                    Ok(JoinOutcome::Joined { member_id, generation, .. }) => {
                        c.member_id = member_id;
                        c.generation = generation;
                    }
                    Err(e) => c.on_error(e),
                }
            }
            GroupOp::Sync { client } => {
                let c = &mut clients[client];
                if c.member_id.is_empty() || c.generation < 0 {
                    continue;
                }
                match broker.sync_group(now, GROUP, &c.meta()) {
                    Ok(assignment) => {
                        // Cooperative: only partitions the old owner gave up
                        // can arrive; what is missing is revoked now.
                        if !c.owned.is_subset(&assignment) {
                            coverage.revocations += 1;
                        }
                        c.owned = assignment;
                    }
                    Err(e) => {
                        coverage.count(e);
                        c.on_error(e);
                    }
                }
            }
            GroupOp::Heartbeat { client } => {
                let c = &mut clients[client];
                if c.member_id.is_empty() {
                    continue;
                }
                if let Err(e) = broker.heartbeat(now, GROUP, &c.meta()) {
                    coverage.count(e);
                    c.on_error(e);
                }
            }
            GroupOp::Leave { client } => {
                let c = &mut clients[client];
                if c.member_id.is_empty() {
                    continue;
                }
                let _ = broker.leave_group(now, GROUP, &c.meta());
                c.owned.clear();
                c.member_id.clear();
                c.generation = -1;
            }
            GroupOp::Restart { client } => {
                // A new process starts with nothing; the old one may live on
                // as a zombie that only learns it was replaced when it next
                // talks to the coordinator.
                let c = &mut clients[client];
                let fresh = Consumer { instance_id: c.instance_id.clone(), generation: -1, ..Consumer::default() };
                zombies[client] = Some(std::mem::replace(c, fresh));
            }
            GroupOp::Zombie { client } => {
                let Some(zombie) = zombies[client].as_mut().filter(|z| !z.member_id.is_empty()) else { continue };
                let r = broker.heartbeat(now, GROUP, &zombie.meta());
                let replaced = zombie.instance_id.is_some()
                    && broker
                        .group_coordinator()
                        .group(GROUP)
                        .is_some_and(|g| g.members.contains_key(&clients[client].member_id));
                if replaced {
                    assert!(r.is_err(), "a replaced static member's old incarnation is still accepted");
                }
                if let Err(e) = r {
                    coverage.count(e);
                    zombie.on_error(e);
                }
            }
            GroupOp::Advance { ms } => now += ms,
        }
        broker.advance(now);
        broker.check_invariants();
        // Among members the coordinator still knows, no partition is
        // owned twice: cooperative rebalancing never hands a partition to
        // a new owner before the old one revoked it.
        let Some(group) = broker.group_coordinator().group(GROUP) else { continue };
        let live_owners =
            clients.iter().filter(|c| group.members.contains_key(&c.member_id) && !c.owned.is_empty()).count();
        if live_owners > 1 {
            coverage.shared_generations += 1;
        }
        let mut owner: BTreeMap<&TopicPartition, &str> = BTreeMap::new();
        let everyone = clients.iter().chain(zombies.iter().flatten());
        for c in everyone.filter(|c| group.members.contains_key(&c.member_id)) {
            for tp in &c.owned {
                if let Some(other) = owner.insert(tp, &c.member_id) {
                    panic!("{tp:?} owned by {other} and {} (generation {})", c.member_id, group.generation);
                }
            }
        }
    }
    coverage
}

impl GroupCoverage {
    fn count(&mut self, e: ErrorCode) {
        match e {
            ErrorCode::UnknownMemberId | ErrorCode::IllegalGeneration => self.lost += 1,
            ErrorCode::FencedInstanceId => self.fenced_instances += 1,
            _ => {}
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn read_committed_sees_exactly_the_committed_records_and_fenced_epochs_change_nothing(
        ops in proptest::collection::vec(txn_op(), 1..60),
        marker_delay_ms in prop_oneof![Just(0i64), 1i64..30],
    ) {
        run_txn_ops(ops, marker_delay_ms);
    }

    #[test]
    fn live_cooperative_members_never_own_the_same_partition(
        ops in proptest::collection::vec(group_op(), 1..80)
    ) {
        run_group_ops(ops);
    }
}

#[test]
fn random_transaction_sequences_reach_commits_fencing_retries_aborts_and_retention() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    // A fixed seed: this test is about the generator, not about luck.
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &[7; 32]));
    let strategy = proptest::collection::vec(txn_op(), 1..60);
    let mut total = Coverage::default();
    for _ in 0..200 {
        let ops = strategy.new_tree(&mut runner).map(|t| t.current()).unwrap_or_default();
        let c = run_txn_ops(ops, 0);
        total.committed_txn_records += c.committed_txn_records;
        total.fenced_rejections += c.fenced_rejections;
        total.duplicates += c.duplicates;
        total.broker_aborts += c.broker_aborts;
        total.log_start_moved += c.log_start_moved;
        total.txn_offsets_committed += c.txn_offsets_committed;
    }
    println!("{total:?}");
    assert!(total.committed_txn_records > 0, "{total:?}");
    assert!(total.fenced_rejections > 0, "{total:?}");
    assert!(total.duplicates > 0, "{total:?}");
    assert!(total.broker_aborts > 0, "{total:?}");
    assert!(total.log_start_moved > 0, "{total:?}");
    assert!(total.txn_offsets_committed > 0, "{total:?}");
}

/// An idempotent producer with one request in flight, retrying every
/// timed-out batch with the same sequence until it is answered.
fn run_retrying_producer(seed: u64, batches: usize, drop_request: u32, drop_response: u32, max_latency_ms: i64) {
    use crate::sim::broker::api::{Request, Response};
    use crate::sim::net::{NetConfig, Network, Outcome};

    let mut broker = Broker::new(BrokerConfig::default());
    broker.create_topic("out", 1).unwrap();
    let config = NetConfig {
        min_latency_ms: 1,
        max_latency_ms,
        request_timeout_ms: 50,
        drop_request_per_million: drop_request,
        drop_response_per_million: drop_response,
    };
    let mut net = Network::new(broker, config, seed);
    let mut now = 0;
    let producer = net.broker_mut().init_producer_id(now, None, 0).unwrap();
    let mut model = Model::default();
    let mut sent_values = Vec::new();
    let mut seq = 0;
    for _ in 0..batches {
        let records = model.values(2);
        sent_values.extend(records.iter().map(value_of));
        let batch = ProduceBatch {
            producer_id: producer.producer_id,
            producer_epoch: producer.epoch,
            base_sequence: seq,
            transactional: false,
            records,
        };
        let mut attempts = 0;
        loop {
            attempts += 1;
            assert!(attempts < 1_000, "never answered");
            net.send(now, 1, Request::Produce { partition: tp(0), batch: batch.clone() });
            let outcome = loop {
                now += 1;
                if let Some(d) = net.poll(now).into_iter().next() {
                    break d.outcome;
                }
            };
            match outcome {
                Outcome::Answered(Response::Produce(Ok(_))) => break,
                Outcome::Answered(other) => panic!("unexpected answer {other:?}"),
                Outcome::TimedOut => continue,
            }
        }
        seq += 2;
    }
    // Let stragglers (applied after their client gave up) land.
    now += 10 * max_latency_ms + 100;
    net.poll(now);
    let broker = net.broker_mut();
    let fetch = broker.fetch(now, &tp(0), 0, usize::MAX, Isolation::ReadCommitted).unwrap();
    let got: Vec<u64> = read_committed_records(&fetch).into_iter().map(|(_, r)| value_of(r)).collect();
    assert_eq!(got, sent_values, "every batch exactly once, in order");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn retries_over_a_lossy_network_write_every_batch_exactly_once_and_in_order(
        seed in any::<u64>(),
        batches in 1usize..30,
        drop_request in 0u32..400_000,
        drop_response in 0u32..400_000,
        max_latency_ms in 1i64..120,
    ) {
        run_retrying_producer(seed, batches, drop_request, drop_response, max_latency_ms);
    }
}

#[test]
fn random_group_sequences_reach_shared_generations_revocations_lost_members_and_fencing() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};
    let mut runner = TestRunner::new_with_rng(Config::default(), TestRng::from_seed(RngAlgorithm::ChaCha, &[11; 32]));
    let strategy = proptest::collection::vec(group_op(), 1..80);
    let mut total = GroupCoverage::default();
    for _ in 0..200 {
        let ops = strategy.new_tree(&mut runner).map(|t| t.current()).unwrap_or_default();
        let c = run_group_ops(ops);
        total.shared_generations += c.shared_generations;
        total.revocations += c.revocations;
        total.lost += c.lost;
        total.fenced_instances += c.fenced_instances;
    }
    println!("{total:?}");
    assert!(total.shared_generations > 0, "{total:?}");
    assert!(total.revocations > 0, "{total:?}");
    assert!(total.lost > 0, "{total:?}");
    assert!(total.fenced_instances > 0, "{total:?}");
}
