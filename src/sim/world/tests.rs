//! The simulation runs of `cargo test`: thousands of seeded schedules in
//! both delivery modes, and every deliberate mutation caught.
//!
//! `SIM_SCHEDULES` (default 10,000, split between the two modes) and
//! `SIM_SEED` (default 1) choose which schedules run: schedule `i` of a run
//! uses seed `SIM_SEED + i`, so a failing seed is reproduced with
//! `SIM_SEED=<seed> SIM_SCHEDULES=1 cargo test --lib sim::world`.

use crate::pipeline::{DeliveryMode, Mutation, Mutations};
use crate::sim::world::{Membership, Rollups, ScheduleConfig, World};

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Seeds of this run's schedules for one mode: half of `SIM_SCHEDULES`
/// each (at least one).
fn seeds() -> std::ops::Range<u64> {
    let first = env_u64("SIM_SEED", 1);
    let count = env_u64("SIM_SCHEDULES", 10_000);
    first..first + count.div_ceil(2).max(1)
}

fn run_all(delivery: DeliveryMode) {
    let mut totals = (0usize, 0usize, 0usize, 0usize, 0usize);
    let mut members = (0usize, 0usize, 0usize, 0usize);
    let mut disk = crate::sim::disk::DiskCounts::default();
    let mut jobs = (0usize, 0usize, 0usize);
    let mut ledger = (0usize, 0usize, 0usize);
    let mut zombies = (0usize, 0usize);
    let mut schedules = 0;
    for seed in seeds() {
        let config = ScheduleConfig {
            seed,
            delivery,
            mutations: Mutations::NONE,
            membership: Membership::Drawn,
            rollups: Rollups::Drawn,
        };
        match World::new(config).run() {
            Ok(r) => {
                schedules += 1;
                totals.0 += r.input_records;
                totals.1 += r.output_records;
                totals.2 += r.crashes;
                totals.3 += r.lost_assignments;
                totals.4 += r.aborted_transactions;
                members.0 += usize::from(r.static_members);
                members.1 += r.duplicates;
                members.2 += r.duplicate_overlaps;
                members.3 += r.fenced_exits;
                disk += r.disk;
                jobs.0 += r.store_job_steps;
                jobs.1 += r.ends_with_a_store_job_out;
                jobs.2 += r.ends_with_a_segment_not_installed;
                ledger.0 += usize::from(r.rollup_hours > 0);
                ledger.1 += r.rollup_hours;
                ledger.2 += r.adjustments;
                zombies.0 += usize::from(r.zombie_publishes > 0);
                if !r.excused.is_empty() {
                    zombies.1 += 1;
                    eprintln!("{delivery}: seed {seed} passed with at-least-once's zombie limitation: {:?}", r.excused);
                }
            }
            Err(failure) => panic!("{failure}"),
        }
    }
    eprintln!(
        "{delivery}: {schedules} schedules passed: {} input records, {} output records, {} crashes, {} lost \
         assignments, {} failed publishes; {} with static members, {} with a second process on a worker's \
         instance id ({} overlapping it), {} fenced exits; disks: {} power losses taking {} unsynced bytes and {} \
         directory changes, {} write errors, {} fsync errors, {} full-disk errors; {} usage store job steps run \
         after an apply, {} process ends with one out ({} with its segment written, not installed); {} publishing \
         rollups, {} counter-hours and {} late events' adjustments checked against the output; {} with a zombie's \
         publish, {} of them with an event published twice by it",
        totals.0,
        totals.1,
        totals.2,
        totals.3,
        totals.4,
        members.0,
        members.1,
        members.2,
        members.3,
        disk.power_losses,
        disk.bytes_lost,
        disk.entries_lost,
        disk.write_errors,
        disk.fsync_errors,
        disk.full_disk_errors,
        jobs.0,
        jobs.1,
        jobs.2,
        ledger.0,
        ledger.1,
        ledger.2,
        zombies.0,
        zombies.1
    );
    // At-least-once's one known way to publish twice (nothing fences a
    // zombie) stays rare: about one schedule in 3,000 when measured, at
    // most one in 1,000 here. Exactly-once has no such excuse.
    match delivery {
        DeliveryMode::ExactlyOnce => assert_eq!(zombies.1, 0),
        DeliveryMode::AtLeastOnce => assert!(
            zombies.1 * 1_000 <= schedules.max(1_000),
            "{} of {schedules} schedules published twice through a zombie",
            zombies.1
        ),
    }
    // The schedules place the store's background jobs, crashes included
    // (unless the run is too short to have any).
    if schedules >= 1_000 {
        assert!(
            jobs.0 > 0 && jobs.1 > 0 && jobs.2 > 0,
            "no usage store job was run after an apply, or lost with its process, or lost written: {jobs:?}"
        );
        // And the rollups check compared something, late events included.
        assert!(ledger.1 > 0 && ledger.2 > 0, "no rollup or no adjustment was checked: {ledger:?}");
    }
}

