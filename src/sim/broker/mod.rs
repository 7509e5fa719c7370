//! The model broker: a single-node Kafka cluster as a pure state machine.
//!
//! Every call takes the simulated time `now_ms` and first runs
//! [`Broker::advance`] to it, so timers (transaction timeouts, session
//! expiry, rebalance deadlines, pending markers, retention) fire in the
//! same order on every replay. Time never goes backwards: an earlier
//! `now_ms` is treated as the latest time seen.
//!
//! One broker plays every role: partition leader of every partition (one
//! replica, so the high watermark is the log end), transaction coordinator
//! and group coordinator. Coordinator moves and unreachable brokers are
//! the network's business ([`crate::sim::net`]).

pub mod api;
pub mod group;
pub mod log;
pub mod producer_state;
pub mod txn;

use std::collections::{BTreeMap, BTreeSet};

use crate::sim::error::ErrorCode;
use group::{GroupCoordinator, GroupMetadata, JoinGroupRequest, JoinOutcome, SessionBounds};
use log::{Appended, ControlMarker, FetchResult, Isolation, PartitionLog, Record, TopicPartition};
use txn::{TxnMetadata, TxnState};

/// Broker settings, named after the Kafka configs they stand for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokerConfig {
    /// `transaction.max.timeout.ms`: InitProducerId asking for more fails.
    pub transaction_max_timeout_ms: i64,
    /// Time between a transaction's decision (EndTxn answered, or the
    /// coordinator aborting) and its markers landing on the partitions.
    /// Kafka's is the marker round trip; 0 writes them on the next call.
    pub marker_delay_ms: i64,
    /// `retention.ms` for every topic; `None` keeps everything.
    pub retention_ms: Option<i64>,
    /// Records per segment; time retention deletes whole segments.
    pub segment_records: i64,
    /// `group.min.session.timeout.ms` / `group.max.session.timeout.ms`.
    pub session_bounds: SessionBounds,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            transaction_max_timeout_ms: 900_000,
            marker_delay_ms: 0,
            retention_ms: None,
            segment_records: 1_000,
            session_bounds: SessionBounds { min_ms: 6_000, max_ms: 1_800_000 },
        }
    }
}

/// A producer id and epoch, as InitProducerId answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProducerIdAndEpoch {
    pub producer_id: i64,
    pub epoch: i16,
}

/// One record batch of a Produce request. `producer_id == -1` is a producer
/// without idempotence; then epoch and sequence are ignored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProduceBatch {
    pub producer_id: i64,
    pub producer_epoch: i16,
    pub base_sequence: i32,
    pub transactional: bool,
    pub records: Vec<Record>,
}

/// ListOffsets' target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetSpec {
    Earliest,
    /// The HWM for read_uncommitted, the LSO for read_committed.
    Latest,
    /// The first offset with a timestamp at or after this one.
    Timestamp(i64),
}

/// The model cluster. See the module documentation.
#[derive(Debug, Clone)]
pub struct Broker {
    config: BrokerConfig,
    now_ms: i64,
    logs: BTreeMap<TopicPartition, PartitionLog>,
    partition_counts: BTreeMap<String, i32>,
    next_producer_id: i64,
    /// Every producer id handed out, with its current epoch.
    producer_epochs: BTreeMap<i64, i16>,
    txns: BTreeMap<String, TxnMetadata>,
    txn_by_producer: BTreeMap<i64, String>,
    groups: GroupCoordinator,
}

impl Broker {
    /// Markers of transactions decided from now on land after `delay_ms`
    /// (the simulator sets 0 once a schedule's faults stop: slow markers
    /// are one of its faults).
    pub fn set_marker_delay_ms(&mut self, delay_ms: i64) {
        self.config.marker_delay_ms = delay_ms;
    }

    pub fn new(config: BrokerConfig) -> Self {
        Broker {
            config,
            now_ms: i64::MIN,
            logs: BTreeMap::new(),
            partition_counts: BTreeMap::new(),
            next_producer_id: 1_000,
            producer_epochs: BTreeMap::new(),
            txns: BTreeMap::new(),
            txn_by_producer: BTreeMap::new(),
            groups: GroupCoordinator::default(),
        }
    }

