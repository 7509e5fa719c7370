//! Warm standbys (`--standby-replicas N`, issue #13): this worker follows
//! the output partitions of other owners and applies them to its own local
//! state, so that when the group moves one of those partitions here, its
//! repair starts from a checkpoint seconds old instead of reading the whole
//! horizon (hours of output at production volume).
//!
//! Which partitions to follow is [`crate::pipeline::standby`]'s pure rule
//! over the consumer group's description (Kafka's `DescribeGroups`, read
//! every [`STANDBY_REFRESH`] on a client of its own). When the brokers cannot
//! describe the group (librdkafka's mock cluster; Tansu 0.6, whose sqlite
//! engine fails to decode its own group record and whose memory engine does
//! not list groups), the worker follows every partition it does not own:
//! never fewer standbys than asked for, at the price of more reads.
//!
//! Ownership stays with the group. A follower never publishes and never
//! commits offsets; it reads `read_committed`, like repair, so an aborted
//! transaction never reaches its state. The order that keeps billing exact:
//! - an assignment stops the partition's follower (after its last apply)
//!   before the partition's task starts, and no follower of it starts while
//!   it is owned; the task's repair then reads from the follower's
//!   checkpoint, waiting for open transactions as any repair does;
//! - a follower that finds its partition's state went back under it (the
//!   previous owner's task released it as it ended) stops, and starts again
//!   from what state holds, so its checkpoint never passes records it did
//!   not apply;
//! - a follower that finds retention deleted output its state never applied
//!   does not skip the gap: it waits, and leaves the judgement
//!   (`--on-output-gap`) to the repair of whoever owns the partition next.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::{KafkaError as RdError, RDKafkaErrorCode};
use rdkafka::message::Message;
use rdkafka::{Offset, TopicPartitionList};
use tokio::sync::watch;

use crate::event::Position;
use crate::kafka::engine::{write_engine, StoredEvent};
use crate::kafka::error::KafkaError;
use crate::kafka::records::parse_output;
use crate::kafka::repair::APPLY_CHUNK;
use crate::kafka::worker::{member_id, InputConsumer, Shared};
use crate::metrics::StandbyProgressed;
use crate::pipeline::standby::{assigned_partitions, standby_partitions, GroupMember};

/// How often the group is described again and the followers reconciled.
pub(crate) const STANDBY_REFRESH: Duration = Duration::from_secs(5);

/// After the brokers could not describe the group, how long until asking
/// again. Several attempts fit in [`DESCRIPTION_GRACE`], so one failure
/// after a good description changes nothing.
const DESCRIBE_BACKOFF: Duration = Duration::from_secs(15);

/// After a good description, how long a failed one leaves the followers as
/// they are (rather than switching to following every unowned partition).
const DESCRIPTION_GRACE: Duration = Duration::from_secs(60);

/// Longest a follower holds records it has read before applying them.
const APPLY_EVERY: Duration = Duration::from_millis(500);

/// Waits before a follower that ended with an error starts again: doubling
/// from the first to the last, back to the first after a long healthy run.
const RESTART_BACKOFF: (Duration, Duration) = (Duration::from_secs(10), Duration::from_secs(300));
const HEALTHY_RUN: Duration = Duration::from_secs(300);

/// Time allowed for each broker call of a follower's start, between which
/// it checks whether it was told to stop.
const START_STEP_TIMEOUT: Duration = Duration::from_secs(5);

/// One partition being followed, on a thread of its own (reads block).
struct Follower {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<(), KafkaError>>,
    started: Instant,
}

impl Follower {
    fn start(shared: Arc<Shared>, partition: i32) -> Result<Follower, KafkaError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("standby-{partition}"))
            .spawn(move || follow(&shared, partition, &flag))
            .map_err(|e| KafkaError::Task { detail: format!("starting the standby of partition {partition}: {e}") })?;
        Ok(Follower { stop, thread, started: Instant::now() })
    }

    /// Tells it to stop after its next apply (see [`Follower::join`]).
    fn tell_stop(&self) {
        self.stop.store(true, Ordering::SeqCst);
    }

    /// Stops it after its last apply and says how it ended.
    fn finish(self, partition: i32) -> Result<(), KafkaError> {
        self.tell_stop();
        self.thread.join().unwrap_or_else(|_| {
            Err(KafkaError::Task { detail: format!("the standby follower of partition {partition} panicked") })
        })
    }
}