#[test]
fn exactly_once_schedules_keep_every_guarantee() {
    run_all(DeliveryMode::ExactlyOnce);
}

#[test]
fn at_least_once_schedules_keep_every_guarantee() {
    run_all(DeliveryMode::AtLeastOnce);
}

/// Runs `mutation` over this run's seeds until a schedule fails; returns
/// the first failing seed.
fn caught(mutation: Mutation, delivery: DeliveryMode) -> Option<(u64, String)> {
    for seed in seeds() {
        let config = ScheduleConfig {
            seed,
            delivery,
            mutations: Mutations::only(mutation),
            membership: Membership::Drawn,
            rollups: Rollups::Drawn,
        };
        if let Err(f) = World::new(config).run() {
            return Some((seed, f.violations.first().map(|v| v.to_string()).unwrap_or_default()));
        }
    }
    None
}

fn assert_caught(mutation: Mutation, delivery: DeliveryMode) {
    match caught(mutation, delivery) {
        Some((seed, violation)) => eprintln!("{mutation:?} ({delivery}) caught by seed {seed}: {violation}"),
        None => panic!("{mutation:?} ({delivery}) survived every schedule of this run: the simulator cannot see it"),
    }
}

#[test]
fn offsets_sent_outside_the_transaction_are_caught() {
    assert_caught(Mutation::OffsetsOutsideTransaction, DeliveryMode::ExactlyOnce);
}

#[test]
fn offsets_committed_before_the_publish_is_acknowledged_are_caught() {
    assert_caught(Mutation::CommitBeforeAcknowledged, DeliveryMode::AtLeastOnce);
}

#[test]
fn apply_before_publish_is_caught() {
    assert_caught(Mutation::ApplyBeforePublish, DeliveryMode::ExactlyOnce);
}

#[test]
fn repair_skipped_on_assignment_is_caught() {
    assert_caught(Mutation::SkipRepairOnAssign, DeliveryMode::ExactlyOnce);
}

#[test]
fn repair_ending_at_the_high_watermark_is_caught() {
    assert_caught(Mutation::RepairEndsAtHighWatermark, DeliveryMode::ExactlyOnce);
}

#[test]
fn a_revoke_that_finishes_a_lost_batch_is_caught() {
    assert_caught(Mutation::RevokeFinishesLostBatch, DeliveryMode::ExactlyOnce);
}

#[test]
fn a_commit_timeout_that_is_not_resumed_is_caught() {
    assert_caught(Mutation::CommitTimeoutNotResumed, DeliveryMode::ExactlyOnce);
}

#[test]
fn a_wal_file_created_without_a_directory_fsync_is_caught() {
    assert_caught(Mutation::WalCreatedWithoutDirFsync, DeliveryMode::ExactlyOnce);
}

#[test]
fn a_commit_of_input_whose_rollups_are_held_is_caught() {
    assert_caught(Mutation::CommitWithRollupsHeld, DeliveryMode::AtLeastOnce);
}

#[test]
fn rollups_published_after_their_events_transaction_are_caught() {
    assert_caught(Mutation::RollupsAfterTheirTransaction, DeliveryMode::ExactlyOnce);
}

