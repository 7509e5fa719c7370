//! A model Kafka broker for deterministic simulation (issue #11).
//!
//! A pure, sans-I/O state machine written from Kafka's protocol documents
//! and KIPs, independent of dedupd: records are opaque bytes. No threads,
//! no clock, no sockets: every call takes the simulated time `now_ms`, and
//! the only randomness is [`rng::SimRng`], so a seed replays exactly.
//!
//! # What is modelled
//!
//! - **Partition logs** ([`broker::log`]): one offset per record, control
//!   markers (COMMIT/ABORT) taking an offset each, the high watermark (a
//!   single replica, so it is the log end), the last stable offset (first
//!   offset of the oldest open transaction, else the HWM), the log start
//!   offset moved by DeleteRecords or time retention over segments, Fetch
//!   with read_uncommitted / read_committed and the aborted-transaction
//!   list, OFFSET_OUT_OF_RANGE, ListOffsets earliest / latest / by time, and
//!   [`broker::log::read_committed_records`], the consumer-side filter.
//! - **Idempotent producer** (KIP-98, [`broker::producer_state`]): producer
//!   ids, epochs, per-partition sequences, the last five batches answered
//!   as duplicates with their original offsets, OUT_OF_ORDER_SEQUENCE_NUMBER
//!   for gaps, INVALID_PRODUCER_EPOCH for older epochs.
//! - **Transactions** (KIP-98, [`broker::txn`]): transactional id → producer
//!   id and epoch; InitProducerId fencing (bump, abort the open transaction,
//!   CONCURRENT_TRANSACTIONS until its markers are written);
//!   AddPartitionsToTxn, AddOffsetsToTxn, TxnOffsetCommit, EndTxn with the
//!   Prepare/Complete states and idempotent retries; markers written
//!   `marker_delay_ms` after the decision; transaction timeouts that fence
//!   and abort; KIP-890-style verification of transactional produce.
//! - **Consumer groups** ([`broker::group`]): JoinGroup / SyncGroup /
//!   Heartbeat / LeaveGroup, generations, cooperative rebalancing (KIP-429,
//!   assignor inside the broker), session expiry and lost assignments,
//!   static membership (KIP-345, FENCED_INSTANCE_ID), OffsetCommit /
//!   OffsetFetch with generation checks, TxnOffsetCommit with group metadata
//!   (KIP-447) and UNSTABLE_OFFSET_COMMIT for require_stable fetches.
//! - **Network** ([`net`]): latency, requests dropped before the broker,
//!   responses lost after it applied the request (the client sees
//!   REQUEST_TIMED_OUT either way and cannot tell which), broker
//!   unavailability and coordinator moves, all from the seeded generator.
//!
//! # What is not
//!
//! Replication, leader elections and ISR (one replica; the HWM is the log
//! end), record batches as units on the wire (each record is its own
//! offset; a fetch never returns records before the fetch offset),
//! compaction, quotas, the consumer group protocol of KIP-848, KIP-394's
//! member-id round trip, producer-state expiry (`transactional.id.expiration.ms`,
//! `producer.id.expiration.ms`), UNKNOWN_PRODUCER_ID after retention
//! removed a producer's batches, and transactions V2 (KIP-890 part 2's
//! epoch bump per transaction). Blocking requests (JoinGroup, long-poll
//! Fetch) answer at once: a pending JoinGroup is polled again.

//!
//! # The simulator
//!
//! `world` (test builds only) runs dedupd workers through the sans-I/O core
//! ([`crate::pipeline`]) against this broker under seeded fault schedules
//! and checks billing's guarantees after each; see its module doc and
//! "Testing" in `docs/ARCHITECTURE.md`.

pub mod broker;
#[cfg(test)]
pub mod disk;
pub mod error;
pub mod net;
pub mod rng;
#[cfg(test)]
pub mod world;

#[cfg(test)]
mod proptests;

pub use broker::api::{Request, Response};
pub use broker::group::{GroupMetadata, JoinGroupRequest, JoinOutcome};
pub use broker::log::{
    read_committed_records, read_uncommitted_records, Appended, ControlMarker, EntryBody, FetchResult, Isolation,
    LogEntry, Record, TopicPartition,
};
pub use broker::{Broker, BrokerConfig, OffsetSpec, ProduceBatch, ProducerIdAndEpoch};
pub use error::ErrorCode;
pub use net::{ClientId, Delivery, NetConfig, Network, Outage, OutageKind, Outcome, RequestId};
pub use rng::SimRng;
