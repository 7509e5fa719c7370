//! # dedupd
//!
//! Turns an at-least-once stream of usage events into an exactly-once stream
//! for billing. Every input record lands in exactly one bucket: accepted,
//! duplicate, conflict or rejected (DESIGN §1).
//!
//! # Layout
//!
//! - [`event`]: wire decoding, validation with reason codes, identity hashing
//!   (pure, no I/O).
//! - [`classify`]: the four-bucket classifier and the in-memory hot cache
//!   (pure, no I/O; time comes from a [`classify::Clock`]).
//! - [`keystore`]: the long-horizon key store on RocksDB (sync).

pub mod classify;
pub mod event;
pub mod keystore;
