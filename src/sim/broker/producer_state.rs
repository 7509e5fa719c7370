//! Per-partition producer state: the last epoch and recent batches of each
//! producer id, as a partition leader keeps them (Kafka's
//! `ProducerStateManager` / `ProducerAppendInfo`, KIP-98 "idempotent producer").
//!
//! Invariants of one [`ProducerEntry`]:
//! - `recent` holds at most [`BATCHES_TO_RETAIN`] batches, oldest first, all
//!   written under `epoch`; a change of epoch clears it.
//! - `open_txn_first_offset` is `Some` exactly while this producer has a
//!   transaction open on the partition (a transactional batch was appended
//!   and no marker has ended it yet).

use std::collections::{BTreeMap, VecDeque};

use crate::sim::error::ErrorCode;

/// How many recent batches per producer are remembered for duplicate
/// detection. Kafka keeps five, which is why a producer may have at most
/// five requests in flight per connection with idempotence on.
pub const BATCHES_TO_RETAIN: usize = 5;

/// The largest sequence number; the next one after it is 0.
const MAX_SEQUENCE: i64 = i32::MAX as i64;

/// Where one appended batch landed and which sequences it carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchMeta {
    pub first_sequence: i32,
    pub last_sequence: i32,
    pub first_offset: i64,
    pub last_offset: i64,
}

/// What the partition remembers of one producer id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProducerEntry {
    pub epoch: i16,
    pub recent: VecDeque<BatchMeta>,
    pub open_txn_first_offset: Option<i64>,
}

/// Result of validating an incoming batch against the producer's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SequenceCheck {
    /// The batch continues the producer's sequence: append it.
    Append,
    /// The batch is a retry of one already written: answer with its offsets
    /// and append nothing.
    Duplicate(BatchMeta),
}

/// The last sequence of a batch of `count` records starting at `first`,
/// wrapping after `i32::MAX` to 0 as Kafka's `DefaultRecordBatch` does.
pub fn last_sequence(first: i32, count: usize) -> i32 {
    let count = i64::try_from(count).unwrap_or(i64::MAX).max(1);
    let last = (i64::from(first) + count - 1) % (MAX_SEQUENCE + 1);
    // The modulo keeps the value inside 0..=i32::MAX.
    i32::try_from(last).unwrap_or(i32::MAX)
}

fn in_sequence(last: i32, next: i32) -> bool {
    i64::from(next) == i64::from(last) + 1 || (next == 0 && last == i32::MAX)
}

/// All producers that have written to one partition.
#[derive(Debug, Clone, Default)]
pub struct ProducerStateTable {
    entries: BTreeMap<i64, ProducerEntry>,
}

impl ProducerStateTable {
    pub fn entry(&self, producer_id: i64) -> Option<&ProducerEntry> {
        self.entries.get(&producer_id)
    }

    /// Validates a data batch before it is appended, in Kafka's order: a
    /// retry of a recent batch of the same epoch is a duplicate; an older
    /// epoch is rejected; a new epoch must start at sequence 0; within an
    /// epoch the batch must follow the last sequence; a non-transactional
    /// batch may not interleave with the producer's open transaction.
    pub fn check(
        &self,
        producer_id: i64,
        epoch: i16,
        first_sequence: i32,
        record_count: usize,
        transactional: bool,
    ) -> Result<SequenceCheck, ErrorCode> {
        let Some(entry) = self.entries.get(&producer_id) else {
            // The first batch of this producer on this partition: Kafka accepts
            // any sequence here, because the producer's earlier batches may
            // have been removed by retention.
            return Ok(SequenceCheck::Append);
        };
        let last = last_sequence(first_sequence, record_count);
        if epoch == entry.epoch {
            if let Some(dup) =
                entry.recent.iter().find(|b| b.first_sequence == first_sequence && b.last_sequence == last)
            {
                return Ok(SequenceCheck::Duplicate(*dup));
            }
        }
        if epoch < entry.epoch {
            return Err(ErrorCode::InvalidProducerEpoch);
        }
        if epoch != entry.epoch {
            if first_sequence != 0 {
                return Err(ErrorCode::OutOfOrderSequence);
            }
        } else if let Some(newest) = entry.recent.back() {
            if !in_sequence(newest.last_sequence, first_sequence) {
                return Err(ErrorCode::OutOfOrderSequence);
            }
        }
        if !transactional && entry.open_txn_first_offset.is_some() {
            return Err(ErrorCode::InvalidTxnState);
        }
        Ok(SequenceCheck::Append)
    }

