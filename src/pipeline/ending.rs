//! How a transaction's commit or abort is resolved.
//!
//! Kafka's transactional producer makes `commit` and `abort` resumable: a
//! call that times out may still complete at the broker, and the only
//! correct next step is the same call again. Aborting a commit that did
//! reach the transaction coordinator would publish the batch twice, once in
//! the committed transaction and again when the batch is retried. A commit
//! the broker refuses as abortable is aborted; an abort that fails other
//! than by timing out leaves the producer with no way forward. Past a
//! deadline (longer than the transaction timeout, after which the broker
//! has resolved the transaction either way) the outcome stays unknown and
//! the worker stops, naming it, rather than wedge the partition for ever.

use crate::pipeline::mutation::{Mutation, Mutations};

/// The two calls that end a transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ending {
    Commit,
    Abort,
}

impl Ending {
    pub fn name(self) -> &'static str {
        match self {
            Ending::Commit => "commit",
            Ending::Abort => "abort",
        }
    }
}

/// What one commit or abort call answered, as the driver sorts it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndAttempt {
    /// The transaction is committed (or aborted).
    Resolved,
    /// The call timed out and may still complete: resumable.
    TimedOut,
    /// The broker refused the commit in a way that requires an abort.
    MustAbort,
    /// Fatal or permanent (fenced, not authorised): no call can help.
    Failed,
}

/// What the driver does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EndDecision {
    /// Resolved: go on.
    Done,
    /// Make the same call again.
    Repeat,
    /// Abort the transaction (the commit did not happen), then retry the
    /// batches it held.
    AbortInstead,
    /// The outcome is unknown past the deadline: stop the worker.
    Unresolved { waited_ms: i64 },
    /// Stop the worker with the driver's own error.
    Fail,
}

/// One commit or abort being resolved.
#[derive(Clone, Copy, Debug)]
pub struct TransactionEnding {
    ending: Ending,
    started_ms: i64,
    resolve_deadline_ms: i64,
    attempts: u32,
    mutations: Mutations,
}

impl TransactionEnding {
    /// Starts resolving `ending` at `now_ms`; gives up `resolve_deadline_ms`
    /// later.
    pub fn new(ending: Ending, now_ms: i64, resolve_deadline_ms: i64, mutations: Mutations) -> TransactionEnding {
        TransactionEnding { ending, started_ms: now_ms, resolve_deadline_ms, attempts: 0, mutations }
    }

    pub fn ending(&self) -> Ending {
        self.ending
    }

    /// Calls made so far.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Decides after one call answered `attempt` at `now_ms`.
    pub fn attempted(&mut self, attempt: EndAttempt, now_ms: i64) -> EndDecision {
        self.attempts += 1;
        let waited_ms = now_ms.saturating_sub(self.started_ms);
        match (attempt, self.ending) {
            (EndAttempt::Resolved, _) => EndDecision::Done,
            (EndAttempt::TimedOut, Ending::Commit) if self.mutations.has(Mutation::CommitTimeoutNotResumed) => {
                EndDecision::Done
            }
            (EndAttempt::TimedOut, _) if waited_ms >= self.resolve_deadline_ms => EndDecision::Unresolved { waited_ms },
            (EndAttempt::TimedOut, _) => EndDecision::Repeat,
            (EndAttempt::MustAbort, Ending::Commit) => EndDecision::AbortInstead,
            (EndAttempt::MustAbort, Ending::Abort) => EndDecision::Unresolved { waited_ms },
            (EndAttempt::Failed, _) => EndDecision::Fail,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timed_out_commit_is_repeated_until_the_deadline_then_left_unresolved() {
        let mut e = TransactionEnding::new(Ending::Commit, 1_000, 60_000, Mutations::NONE);
        assert_eq!(e.attempted(EndAttempt::TimedOut, 11_000), EndDecision::Repeat);
        assert_eq!(e.attempted(EndAttempt::TimedOut, 40_000), EndDecision::Repeat);
        assert_eq!(e.attempted(EndAttempt::TimedOut, 61_000), EndDecision::Unresolved { waited_ms: 60_000 });
        assert_eq!(e.attempts(), 3);
    }

    #[test]
    fn a_commit_that_must_abort_is_aborted_and_a_failing_abort_is_unresolved() {
        let mut c = TransactionEnding::new(Ending::Commit, 0, 60_000, Mutations::NONE);
        assert_eq!(c.attempted(EndAttempt::MustAbort, 5), EndDecision::AbortInstead);
        let mut a = TransactionEnding::new(Ending::Abort, 0, 60_000, Mutations::NONE);
        assert_eq!(a.attempted(EndAttempt::TimedOut, 5), EndDecision::Repeat);
        assert_eq!(a.attempted(EndAttempt::MustAbort, 9), EndDecision::Unresolved { waited_ms: 9 });
        let mut f = TransactionEnding::new(Ending::Commit, 0, 60_000, Mutations::NONE);
        assert_eq!(f.attempted(EndAttempt::Failed, 1), EndDecision::Fail);
        assert_eq!(f.attempted(EndAttempt::Resolved, 2), EndDecision::Done);
    }

    #[test]
    fn the_mutation_takes_a_timed_out_commit_as_done() {
        let mut e =
            TransactionEnding::new(Ending::Commit, 0, 60_000, Mutations::only(Mutation::CommitTimeoutNotResumed));
        assert_eq!(e.attempted(EndAttempt::TimedOut, 1), EndDecision::Done);
    }
}
