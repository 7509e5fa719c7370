//! # dedupd
//!
//! Turns an at-least-once stream of usage events into an exactly-once stream
//! for billing. Every input record lands in exactly one bucket: accepted,
//! duplicate, conflict or rejected (DESIGN §1).
//!
//! # Layout
//!
//! - [`event`]: wire decoding, validation with reason codes, identity hashing,
//!   and which input partition an identity belongs on (pure, no I/O).
//! - [`classify`]: the four-bucket classifier, the in-memory hot cache, and
//!   `classify_records`, the pure part of the pipeline (pure, no I/O; time
//!   comes from a [`classify::Clock`]).
//! - [`config`]: flags, `DEDUPD_*` environment and the TOML file, validated
//!   before any I/O.
//! - [`state`]: local state, the materialised view of the output topic; ties
//!   the classifier to the durable tiers (sync).
//! - [`storage`]: the durable usage store: WAL, columnar segments, sidecar
//!   index, manifest, recovery (sync, no async runtime).
//! - [`keystore`]: the long-horizon key store on RocksDB (sync).
//! - [`ledger`]: the usage ledger: hourly rollups per customer and meter,
//!   watermarks, late events as adjustments, periods and queries; a tier of
//!   local state, pure fold with a RocksDB store (sync).
//! - [`offline`]: `dedupd dedupe`, the engine over NDJSON files (sync).
//! - [`pipeline`]: the sans-I/O core of the worker: every decision of a
//!   partition's life (repair, batch order, revoke and lost assignments,
//!   transaction endings) with time as an input, and which partitions a
//!   worker follows as a warm standby; driven by [`kafka`] in production
//!   and by [`sim`] in tests (pure, no I/O).
//! - [`kafka`]: the worker (`dedupd run`, `dedupd demo`): consumer group,
//!   publishing, repair, warm standbys; and the router (`dedupd route`), which keys and
//!   places raw records by identity in front of it (async).
//! - [`process`]: process-wide settings made at start (transparent huge
//!   pages off), shared with the benches.
//! - [`metrics`]: the Prometheus registry and the HTTP endpoint (`/metrics`,
//!   health, `/v1/usage`, and [`runbook`], the on-call runbook the alerts
//!   link to, built into the binary).
//! - [`sim`]: a model Kafka broker and faulty network for deterministic
//!   simulation (pure, sans-I/O, seeded; knows nothing of dedupd's records);
//!   in test builds, `sim::disk` (a disk that loses unsynced writes and
//!   fails, behind [`storage::FileSystem`], and a key-store model behind
//!   [`keystore::KeyTier`]) and `sim::world`, the simulator that drives
//!   [`pipeline`] and [`state`] against them under thousands of seeded
//!   fault schedules.

pub mod classify;
pub mod config;
pub mod event;
pub mod kafka;
pub mod keystore;
pub mod ledger;
pub mod metrics;
pub mod offline;
pub mod pipeline;
pub mod process;
pub mod runbook;
pub mod sim;
pub mod state;
pub mod storage;