    pub fn config(&self) -> &BrokerConfig {
        &self.config
    }

    /// The latest time the broker has seen.
    pub fn now_ms(&self) -> i64 {
        self.now_ms
    }

    /// CreateTopics. Creating an existing topic is a no-op if the partition
    /// count matches.
    pub fn create_topic(&mut self, topic: &str, partitions: i32) -> Result<(), ErrorCode> {
        if topic.is_empty() || partitions <= 0 {
            return Err(ErrorCode::InvalidRequest);
        }
        if let Some(existing) = self.partition_counts.get(topic) {
            return if *existing == partitions { Ok(()) } else { Err(ErrorCode::InvalidRequest) };
        }
        self.partition_counts.insert(topic.to_owned(), partitions);
        for p in 0..partitions {
            self.logs.insert(TopicPartition::new(topic, p), PartitionLog::default());
        }
        Ok(())
    }

    pub fn partition_counts(&self) -> &BTreeMap<String, i32> {
        &self.partition_counts
    }

    pub fn partition(&self, tp: &TopicPartition) -> Option<&PartitionLog> {
        self.logs.get(tp)
    }

    pub fn partitions(&self) -> impl Iterator<Item = (&TopicPartition, &PartitionLog)> {
        self.logs.iter()
    }

    pub fn transaction(&self, transactional_id: &str) -> Option<&TxnMetadata> {
        self.txns.get(transactional_id)
    }

    pub fn group_coordinator(&self) -> &GroupCoordinator {
        &self.groups
    }

    /// Moves time to `now_ms` and fires everything due, in this order:
    /// transaction timeouts (epoch bump and abort decision), pending
    /// markers, group session and rebalance timers, retention.
    pub fn advance(&mut self, now_ms: i64) {
        let now_ms = now_ms.max(self.now_ms);
        self.now_ms = now_ms;
        let delay = self.config.marker_delay_ms;
        for txn in self.txns.values_mut() {
            if txn.timed_out(now_ms) {
                // Kafka's abortTimedOutTransactions: fence the epoch first, so
                // the timed-out producer can neither append nor commit. The
                // decision is dated at the expiry, not at `now_ms`, so a
                // driver that jumps time sees the markers that would have
                // landed meanwhile.
                let expired_at = txn.started_ms.saturating_add(txn.timeout_ms).saturating_add(1).min(now_ms);
                txn.fence_and_abort(expired_at, delay);
                self.producer_epochs.insert(txn.producer_id, txn.epoch);
            }
        }
        self.write_due_markers(now_ms);
        self.groups.advance(now_ms, &self.partition_counts);
        if let Some(retention_ms) = self.config.retention_ms {
            for log in self.logs.values_mut() {
                log.apply_retention(now_ms, retention_ms, self.config.segment_records);
            }
        }
    }

    fn write_due_markers(&mut self, now_ms: i64) {
        let mut due: Vec<(i64, String)> = self
            .txns
            .iter()
            .filter_map(|(id, t)| t.pending.as_ref().filter(|p| p.due_ms <= now_ms).map(|p| (p.due_ms, id.clone())))
            .collect();
        due.sort();
        for (_, id) in due {
            let Some(txn) = self.txns.get_mut(&id) else { continue };
            let producer_id = txn.producer_id;
            let Some(done) = txn.complete() else { continue };
            let marker = if done.commit { ControlMarker::Commit } else { ControlMarker::Abort };
            for tp in &done.partitions {
                if let Some(log) = self.logs.get_mut(tp) {
                    log.append_marker(producer_id, done.epoch, marker, now_ms);
                }
            }
            for group in &done.groups {
                self.groups.complete_txn(group, producer_id, done.commit);
            }
        }
    }

    fn log_mut(&mut self, tp: &TopicPartition) -> Result<&mut PartitionLog, ErrorCode> {
        self.logs.get_mut(tp).ok_or(ErrorCode::UnknownTopicOrPartition)
    }

