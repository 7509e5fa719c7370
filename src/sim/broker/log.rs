//! One partition's log: offsets, data records, control markers, the high
//! watermark, the last stable offset, the log start and the aborted
//! transaction index.
//!
//! ```text
//! log_start_offset          last_stable_offset       high_watermark
//!        |                          |                        |
//!        v                          v                        v
//!        [ d d C d d d A d | d d d d d ... (open txn) ... d ]
//!          ^ data record      ^ first offset of the oldest open transaction
//!          C/A: COMMIT/ABORT control marker, one offset each
//! ```
//!
//! Each record occupies one offset (a producer batch of n records takes n
//! consecutive offsets). The model is a single replica, so the high
//! watermark equals the log end offset: every append is immediately
//! "replicated". Invariants, checked by [`PartitionLog::check_invariants`]:
//! - `log_start_offset <= last_stable_offset <= high_watermark`;
//! - `entries` hold exactly the offsets `log_start_offset..high_watermark`;
//! - the aborted index is ordered by marker offset and every entry's
//!   `first_offset <= last_offset`.

use std::collections::{BTreeMap, BinaryHeap, HashSet, VecDeque};

use crate::sim::broker::producer_state::{last_sequence, BatchMeta, ProducerStateTable, SequenceCheck};
use crate::sim::error::ErrorCode;

/// A topic and partition number.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TopicPartition {
    pub topic: String,
    pub partition: i32,
}

impl TopicPartition {
    pub fn new(topic: impl Into<String>, partition: i32) -> Self {
        TopicPartition { topic: topic.into(), partition }
    }
}

/// A record as a client produces it: opaque bytes, the model never looks
/// inside.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Record {
    pub key: Option<Vec<u8>>,
    pub value: Option<Vec<u8>>,
    pub headers: Vec<(String, Vec<u8>)>,
    /// CreateTime, as set by the producer.
    pub timestamp_ms: i64,
}

/// The producer fields of a record batch. `producer_id == -1` marks a
/// producer without idempotence (no sequence checks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProducerTag {
    pub producer_id: i64,
    pub producer_epoch: i16,
    /// This record's own sequence number (the batch's base sequence plus
    /// its index).
    pub sequence: i32,
    pub transactional: bool,
}

/// The result a control marker records for its transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlMarker {
    Commit,
    Abort,
}

/// What sits at one offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EntryBody {
    Data { record: Record, producer: ProducerTag },
    Control { marker: ControlMarker, producer_id: i64, producer_epoch: i16 },
}

/// One offset of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogEntry {
    pub offset: i64,
    /// The broker's clock when the entry was appended (LogAppendTime).
    pub append_time_ms: i64,
    pub body: EntryBody,
}

impl LogEntry {
    pub fn is_control(&self) -> bool {
        matches!(self.body, EntryBody::Control { .. })
    }

    /// The timestamp retention and ListOffsets-by-time look at: CreateTime
    /// for data, the append time for markers.
    pub fn timestamp_ms(&self) -> i64 {
        match &self.body {
            EntryBody::Data { record, .. } => record.timestamp_ms,
            EntryBody::Control { .. } => self.append_time_ms,
        }
    }
}

/// A transaction aborted on this partition, as kept in Kafka's `.txnindex`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AbortedTxn {
    pub producer_id: i64,
    pub first_offset: i64,
    /// Offset of the ABORT marker.
    pub last_offset: i64,
}

/// The `(producer_id, first_offset)` pairs a read_committed fetch response
/// carries, as in the Fetch API's `AbortedTransactions` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct AbortedTxnRef {
    pub producer_id: i64,
    pub first_offset: i64,
}

/// The consumer's `isolation.level`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    ReadUncommitted,
    ReadCommitted,
}

/// A fetch response for one partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FetchResult {
    pub high_watermark: i64,
    pub last_stable_offset: i64,
    pub log_start_offset: i64,
    /// Data records and control markers, in offset order. Like a real
    /// fetch, markers and aborted records are included; a client filters
    /// them (see [`read_committed_records`]).
    pub entries: Vec<LogEntry>,
    /// Empty for read_uncommitted.
    pub aborted_transactions: Vec<AbortedTxnRef>,
}

