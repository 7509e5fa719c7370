//! [`PartitionLife`]: one input partition from assignment to release, as
//! decisions only.
//!
//! ```text
//! assign ─► Load ─► ProbeOutputEnd ─► ProbeStableEnd ⟲ Wait ─► (FindHorizonStart) ─► ReadOutput
//!              ▲                                                                      │ repaired
//!              │ retry after repair                                                   ▼
//!   Wait ◄─ publish failed ◄─ Publish ◄─ Classify ◄─ Collect ◄─────────────────── (next batch)
//!                                │ published                                          ▲
//!                                ▼                                                    │
//!                              Apply ─► (at-least-once: CommitInput) ─────────────────┘
//! revoke: abandon repair or an unpublished batch, finish a batch in flight, then Release
//! lost:   abandon at the next point where nothing of the batch is in flight
//! ```
//!
//! The driver performs each [`Step`] and reports what happened as an
//! [`Event`]; [`PartitionLife::on`] answers with the next step. Time is an
//! argument (`now_ms`), never read, so the simulator drives this code in
//! simulated time and a seed replays exactly.

use crate::pipeline::mutation::{Mutation, Mutations};
use crate::pipeline::{DeliveryMode, OnOutputGap};

/// What the life of a partition needs to know; fixed for the partition.
#[derive(Clone, Copy, Debug)]
pub struct LifeSettings {
    pub partition: i32,
    pub delivery: DeliveryMode,
    pub on_output_gap: OnOutputGap,
    /// Longest repair waits for transactions open on the output partition
    /// at its start to end (at least the producers' transaction timeout).
    pub settle_timeout_ms: i64,
    /// How often the last stable offset is read again while waiting.
    pub settle_poll_ms: i64,
    /// Repairs that fail on broker errors are tried this many times.
    pub repair_attempts: u32,
    /// First back-off between repair attempts; doubles.
    pub repair_backoff_ms: i64,
    /// First back-off before retrying a failed publish; doubles up to
    /// [`LifeSettings::publish_backoff_max_ms`].
    pub publish_backoff_ms: i64,
    pub publish_backoff_max_ms: i64,
    /// At-least-once: how often an unconfirmed input offset commit is sent
    /// again while the partition is idle.
    pub commit_retry_ms: i64,
    /// At-least-once with a rollups topic: how long the rollups of applied
    /// batches may be held back while batches keep coming, so that one
    /// record carries many batches' changes to an hour
    /// (`--rollups-interval`); a partition with no input publishes them at
    /// once. `None`: every batch
    /// publishes its own, as exactly-once always does (they ride its
    /// transaction, issue #12).
    pub hold_rollups_ms: Option<i64>,
    /// Deliberate bugs (test builds only).
    pub mutations: Mutations,
}

impl LifeSettings {
    /// dedupd's defaults for `partition`.
    pub fn new(partition: i32, delivery: DeliveryMode) -> LifeSettings {
        LifeSettings {
            partition,
            delivery,
            on_output_gap: OnOutputGap::Stop,
            settle_timeout_ms: 120_000,
            settle_poll_ms: 200,
            repair_attempts: 5,
            repair_backoff_ms: 500,
            publish_backoff_ms: 100,
            publish_backoff_max_ms: 5_000,
            commit_retry_ms: 1_000,
            hold_rollups_ms: None,
            mutations: Mutations::NONE,
        }
    }
}

/// What the driver must do next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Read local state's checkpoints for the partition (taking ownership
    /// of it first when `assign`). Answer: [`Event::Loaded`].
    Load { assign: bool },
    /// Read the output partition's high watermark, regardless of
    /// transactions (read_uncommitted). Answer: [`Event::OutputEnd`].
    ProbeOutputEnd,
    /// Read the output partition's log start and last stable offset
    /// (read_committed). Answer: [`Event::StableEnd`].
    ProbeStableEnd,
    /// Find the first output offset published within the dedupe horizon
    /// (by the event clock, the driver's), within `log_start..end`: the
    /// log start when the broker cannot say. A partition without a
    /// checkpoint has nothing older to remember. Answer:
    /// [`Event::HorizonStart`].
    FindHorizonStart { log_start: i64, end: i64 },
    /// Read output `from..end` under read_committed and apply every record
    /// to local state. `gap` output records below `from` were deleted by
    /// retention before local state applied them (count them). Answer:
    /// [`Event::OutputRead`].
    ReadOutput { from: i64, end: i64, gap: u64 },
    /// Collect the next input batch. Answer: [`Event::Collected`] or
    /// [`Event::Idle`].
    Collect,
    /// Classify the collected batch against local state, read-only, and
    /// build its records. Answer: [`Event::Classified`].
    Classify,
    /// Publish the classified batch. With `offsets_in_transaction` the input
    /// offset `next_input` commits in the same transaction. With
    /// `flush_rollups` the batch's rollups go with it, and so do those held
    /// back from earlier batches; without, its rollups join the held ones.
    /// Answer: [`Event::Published`] or [`Event::PublishFailed`].
    Publish { next_input: i64, offsets_in_transaction: bool, flush_rollups: bool },
    /// Publish the rollups held back from applied batches, alone (see
    /// [`LifeSettings::hold_rollups_ms`]). Answer: [`Event::Published`] or
    /// [`Event::PublishFailed`].
    PublishRollups,
    /// Apply the batch's accepted events to local state. Answer:
    /// [`Event::Applied`].
    Apply,
    /// Commit the input offset `next_input` with a plain consumer commit
    /// (asynchronous; a failed one is sent again while idle). Answer:
    /// [`Event::CommitSent`].
    CommitInput { next_input: i64 },
    /// Do nothing until `until_ms`. Answer: [`Event::Waited`].
    Wait { until_ms: i64 },
    /// The partition's life is over: release it, after sending the
    /// at-least-once input commit `commit_first` when there is one.
    Release { commit_first: Option<i64> },
    /// Stop the worker with this error.
    Stop(LifeError),
}