    fn log(&self, tp: &TopicPartition) -> Result<&PartitionLog, ErrorCode> {
        self.logs.get(tp).ok_or(ErrorCode::UnknownTopicOrPartition)
    }

    fn allocate_producer_id(&mut self) -> i64 {
        let id = self.next_producer_id;
        self.next_producer_id += 1;
        self.producer_epochs.insert(id, 0);
        id
    }

    /// InitProducerId. Without a transactional id: a fresh producer id,
    /// epoch 0. With one: the first call creates the mapping; later calls
    /// bump the epoch (fencing the previous producer). If a transaction is
    /// open, it is aborted under a bumped epoch and the answer is
    /// CONCURRENT_TRANSACTIONS until its markers are written, after which a
    /// retry bumps the epoch again, exactly as Kafka's coordinator does.
    pub fn init_producer_id(
        &mut self,
        now_ms: i64,
        transactional_id: Option<&str>,
        transaction_timeout_ms: i64,
    ) -> Result<ProducerIdAndEpoch, ErrorCode> {
        self.advance(now_ms);
        let Some(id) = transactional_id else {
            let producer_id = self.allocate_producer_id();
            return Ok(ProducerIdAndEpoch { producer_id, epoch: 0 });
        };
        if id.is_empty() {
            return Err(ErrorCode::InvalidRequest);
        }
        if transaction_timeout_ms <= 0 || transaction_timeout_ms > self.config.transaction_max_timeout_ms {
            return Err(ErrorCode::InvalidTransactionTimeout);
        }
        if !self.txns.contains_key(id) {
            let producer_id = self.allocate_producer_id();
            self.txns.insert(id.to_owned(), TxnMetadata::new(id.to_owned(), producer_id, transaction_timeout_ms));
            self.txn_by_producer.insert(producer_id, id.to_owned());
            return Ok(ProducerIdAndEpoch { producer_id, epoch: 0 });
        }
        let delay = self.config.marker_delay_ms;
        let exhausted = self.txns.get(id).is_some_and(|t| t.epoch >= i16::MAX - 1);
        let fresh_id = if exhausted { Some(self.allocate_producer_id()) } else { None };
        let Some(txn) = self.txns.get_mut(id) else {
            return Err(ErrorCode::InvalidProducerIdMapping);
        };
        match txn.state {
            TxnState::PrepareCommit | TxnState::PrepareAbort => Err(ErrorCode::ConcurrentTransactions),
            TxnState::Ongoing => {
                txn.fence_and_abort(now_ms, delay);
                self.producer_epochs.insert(txn.producer_id, txn.epoch);
                Err(ErrorCode::ConcurrentTransactions)
            }
            TxnState::Empty | TxnState::CompleteCommit | TxnState::CompleteAbort => {
                if let Some(new_id) = fresh_id {
                    // Epoch exhausted: rotate to a new producer id, epoch 0.
                    txn.producer_id = new_id;
                    txn.epoch = 0;
                    self.txn_by_producer.insert(new_id, id.to_owned());
                } else {
                    txn.epoch += 1;
                }
                txn.timeout_ms = transaction_timeout_ms;
                txn.state = TxnState::Empty;
                self.producer_epochs.insert(txn.producer_id, txn.epoch);
                Ok(ProducerIdAndEpoch { producer_id: txn.producer_id, epoch: txn.epoch })
            }
        }
    }