    /// Records an appended batch. Returns true when the batch opened a
    /// transaction on this partition (the caller tracks the LSO).
    pub fn record_batch(&mut self, producer_id: i64, epoch: i16, batch: BatchMeta, transactional: bool) -> bool {
        let entry =
            self.entries.entry(producer_id).or_insert_with(|| ProducerEntry { epoch, ..ProducerEntry::default() });
        if entry.epoch != epoch {
            entry.epoch = epoch;
            entry.recent.clear();
        }
        entry.recent.push_back(batch);
        while entry.recent.len() > BATCHES_TO_RETAIN {
            entry.recent.pop_front();
        }
        if transactional && entry.open_txn_first_offset.is_none() {
            entry.open_txn_first_offset = Some(batch.first_offset);
            return true;
        }
        false
    }

    /// Records a COMMIT or ABORT marker written by the transaction
    /// coordinator with `epoch` (possibly bumped to fence the producer).
    /// Returns the first offset of the transaction it ended, if one was open.
    pub fn record_marker(&mut self, producer_id: i64, epoch: i16) -> Option<i64> {
        let entry =
            self.entries.entry(producer_id).or_insert_with(|| ProducerEntry { epoch, ..ProducerEntry::default() });
        if epoch > entry.epoch {
            // A bumped epoch fences the old one; its batches can no longer be
            // retried, so their metadata goes.
            entry.epoch = epoch;
            entry.recent.clear();
        }
        entry.open_txn_first_offset.take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(first_sequence: i32, last_sequence: i32, first_offset: i64) -> BatchMeta {
        BatchMeta {
            first_sequence,
            last_sequence,
            first_offset,
            last_offset: first_offset + i64::from(last_sequence - first_sequence),
        }
    }

    #[test]
    fn a_retry_of_a_recent_batch_is_reported_as_a_duplicate_with_its_offsets() {
        let mut table = ProducerStateTable::default();
        table.record_batch(7, 0, meta(0, 2, 10), false);
        assert_eq!(table.check(7, 0, 0, 3, false), Ok(SequenceCheck::Duplicate(meta(0, 2, 10))));
        assert_eq!(table.check(7, 0, 3, 1, false), Ok(SequenceCheck::Append));
    }

    #[test]
    fn a_gap_in_sequences_is_out_of_order() {
        let mut table = ProducerStateTable::default();
        table.record_batch(7, 0, meta(0, 0, 0), false);
        assert_eq!(table.check(7, 0, 2, 1, false), Err(ErrorCode::OutOfOrderSequence));
    }

    #[test]
    fn only_the_last_five_batches_are_remembered_as_duplicates() {
        let mut table = ProducerStateTable::default();
        for seq in 0..6 {
            table.record_batch(7, 0, meta(seq, seq, i64::from(seq)), false);
        }
        assert_eq!(table.check(7, 0, 0, 1, false), Err(ErrorCode::OutOfOrderSequence));
        assert!(matches!(table.check(7, 0, 1, 1, false), Ok(SequenceCheck::Duplicate(_))));
    }

    #[test]
    fn an_older_epoch_is_rejected_and_a_new_epoch_must_start_at_zero() {
        let mut table = ProducerStateTable::default();
        table.record_batch(7, 3, meta(0, 0, 0), false);
        assert_eq!(table.check(7, 2, 1, 1, false), Err(ErrorCode::InvalidProducerEpoch));
        assert_eq!(table.check(7, 4, 5, 1, false), Err(ErrorCode::OutOfOrderSequence));
        assert_eq!(table.check(7, 4, 0, 1, false), Ok(SequenceCheck::Append));
    }

    #[test]
    fn sequences_wrap_after_the_largest_i32() {
        assert_eq!(last_sequence(i32::MAX, 2), 0);
        let mut table = ProducerStateTable::default();
        table.record_batch(7, 0, meta(i32::MAX - 1, i32::MAX, 0), false);
        assert_eq!(table.check(7, 0, 0, 1, false), Ok(SequenceCheck::Append));
    }

    #[test]
    fn a_plain_batch_cannot_interleave_with_an_open_transaction() {
        let mut table = ProducerStateTable::default();
        assert!(table.record_batch(7, 0, meta(0, 0, 4), true));
        assert_eq!(table.check(7, 0, 1, 1, false), Err(ErrorCode::InvalidTxnState));
        assert_eq!(table.record_marker(7, 0), Some(4));
        assert_eq!(table.check(7, 0, 1, 1, false), Ok(SequenceCheck::Append));
    }

    #[test]
    fn a_marker_with_a_bumped_epoch_fences_the_old_epoch() {
        let mut table = ProducerStateTable::default();
        table.record_batch(7, 0, meta(0, 0, 0), true);
        assert_eq!(table.record_marker(7, 1), Some(0));
        assert_eq!(table.check(7, 0, 1, 1, true), Err(ErrorCode::InvalidProducerEpoch));
    }
}