/// The followers and when each partition whose follower failed may be
/// followed again.
#[derive(Default)]
struct Followers {
    running: HashMap<i32, Follower>,
    /// Partition → (not before, the wait after its next failure).
    backoff: HashMap<i32, (Instant, Duration)>,
}

/// The followers of one worker. Lock order: the followers, then the
/// worker's partition tasks (an assignment holds the followers while it
/// starts a task, so no follower of that partition can start in between).
#[derive(Default)]
pub(crate) struct Standbys {
    followers: Mutex<Followers>,
    /// Records the followers applied since the last report.
    applied: AtomicU64,
}

impl std::fmt::Debug for Standbys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standbys").finish_non_exhaustive()
    }
}

/// The followers, locked: see [`Standbys`] for the order.
pub(crate) struct Following<'a>(MutexGuard<'a, Followers>);

impl Following<'_> {
    /// This worker was given `partitions`: their followers, if any, stop
    /// after their last apply (all told first, then each joined), leaving
    /// local state warm for the partitions' repair.
    pub(crate) fn hand_over(&mut self, shared: &Shared, partitions: &[i32]) {
        let stopping: Vec<(i32, Follower)> =
            partitions.iter().filter_map(|p| self.0.running.remove(p).map(|f| (*p, f))).collect();
        for p in partitions {
            self.0.backoff.remove(p);
        }
        finish_all(shared, stopping, |p| {
            tracing::info!(partition = p, "standby handed its partition over to this worker's task");
        });
    }
}

/// Tells every one of `followers` to stop, then joins each. A local-state
/// error fails the worker (as for owned partitions: state that cannot apply
/// cannot be trusted by anyone in this process); others are logged, and
/// what a follower applied stays. Returns the partitions that failed, with
/// how long each had run.
fn finish_all(shared: &Shared, followers: Vec<(i32, Follower)>, ended_well: impl Fn(i32)) -> Vec<(i32, Duration)> {
    for (_, f) in &followers {
        f.tell_stop();
    }
    let mut failed = Vec::new();
    for (p, f) in followers {
        let ran = f.started.elapsed();
        match f.finish(p) {
            Ok(()) => ended_well(p),
            Err(KafkaError::Engine(e)) => shared.fail(KafkaError::Engine(e)),
            Err(e) => {
                tracing::warn!(partition = p, error = %e, "standby follower stopped");
                failed.push((p, ran));
            }
        }
    }
    failed
}