    /// Produce one batch to one partition.
    ///
    /// A transactional batch is verified against the coordinator before it
    /// is appended, as KIP-890 (Kafka 3.6+) does: a stale epoch is
    /// INVALID_PRODUCER_EPOCH, a partition not added to the open transaction
    /// is INVALID_TXN_STATE. Without that check a zombie could open a
    /// "hanging" transaction that holds the LSO forever.
    pub fn produce(&mut self, now_ms: i64, tp: &TopicPartition, batch: ProduceBatch) -> Result<Appended, ErrorCode> {
        self.advance(now_ms);
        self.log(tp)?;
        if batch.producer_id >= 0 {
            let Some(current_epoch) = self.producer_epochs.get(&batch.producer_id).copied() else {
                return Err(ErrorCode::UnknownProducerId);
            };
            if batch.producer_epoch < current_epoch {
                return Err(ErrorCode::InvalidProducerEpoch);
            }
            if batch.producer_epoch > current_epoch {
                return Err(ErrorCode::InvalidProducerEpoch);
            }
            let txn = self.txn_by_producer.get(&batch.producer_id).and_then(|id| self.txns.get(id));
            match (batch.transactional, txn) {
                (true, None) => return Err(ErrorCode::InvalidProducerIdMapping),
                (true, Some(txn)) => {
                    if txn.state != TxnState::Ongoing || !txn.partitions.contains(tp) {
                        return Err(ErrorCode::InvalidTxnState);
                    }
                }
                (false, Some(_)) => return Err(ErrorCode::InvalidTxnState),
                (false, None) => {}
            }
        }
        let log = self.log_mut(tp)?;
        log.append_batch(
            batch.producer_id,
            batch.producer_epoch,
            batch.base_sequence,
            batch.transactional,
            batch.records,
            now_ms,
        )
    }

    pub fn fetch(
        &mut self,
        now_ms: i64,
        tp: &TopicPartition,
        offset: i64,
        max_records: usize,
        isolation: Isolation,
    ) -> Result<FetchResult, ErrorCode> {
        self.advance(now_ms);
        self.log(tp)?.fetch(offset, max_records, isolation)
    }

    /// ListOffsets; `Ok(None)` when no record has a timestamp that late
    /// (Kafka answers offset -1).
    pub fn list_offsets(
        &mut self,
        now_ms: i64,
        tp: &TopicPartition,
        spec: OffsetSpec,
        isolation: Isolation,
    ) -> Result<Option<i64>, ErrorCode> {
        self.advance(now_ms);
        let log = self.log(tp)?;
        let upper = match isolation {
            Isolation::ReadUncommitted => log.high_watermark(),
            Isolation::ReadCommitted => log.last_stable_offset(),
        };
        Ok(match spec {
            OffsetSpec::Earliest => Some(log.log_start_offset()),
            OffsetSpec::Latest => Some(upper),
            OffsetSpec::Timestamp(ts) => log.offset_for_timestamp(ts, upper),
        })
    }

    /// DeleteRecords: the new log start offset.
    pub fn delete_records(&mut self, now_ms: i64, tp: &TopicPartition, before: i64) -> Result<i64, ErrorCode> {
        self.advance(now_ms);
        self.log_mut(tp)?.delete_records_before(before)
    }

    fn txn_mut(&mut self, transactional_id: &str) -> Result<&mut TxnMetadata, ErrorCode> {
        self.txns.get_mut(transactional_id).ok_or(ErrorCode::InvalidProducerIdMapping)
    }