/// Where a produced batch landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub base_offset: i64,
    pub last_offset: i64,
    /// True when the batch was a retry of one already in the log: nothing
    /// was appended and the offsets are the original ones.
    pub duplicate: bool,
    pub log_start_offset: i64,
}

/// A partition's log and the producer state kept with it.
#[derive(Debug, Clone, Default)]
pub struct PartitionLog {
    entries: VecDeque<LogEntry>,
    log_start_offset: i64,
    high_watermark: i64,
    /// First offset of each producer's open transaction on this partition.
    open_txns: BTreeMap<i64, i64>,
    aborted: Vec<AbortedTxn>,
    producers: ProducerStateTable,
}

impl PartitionLog {
    pub fn high_watermark(&self) -> i64 {
        self.high_watermark
    }

    pub fn log_start_offset(&self) -> i64 {
        self.log_start_offset
    }

    /// The first offset of the oldest open transaction, else the high
    /// watermark; never below the log start (Kafka clamps the first
    /// unstable offset to it once retention passed an open transaction).
    pub fn last_stable_offset(&self) -> i64 {
        match self.open_txns.values().min() {
            Some(first) => (*first).max(self.log_start_offset),
            None => self.high_watermark,
        }
    }

    pub fn producers(&self) -> &ProducerStateTable {
        &self.producers
    }

    /// Producers with a transaction open on this partition.
    pub fn open_transactions(&self) -> &BTreeMap<i64, i64> {
        &self.open_txns
    }

    pub fn entries(&self) -> impl Iterator<Item = &LogEntry> {
        self.entries.iter()
    }

    /// Validates and appends one producer batch. Epoch and sequence checks
    /// apply when `producer_id >= 0`; the transactional checks against the
    /// coordinator are the caller's.
    pub fn append_batch(
        &mut self,
        producer_id: i64,
        producer_epoch: i16,
        base_sequence: i32,
        transactional: bool,
        records: Vec<Record>,
        now_ms: i64,
    ) -> Result<Appended, ErrorCode> {
        if records.is_empty() {
            return Err(ErrorCode::InvalidRequest);
        }
        let idempotent = producer_id >= 0;
        if idempotent {
            let check =
                self.producers.check(producer_id, producer_epoch, base_sequence, records.len(), transactional)?;
            if let SequenceCheck::Duplicate(meta) = check {
                return Ok(Appended {
                    base_offset: meta.first_offset,
                    last_offset: meta.last_offset,
                    duplicate: true,
                    log_start_offset: self.log_start_offset,
                });
            }
        } else if transactional {
            return Err(ErrorCode::InvalidRequest);
        }
        let base_offset = self.high_watermark;
        let count = records.len();
        for (index, record) in records.into_iter().enumerate() {
            let sequence = if idempotent { last_sequence(base_sequence, index + 1) } else { -1 };
            self.push(
                now_ms,
                EntryBody::Data {
                    record,
                    producer: ProducerTag { producer_id, producer_epoch, sequence, transactional },
                },
            );
        }
        let last_offset = self.high_watermark - 1;
        if idempotent {
            let meta = BatchMeta {
                first_sequence: base_sequence,
                last_sequence: last_sequence(base_sequence, count),
                first_offset: base_offset,
                last_offset,
            };
            if self.producers.record_batch(producer_id, producer_epoch, meta, transactional) {
                self.open_txns.insert(producer_id, base_offset);
            }
        }
        Ok(Appended { base_offset, last_offset, duplicate: false, log_start_offset: self.log_start_offset })
    }

    /// Writes a COMMIT or ABORT marker for `producer_id`. Returns its offset.
    pub fn append_marker(&mut self, producer_id: i64, producer_epoch: i16, marker: ControlMarker, now_ms: i64) -> i64 {
        let offset = self.high_watermark;
        self.push(now_ms, EntryBody::Control { marker, producer_id, producer_epoch });
        let first = self.producers.record_marker(producer_id, producer_epoch);
        self.open_txns.remove(&producer_id);
        if marker == ControlMarker::Abort {
            if let Some(first_offset) = first {
                self.aborted.push(AbortedTxn { producer_id, first_offset, last_offset: offset });
            }
        }
        offset
    }