/// What the driver reports after performing a [`Step`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The last output offset applied to local state, and the furthest
    /// applied to any of its tiers.
    Loaded {
        checkpoint: Option<i64>,
        furthest: Option<i64>,
    },
    OutputEnd {
        high_watermark: i64,
    },
    StableEnd {
        log_start: i64,
        last_stable: i64,
    },
    HorizonStart {
        offset: i64,
    },
    /// Every output record below `next` is applied.
    OutputRead {
        next: i64,
    },
    /// A broker error while repairing (retried with back-off).
    RepairFailed {
        detail: String,
    },
    /// A batch was collected; `next_input` is one past its last offset.
    Collected {
        next_input: i64,
    },
    /// Nothing arrived; `committed` is the broker's confirmed input offset.
    Idle {
        committed: Option<i64>,
    },
    Classified,
    Published,
    /// A retriable publish failure (the driver stops the worker on the
    /// others itself).
    PublishFailed(BatchFailure),
    Applied,
    CommitSent,
    Waited,
}

/// Why a publish failed but may be retried.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchFailure {
    /// Bounded label for `dedupd_publish_retries_total`.
    pub reason: &'static str,
    pub detail: String,
}

/// A decision of the core that stops the worker.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LifeError {
    #[error("local state has applied output offset {checkpoint} but the output partition ends at {end}")]
    StateAheadOfOutput { checkpoint: i64, end: i64 },
    #[error("retention deleted output records {first_missing}..{log_start} before local state applied them")]
    OutputGap { checkpoint: i64, first_missing: i64, log_start: i64, missing: i64 },
    #[error(
        "a transaction on the output stayed open for {waited_ms} ms (last stable offset {last_stable}, high \
         watermark {high_watermark}); refusing to consume input before it ends, because its events may still commit"
    )]
    OpenTransactionNeverEnded { waited_ms: i64, last_stable: i64, high_watermark: i64 },
    #[error("repair failed {attempts} times: {detail}")]
    RepairFailed { attempts: u32, detail: String },
}

/// Why the partition is repairing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RepairFor {
    /// Newly assigned: nothing consumed yet, so a revoke abandons it.
    Assignment,
    /// Before retrying the batch ending at `next_input`, whose failed
    /// publish may have reached the output: must finish unless lost.
    Retry { next_input: i64 },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RepairStage {
    Loading { assign: bool },
    ProbingEnd { checkpoint: Option<i64>, furthest: Option<i64> },
    ProbingStable { checkpoint: Option<i64>, high_watermark: i64, settle_deadline_ms: i64 },
    FindingStart { end: i64 },
    Reading { end: i64 },
    BackingOff,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Repair {
    purpose: RepairFor,
    stage: RepairStage,
    attempts: u32,
    started_ms: i64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Repairing(Repair),
    Collecting,
    Classifying {
        next_input: i64,
    },
    /// A mutation's step before the publish (commit first, apply first).
    BeforePublish {
        next_input: i64,
    },
    Publishing {
        next_input: i64,
        applied: bool,
        flush_rollups: bool,
    },
    Applying {
        next_input: i64,
        flush_rollups: bool,
    },
    /// Publishing held rollups alone; `next_input` commits once they are
    /// acknowledged.
    FlushingRollups {
        next_input: i64,
    },
    /// A publish of held rollups failed; tried again after a wait.
    FlushBackingOff {
        next_input: i64,
    },
    Committing {
        next_input: i64,
    },
    BackingOff {
        next_input: i64,
    },
    Released,
    Stopped,
}

/// Applied batches whose rollups are held back: the input offset after the
/// last of them, and when the first was applied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Held {
    next_input: i64,
    since_ms: i64,
}

/// One input partition's life. See the module doc.
#[derive(Clone, Debug)]
pub struct PartitionLife {
    settings: LifeSettings,
    phase: Phase,
    /// A revoke arrived: finish what must be finished, then release.
    revoking: bool,
    /// The assignment was lost: abandon at the next point where nothing of
    /// the batch is in flight.
    lost: bool,
    /// At-least-once: the input offset published and applied but not yet
    /// confirmed committed, and when its commit was last sent.
    uncommitted: Option<(i64, i64)>,
    /// At-least-once, rollups held back ([`LifeSettings::hold_rollups_ms`]):
    /// batches published and applied whose rollups are not published yet.
    /// Their input offsets are not committed until a publish carries their
    /// rollups: a crash before that replays them, and a replay publishes
    /// its hour's total again (see `crate::ledger::Replays`), so the
    /// rollups topic never stays short of the output.
    held: Option<Held>,
    publish_backoff_ms: i64,
    /// Input batches published and applied.
    batches: u64,
}

impl PartitionLife {
    /// A newly assigned partition; perform the returned step first.
    pub fn assigned(settings: LifeSettings, now_ms: i64) -> (PartitionLife, Step) {
        let mut life = PartitionLife {
            settings,
            phase: Phase::Released,
            revoking: false,
            lost: false,
            uncommitted: None,
            held: None,
            publish_backoff_ms: settings.publish_backoff_ms,
            batches: 0,
        };
        let step = life.start_repair(RepairFor::Assignment, true, now_ms);
        (life, step)
    }

    pub fn partition(&self) -> i32 {
        self.settings.partition
    }

    /// True while repair (of an assignment or before a retry) runs.
    pub fn repairing(&self) -> bool {
        matches!(self.phase, Phase::Repairing(_))
    }

