//! The transaction coordinator's view of each transactional id (KIP-98).
//!
//! State machine (transactions V1, as in Kafka's `TransactionMetadata`):
//!
//! ```text
//!  Empty --AddPartitions/AddOffsets--> Ongoing --EndTxn(commit)--> PrepareCommit --markers--> CompleteCommit
//!                                         |    --EndTxn(abort)---> PrepareAbort  --markers--> CompleteAbort
//!                                         |    --timeout / InitProducerId: epoch+1, PrepareAbort
//!  Complete* --AddPartitions/AddOffsets--> Ongoing
//! ```
//!
//! `Prepare*` is where the coordinator has logged the decision and answered
//! EndTxn, but the markers are not yet on the partitions: the model writes
//! them `marker_delay_ms` later (see [`crate::sim::broker::BrokerConfig`]),
//! so readers can observe the window in which a committed transaction is
//! not yet readable and the producer gets CONCURRENT_TRANSACTIONS.
//!
//! This file holds the pure transitions; the broker applies their effects
//! (markers, offsets) in `broker/mod.rs`.

use std::collections::BTreeSet;

use crate::sim::broker::log::TopicPartition;
use crate::sim::error::ErrorCode;

/// Kafka's `TransactionState`, without `Dead` and `PrepareEpochFence`
/// (the model never expires transactional ids and fences in one step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxnState {
    Empty,
    Ongoing,
    PrepareCommit,
    PrepareAbort,
    CompleteCommit,
    CompleteAbort,
}

/// A decided transaction whose markers are still to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingMarkers {
    pub commit: bool,
    /// The epoch the markers carry (bumped when the coordinator fenced).
    pub epoch: i16,
    pub partitions: BTreeSet<TopicPartition>,
    pub groups: BTreeSet<String>,
    pub due_ms: i64,
}

/// What the coordinator knows of one transactional id.
///
/// Invariants: `partitions` and `groups` are empty unless the state is
/// `Ongoing`; `pending` is `Some` exactly in the `Prepare*` states;
/// `started_ms` is meaningful only while `Ongoing`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnMetadata {
    pub transactional_id: String,
    pub producer_id: i64,
    pub epoch: i16,
    pub timeout_ms: i64,
    pub state: TxnState,
    pub partitions: BTreeSet<TopicPartition>,
    pub groups: BTreeSet<String>,
    pub started_ms: i64,
    pub pending: Option<PendingMarkers>,
}

impl TxnMetadata {
    pub fn new(transactional_id: String, producer_id: i64, timeout_ms: i64) -> Self {
        TxnMetadata {
            transactional_id,
            producer_id,
            epoch: 0,
            timeout_ms,
            state: TxnState::Empty,
            partitions: BTreeSet::new(),
            groups: BTreeSet::new(),
            started_ms: 0,
            pending: None,
        }
    }

    /// The producer id / epoch checks every client request to the
    /// coordinator starts with (AddPartitions, AddOffsets, EndTxn).
    pub fn check_producer(&self, producer_id: i64, epoch: i16) -> Result<(), ErrorCode> {
        if producer_id != self.producer_id {
            return Err(ErrorCode::InvalidProducerIdMapping);
        }
        if epoch != self.epoch {
            return Err(ErrorCode::ProducerFenced);
        }
        Ok(())
    }

    fn is_preparing(&self) -> bool {
        matches!(self.state, TxnState::PrepareCommit | TxnState::PrepareAbort)
    }

    /// AddPartitionsToTxn / AddOffsetsToTxn: joins partitions or a group's
    /// offsets to the transaction, starting it if needed.
    pub fn add(
        &mut self,
        producer_id: i64,
        epoch: i16,
        partitions: &[TopicPartition],
        group: Option<&str>,
        now_ms: i64,
    ) -> Result<(), ErrorCode> {
        self.check_producer(producer_id, epoch)?;
        if self.is_preparing() {
            return Err(ErrorCode::ConcurrentTransactions);
        }
        if self.state != TxnState::Ongoing {
            self.state = TxnState::Ongoing;
            self.started_ms = now_ms;
        }
        self.partitions.extend(partitions.iter().cloned());
        if let Some(group) = group {
            self.groups.insert(group.to_owned());
        }
        Ok(())
    }