    fn push(&mut self, now_ms: i64, body: EntryBody) {
        let offset = self.high_watermark;
        self.entries.push_back(LogEntry { offset, append_time_ms: now_ms, body });
        self.high_watermark += 1;
    }

    /// Reads from `offset`: up to the high watermark for read_uncommitted,
    /// up to the last stable offset for read_committed (with the aborted
    /// transactions overlapping the returned range). An offset below the
    /// log start or above the high watermark is OFFSET_OUT_OF_RANGE; an
    /// offset at the end returns nothing.
    pub fn fetch(&self, offset: i64, max_records: usize, isolation: Isolation) -> Result<FetchResult, ErrorCode> {
        if offset < self.log_start_offset || offset > self.high_watermark {
            return Err(ErrorCode::OffsetOutOfRange);
        }
        let last_stable_offset = self.last_stable_offset();
        let upper = match isolation {
            Isolation::ReadUncommitted => self.high_watermark,
            Isolation::ReadCommitted => last_stable_offset,
        };
        let skip = usize::try_from(offset - self.log_start_offset).unwrap_or(usize::MAX);
        let entries: Vec<LogEntry> =
            self.entries.iter().skip(skip).take_while(|e| e.offset < upper).take(max_records).cloned().collect();
        let aborted_transactions = match (isolation, entries.last()) {
            (Isolation::ReadCommitted, Some(last)) => {
                let end = last.offset;
                let mut refs: Vec<AbortedTxnRef> = self
                    .aborted
                    .iter()
                    .filter(|a| a.last_offset >= offset && a.first_offset <= end)
                    .map(|a| AbortedTxnRef { producer_id: a.producer_id, first_offset: a.first_offset })
                    .collect();
                refs.sort();
                refs
            }
            _ => Vec::new(),
        };
        Ok(FetchResult {
            high_watermark: self.high_watermark,
            last_stable_offset,
            log_start_offset: self.log_start_offset,
            entries,
            aborted_transactions,
        })
    }

    /// ListOffsets by timestamp: the first offset whose timestamp is at
    /// least `timestamp_ms`, searched below `upper` (the HWM or the LSO);
    /// `None` when there is none (Kafka answers offset -1).
    pub fn offset_for_timestamp(&self, timestamp_ms: i64, upper: i64) -> Option<i64> {
        self.entries
            .iter()
            .take_while(|e| e.offset < upper)
            .find(|e| e.timestamp_ms() >= timestamp_ms)
            .map(|e| e.offset)
    }

    /// DeleteRecords: moves the log start to `offset`. Past the high
    /// watermark is OFFSET_OUT_OF_RANGE; below the current start is a no-op.
    pub fn delete_records_before(&mut self, offset: i64) -> Result<i64, ErrorCode> {
        if offset > self.high_watermark {
            return Err(ErrorCode::OffsetOutOfRange);
        }
        if offset > self.log_start_offset {
            self.set_log_start(offset);
        }
        Ok(self.log_start_offset)
    }

    /// Time-based retention over segments of `segment_records` offsets: a
    /// full segment (its last offset written) whose newest timestamp is more
    /// than `retention_ms` before `now_ms` is deleted, oldest first,
    /// stopping at the first one that must stay. A partly written segment
    /// stays; a full one at the end may go, leaving the log empty with its
    /// start at the high watermark, as Kafka rolls and deletes an expired
    /// active segment.
    pub fn apply_retention(&mut self, now_ms: i64, retention_ms: i64, segment_records: i64) {
        let segment_records = segment_records.max(1);
        loop {
            let segment_end = (self.log_start_offset / segment_records + 1) * segment_records;
            if segment_end > self.high_watermark {
                return;
            }
            let newest = self
                .entries
                .iter()
                .take_while(|e| e.offset < segment_end)
                .map(LogEntry::timestamp_ms)
                .max()
                .unwrap_or(i64::MIN);
            if now_ms.saturating_sub(newest) <= retention_ms {
                return;
            }
            self.set_log_start(segment_end);
        }
    }

    fn set_log_start(&mut self, offset: i64) {
        self.log_start_offset = offset;
        while self.entries.front().is_some_and(|e| e.offset < offset) {
            self.entries.pop_front();
        }
        self.aborted.retain(|a| a.last_offset >= offset);
    }