impl Standbys {
    pub(crate) fn lock(&self) -> Following<'_> {
        Following(self.followers.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Follows exactly `wanted` (less what `owned` says this worker owns):
    /// stops the followers of partitions no longer wanted, releasing their
    /// memory, restarts followers that ended (after a back-off when they
    /// failed), starts new ones. Blocking (joins threads). Returns how many
    /// partitions are followed.
    fn reconcile(&self, shared: &Arc<Shared>, wanted: &BTreeSet<i32>, owned: &dyn Fn(i32) -> bool) -> usize {
        let mut following = self.lock();
        let f = &mut following.0;
        let ended: Vec<(i32, Follower)> =
            f.running.extract_if(|p, follower| !wanted.contains(p) || follower.thread.is_finished()).collect();
        let stopped: Vec<i32> = ended.iter().map(|(p, _)| *p).collect();
        for (p, ran) in finish_all(shared, ended, |_| {}) {
            let (_, mut wait) = f.backoff.get(&p).copied().unwrap_or((Instant::now(), RESTART_BACKOFF.0));
            if ran >= HEALTHY_RUN {
                wait = RESTART_BACKOFF.0;
            }
            tracing::info!(partition = p, retry_in = ?wait, "standby follower starts again after a back-off");
            f.backoff.insert(p, (Instant::now() + wait, (wait * 2).min(RESTART_BACKOFF.1)));
        }
        // Released: partitions no longer wanted whose follower just stopped
        // or had failed earlier (and waits out its back-off). Memory goes;
        // durable state stays for when they come back.
        let waiting: Vec<i32> = f.backoff.keys().copied().collect();
        for p in stopped.into_iter().chain(waiting) {
            if wanted.contains(&p) || owned(p) || f.running.contains_key(&p) {
                continue;
            }
            f.backoff.remove(&p);
            write_engine(&shared.engine).revoke(p);
            tracing::info!(partition = p, "no longer a standby of this partition");
        }
        let starting: Vec<i32> = wanted
            .iter()
            .copied()
            .filter(|&p| !owned(p) && !f.running.contains_key(&p))
            .filter(|p| f.backoff.get(p).is_none_or(|(not_before, _)| Instant::now() >= *not_before))
            .collect();
        // Their hot caches from one pass over the stored keys; a failure
        // comes back to each follower's own load.
        if let Err(e) = write_engine(&shared.engine).assign_all(&starting, shared.clock.now_ms()) {
            tracing::warn!(error = %e, "loading the followed partitions' state together failed");
        }
        for p in starting {
            match Follower::start(shared.clone(), p) {
                Ok(follower) => {
                    tracing::info!(partition = p, "following this partition's output as a standby");
                    f.running.insert(p, follower);
                }
                Err(e) => tracing::warn!(partition = p, error = %e, "cannot start a standby follower"),
            }
        }
        f.running.len()
    }

    /// Stops every follower (shutdown), after its last apply.
    pub(crate) fn stop_all(&self, shared: &Shared) {
        let mut following = self.lock();
        let all: Vec<(i32, Follower)> = following.0.running.drain().collect();
        finish_all(shared, all, |_| {});
    }
}

/// What the group's description says, as this worker last read it.
struct Membership {
    describer: Option<BaseConsumer>,
    /// When the group was last described with this worker in it.
    last_good: Option<Instant>,
    /// No description before this instant (after a failure).
    next_attempt: Instant,
    /// Whether the last attempt failed, to log the change once.
    failing: bool,
}

impl Membership {
    /// The group's members, or `None` when the brokers cannot say now.
    fn describe(&mut self, shared: &Shared) -> Option<Vec<GroupMember>> {
        if Instant::now() < self.next_attempt {
            return None;
        }
        let settings = &shared.settings;
        let result = match &self.describer {
            Some(d) => d.fetch_group_list(Some(&settings.group), settings.operation_timeout),
            None => match crate::kafka::clients::watermark_probe_config(settings).create::<BaseConsumer>() {
                Ok(d) => {
                    let r = d.fetch_group_list(Some(&settings.group), settings.operation_timeout);
                    self.describer = Some(d);
                    r
                }
                Err(e) => Err(e),
            },
        };
        let members = match result {
            Ok(list) => list.groups().iter().find(|g| g.name() == settings.group).map(|g| {
                g.members()
                    .iter()
                    .map(|m| GroupMember {
                        id: m.id().to_owned(),
                        owns: m.assignment().and_then(|b| assigned_partitions(b, &settings.topics.input)),
                    })
                    .collect::<Vec<_>>()
            }),
            Err(e) => {
                tracing::debug!(error = %e, "describing the consumer group failed");
                None
            }
        };
        let members = members.filter(|m| !m.is_empty());
        if members.is_none() {
            self.next_attempt = Instant::now() + DESCRIBE_BACKOFF;
            // The brokers' connection may be what failed: a fresh client next time.
            self.describer = None;
        }
        if members.is_none() != self.failing {
            self.failing = members.is_none();
            if self.failing {
                tracing::warn!(
                    group = %settings.group,
                    "the brokers cannot describe the consumer group: standbys follow every partition this worker \
                     does not own until they can"
                );
            } else {
                tracing::info!(group = %settings.group, "consumer group described: standbys follow their share");
            }
        }
        members
    }
}

/// The partitions this worker should follow now, or `None` to leave the
/// followers as they are: while this worker is not a group member (between
/// sessions), while the description does not list it yet (just joined),
/// and for [`DESCRIPTION_GRACE`] after a good description when the next
/// ones fail. Past that, a group the brokers cannot describe means
/// following every partition this worker does not own.
fn wanted(
    shared: &Shared,
    consumer: &InputConsumer,
    membership: &mut Membership,
    owned: &BTreeSet<i32>,
) -> Option<BTreeSet<i32>> {
    let me = member_id(consumer)?;
    let partitions = u32::try_from(shared.layout.partitions).unwrap_or(u32::MAX);
    let replicas = shared.settings.standby_replicas;
    match membership.describe(shared) {
        Some(members) if members.iter().any(|m| m.id == me) => {
            membership.last_good = Some(Instant::now());
            Some(standby_partitions(&members, &me, partitions, replicas, owned))
        }
        Some(_) => None,
        None if membership.last_good.is_some_and(|t| t.elapsed() < DESCRIPTION_GRACE) => None,
        None => Some((0..i32::try_from(partitions).unwrap_or(i32::MAX)).filter(|p| !owned.contains(p)).collect()),
    }
}

/// Runs the standbys until `stop` flips: describes the group, reconciles
/// the followers, reports. Stops every follower before it returns.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    consumer: Weak<InputConsumer>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let membership = Arc::new(Mutex::new(Membership {
            describer: None,
            last_good: None,
            next_attempt: Instant::now(),
            failing: false,
        }));
        loop {
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => break,
                _ = tokio::time::sleep(STANDBY_REFRESH) => {}
            }
            let Some(c) = consumer.upgrade() else { break };
            let (s, m) = (shared.clone(), membership.clone());
            let reconciled = tokio::task::spawn_blocking(move || {
                let owned_now = || -> BTreeSet<i32> { c.context().owned_partitions() };
                let mut membership = m.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                let wanted = wanted(&s, &c, &mut membership, &owned_now())?;
                let owned = |p: i32| c.context().owns(p);
                Some(s.standbys.reconcile(&s, &wanted, &owned))
            })
            .await;
            if let Ok(Some(following)) = reconciled {
                let applied = shared.standbys.applied.swap(0, Ordering::Relaxed);
                StandbyProgressed { following, applied }.emit(&shared.metrics);
            }
        }
        let s = shared.clone();
        let _ = tokio::task::spawn_blocking(move || s.standbys.stop_all(&s)).await;
        let applied = shared.standbys.applied.swap(0, Ordering::Relaxed);
        StandbyProgressed { following: 0, applied }.emit(&shared.metrics);
    })
}

