//! The sans-I/O core of the worker: every decision of a partition's life,
//! with no I/O and time as an input (issue #11).
//!
//! A partition's life is a sequence of [`Step`]s the core asks its driver to
//! perform (load local state, read the output's ends, read output back, collect
//! a batch, classify, publish, apply, commit offsets, wait, release) and the
//! [`Event`]s the driver reports back. The order of those steps is what keeps
//! billing exact: repair before any input, publish before apply, input offsets
//! inside the transaction (exactly-once) or only after the acknowledgement
//! (at-least-once), a revoked batch finished but a lost one abandoned, a
//! timed-out transaction commit repeated rather than given up.
//!
//! Two drivers run this same code:
//! - `crate::kafka` (`dedupd run`): rdkafka clients and the real local state;
//! - `crate::sim` (tests): the model broker, a faulty network and a modelled
//!   durable state, under thousands of seeded fault schedules.
//!
//! - [`life`]: [`PartitionLife`], one input partition from assignment to release.
//! - [`ending`]: [`TransactionEnding`], how a transaction's commit or abort
//!   is resolved.
//! - [`standby`]: which partitions a worker follows as a warm standby, from
//!   the consumer group's membership.
//! - [`mutation`]: deliberate bugs, compiled into tests only, that the
//!   simulator must catch.

pub mod ending;
pub mod life;
pub mod mutation;
pub mod standby;

pub use ending::{EndAttempt, EndDecision, Ending, TransactionEnding};
pub use life::{BatchFailure, Event, LifeError, LifeSettings, PartitionLife, Step};
pub use mutation::{Mutation, Mutations};

/// How publishing and input offsets are tied together (DESIGN §6).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DeliveryMode {
    /// Kafka transactions: output records and input offsets commit together;
    /// a zombie instance is fenced. Needs a broker with transactions.
    #[default]
    ExactlyOnce,
    /// Idempotent producer: publish, await every ack, apply, then commit the
    /// input offsets. A crash between publish and commit replays input that
    /// repair recognises, so the output stays exactly once.
    AtLeastOnce,
}

impl DeliveryMode {
    /// The flag spelling (`--delivery`).
    pub fn as_str(self) -> &'static str {
        match self {
            DeliveryMode::ExactlyOnce => "exactly-once",
            DeliveryMode::AtLeastOnce => "at-least-once",
        }
    }

    pub fn parse(s: &str) -> Option<DeliveryMode> {
        match s {
            "exactly-once" => Some(DeliveryMode::ExactlyOnce),
            "at-least-once" => Some(DeliveryMode::AtLeastOnce),
            _ => None,
        }
    }
}

impl std::fmt::Display for DeliveryMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What repair does when retention deleted output that local state never
/// applied (`--on-output-gap`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OnOutputGap {
    /// Stop the worker and name the gap: retries of the deleted events can
    /// no longer be recognised, so going on may bill them twice.
    #[default]
    Stop,
    /// Go on from the log start, counting the gap
    /// (`dedupd_repair_gap_records_total`) so an alert fires.
    Continue,
}

impl OnOutputGap {
    pub fn parse(s: &str) -> Option<OnOutputGap> {
        match s {
            "stop" => Some(OnOutputGap::Stop),
            "continue" => Some(OnOutputGap::Continue),
            _ => None,
        }
    }
}