    /// Panics with a description when a documented invariant is broken; for
    /// tests and simulators.
    pub fn check_invariants(&self) {
        let lso = self.last_stable_offset();
        assert!(self.log_start_offset <= lso, "log start {} > LSO {}", self.log_start_offset, lso);
        assert!(lso <= self.high_watermark, "LSO {} > HWM {}", lso, self.high_watermark);
        let len = i64::try_from(self.entries.len()).unwrap_or(i64::MAX);
        assert_eq!(self.high_watermark - self.log_start_offset, len, "entries do not cover start..HWM");
        for (i, e) in self.entries.iter().enumerate() {
            assert_eq!(e.offset, self.log_start_offset + i64::try_from(i).unwrap_or(i64::MAX));
        }
        assert!(self.aborted.windows(2).all(|w| w[0].last_offset < w[1].last_offset));
        assert!(self.aborted.iter().all(|a| a.first_offset <= a.last_offset));
    }
}

/// The records a Kafka consumer in read_committed mode hands to the
/// application from one fetch response: control markers are dropped, and
/// transactional records of a producer are dropped from the first offset of
/// one of its aborted transactions until that transaction's ABORT marker.
///
/// This follows the Java consumer's `CompletedFetch`: aborted transactions
/// are taken in first-offset order and a producer id enters the aborted set
/// once the reader reaches that offset; the ABORT marker takes it out again.
pub fn read_committed_records(fetch: &FetchResult) -> Vec<(i64, &Record)> {
    // Min-heap on first offset, as the consumer's PriorityQueue.
    let mut pending: BinaryHeap<std::cmp::Reverse<(i64, i64)>> =
        fetch.aborted_transactions.iter().map(|a| std::cmp::Reverse((a.first_offset, a.producer_id))).collect();
    let mut aborted_producers: HashSet<i64> = HashSet::new();
    let mut out = Vec::new();
    for entry in &fetch.entries {
        while let Some(std::cmp::Reverse((first, pid))) = pending.peek().copied() {
            if first > entry.offset {
                break;
            }
            pending.pop();
            aborted_producers.insert(pid);
        }
        match &entry.body {
            EntryBody::Control { marker, producer_id, .. } => {
                if *marker == ControlMarker::Abort {
                    aborted_producers.remove(producer_id);
                }
            }
            EntryBody::Data { record, producer } => {
                if producer.transactional && aborted_producers.contains(&producer.producer_id) {
                    continue;
                }
                out.push((entry.offset, record));
            }
        }
    }
    out
}

