//! The Kafka worker (`dedupd run`): consumer group, per-partition pipelines,
//! exactly-once or at-least-once publishing, side topics, repair from the
//! output topic, and the in-process demo (DESIGN §1, §6).
//!
//! Async (tokio + rdkafka); local state is reached through the sync
//! [`Engine`] seam on blocking threads.
//!
//! - [`settings`]: [`RunSettings`], [`DeliveryMode`].
//! - [`clients`]: librdkafka configurations and start-up broker checks.
//! - [`engine`]: the seam to local state ([`StateEngine`] over `LocalState`).
//! - [`records`]: the output, conflicts and rejected record formats.
//! - [`batch`]: one input batch classified into those records (no rdkafka).
//! - [`publisher`]: transactional group commit, or idempotent publish.
//! - [`repair`]: reading an output partition back into local state.
//! - [`partition`]: one input partition's pipeline.
//! - `standby`: warm standbys, following other owners' output partitions.
//! - [`worker`]: [`run`], rebalance callbacks, shutdown.
//! - [`router`]: `dedupd route`, keying and placing raw records by identity.
//! - [`demo`]: `dedupd demo` on librdkafka's mock cluster.
//! - [`usage`]: the usage ledger read from the rollups and output topics.

pub mod batch;
pub mod clients;
pub mod demo;
pub mod engine;
mod error;
mod partition;
pub mod periods;
pub mod publisher;
pub mod records;
pub mod repair;
pub mod router;
pub mod settings;
mod standby;
pub mod usage;
pub mod worker;

pub use engine::{Engine, EngineError, EngineStats, InputRecord, Outcome, StateEngine, StoredEvent};
pub use error::KafkaError;
pub use settings::{BatchLimits, DeliveryMode, OnMisrouted, OnOutputGap, Partitioner, RunSettings, Topics};
pub use worker::{run, shutdown_signal, RunReport, WorkerParts};