    /// True once the partition was released or the worker told to stop.
    pub fn ended(&self) -> bool {
        matches!(self.phase, Phase::Released | Phase::Stopped)
    }

    /// Batches published and applied so far.
    pub fn batches(&self) -> u64 {
        self.batches
    }

    /// When the current repair started, if one runs.
    pub fn repair_started_ms(&self) -> Option<i64> {
        match self.phase {
            Phase::Repairing(r) => Some(r.started_ms),
            _ => None,
        }
    }

    fn mutated(&self, m: Mutation) -> bool {
        self.settings.mutations.has(m)
    }

    fn start_repair(&mut self, purpose: RepairFor, assign: bool, now_ms: i64) -> Step {
        self.phase = Phase::Repairing(Repair {
            purpose,
            stage: RepairStage::Loading { assign },
            attempts: 0,
            started_ms: now_ms,
        });
        Step::Load { assign }
    }

    fn release(&mut self) -> Step {
        self.phase = Phase::Released;
        let commit_first = if self.lost { None } else { self.uncommitted.map(|(next, _)| next) };
        Step::Release { commit_first }
    }

    fn stop(&mut self, e: LifeError) -> Step {
        self.phase = Phase::Stopped;
        Step::Stop(e)
    }

    /// The partition is being revoked (`lost`: the assignment was lost, so
    /// another member may own it already). `Some(step)`: interrupt the step
    /// in progress (if any) and perform this one instead; `None`: carry on,
    /// the core releases the partition when the batch in flight is done.
    pub fn revoke(&mut self, lost: bool) -> Option<Step> {
        self.revoking = true;
        if lost && !self.mutated(Mutation::RevokeFinishesLostBatch) {
            self.lost = true;
        }
        self.interruptible(false).then(|| self.wind_up())
    }

    /// Ends the partition's life: a partition let go in good order
    /// publishes its held rollups first (its input offsets then commit), a
    /// lost one leaves them to the next owner's replays.
    fn wind_up(&mut self) -> Step {
        match self.held {
            Some(h) if !self.lost => self.flush_held(h.next_input),
            _ => self.release(),
        }
    }

    fn flush_held(&mut self, next_input: i64) -> Step {
        self.phase = Phase::FlushingRollups { next_input };
        Step::PublishRollups
    }

    /// Whether the batch about to be published carries the rollups: always,
    /// but at least once with a hold, where they wait until the oldest held
    /// batch is `hold_rollups_ms` old or the partition is being let go.
    fn flushes_rollups(&self, now_ms: i64) -> bool {
        let hold_ms = match (self.settings.delivery, self.settings.hold_rollups_ms) {
            (DeliveryMode::AtLeastOnce, Some(hold_ms)) => hold_ms,
            (DeliveryMode::ExactlyOnce, hold) if self.mutated(Mutation::RollupsAfterTheirTransaction) => {
                hold.unwrap_or(1_000)
            }
            _ => return true,
        };
        self.revoking || self.held.is_some_and(|h| now_ms - h.since_ms >= hold_ms)
    }

    /// Whether a revoke now (`lost`: of a lost assignment) interrupts the
    /// step in progress rather than let it finish.
    pub fn interruptible(&self, lost: bool) -> bool {
        let lost = self.lost || (lost && !self.mutated(Mutation::RevokeFinishesLostBatch));
        match self.phase {
            // Nothing of the partition's input consumed yet.
            Phase::Repairing(Repair { purpose: RepairFor::Assignment, .. }) => true,
            // Nothing in flight but the retried batch, which a lost
            // partition abandons and a revoked one finishes.
            Phase::Repairing(_) | Phase::BackingOff { .. } => lost,
            // Held rollups waiting to be published again: a revoke tries
            // once more, a lost partition leaves them to replays.
            Phase::FlushBackingOff { .. } => true,
            // An unpublished batch is abandoned: the next owner consumes
            // it from the committed offset.
            Phase::Collecting => true,
            Phase::Classifying { .. }
            | Phase::BeforePublish { .. }
            | Phase::Publishing { .. }
            | Phase::FlushingRollups { .. }
            | Phase::Applying { .. }
            | Phase::Committing { .. } => false,
            Phase::Released | Phase::Stopped => false,
        }
    }

    /// Whether the partition's life was revoked as lost (and so never
    /// commits input offsets on release).
    pub fn lost(&self) -> bool {
        self.lost
    }