    /// EndTxn from the client. `Ok(true)` means a decision was taken now and
    /// markers are pending; `Ok(false)` is an idempotent retry of a decision
    /// already completed.
    pub fn end(
        &mut self,
        producer_id: i64,
        epoch: i16,
        commit: bool,
        now_ms: i64,
        marker_delay_ms: i64,
    ) -> Result<bool, ErrorCode> {
        self.check_producer(producer_id, epoch)?;
        match (self.state, commit) {
            (TxnState::Ongoing, _) => {
                self.prepare(commit, now_ms, marker_delay_ms);
                Ok(true)
            }
            (TxnState::CompleteCommit, true) | (TxnState::CompleteAbort, false) => Ok(false),
            (TxnState::PrepareCommit, true) | (TxnState::PrepareAbort, false) => Err(ErrorCode::ConcurrentTransactions),
            _ => Err(ErrorCode::InvalidTxnState),
        }
    }

    /// Bumps the epoch (fencing the current producer) and decides to abort
    /// the open transaction: what the coordinator does on a transaction
    /// timeout and on InitProducerId during an open transaction.
    pub fn fence_and_abort(&mut self, now_ms: i64, marker_delay_ms: i64) {
        self.epoch = self.epoch.saturating_add(1);
        self.prepare(false, now_ms, marker_delay_ms);
    }

    fn prepare(&mut self, commit: bool, now_ms: i64, marker_delay_ms: i64) {
        self.state = if commit { TxnState::PrepareCommit } else { TxnState::PrepareAbort };
        self.pending = Some(PendingMarkers {
            commit,
            epoch: self.epoch,
            partitions: std::mem::take(&mut self.partitions),
            groups: std::mem::take(&mut self.groups),
            due_ms: now_ms.saturating_add(marker_delay_ms.max(0)),
        });
    }

    /// Marks the pending markers as written; returns them for the broker to
    /// apply.
    pub fn complete(&mut self) -> Option<PendingMarkers> {
        let pending = self.pending.take()?;
        self.state = if pending.commit { TxnState::CompleteCommit } else { TxnState::CompleteAbort };
        Some(pending)
    }

    /// Whether the broker must abort this transaction at `now_ms`.
    pub fn timed_out(&self, now_ms: i64) -> bool {
        self.state == TxnState::Ongoing && now_ms.saturating_sub(self.started_ms) > self.timeout_ms
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tp() -> TopicPartition {
        TopicPartition::new("out", 0)
    }

    #[test]
    fn end_txn_on_an_empty_transaction_is_an_invalid_state() {
        let mut txn = TxnMetadata::new("t".into(), 1, 1000);
        assert_eq!(txn.end(1, 0, true, 0, 0), Err(ErrorCode::InvalidTxnState));
    }

    #[test]
    fn a_retried_commit_after_completion_succeeds_without_a_new_decision() {
        let mut txn = TxnMetadata::new("t".into(), 1, 1000);
        txn.add(1, 0, &[tp()], None, 0).unwrap();
        assert_eq!(txn.end(1, 0, true, 0, 10), Ok(true));
        assert_eq!(txn.end(1, 0, true, 1, 10), Err(ErrorCode::ConcurrentTransactions));
        assert_eq!(txn.add(1, 0, &[tp()], None, 1), Err(ErrorCode::ConcurrentTransactions));
        let pending = txn.complete().unwrap();
        assert!(pending.commit && pending.partitions.contains(&tp()));
        assert_eq!(txn.end(1, 0, true, 2, 10), Ok(false));
        assert_eq!(txn.end(1, 0, false, 2, 10), Err(ErrorCode::InvalidTxnState));
    }

    #[test]
    fn a_stale_epoch_is_fenced_and_a_foreign_producer_id_is_a_bad_mapping() {
        let mut txn = TxnMetadata::new("t".into(), 1, 1000);
        txn.add(1, 0, &[tp()], None, 0).unwrap();
        txn.fence_and_abort(5, 0);
        assert_eq!(txn.epoch, 1);
        assert_eq!(txn.end(1, 0, true, 6, 0), Err(ErrorCode::ProducerFenced));
        assert_eq!(txn.add(2, 1, &[tp()], None, 6), Err(ErrorCode::InvalidProducerIdMapping));
    }

    #[test]
    fn a_transaction_times_out_only_while_ongoing_and_after_its_timeout() {
        let mut txn = TxnMetadata::new("t".into(), 1, 100);
        assert!(!txn.timed_out(1_000));
        txn.add(1, 0, &[tp()], None, 50).unwrap();
        assert!(!txn.timed_out(150));
        assert!(txn.timed_out(151));
    }
}