/// Where a follower of an output partition starts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum FollowStart {
    /// Read from this offset on.
    From(i64),
    /// Retention deleted output from `from` on that state never applied.
    Gap { from: i64 },
    /// State holds an offset the output does not (`furthest` at or past
    /// its end): the topic was recreated or truncated. Reading on from the
    /// checkpoint would skip the new log's first records for good, and a
    /// promotion's repair would find state level with the output.
    Ahead { furthest: i64 },
}

/// Where to follow from: after the lowest tier's `checkpoint` (or the
/// horizon's first offset, `first_in_horizon`, with none), unless state is
/// ahead of the output's `end` by its furthest tier or retention passed
/// the start (`log_start`).
fn follow_start(
    checkpoint: Option<i64>,
    furthest: Option<i64>,
    log_start: i64,
    end: i64,
    first_in_horizon: impl FnOnce() -> i64,
) -> FollowStart {
    if let Some(furthest) = furthest.filter(|f| *f >= end) {
        return FollowStart::Ahead { furthest };
    }
    let from = checkpoint.map_or_else(first_in_horizon, |c| c + 1);
    if from < log_start {
        FollowStart::Gap { from }
    } else {
        FollowStart::From(from)
    }
}

/// Follows output `partition` into local state until `stop` flips.
fn follow(shared: &Shared, partition: i32, stop: &AtomicBool) -> Result<(), KafkaError> {
    let r = &shared.repairer;
    let (checkpoint, furthest) = {
        let mut engine = write_engine(&r.engine);
        engine.assign(partition, r.clock.now_ms())?;
        (engine.checkpoint(partition), engine.furthest_checkpoint(partition))
    };
    let mut config = r.config.clone();
    // A follower sits at the head: no busy fetching while nothing arrives,
    // a small fetch queue (it is one of many clients), and a position
    // retention passed is an error, never a silent jump.
    config.set("fetch.wait.max.ms", "500").set("queued.max.messages.kbytes", "8192").set("auto.offset.reset", "error");
    let consumer: BaseConsumer = config.create().map_err(KafkaError::client("creating a standby follower"))?;
    let (log_start, end) = loop {
        if stop.load(Ordering::SeqCst) {
            return Ok(());
        }
        match consumer.fetch_watermarks(&r.output_topic, partition, START_STEP_TIMEOUT) {
            Ok(ends) => break ends,
            Err(e) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::OperationTimedOut) => continue,
            Err(e) => {
                return Err(KafkaError::Client { operation: "reading the output's ends for a standby", source: e })
            }
        }
    };
    if stop.load(Ordering::SeqCst) {
        return Ok(());
    }
    let start = follow_start(checkpoint, furthest, log_start, end, || {
        r.first_offset_within_horizon(&consumer, partition, log_start, end, START_STEP_TIMEOUT)
    });
    let from = match start {
        FollowStart::From(from) => Some(from),
        FollowStart::Gap { from } => {
            tracing::warn!(
                partition,
                from,
                log_start,
                "retention deleted output this standby never applied; not following it (the next owner's repair \
                 decides, as --on-output-gap says)"
            );
            None
        }
        FollowStart::Ahead { furthest } => {
            tracing::error!(
                partition,
                furthest,
                end,
                "local state holds output offsets this output partition does not (the topic was recreated or \
                 truncated, or the state came from elsewhere); not following it (the next owner's repair refuses \
                 it)"
            );
            None
        }
    };
    let Some(from) = from else {
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(200));
        }
        return Ok(());
    };
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(&r.output_topic, partition, Offset::Offset(from))
        .map_err(KafkaError::client("assigning an output partition to a standby"))?;
    consumer.assign(&tpl).map_err(KafkaError::client("assigning an output partition to a standby"))?;

    let mut chunk: Vec<StoredEvent> = Vec::new();
    let mut applied_to = checkpoint;
    let mut last_apply = Instant::now();
    loop {
        if stop.load(Ordering::SeqCst) {
            return apply(shared, partition, &mut chunk, &mut applied_to);
        }
        let caught_up = match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(m)) => {
                let stored = parse_output(&r.validator, Position::new(partition, m.offset()), m.headers(), m.payload())
                    .map_err(|detail| KafkaError::ForeignOutputRecord {
                        topic: r.output_topic.clone(),
                        partition,
                        offset: m.offset(),
                        detail,
                    })?;
                chunk.push(stored);
                false
            }
            Some(Err(RdError::PartitionEOF(_))) | None => true,
            // The position is outside the partition (retention passed it, or
            // the topic was recreated): start again, where the start decides.
            Some(Err(e)) if crate::kafka::clients::position_gone(&e) => {
                return Err(KafkaError::Client { operation: "following an output partition", source: e });
            }
            Some(Err(e)) => {
                // Transient broker errors are retried by librdkafka.
                tracing::debug!(partition, error = %e, "standby follower consumer error");
                true
            }
        };
        if chunk.len() >= APPLY_CHUNK || (!chunk.is_empty() && (caught_up || last_apply.elapsed() >= APPLY_EVERY)) {
            apply(shared, partition, &mut chunk, &mut applied_to)?;
            last_apply = Instant::now();
        }
    }
}