    /// Decides the next step after `event`, at `now_ms`.
    pub fn on(&mut self, event: Event, now_ms: i64) -> Step {
        match (self.phase, event) {
            (Phase::Released, _) => Step::Release { commit_first: None },
            (Phase::Stopped, _) => Step::Release { commit_first: None },
            (Phase::Repairing(r), event) => self.on_repair(r, event, now_ms),
            (Phase::Collecting, Event::Collected { next_input }) => {
                self.phase = Phase::Classifying { next_input };
                Step::Classify
            }
            (Phase::Collecting, Event::Idle { committed }) => self.idle(committed, now_ms),
            (Phase::Collecting, Event::CommitSent) => Step::Collect,
            (Phase::Classifying { next_input }, Event::Classified) => self.classified(next_input, now_ms),
            (Phase::BeforePublish { next_input }, Event::CommitSent) => self.publish(next_input, false, false, now_ms),
            (Phase::BeforePublish { next_input }, Event::Applied) => {
                self.publish(next_input, true, self.offsets_in_transaction(), now_ms)
            }
            (Phase::Publishing { next_input, applied, flush_rollups }, Event::Published) => {
                self.publish_backoff_ms = self.settings.publish_backoff_ms;
                if applied {
                    self.batch_done(next_input, flush_rollups, now_ms)
                } else {
                    self.phase = Phase::Applying { next_input, flush_rollups };
                    Step::Apply
                }
            }
            (Phase::FlushingRollups { next_input }, Event::Published) => {
                self.publish_backoff_ms = self.settings.publish_backoff_ms;
                self.held = None;
                if self.lost {
                    return self.release();
                }
                self.phase = Phase::Committing { next_input };
                Step::CommitInput { next_input }
            }
            (Phase::FlushingRollups { next_input }, Event::PublishFailed(_)) => {
                // Let go now: the next owner replays the held batches.
                if self.revoking {
                    return self.release();
                }
                self.phase = Phase::FlushBackingOff { next_input };
                Step::Wait { until_ms: now_ms + self.back_off() }
            }
            (Phase::FlushBackingOff { next_input }, Event::Waited) => self.flush_held(next_input),
            (Phase::Publishing { next_input, .. }, Event::PublishFailed(_)) => {
                if self.lost {
                    return self.release();
                }
                self.phase = Phase::BackingOff { next_input };
                Step::Wait { until_ms: now_ms + self.back_off() }
            }
            (Phase::BackingOff { next_input }, Event::Waited) => {
                if self.lost {
                    return self.release();
                }
                // Whatever of the batch reached the output is read back, so
                // the retry sees those records as replays, not new events.
                self.start_repair(RepairFor::Retry { next_input }, false, now_ms)
            }
            (Phase::Applying { next_input, flush_rollups }, Event::Applied) => {
                self.batch_done(next_input, flush_rollups, now_ms)
            }
            (Phase::Committing { next_input }, Event::CommitSent) => {
                self.uncommitted = Some((next_input, now_ms));
                self.next_batch()
            }
            (phase, event) => {
                // A driver bug: say so loudly in tests, carry on safely
                // (finish nothing new) in production.
                debug_assert!(false, "event {event:?} in phase {phase:?}");
                self.release()
            }
        }
    }

    /// The wait before a failed publish is tried again; doubles each time.
    fn back_off(&mut self) -> i64 {
        let wait = self.publish_backoff_ms;
        self.publish_backoff_ms = (wait * 2).min(self.settings.publish_backoff_max_ms);
        wait
    }

    fn publish(&mut self, next_input: i64, applied: bool, offsets_in_transaction: bool, now_ms: i64) -> Step {
        let flush_rollups = self.flushes_rollups(now_ms);
        self.phase = Phase::Publishing { next_input, applied, flush_rollups };
        Step::Publish { next_input, offsets_in_transaction, flush_rollups }
    }

    fn offsets_in_transaction(&self) -> bool {
        self.settings.delivery == DeliveryMode::ExactlyOnce && !self.mutated(Mutation::OffsetsOutsideTransaction)
    }

    fn classified(&mut self, next_input: i64, now_ms: i64) -> Step {
        // Lost before anything of the batch is in flight: abandon it.
        if self.lost {
            return self.release();
        }
        let commit_first = match self.settings.delivery {
            DeliveryMode::ExactlyOnce => self.mutated(Mutation::OffsetsOutsideTransaction),
            DeliveryMode::AtLeastOnce => self.mutated(Mutation::CommitBeforeAcknowledged),
        };
        if commit_first {
            self.phase = Phase::BeforePublish { next_input };
            return Step::CommitInput { next_input };
        }
        if self.mutated(Mutation::ApplyBeforePublish) {
            self.phase = Phase::BeforePublish { next_input };
            return Step::Apply;
        }
        let offsets_in_transaction = self.offsets_in_transaction();
        self.publish(next_input, false, offsets_in_transaction, now_ms)
    }

    /// The batch is published and applied (its rollups with it when
    /// `flushed_rollups`).
    fn batch_done(&mut self, next_input: i64, flushed_rollups: bool, now_ms: i64) -> Step {
        self.batches += 1;
        // Lost while the batch was in flight: it is published and applied,
        // and nothing more is sent (its input offsets are the next owner's
        // to commit; its replays find the batch in the output).
        if self.lost {
            return self.release();
        }
        let at_least_once = self.settings.delivery == DeliveryMode::AtLeastOnce;
        if flushed_rollups {
            self.held = None;
        } else if !(at_least_once && self.mutated(Mutation::CommitBeforeAcknowledged)) {
            let since_ms = self.held.map_or(now_ms, |h| h.since_ms);
            self.held = Some(Held { next_input, since_ms });
        }
        // At least once, the input offsets commit only once the batch's
        // rollups are out too (exactly once, they went in its transaction).
        let commit = at_least_once
            && !self.mutated(Mutation::CommitBeforeAcknowledged)
            && (flushed_rollups || self.mutated(Mutation::CommitWithRollupsHeld));
        if commit {
            self.phase = Phase::Committing { next_input };
            return Step::CommitInput { next_input };
        }
        self.next_batch()
    }

    fn next_batch(&mut self) -> Step {
        if self.revoking {
            return self.wind_up();
        }
        self.phase = Phase::Collecting;
        Step::Collect
    }

    fn idle(&mut self, committed: Option<i64>, now_ms: i64) -> Step {
        // Held rollups wait for more batches only while batches come: a
        // partition with no input publishes them at once, so the rollups
        // topic does not trail a quiet output by the interval.
        if let Some(h) = self.held {
            return self.flush_held(h.next_input);
        }
        if let Some((next, sent_ms)) = self.uncommitted {
            if committed >= Some(next) {
                self.uncommitted = None;
            } else if now_ms - sent_ms >= self.settings.commit_retry_ms {
                // Commits are idempotent: send it again.
                self.uncommitted = Some((next, now_ms));
                return Step::CommitInput { next_input: next };
            }
        }
        Step::Collect
    }

