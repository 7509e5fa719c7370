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
use crate::kafka::engine::StoredEvent;
use crate::kafka::error::KafkaError;
use crate::kafka::records::parse_output;
use crate::kafka::repair::{lock_engine, APPLY_CHUNK};
use crate::kafka::worker::{member_id, InputConsumer, Shared};
use crate::metrics::StandbyProgressed;
use crate::pipeline::standby::{assigned_partitions, standby_partitions, GroupMember};

/// How often the group is described again and the followers reconciled.
pub(crate) const STANDBY_REFRESH: Duration = Duration::from_secs(5);

/// After the brokers could not describe the group, how long until asking
/// again (meanwhile every unowned partition is followed).
const DESCRIBE_BACKOFF: Duration = Duration::from_secs(60);

/// Longest a follower holds records it has read before applying them.
const APPLY_EVERY: Duration = Duration::from_millis(500);

/// One partition being followed, on a thread of its own (reads block).
struct Follower {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<Result<(), KafkaError>>,
}

impl Follower {
    fn start(shared: Arc<Shared>, partition: i32) -> Result<Follower, KafkaError> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("standby-{partition}"))
            .spawn(move || follow(&shared, partition, &flag))
            .map_err(|e| KafkaError::Task { detail: format!("starting the standby of partition {partition}: {e}") })?;
        Ok(Follower { stop, thread })
    }

    /// Stops it after its last apply and says how it ended.
    fn finish(self, partition: i32) -> Result<(), KafkaError> {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().unwrap_or_else(|_| {
            Err(KafkaError::Task { detail: format!("the standby follower of partition {partition} panicked") })
        })
    }
}

/// The followers of one worker. Lock order: the followers, then the
/// worker's partition tasks (an assignment holds the followers while it
/// starts a task, so no follower of that partition can start in between).
#[derive(Default)]
pub(crate) struct Standbys {
    followers: Mutex<HashMap<i32, Follower>>,
    /// Records the followers applied since the last report.
    applied: AtomicU64,
}

impl std::fmt::Debug for Standbys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standbys").finish_non_exhaustive()
    }
}

/// The followers, locked: see [`Standbys`] for the order.
pub(crate) struct Following<'a>(MutexGuard<'a, HashMap<i32, Follower>>);

impl Following<'_> {
    /// This worker was given `partition`: its follower, if any, stops after
    /// its last apply, leaving local state warm for the partition's repair.
    pub(crate) fn hand_over(&mut self, partition: i32) {
        if let Some(f) = self.0.remove(&partition) {
            match f.finish(partition) {
                Ok(()) => tracing::info!(partition, "standby handed its partition over to this worker's task"),
                // Whatever it applied stays; repair reads on from there.
                Err(e) => tracing::warn!(partition, error = %e, "standby ended with an error at handover"),
            }
        }
    }
}

impl Standbys {
    pub(crate) fn lock(&self) -> Following<'_> {
        Following(self.followers.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
    }

    /// Follows exactly `wanted` (less what `owned` says this worker owns):
    /// stops the followers of partitions no longer wanted, releasing their
    /// memory, restarts followers that ended, starts new ones. Blocking
    /// (joins threads). Returns how many partitions are followed.
    fn reconcile(&self, shared: &Arc<Shared>, wanted: &BTreeSet<i32>, owned: &dyn Fn(i32) -> bool) -> usize {
        let mut following = self.lock();
        let map = &mut following.0;
        let ended: Vec<i32> =
            map.iter().filter(|(p, f)| !wanted.contains(*p) || f.thread.is_finished()).map(|(p, _)| *p).collect();
        for p in ended {
            let Some(f) = map.remove(&p) else { continue };
            match f.finish(p) {
                Ok(()) => {}
                // Local state that cannot apply cannot be trusted by anyone
                // in this process: the same rule as for owned partitions.
                Err(KafkaError::Engine(e)) => shared.fail(KafkaError::Engine(e)),
                Err(e) => tracing::warn!(partition = p, error = %e, "standby follower stopped; following again"),
            }
            if !wanted.contains(&p) && !owned(p) {
                // Memory goes; durable state stays for when it comes back.
                lock_engine(&shared.engine).revoke(p);
                tracing::info!(partition = p, "no longer a standby of this partition");
            }
        }
        for &p in wanted {
            if owned(p) || map.contains_key(&p) {
                continue;
            }
            match Follower::start(shared.clone(), p) {
                Ok(f) => {
                    tracing::info!(partition = p, "following this partition's output as a standby");
                    map.insert(p, f);
                }
                Err(e) => tracing::warn!(partition = p, error = %e, "cannot start a standby follower"),
            }
        }
        map.len()
    }