#[test]
fn a_seed_replays_exactly() {
    let config = ScheduleConfig {
        seed: 42,
        delivery: DeliveryMode::ExactlyOnce,
        mutations: Mutations::NONE,
        membership: Membership::Drawn,
        rollups: Rollups::Published { hold_ms: None },
    };
    let a = World::new(config);
    let b = World::new(config);
    assert_eq!(a.plan, b.plan);
    let (ra, rb) = (a.run(), b.run());
    assert_eq!(format!("{ra:?}"), format!("{rb:?}"));
}

/// Runs one exactly-once schedule with `membership` (the regressions below
/// pin the one they were found with) and fails with its violations and
/// trace; the trace of a schedule that passed otherwise.
fn assert_exactly_once(seed: u64, membership: Membership) -> Vec<String> {
    // Found before the ledger was modelled, and pinned without it.
    let config = ScheduleConfig {
        seed,
        delivery: DeliveryMode::ExactlyOnce,
        mutations: Mutations::NONE,
        membership,
        rollups: Rollups::Off,
    };
    match World::new(config).run_with_trace() {
        Ok((_, trace)) => trace,
        Err(failure) => panic!("{failure}"),
    }
}

fn assert_exactly_once_with_dynamic_members(seed: u64) {
    assert_exactly_once(seed, Membership::Dynamic);
}

/// Regression (found by the simulator, seed 224 of the default run): a
/// member whose session was lost while its transaction was in flight sent
/// the input offsets with no member id and generation -1, which Kafka
/// accepts unfenced, so a zombie committed a batch of a partition another
/// member had already taken over (billed twice). dedupd now refuses to send
/// offsets without a live membership; without that guard this seed fails.
/// Found with dynamic members, and pinned to them.
#[test]
fn a_member_that_lost_its_session_cannot_commit_offsets_unfenced() {
    assert_exactly_once_with_dynamic_members(224);
}

/// Regression (found by the simulator, seed 307391, beyond the default
/// run's seeds): both members lost their session; one rejoined and was
/// given both partitions again while its old task of one of them was still
/// publishing, and that task then failed and let the partition go. The next
/// generation held the partition back for the member to give up, but it had
/// given it up already, so nothing made it join again and no member was ever
/// given the partition (a stall). The simulator's client now joins again,
/// as librdkafka's cooperative protocol does, when a partition it owned at
/// its join is not in the answer; without that, this seed stalls.
#[test]
fn a_partition_let_go_before_the_assignment_that_takes_it_away_is_given_to_someone() {
    assert_exactly_once_with_dynamic_members(307391);
}

/// Regression (found by the simulator, seed 3009909, beyond the default
/// run's seeds): one worker held both partitions, each batch its own
/// transaction, and the coordinator wrote each commit's markers slowly
/// (up to 3 s). The next transaction's AddPartitionsToTxn or
/// AddOffsetsToTxn was answered CONCURRENT_TRANSACTIONS meanwhile, and the
/// simulator's client failed the batch on it, so the two partitions'
/// batches kept aborting each other's turn until the schedule stalled.
/// librdkafka sends those requests again by itself, as the simulator's
/// client now does: no batch fails on CONCURRENT_TRANSACTIONS any more
/// (without the retry, this schedule's trace has such failures; before
/// slow markers also ended with the schedule's other faults, it stalled).
#[test]
fn a_transaction_that_waits_for_the_last_ones_markers_is_sent_again_not_aborted() {
    let trace = assert_exactly_once(3_009_909, Membership::Drawn);
    let failed: Vec<&String> =
        trace.iter().filter(|l| l.contains("publish of") && l.contains("ConcurrentTransactions")).collect();
    assert!(failed.is_empty(), "{failed:?}");
    let waited = trace.iter().filter(|l| l.contains("answered ConcurrentTransactions: sent again")).count();
    assert!(waited > 0, "the schedule must meet a coordinator still writing markers");
}