/// Applies what a follower read, under the engine lock, after checking
/// local state still holds everything the follower applied before.
fn apply(
    shared: &Shared,
    partition: i32,
    chunk: &mut Vec<StoredEvent>,
    applied_to: &mut Option<i64>,
) -> Result<(), KafkaError> {
    if chunk.is_empty() {
        return Ok(());
    }
    let now = shared.clock.now_ms();
    let mut engine = write_engine(&shared.engine);
    // The previous owner's task, ending, may have released the partition.
    engine.assign(partition, now)?;
    let checkpoint = engine.checkpoint(partition);
    if checkpoint != *applied_to {
        // Only this follower applies a partition this worker does not own:
        // state that moved under it (back, when a previous owner's task
        // released it; anywhere else, a bug) is state this follower's
        // position no longer continues. Its reading starts again from it.
        return Err(KafkaError::Task {
            detail: format!(
                "local state of partition {partition} moved from offset {applied_to:?} to {checkpoint:?} under its \
                 standby; following again from what it holds"
            ),
        });
    }
    let fresh = chunk.iter().filter(|e| checkpoint.is_none_or(|c| e.key.output.offset > c)).count();
    engine.apply_published(partition, chunk, now)?;
    *applied_to = engine.checkpoint(partition);
    drop(engine);
    shared.standbys.applied.fetch_add(fresh as u64, Ordering::Relaxed);
    chunk.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A follower reads on after its checkpoint, or from the horizon; it
    /// does not follow across a retention gap, nor when state holds
    /// offsets past the output's end (a recreated topic: reading on from
    /// the old checkpoint skipped the new log's first records for good).
    #[test]
    fn a_follower_starts_after_its_checkpoint_unless_state_is_ahead_or_retention_passed_it() {
        let never = || panic!("no horizon lookup with a checkpoint");
        assert_eq!(follow_start(Some(99), Some(99), 0, 150, never), FollowStart::From(100));
        assert_eq!(follow_start(None, None, 10, 150, || 40), FollowStart::From(40));
        assert_eq!(follow_start(Some(5), Some(5), 10, 150, never), FollowStart::Gap { from: 6 });
        // The topic recreated: 100 records applied, the new log 60 long.
        assert_eq!(follow_start(Some(99), Some(99), 0, 60, never), FollowStart::Ahead { furthest: 99 });
        assert_eq!(follow_start(Some(99), Some(99), 0, 99, never), FollowStart::Ahead { furthest: 99 });
        // One tier ahead is enough.
        assert_eq!(follow_start(Some(40), Some(99), 0, 60, never), FollowStart::Ahead { furthest: 99 });
    }
}