    pub fn add_partitions_to_txn(
        &mut self,
        now_ms: i64,
        transactional_id: &str,
        producer: ProducerIdAndEpoch,
        partitions: &[TopicPartition],
    ) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        if partitions.iter().any(|tp| !self.logs.contains_key(tp)) {
            return Err(ErrorCode::UnknownTopicOrPartition);
        }
        self.txn_mut(transactional_id)?.add(producer.producer_id, producer.epoch, partitions, None, now_ms)
    }

    pub fn add_offsets_to_txn(
        &mut self,
        now_ms: i64,
        transactional_id: &str,
        producer: ProducerIdAndEpoch,
        group_id: &str,
    ) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        if group_id.is_empty() {
            return Err(ErrorCode::InvalidRequest);
        }
        self.txn_mut(transactional_id)?.add(producer.producer_id, producer.epoch, &[], Some(group_id), now_ms)
    }

    /// TxnOffsetCommit: offsets pending until the transaction commits.
    /// The producer must be current and the group added to the open
    /// transaction (INVALID_TXN_STATE otherwise, where Kafka before KIP-890
    /// would have accepted a write it later could not complete); the group
    /// metadata is checked as KIP-447 specifies.
    pub fn txn_offset_commit(
        &mut self,
        now_ms: i64,
        transactional_id: &str,
        producer: ProducerIdAndEpoch,
        group_id: &str,
        member: &GroupMetadata,
        offsets: &[(TopicPartition, i64)],
    ) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        let txn = self.txns.get(transactional_id).ok_or(ErrorCode::InvalidProducerIdMapping)?;
        txn.check_producer(producer.producer_id, producer.epoch)?;
        if txn.state != TxnState::Ongoing || !txn.groups.contains(group_id) {
            return Err(ErrorCode::InvalidTxnState);
        }
        self.groups.txn_commit_offsets(group_id, producer.producer_id, member, offsets)
    }

    /// EndTxn. Success means the decision is logged; markers follow after
    /// `marker_delay_ms`.
    pub fn end_txn(
        &mut self,
        now_ms: i64,
        transactional_id: &str,
        producer: ProducerIdAndEpoch,
        commit: bool,
    ) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        let delay = self.config.marker_delay_ms;
        self.txn_mut(transactional_id)?.end(producer.producer_id, producer.epoch, commit, now_ms, delay).map(|_| ())
    }

    pub fn join_group(&mut self, now_ms: i64, req: JoinGroupRequest) -> Result<JoinOutcome, ErrorCode> {
        self.advance(now_ms);
        let bounds = self.config.session_bounds;
        self.groups.join(req, now_ms, bounds, &self.partition_counts)
    }

    pub fn sync_group(
        &mut self,
        now_ms: i64,
        group_id: &str,
        member: &GroupMetadata,
    ) -> Result<BTreeSet<TopicPartition>, ErrorCode> {
        self.advance(now_ms);
        self.groups.sync(group_id, member, now_ms)
    }

    pub fn heartbeat(&mut self, now_ms: i64, group_id: &str, member: &GroupMetadata) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        self.groups.heartbeat(group_id, member, now_ms)
    }

    pub fn leave_group(&mut self, now_ms: i64, group_id: &str, member: &GroupMetadata) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        self.groups.leave(group_id, member, now_ms, &self.partition_counts)
    }

    pub fn offset_commit(
        &mut self,
        now_ms: i64,
        group_id: &str,
        member: &GroupMetadata,
        offsets: &[(TopicPartition, i64)],
    ) -> Result<(), ErrorCode> {
        self.advance(now_ms);
        self.groups.commit_offsets(group_id, member, offsets, now_ms)
    }

    pub fn offset_fetch(
        &mut self,
        now_ms: i64,
        group_id: &str,
        partitions: &[TopicPartition],
        require_stable: bool,
    ) -> Vec<(TopicPartition, Result<Option<i64>, ErrorCode>)> {
        self.advance(now_ms);
        self.groups.fetch_offsets(group_id, partitions, require_stable)
    }

    /// Panics with a description when a cross-module invariant is broken;
    /// for tests and simulators.
    pub fn check_invariants(&self) {
        for log in self.logs.values() {
            log.check_invariants();
        }
        for txn in self.txns.values() {
            assert_eq!(txn.pending.is_some(), matches!(txn.state, TxnState::PrepareCommit | TxnState::PrepareAbort));
            if txn.state != TxnState::Ongoing {
                assert!(
                    txn.partitions.is_empty() && txn.groups.is_empty(),
                    "{} holds partitions outside Ongoing",
                    txn.transactional_id
                );
            }
            // A partition can only hold an open transaction of a producer
            // whose transaction is open or decided.
            for (tp, log) in &self.logs {
                if log.open_transactions().contains_key(&txn.producer_id) {
                    let in_txn =
                        txn.partitions.contains(tp) || txn.pending.as_ref().is_some_and(|p| p.partitions.contains(tp));
                    assert!(
                        in_txn,
                        "{tp:?} holds an open transaction of {} the coordinator forgot",
                        txn.transactional_id
                    );
                }
            }
        }
        for group in self.groups.groups() {
            for (tp, owners) in group.synced_owners() {
                assert!(owners.len() <= 1, "{tp:?} owned by {owners:?} in generation {}", group.generation);
            }
        }
    }
}

#[cfg(test)]
mod tests;