/// Regression (found by the simulator, seed 182255, beyond the default
/// run's seeds): a worker's disk failed fsyncs while the usage store's
/// background flush ran after an apply. The flush poisoned the store, the
/// worker went on (its other partition idle, repairing with nothing to
/// apply) and claimed a repaired partition on a store that refused to be
/// read. The real worker only warned when maintenance failed; a failed
/// maintenance now stops it, and the simulator's worker checks its store as
/// that maintenance tick does. Without that, this seed fails.
#[test]
fn a_store_poisoned_by_a_background_job_stops_the_worker() {
    assert_exactly_once(182_255, Membership::Drawn);
}

/// Regression (found by the simulator, seed 199980, beyond the default
/// run's seeds): a generation took one partition from a member and gave it
/// another. The member let the first go at once and joined again, before
/// taking up the second, so its JoinGroup said it owned nothing; the next
/// generation gave the second partition to the other worker, while this
/// member still published its batch there under its old generation
/// (refused), then under the one after (accepted): billed twice. The
/// simulator's client now takes up new partitions before letting revoked
/// ones go, so a rejoin reports its whole assignment, as librdkafka's does.
/// Without that, this seed bills an event twice.
#[test]
fn a_rejoin_after_a_revoke_reports_the_partitions_just_assigned() {
    assert_exactly_once(199_980, Membership::Drawn);
}

/// Issue #10: two processes with one `--instance-id`. At 10 s a second
/// process starts with worker 0's instance id while worker 0 holds input
/// partition 0 and has a transaction in flight on it. The
/// coordinator hands the newcomer worker 0's assignment in the same
/// generation (KIP-345, no rebalance), and it repairs and publishes both
/// partitions while worker 0 still runs; its InitProducerId (the
/// transactional id is the instance's) fences worker 0's producer. Worker
/// 0's next heartbeat is answered FENCED_INSTANCE_ID and it stops for good
/// with the real driver's message. Nothing is billed twice or lost, side
/// topics are exact, and the survivor finishes the input.
#[test]
fn a_second_process_with_a_live_workers_instance_id_is_fenced_out_and_nothing_is_billed_twice_or_lost() {
    // Seed 17 until the simulator's client retried "not now" answers to
    // transactional requests (below); the same faults now also crash w0.
    let config = ScheduleConfig {
        seed: 47,
        delivery: DeliveryMode::ExactlyOnce,
        mutations: Mutations::NONE,
        membership: Membership::Duplicate { of: 0, at_ms: 10_000 },
        rollups: Rollups::Off,
    };
    let (report, trace) = match World::new(config).run_with_trace() {
        Ok(done) => done,
        Err(failure) => panic!("{failure}"),
    };
    assert_eq!(report.duplicate_overlaps, 1, "the second process must meet worker 0 holding partitions");
    assert_eq!(report.fenced_exits, 1);
    assert_eq!(report.crashes, 0, "no other fault may explain the outcome");
    let exits: Vec<&String> = trace.iter().filter(|l| l.contains("exits non-zero")).collect();
    assert_eq!(exits.len(), 1, "{exits:?}");
    let message = "w0 exits non-zero and is not restarted: the Kafka consumer cannot go on: FencedInstanceId: Fatal \
                   consumer error: Broker: Static consumer fenced by other consumer with same group.instance.id; \
                   another process joined group `dedupd` with the same --instance-id \"worker-0\": give each worker \
                   its own";
    assert!(exits[0].ends_with(message), "{}", exits[0]);
    // The newcomer published while worker 0 was still running: the
    // overlap the fencing has to make safe.
    let exit_at = trace.iter().position(|l| l.contains("w0 exits")).unwrap_or(0);
    assert!(trace[..exit_at].iter().any(|l| l.contains("w2 p0 Apply") || l.contains("w2 p1 Apply")));
    // One fence, and the newcomer runs on to the end. A fenced process
    // that carried on would join again with no member id and fence the
    // newcomer in turn; the billing checks alone would not see that (the
    // shared transactional id still fences every stale producer).
    let fenced: Vec<&String> = trace.iter().filter(|l| l.contains("answered FENCED_INSTANCE_ID")).collect();
    assert_eq!(fenced.len(), 1, "{fenced:?}");
    assert!(!trace.iter().any(|l| l.contains("w2 stops") || l.contains("w2 exits")));
}