/// The records a read_uncommitted consumer hands over: everything but
/// control markers.
pub fn read_uncommitted_records(fetch: &FetchResult) -> Vec<(i64, &Record)> {
    fetch
        .entries
        .iter()
        .filter_map(|e| match &e.body {
            EntryBody::Data { record, .. } => Some((e.offset, record)),
            EntryBody::Control { .. } => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(v: &str, ts: i64) -> Record {
        Record { key: None, value: Some(v.as_bytes().to_vec()), headers: vec![], timestamp_ms: ts }
    }

    fn values(fetch: &FetchResult) -> Vec<String> {
        read_committed_records(fetch)
            .into_iter()
            .map(|(_, r)| String::from_utf8_lossy(r.value.as_deref().unwrap_or_default()).into_owned())
            .collect()
    }

    #[test]
    fn an_open_transaction_holds_the_last_stable_offset_at_its_first_offset() {
        let mut log = PartitionLog::default();
        log.append_batch(-1, -1, -1, false, vec![rec("a", 0)], 0).unwrap();
        log.append_batch(1, 0, 0, true, vec![rec("t1", 0), rec("t2", 0)], 0).unwrap();
        log.append_batch(2, 0, 0, false, vec![rec("b", 0)], 0).unwrap();
        assert_eq!(log.high_watermark(), 4);
        assert_eq!(log.last_stable_offset(), 1);
        let fetch = log.fetch(0, 100, Isolation::ReadCommitted).unwrap();
        assert_eq!(values(&fetch), vec!["a"]);
        log.append_marker(1, 0, ControlMarker::Commit, 0);
        assert_eq!(log.last_stable_offset(), 5);
        let fetch = log.fetch(0, 100, Isolation::ReadCommitted).unwrap();
        assert_eq!(values(&fetch), vec!["a", "t1", "t2", "b"]);
        log.check_invariants();
    }

    #[test]
    fn read_committed_skips_aborted_records_and_markers() {
        let mut log = PartitionLog::default();
        log.append_batch(1, 0, 0, true, vec![rec("x", 0)], 0).unwrap();
        log.append_batch(2, 0, 0, true, vec![rec("y", 0)], 0).unwrap();
        log.append_batch(1, 0, 1, true, vec![rec("x2", 0)], 0).unwrap();
        log.append_marker(1, 0, ControlMarker::Abort, 0);
        log.append_marker(2, 0, ControlMarker::Commit, 0);
        log.append_batch(1, 0, 2, true, vec![rec("x3", 0)], 0).unwrap();
        log.append_marker(1, 0, ControlMarker::Commit, 0);
        let fetch = log.fetch(0, 100, Isolation::ReadCommitted).unwrap();
        assert_eq!(fetch.aborted_transactions, vec![AbortedTxnRef { producer_id: 1, first_offset: 0 }]);
        assert_eq!(values(&fetch), vec!["y", "x3"]);
        let uncommitted = log.fetch(0, 100, Isolation::ReadUncommitted).unwrap();
        assert!(uncommitted.aborted_transactions.is_empty());
        assert_eq!(read_uncommitted_records(&uncommitted).len(), 4);
    }

    #[test]
    fn a_fetch_starting_inside_an_aborted_transaction_still_gets_its_entry() {
        let mut log = PartitionLog::default();
        log.append_batch(1, 0, 0, true, vec![rec("x", 0), rec("x2", 0)], 0).unwrap();
        log.append_marker(1, 0, ControlMarker::Abort, 0);
        let fetch = log.fetch(1, 100, Isolation::ReadCommitted).unwrap();
        assert_eq!(fetch.aborted_transactions.len(), 1);
        assert!(values(&fetch).is_empty());
    }

    #[test]
    fn fetching_below_the_log_start_is_out_of_range_after_delete_records() {
        let mut log = PartitionLog::default();
        log.append_batch(-1, -1, -1, false, vec![rec("a", 0), rec("b", 0), rec("c", 0)], 0).unwrap();
        assert_eq!(log.delete_records_before(2), Ok(2));
        assert_eq!(log.fetch(1, 10, Isolation::ReadUncommitted), Err(ErrorCode::OffsetOutOfRange));
        assert_eq!(log.fetch(2, 10, Isolation::ReadUncommitted).unwrap().entries.len(), 1);
        assert_eq!(log.fetch(4, 10, Isolation::ReadUncommitted), Err(ErrorCode::OffsetOutOfRange));
        assert_eq!(log.delete_records_before(9), Err(ErrorCode::OffsetOutOfRange));
        log.check_invariants();
    }

    #[test]
    fn time_retention_deletes_only_full_expired_segments() {
        let mut log = PartitionLog::default();
        for i in 0..5 {
            log.append_batch(-1, -1, -1, false, vec![rec("r", i * 10)], 0).unwrap();
        }
        // Segments of 2: [0,1] newest ts 10, [2,3] newest 30, [4] active.
        log.apply_retention(100, 75, 2);
        assert_eq!(log.log_start_offset(), 2);
        log.apply_retention(1_000, 75, 2);
        assert_eq!(log.log_start_offset(), 4);
        log.check_invariants();
    }

    #[test]
    fn list_offsets_by_time_finds_the_first_record_at_or_after_the_timestamp() {
        let mut log = PartitionLog::default();
        for ts in [5, 10, 10, 20] {
            log.append_batch(-1, -1, -1, false, vec![rec("r", ts)], 0).unwrap();
        }
        assert_eq!(log.offset_for_timestamp(10, log.high_watermark()), Some(1));
        assert_eq!(log.offset_for_timestamp(21, log.high_watermark()), None);
    }

    #[test]
    fn retention_past_an_open_transaction_clamps_the_last_stable_offset() {
        let mut log = PartitionLog::default();
        log.append_batch(1, 0, 0, true, vec![rec("t", 0), rec("t", 0)], 0).unwrap();
        log.delete_records_before(1).unwrap();
        assert_eq!(log.last_stable_offset(), 1);
        log.check_invariants();
    }
}