    fn repaired(&mut self, purpose: RepairFor) -> Step {
        match purpose {
            RepairFor::Assignment => self.next_batch(),
            RepairFor::Retry { next_input } => {
                if self.lost {
                    return self.release();
                }
                self.phase = Phase::Classifying { next_input };
                Step::Classify
            }
        }
    }

    fn on_repair(&mut self, mut r: Repair, event: Event, now_ms: i64) -> Step {
        let s = self.settings;
        let step = match (r.stage, event) {
            (_, Event::RepairFailed { detail }) => {
                r.attempts += 1;
                if r.attempts >= s.repair_attempts {
                    return self.stop(LifeError::RepairFailed { attempts: r.attempts, detail });
                }
                r.stage = RepairStage::BackingOff;
                let wait = s.repair_backoff_ms.saturating_mul(1 << (r.attempts - 1).min(16));
                Step::Wait { until_ms: now_ms + wait }
            }
            (RepairStage::BackingOff, Event::Waited) => {
                r.stage = RepairStage::Loading { assign: false };
                Step::Load { assign: false }
            }
            (RepairStage::Loading { .. }, Event::Loaded { checkpoint, furthest }) => {
                if r.purpose == RepairFor::Assignment && self.mutated(Mutation::SkipRepairOnAssign) {
                    return self.repaired(r.purpose);
                }
                r.stage = RepairStage::ProbingEnd { checkpoint, furthest };
                Step::ProbeOutputEnd
            }
            (RepairStage::ProbingEnd { checkpoint, furthest }, Event::OutputEnd { high_watermark }) => {
                // The furthest tier decides: a tier without a checkpoint must
                // not hide a recreated output topic.
                if let Some(c) = furthest.filter(|&c| c >= high_watermark) {
                    return self.stop(LifeError::StateAheadOfOutput { checkpoint: c, end: high_watermark });
                }
                r.stage = RepairStage::ProbingStable {
                    checkpoint,
                    high_watermark,
                    settle_deadline_ms: now_ms.saturating_add(s.settle_timeout_ms),
                };
                Step::ProbeStableEnd
            }
            (
                RepairStage::ProbingStable { checkpoint, high_watermark, settle_deadline_ms },
                Event::StableEnd { log_start, last_stable },
            ) => {
                // Every transaction that wrote below the high watermark seen
                // at the start must have ended before repair can end: one
                // still open (a dead owner's) may yet commit.
                if last_stable < high_watermark && !self.mutated(Mutation::RepairEndsAtHighWatermark) {
                    if now_ms >= settle_deadline_ms {
                        let waited_ms = now_ms - (settle_deadline_ms - s.settle_timeout_ms);
                        return self.stop(LifeError::OpenTransactionNeverEnded {
                            waited_ms,
                            last_stable,
                            high_watermark,
                        });
                    }
                    self.phase = Phase::Repairing(r);
                    return Step::Wait { until_ms: now_ms + s.settle_poll_ms };
                }
                let end = last_stable;
                match checkpoint {
                    Some(c) => match start_after_checkpoint(c, log_start, s.on_output_gap) {
                        Ok((from, gap)) => {
                            r.stage = RepairStage::Reading { end };
                            Step::ReadOutput { from, end, gap }
                        }
                        Err(e) => return self.stop(e),
                    },
                    None => {
                        r.stage = RepairStage::FindingStart { end };
                        Step::FindHorizonStart { log_start, end }
                    }
                }
            }
            (RepairStage::ProbingStable { .. }, Event::Waited) => Step::ProbeStableEnd,
            (RepairStage::FindingStart { end }, Event::HorizonStart { offset }) => {
                r.stage = RepairStage::Reading { end };
                Step::ReadOutput { from: offset.min(end), end, gap: 0 }
            }
            (RepairStage::Reading { end }, Event::OutputRead { next }) if next >= end => {
                return self.repaired(r.purpose);
            }
            (RepairStage::Reading { end }, Event::OutputRead { next }) => {
                // The driver stopped short (a partial read): read the rest.
                Step::ReadOutput { from: next, end, gap: 0 }
            }
            (stage, event) => {
                debug_assert!(false, "repair event {event:?} in stage {stage:?}");
                return self.release();
            }
        };
        self.phase = Phase::Repairing(r);
        step
    }
}