    /// Stops every follower (shutdown), after its last apply.
    fn stop_all(&self) {
        let mut following = self.lock();
        for (p, f) in following.0.drain() {
            if let Err(e) = f.finish(p) {
                tracing::warn!(partition = p, error = %e, "standby follower ended with an error at shutdown");
            }
        }
    }
}

/// What the group's description says, as this worker last read it.
struct Membership {
    describer: Option<BaseConsumer>,
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

/// The partitions this worker should follow now, `None` when it is not a
/// group member (between sessions): then the followers stay as they are.
fn wanted(
    shared: &Shared,
    consumer: &InputConsumer,
    membership: &mut Membership,
    owned: &BTreeSet<i32>,
) -> Option<BTreeSet<i32>> {
    let me = member_id(consumer)?;
    let partitions = u32::try_from(shared.layout.partitions).unwrap_or(u32::MAX);
    let replicas = shared.settings.standby_replicas;
    let described = membership.describe(shared).filter(|members| members.iter().any(|m| m.id == me));
    Some(match described {
        Some(members) => standby_partitions(&members, &me, partitions, replicas, owned),
        None => (0..i32::try_from(partitions).unwrap_or(i32::MAX)).filter(|p| !owned.contains(p)).collect(),
    })
}

/// Runs the standbys until `stop` flips: describes the group, reconciles
/// the followers, reports. Stops every follower before it returns.
pub(crate) fn spawn(
    shared: Arc<Shared>,
    consumer: Weak<InputConsumer>,
    mut stop: watch::Receiver<bool>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let membership =
            Arc::new(Mutex::new(Membership { describer: None, next_attempt: Instant::now(), failing: false }));
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
        let _ = tokio::task::spawn_blocking(move || s.standbys.stop_all()).await;
        let applied = shared.standbys.applied.swap(0, Ordering::Relaxed);
        StandbyProgressed { following: 0, applied }.emit(&shared.metrics);
    })
}

/// Follows output `partition` into local state until `stop` flips.
fn follow(shared: &Shared, partition: i32, stop: &AtomicBool) -> Result<(), KafkaError> {
    let r = &shared.repairer;
    let checkpoint = {
        let mut engine = lock_engine(&r.engine);
        engine.assign(partition, r.clock.now_ms())?;
        engine.checkpoint(partition)
    };
    let mut config = r.config.clone();
    // A follower sits at the head: no busy fetching while nothing arrives,
    // and a position retention passed is an error, never a silent jump.
    config.set("fetch.wait.max.ms", "500").set("auto.offset.reset", "error");
    let consumer: BaseConsumer = config.create().map_err(KafkaError::client("creating a standby follower"))?;
    let (log_start, end) = consumer
        .fetch_watermarks(&r.output_topic, partition, r.stall_timeout)
        .map_err(KafkaError::client("reading the output's ends for a standby"))?;
    let from = match checkpoint {
        Some(c) => c + 1,
        None => r.first_offset_within_horizon(&consumer, partition, log_start, end),
    };
    if from < log_start {
        tracing::warn!(
            partition,
            from,
            log_start,
            "retention deleted output this standby never applied; not following it (the next owner's repair \
             decides, as --on-output-gap says)"
        );
        while !stop.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(200));
        }
        return Ok(());
    }
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
            Some(Err(e)) if e.rdkafka_error_code() == Some(RDKafkaErrorCode::OffsetOutOfRange) => {
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
    let mut engine = lock_engine(&shared.engine);
    // The previous owner's task, ending, may have released the partition.
    engine.assign(partition, now)?;
    let checkpoint = engine.checkpoint(partition);
    if checkpoint < *applied_to {
        return Err(KafkaError::Task {
            detail: format!(
                "local state of partition {partition} went back from offset {applied_to:?} to {checkpoint:?} under \
                 its standby (its previous owner released it); following again from what it holds"
            ),
        });
    }
    engine.apply_published(partition, chunk, now)?;
    *applied_to = engine.checkpoint(partition);
    drop(engine);
    shared.standbys.applied.fetch_add(chunk.len() as u64, Ordering::Relaxed);
    chunk.clear();
    Ok(())
}