/// Where repair of a partition with checkpoint `c` starts, given the
/// output's log start `low`, and how many unapplied records retention
/// deleted: right after the checkpoint, unless retention deleted output
/// local state never applied. Retries of those events can no longer be
/// recognised, so that gap stops the worker unless the operator chose to
/// continue; then repair starts at the log start and the gap is counted.
pub fn start_after_checkpoint(c: i64, low: i64, on_gap: OnOutputGap) -> Result<(i64, u64), LifeError> {
    let first_missing = c.saturating_add(1);
    if first_missing >= low {
        return Ok((first_missing, 0));
    }
    let missing = low - first_missing;
    match on_gap {
        OnOutputGap::Stop => Err(LifeError::OutputGap { checkpoint: c, first_missing, log_start: low, missing }),
        OnOutputGap::Continue => Ok((low, u64::try_from(missing).unwrap_or(0))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(delivery: DeliveryMode) -> LifeSettings {
        LifeSettings::new(3, delivery)
    }

    /// Drives a life through a clean repair of output 0..`end` from
    /// checkpoint `checkpoint`; returns the life at its first Collect.
    fn repaired(delivery: DeliveryMode, checkpoint: Option<i64>, end: i64) -> PartitionLife {
        repaired_with(settings(delivery), checkpoint, end)
    }

    fn repaired_with(settings: LifeSettings, checkpoint: Option<i64>, end: i64) -> PartitionLife {
        let (mut life, step) = PartitionLife::assigned(settings, 0);
        assert_eq!(step, Step::Load { assign: true });
        assert_eq!(life.on(Event::Loaded { checkpoint, furthest: checkpoint }, 1), Step::ProbeOutputEnd);
        assert_eq!(life.on(Event::OutputEnd { high_watermark: end }, 2), Step::ProbeStableEnd);
        let step = life.on(Event::StableEnd { log_start: 0, last_stable: end }, 3);
        let from = match checkpoint {
            Some(c) => c + 1,
            None => {
                assert_eq!(step, Step::FindHorizonStart { log_start: 0, end });
                let step = life.on(Event::HorizonStart { offset: 0 }, 4);
                assert_eq!(step, Step::ReadOutput { from: 0, end, gap: 0 });
                0
            }
        };
        if checkpoint.is_some() {
            assert_eq!(step, Step::ReadOutput { from, end, gap: 0 });
        }
        assert_eq!(life.on(Event::OutputRead { next: end }, 5), Step::Collect);
        life
    }

    #[test]
    fn exactly_once_publishes_offsets_in_the_transaction_then_applies() {
        let mut life = repaired(DeliveryMode::ExactlyOnce, Some(9), 10);
        assert_eq!(life.on(Event::Collected { next_input: 100 }, 10), Step::Classify);
        assert_eq!(
            life.on(Event::Classified, 11),
            Step::Publish { next_input: 100, offsets_in_transaction: true, flush_rollups: true }
        );
        assert_eq!(life.on(Event::Published, 12), Step::Apply);
        assert_eq!(life.on(Event::Applied, 13), Step::Collect);
        assert_eq!(life.batches(), 1);
    }

    #[test]
    fn at_least_once_commits_input_only_after_publish_and_apply() {
        let mut life = repaired(DeliveryMode::AtLeastOnce, None, 0);
        life.on(Event::Collected { next_input: 7 }, 10);
        assert_eq!(
            life.on(Event::Classified, 11),
            Step::Publish { next_input: 7, offsets_in_transaction: false, flush_rollups: true }
        );
        assert_eq!(life.on(Event::Published, 12), Step::Apply);
        assert_eq!(life.on(Event::Applied, 13), Step::CommitInput { next_input: 7 });
        assert_eq!(life.on(Event::CommitSent, 14), Step::Collect);
        // Unconfirmed: sent again when idle past the retry interval, until
        // the broker confirms it.
        assert_eq!(life.on(Event::Idle { committed: Some(3) }, 500), Step::Collect);
        assert_eq!(life.on(Event::Idle { committed: Some(3) }, 1_100), Step::CommitInput { next_input: 7 });
        assert_eq!(life.on(Event::CommitSent, 1_101), Step::Collect);
        assert_eq!(life.on(Event::Idle { committed: Some(7) }, 5_000), Step::Collect);
        assert_eq!(life.on(Event::Idle { committed: Some(3) }, 9_000), Step::Collect, "confirmed once is enough");
    }

    /// At least once with rollups held back for 1 s.
    fn holding(delivery: DeliveryMode) -> PartitionLife {
        repaired_with(LifeSettings { hold_rollups_ms: Some(1_000), ..settings(delivery) }, None, 0)
    }

    /// Runs one batch ending at `next_input` through classify, publish and
    /// apply at `now_ms`; returns whether its publish carried the rollups
    /// and the step after the apply.
    fn one_batch(life: &mut PartitionLife, next_input: i64, now_ms: i64) -> (bool, Step) {
        assert_eq!(life.on(Event::Collected { next_input }, now_ms), Step::Classify);
        let Step::Publish { flush_rollups, .. } = life.on(Event::Classified, now_ms) else { panic!("no publish") };
        assert_eq!(life.on(Event::Published, now_ms), Step::Apply);
        (flush_rollups, life.on(Event::Applied, now_ms))
    }

    #[test]
    fn held_rollups_go_out_with_the_first_batch_past_the_interval_and_only_then_commit_input() {
        let mut life = holding(DeliveryMode::AtLeastOnce);
        // Held from the first batch's apply: no commit, straight on.
        assert_eq!(one_batch(&mut life, 10, 100), (false, Step::Collect));
        assert_eq!(one_batch(&mut life, 20, 600), (false, Step::Collect));
        assert_eq!(one_batch(&mut life, 25, 1_050), (false, Step::Collect), "not yet a second old");
        // The oldest held batch is a second old: this batch carries every
        // held rollup, and the input commits through it.
        assert_eq!(one_batch(&mut life, 30, 1_100), (true, Step::CommitInput { next_input: 30 }));
        assert_eq!(life.on(Event::CommitSent, 1_101), Step::Collect);
        // Held again from the next batch on.
        assert_eq!(one_batch(&mut life, 40, 1_200), (false, Step::Collect));
    }

    #[test]
    fn an_idle_partition_publishes_its_held_rollups_alone_at_once_retrying_a_failure() {
        let mut life = holding(DeliveryMode::AtLeastOnce);
        assert_eq!(one_batch(&mut life, 10, 100), (false, Step::Collect));
        // No more input: no reason to wait out the interval.
        assert_eq!(life.on(Event::Idle { committed: None }, 350), Step::PublishRollups);
        let failure = BatchFailure { reason: "timeout", detail: "no answer".into() };
        assert_eq!(life.on(Event::PublishFailed(failure), 1_200), Step::Wait { until_ms: 1_300 });
        assert_eq!(life.on(Event::Waited, 1_300), Step::PublishRollups, "held rollups are never dropped");
        assert_eq!(life.on(Event::Published, 1_350), Step::CommitInput { next_input: 10 });
        assert_eq!(life.on(Event::CommitSent, 1_351), Step::Collect);
        assert_eq!(life.on(Event::Idle { committed: Some(10) }, 9_000), Step::Collect, "nothing held");
    }

    #[test]
    fn a_revoke_publishes_held_rollups_before_release_but_a_lost_partition_leaves_them_to_replays() {
        // Revoked while collecting: the held rollups go out, then the input
        // commits, then the partition is released.
        let mut life = holding(DeliveryMode::AtLeastOnce);
        assert_eq!(one_batch(&mut life, 10, 100), (false, Step::Collect));
        assert_eq!(life.revoke(false), Some(Step::PublishRollups));
        assert_eq!(life.on(Event::Published, 200), Step::CommitInput { next_input: 10 });
        assert_eq!(life.on(Event::CommitSent, 201), Step::Release { commit_first: Some(10) });

        // Revoked mid-batch: the batch in flight carries them.
        let mut life = holding(DeliveryMode::AtLeastOnce);
        assert_eq!(one_batch(&mut life, 10, 100), (false, Step::Collect));
        life.on(Event::Collected { next_input: 20 }, 150);
        assert_eq!(life.revoke(false), None, "a batch in classification finishes");
        let step = life.on(Event::Classified, 160);
        assert_eq!(step, Step::Publish { next_input: 20, offsets_in_transaction: false, flush_rollups: true });

        // A failed publish of held rollups while revoking: released at once,
        // committing only what was committed before them.
        let mut life = holding(DeliveryMode::AtLeastOnce);
        assert_eq!(one_batch(&mut life, 10, 0), (false, Step::Collect));
        assert_eq!(life.revoke(false), Some(Step::PublishRollups));
        let failure = BatchFailure { reason: "timeout", detail: "no answer".into() };
        assert_eq!(life.on(Event::PublishFailed(failure), 100), Step::Release { commit_first: None });

        // Lost: nothing of the held batches commits.
        let mut life = holding(DeliveryMode::AtLeastOnce);
        assert_eq!(one_batch(&mut life, 10, 100), (false, Step::Collect));
        assert_eq!(life.revoke(true), Some(Step::Release { commit_first: None }));
    }

    #[test]
    fn exactly_once_never_holds_rollups_back_they_ride_each_transaction() {
        let mut life = holding(DeliveryMode::ExactlyOnce);
        for (n, now) in [(10, 100), (20, 200), (30, 5_000)] {
            assert_eq!(one_batch(&mut life, n, now), (true, Step::Collect));
        }
        assert_eq!(life.on(Event::Idle { committed: None }, 60_000), Step::Collect);
    }

    #[test]
    fn repair_waits_for_open_transactions_below_the_high_watermark_then_reads_to_the_stable_end() {
        let (mut life, _) = PartitionLife::assigned(settings(DeliveryMode::ExactlyOnce), 0);
        life.on(Event::Loaded { checkpoint: Some(4), furthest: Some(4) }, 0);
        life.on(Event::OutputEnd { high_watermark: 50 }, 0);
        assert_eq!(life.on(Event::StableEnd { log_start: 0, last_stable: 40 }, 10), Step::Wait { until_ms: 210 });
        assert_eq!(life.on(Event::Waited, 210), Step::ProbeStableEnd);
        assert_eq!(
            life.on(Event::StableEnd { log_start: 0, last_stable: 52 }, 220),
            Step::ReadOutput { from: 5, end: 52, gap: 0 }
        );
    }

    #[test]
    fn repair_stops_the_worker_rather_than_end_below_a_transaction_that_never_ends() {
        let (mut life, _) = PartitionLife::assigned(settings(DeliveryMode::ExactlyOnce), 0);
        life.on(Event::Loaded { checkpoint: None, furthest: None }, 0);
        life.on(Event::OutputEnd { high_watermark: 11 }, 0);
        let step = life.on(Event::StableEnd { log_start: 0, last_stable: 10 }, 120_000);
        assert!(matches!(step, Step::Stop(LifeError::OpenTransactionNeverEnded { last_stable: 10, .. })), "{step:?}");
        assert!(life.ended());
    }

    #[test]
    fn state_ahead_of_the_output_and_retention_gaps_stop_the_worker() {
        let (mut life, _) = PartitionLife::assigned(settings(DeliveryMode::ExactlyOnce), 0);
        life.on(Event::Loaded { checkpoint: None, furthest: Some(20) }, 0);
        let step = life.on(Event::OutputEnd { high_watermark: 20 }, 0);
        assert_eq!(step, Step::Stop(LifeError::StateAheadOfOutput { checkpoint: 20, end: 20 }));

        let (mut life, _) = PartitionLife::assigned(settings(DeliveryMode::ExactlyOnce), 0);
        life.on(Event::Loaded { checkpoint: Some(99), furthest: Some(99) }, 0);
        life.on(Event::OutputEnd { high_watermark: 200 }, 0);
        let step = life.on(Event::StableEnd { log_start: 150, last_stable: 200 }, 0);
        assert!(matches!(step, Step::Stop(LifeError::OutputGap { missing: 50, first_missing: 100, .. })), "{step:?}");

        let mut s = settings(DeliveryMode::ExactlyOnce);
        s.on_output_gap = OnOutputGap::Continue;
        let (mut life, _) = PartitionLife::assigned(s, 0);
        life.on(Event::Loaded { checkpoint: Some(99), furthest: Some(99) }, 0);
        life.on(Event::OutputEnd { high_watermark: 200 }, 0);
        let step = life.on(Event::StableEnd { log_start: 150, last_stable: 200 }, 0);
        assert_eq!(step, Step::ReadOutput { from: 150, end: 200, gap: 50 });
    }

    #[test]
    fn a_failed_publish_backs_off_repairs_then_reclassifies_the_same_batch() {
        let mut life = repaired(DeliveryMode::ExactlyOnce, Some(1), 2);
        life.on(Event::Collected { next_input: 30 }, 0);
        life.on(Event::Classified, 0);
        let failure = BatchFailure { reason: "timeout", detail: "x".into() };
        assert_eq!(life.on(Event::PublishFailed(failure.clone()), 1_000), Step::Wait { until_ms: 1_100 });
        assert_eq!(life.on(Event::Waited, 1_100), Step::Load { assign: false });
        life.on(Event::Loaded { checkpoint: Some(1), furthest: Some(1) }, 1_100);
        life.on(Event::OutputEnd { high_watermark: 5 }, 1_100);
        life.on(Event::StableEnd { log_start: 0, last_stable: 5 }, 1_100);
        assert_eq!(life.on(Event::OutputRead { next: 5 }, 1_200), Step::Classify);
        // The second failure backs off twice as long.
        life.on(Event::Classified, 1_200);
        assert_eq!(life.on(Event::PublishFailed(failure), 2_000), Step::Wait { until_ms: 2_200 });
    }

    #[test]
    fn a_revoke_abandons_repair_and_unpublished_batches_but_finishes_a_batch_in_flight() {
        let (mut life, _) = PartitionLife::assigned(settings(DeliveryMode::ExactlyOnce), 0);
        life.on(Event::Loaded { checkpoint: None, furthest: None }, 0);
        assert_eq!(life.revoke(false), Some(Step::Release { commit_first: None }), "repair is abandoned");

        let mut life = repaired(DeliveryMode::ExactlyOnce, None, 0);
        assert_eq!(life.revoke(false), Some(Step::Release { commit_first: None }), "collecting is abandoned");

        let mut life = repaired(DeliveryMode::AtLeastOnce, None, 0);
        life.on(Event::Collected { next_input: 5 }, 0);
        life.on(Event::Classified, 0);
        assert_eq!(life.revoke(false), None, "a batch in flight is finished");
        assert_eq!(life.on(Event::Published, 0), Step::Apply);
        assert_eq!(life.on(Event::Applied, 0), Step::CommitInput { next_input: 5 });
        assert_eq!(life.on(Event::CommitSent, 0), Step::Release { commit_first: Some(5) });
    }

    #[test]
    fn a_lost_assignment_abandons_the_batch_where_nothing_is_in_flight() {
        let mut life = repaired(DeliveryMode::AtLeastOnce, None, 0);
        life.on(Event::Collected { next_input: 5 }, 0);
        assert_eq!(life.revoke(true), None, "classification is not interrupted");
        assert_eq!(life.on(Event::Classified, 0), Step::Release { commit_first: None }, "never published");

        let mut life = repaired(DeliveryMode::AtLeastOnce, None, 0);
        life.on(Event::Collected { next_input: 5 }, 0);
        life.on(Event::Classified, 0);
        let failure = BatchFailure { reason: "timeout", detail: "x".into() };
        life.on(Event::PublishFailed(failure), 0);
        assert_eq!(life.revoke(true), Some(Step::Release { commit_first: None }), "no retry of a lost batch");
    }

    /// A partition lost while its batch is published finishes the batch
    /// (it may have reached the output) and then sends nothing more: no
    /// input commit, which is the next owner's to make.
    #[test]
    fn a_partition_lost_while_its_batch_is_published_commits_nothing_more() {
        for delivery in [DeliveryMode::AtLeastOnce, DeliveryMode::ExactlyOnce] {
            let mut life = repaired(delivery, None, 0);
            life.on(Event::Collected { next_input: 5 }, 0);
            assert!(matches!(life.on(Event::Classified, 0), Step::Publish { .. }));
            assert_eq!(life.revoke(true), None, "a publish in flight is not interrupted");
            let mut step = life.on(Event::Published, 0);
            if step == Step::Apply {
                step = life.on(Event::Applied, 0);
            }
            assert_eq!(step, Step::Release { commit_first: None }, "{delivery:?}");
        }
        // Lost while an idle partition's held rollups are published: the
        // flush finishes, and commits nothing either.
        let mut life = holding(DeliveryMode::AtLeastOnce);
        assert_eq!(one_batch(&mut life, 10, 100), (false, Step::Collect));
        assert_eq!(life.on(Event::Idle { committed: None }, 350), Step::PublishRollups);
        assert_eq!(life.revoke(true), None, "a publish in flight is not interrupted");
        assert_eq!(life.on(Event::Published, 400), Step::Release { commit_first: None });
    }

    #[test]
    fn repair_broker_errors_back_off_and_give_up_after_the_attempts() {
        let (mut life, _) = PartitionLife::assigned(settings(DeliveryMode::ExactlyOnce), 0);
        let fail = || Event::RepairFailed { detail: "broker down".into() };
        assert_eq!(life.on(fail(), 0), Step::Wait { until_ms: 500 });
        assert_eq!(life.on(Event::Waited, 500), Step::Load { assign: false });
        assert_eq!(life.on(fail(), 500), Step::Wait { until_ms: 1_500 });
        life.on(Event::Waited, 1_500);
        life.on(fail(), 1_500);
        life.on(Event::Waited, 3_500);
        life.on(fail(), 3_500);
        life.on(Event::Waited, 7_500);
        let step = life.on(fail(), 7_500);
        assert!(matches!(step, Step::Stop(LifeError::RepairFailed { attempts: 5, .. })), "{step:?}");
    }

    #[test]
    fn retention_gap_arithmetic() {
        assert_eq!(start_after_checkpoint(99, 150, OnOutputGap::Continue), Ok((150, 50)));
        assert_eq!(start_after_checkpoint(149, 150, OnOutputGap::Stop), Ok((150, 0)));
        assert_eq!(start_after_checkpoint(7, 0, OnOutputGap::Stop), Ok((8, 0)));
        assert!(start_after_checkpoint(99, 150, OnOutputGap::Stop).is_err());
    }
}
