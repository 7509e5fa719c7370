//! The worker against librdkafka's in-process mock cluster, with injected
//! faults: produce errors, transaction aborts, a broker outage, coordinator
//! moves, crashes and rebalances. After each, the output topic must hold
//! every valid id exactly once with its first payload, and input offsets
//! must cover everything (never ahead of output: a crash after an offset
//! commit that ran ahead would show up as a missing id).

mod kafka_common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use dedupd::kafka::demo::{demo, produce_traffic, DemoSettings};
use dedupd::kafka::{run, DeliveryMode, KafkaError, RunSettings, Topics};
use rdkafka::mocking::{MockCluster, MockCoordinator};
use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr};

use kafka_common::*;

const PARTITIONS: i32 = 3;

fn cluster(topics: &Topics, output_partitions: i32) -> MockCluster<'static, rdkafka::producer::DefaultProducerContext> {
    let mock = MockCluster::new(3).expect("mock cluster");
    mock.create_topic(&topics.input, PARTITIONS, 1).expect("topic");
    mock.create_topic(&topics.output, output_partitions, 1).expect("topic");
    mock.create_topic(&topics.conflicts, 1, 1).expect("topic");
    mock.create_topic(&topics.rejected, 2, 1).expect("topic");
    if let Some(rollups) = &topics.rollups {
        mock.create_topic(rollups, 2, 1).expect("topic");
    }
    mock
}

type Spawned = (
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<Result<dedupd::kafka::RunReport, KafkaError>>,
    std::sync::Arc<dedupd::metrics::Metrics>,
);

/// Runs a worker over in-memory state in the background until `stop` is sent.
fn spawn_worker(settings: RunSettings) -> Spawned {
    spawn_worker_with(settings, parts())
}

/// [`spawn_worker`] over the given parts (e.g. a real state directory).
fn spawn_worker_with(
    settings: RunSettings,
    (parts, metrics): (dedupd::kafka::WorkerParts, std::sync::Arc<dedupd::metrics::Metrics>),
) -> Spawned {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    // Held by the worker's task: gone when the worker returns or its task
    // is cancelled, which is what the watch below looks for.
    let running = Arc::new(());
    let watched = Arc::downgrade(&running);
    let handle = tokio::spawn(async move {
        let _running = running;
        run(settings, parts, async move {
            if rx.await.is_ok() {
                watch_the_stop(test, watched);
            }
        })
        .await
    });
    (tx, handle, metrics)
}

/// Bounds a worker's orderly stop, which the test itself cannot: a stop
/// stuck in a blocking call would hang this suite until CI's own limit
/// killed it without naming the test, and a timed-out test cannot end it
/// either (its runtime waits for blocking threads when it shuts down). So
/// a thread outside the runtime ends the whole process, saying why, if the
/// worker has not stopped well after its revoke timeout (30 s here) and
/// flush timeout (20 s) allow for.
fn watch_the_stop(test: String, running: std::sync::Weak<()>) {
    const STOP_WITHIN: Duration = Duration::from_secs(180);
    std::thread::spawn(move || {
        std::thread::sleep(STOP_WITHIN);
        if running.upgrade().is_some() {
            // Straight to the process's stderr: `eprintln!` here would go
            // to the test's captured output, which an abort never prints.
            let why = format!("{test}: a worker told to stop had not stopped after {STOP_WITHIN:?}; aborting\n");
            let _ = std::io::Write::write_all(&mut std::io::stderr(), why.as_bytes());
            std::process::abort();
        }
    });
}

fn buckets_total(m: &dedupd::metrics::Metrics) -> u64 {
    use dedupd::metrics::Bucket;
    Bucket::ALL.iter().map(|b| m.events(*b)).sum()
}

/// Stops an exactly-once worker that consumed all of `s`, checks its report's
/// conflict and reject counts, then the topics (see [`check_outcome`]).
async fn stop_and_check_exactly_once(
    (stop, worker): (
        tokio::sync::oneshot::Sender<()>,
        tokio::task::JoinHandle<Result<dedupd::kafka::RunReport, KafkaError>>,
    ),
    brokers: &str,
    topics: &Topics,
    group: &str,
    s: &Scenario,
) {
    let _ = stop.send(());
    let report = worker.await.expect("join").expect("run");
    assert_eq!(report.conflict, s.conflicts);
    assert_eq!(report.rejected, s.invalid);
    check_outcome(brokers, topics, group, s, DeliveryMode::ExactlyOnce);
}

fn check_outcome(brokers: &str, topics: &Topics, group: &str, s: &Scenario, delivery: DeliveryMode) {
    let output = read_topic(brokers, &topics.output);
    assert_exactly_once(&output, s);
    let conflicts = read_topic(brokers, &topics.conflicts);
    assert!(conflicts.len() as u64 >= s.conflicts, "conflicts topic holds {} < {}", conflicts.len(), s.conflicts);
    let rejected = read_topic(brokers, &topics.rejected);
    assert!(rejected_count(&rejected) as u64 >= s.invalid, "rejected topic holds {} < {}", rejected.len(), s.invalid);
    // The mock cluster acknowledges TxnOffsetCommit without storing the
    // offsets (librdkafka rdkafka_mock_handlers.c), so in exactly-once mode
    // committed offsets can only be checked on a real broker.
    if delivery == DeliveryMode::AtLeastOnce {
        let committed = committed(brokers, group, &topics.input, PARTITIONS);
        let ends = high_watermarks(brokers, &topics.input, PARTITIONS);
        assert_eq!(committed, ends, "input offsets must cover all input once everything is published");
    }
}

/// Input fully processed: offsets committed to the end (at-least-once), or
/// every record counted in a bucket (exactly-once on the mock, see above).
fn input_done(
    brokers: &str,
    topics: &Topics,
    group: &str,
    delivery: DeliveryMode,
    m: &dedupd::metrics::Metrics,
    total: u64,
) -> bool {
    match delivery {
        DeliveryMode::AtLeastOnce => {
            committed(brokers, group, &topics.input, PARTITIONS) == high_watermarks(brokers, &topics.input, PARTITIONS)
        }
        DeliveryMode::ExactlyOnce => buckets_total(m) >= total,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_once_survives_produce_errors_and_aborted_transactions() {
    let topics = topics("eos-faults");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(3000, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    let (half1, half2) = s.records.split_at(s.records.len() / 2);
    produce_traffic(&producer, &topics.input, PARTITIONS, half1).await.expect("produce");

    let mut settings = settings(&brokers, "eos-faults", &topics, DeliveryMode::ExactlyOnce);
    settings.instance_id = Some("w1".into());
    let (stop, worker, metrics) = spawn_worker(settings);
    // Produce errors the idempotent producer retries; an AddPartitionsToTxn
    // failure aborts a transaction, which the pipeline retries after repair.
    mock.request_errors(
        RDKafkaApiKey::Produce,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS, RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS],
    );
    // (An abortable error that is not permanent: TOPIC_AUTHORIZATION_FAILED
    // would now stop the worker, as an ACL problem should.)
    mock.request_errors(RDKafkaApiKey::AddPartitionsToTxn, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_PRODUCER_ID]);
    produce_traffic(&producer, &topics.input, PARTITIONS, half2).await.expect("produce");
    // Move the transaction and group coordinators mid-stream.
    mock.coordinator(MockCoordinator::Transaction("dedupd-eos-faults-w1".into()), 2).expect("coordinator");
    mock.coordinator(MockCoordinator::Group("eos-faults".into()), 3).expect("coordinator");

    let total = s.records.len() as u64;
    assert!(wait_until(Duration::from_secs(90), || buckets_total(&metrics) >= total).await, "worker did not catch up");
    stop_and_check_exactly_once((stop, worker), &brokers, &topics, "eos-faults", &s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_least_once_survives_a_broker_outage_and_a_coordinator_move() {
    let topics = topics("alo-outage");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(3000, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    let (half1, half2) = s.records.split_at(s.records.len() / 2);
    produce_traffic(&producer, &topics.input, PARTITIONS, half1).await.expect("produce");

    let (stop, worker, metrics) = spawn_worker(settings(&brokers, "alo-outage", &topics, DeliveryMode::AtLeastOnce));
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics) > 0).await);
    mock.broker_down(2).expect("down");
    // Produced while a broker is down: deliveries to its partitions wait
    // (the producer is idempotent, so they land once, in order).
    let (p2, input, rest) = (producer.clone(), topics.input.clone(), half2.to_vec());
    let late = tokio::spawn(async move { produce_traffic(&p2, &input, PARTITIONS, &rest).await });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    mock.broker_up(2).expect("up");
    mock.coordinator(MockCoordinator::Group("alo-outage".into()), 1).expect("coordinator");
    late.await.expect("join").expect("produce");
    let total = s.records.len() as u64;
    let caught_up = wait_until(Duration::from_secs(90), || {
        buckets_total(&metrics) >= total
            && committed(&brokers, "alo-outage", &topics.input, PARTITIONS)
                == high_watermarks(&brokers, &topics.input, PARTITIONS)
    })
    .await;
    assert!(caught_up, "worker did not catch up");
    let _ = stop.send(());
    worker.await.expect("join").expect("run");
    check_outcome(&brokers, &topics, "alo-outage", &s, DeliveryMode::AtLeastOnce);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crashed_worker_is_repaired_from_the_output_topic_by_its_successor() {
    for delivery in [DeliveryMode::AtLeastOnce, DeliveryMode::ExactlyOnce] {
        let mut topics = topics(&format!("crash-{delivery}"));
        topics.rollups = Some(format!("crash-{delivery}-rollups"));
        let group = format!("crash-{delivery}");
        let mock = cluster(&topics, PARTITIONS);
        let brokers = mock.bootstrap_servers();
        let s = scenario(4000, 20, 5, 5);
        let producer = traffic_producer(&brokers);
        produce_traffic(&producer, &topics.input, PARTITIONS, &s.records).await.expect("produce");

        // The first worker runs on its own runtime, so a crash can stop all
        // of its tasks at once, wherever they are (mid-batch, between
        // publish and commit), without any shutdown path running.
        let crashed = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
        let (parts1, metrics1) = parts();
        // Both lives use the same instance id, as a restarted pod does: its
        // stable transactional id fences the crashed life's open transaction,
        // which would otherwise hold the output's last stable offset (and so
        // repair) back until the broker times the transaction out.
        let with_instance = || {
            let mut st = settings(&brokers, &group, &topics, delivery);
            st.instance_id = Some(format!("{group}-0"));
            st
        };
        crashed.spawn(run(with_instance(), parts1, std::future::pending()));
        assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics1) > 1000).await);
        crashed.shutdown_background();
        // What the crashed worker left visible on the output. The crash may
        // land before its first publish completed; then there is nothing to
        // repair from, and the outcome check below is what matters.
        let left_on_output: i64 = high_watermarks(&brokers, &topics.output, PARTITIONS).iter().sum();

        let (stop, worker, metrics) = spawn_worker(with_instance());
        let total = s.records.len() as u64;
        // Ready first (assigned and repaired): the crashed life may have
        // committed all input already, and stopping the successor then
        // would cut its repair short.
        assert!(wait_until(Duration::from_secs(90), || metrics.is_ready()).await, "successor never became ready");
        let done =
            wait_until(Duration::from_secs(90), || input_done(&brokers, &topics, &group, delivery, &metrics, total))
                .await;
        assert!(done, "successor did not finish the input");
        let _ = stop.send(());
        let report = worker.await.expect("join").expect("run");
        if left_on_output > 0 {
            assert!(report.repaired_records > 0, "the successor must rebuild state from the output topic");
        }
        check_outcome(&brokers, &topics, &group, &s, delivery);
        // The successor's ledger was rebuilt from the output, so the totals
        // on the rollups topic (latest per key, summed over partitions) are
        // the output's, hour by hour.
        let output = read_topic(&brokers, &topics.output);
        let (rollups, late) = rollup_totals(&read_topic(&brokers, topics.rollups.as_deref().expect("rollups")));
        assert_eq!(rollups, output_totals(&output), "rollups topic against the accepted events ({delivery})");
        assert!(late.is_empty(), "no event of the scenario is later than 48 hours: {late:?}");
        // `dedupd usage verify` over the topics: every rollup (sum, count,
        // max, last, latest event) is what the output refolds to.
        let usage_brokers = dedupd::kafka::usage::Brokers {
            servers: brokers.clone(),
            properties: Vec::new(),
            timeout: Duration::from_secs(30),
        };
        let rollups_topic = topics.rollups.as_deref().expect("rollups");
        let check = dedupd::kafka::usage::verify_topics(
            &usage_brokers,
            &topics.output,
            rollups_topic,
            &validator(),
            &dedupd::ledger::Lateness::default(),
        )
        .expect("verify");
        assert!(check.drift.is_empty(), "drift ({delivery}): {:?}", &check.drift[..check.drift.len().min(5)]);
        assert_eq!(check.events as usize, output.len());
        // And `dedupd usage --rollups-topic` totals one tenant like the output.
        let now = dedupd::classify::Clock::now_ms(&dedupd::classify::SystemClock);
        let query = dedupd::ledger::UsageQuery {
            tenant_id: "acme".into(),
            customer_id: None,
            meter: None,
            from_ms: now - 3 * 3_600_000,
            to_ms: now + 3_600_000,
            group_by: None,
        };
        let answer = dedupd::kafka::usage::usage_from_topic(&usage_brokers, rollups_topic, &query).expect("usage");
        let acme: rust_decimal::Decimal =
            output_totals(&output).iter().filter(|((t, ..), _)| t == "acme").map(|(_, v)| *v).sum();
        assert_eq!(answer.rolled_up(), Ok(acme), "acme's total from the rollups topic ({delivery})");
    }
}

/// At least once, a worker holds its batches' rollups back for
/// `--rollups-interval` and commits their input only once a publish
/// carried them. A crash while they are held loses them with the process:
/// the successor must meet those batches again (their input was not
/// committed), recognise them as replays and publish their hours' totals,
/// or the rollups topic stays short of the output for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_crash_with_rollups_held_back_replays_their_batches_and_publishes_their_totals() {
    let mut topics = topics("held-rollups");
    let rollups = "held-rollups-rollups".to_owned();
    topics.rollups = Some(rollups.clone());
    let group = "held-rollups";
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(1500, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records).await.expect("produce");
    let total = s.records.len() as u64;

    // The first life holds everything: no batch is due to carry rollups for
    // a minute, and the publish of them alone, which an idle partition
    // makes at once, cannot complete: the rollups topic has no leader.
    for p in 0..2 {
        mock.partition_leader(&rollups, p, None).expect("leaderless");
    }
    let crashed = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("rt");
    let (parts1, metrics1) = parts();
    let mut holding = settings(&brokers, group, &topics, DeliveryMode::AtLeastOnce);
    holding.rollups_interval = Duration::from_secs(60);
    crashed.spawn(run(holding, parts1, std::future::pending()));
    assert!(
        wait_until(Duration::from_secs(60), || buckets_total(&metrics1) >= total).await,
        "the first life did not classify the input"
    );
    let output_events: i64 = high_watermarks(&brokers, &topics.output, PARTITIONS).iter().sum();
    assert!(output_events > 0, "the first life published events");
    assert_eq!(
        committed(&brokers, group, &topics.input, PARTITIONS),
        vec![-1; PARTITIONS as usize],
        "no input commits before its rollups are published"
    );
    crashed.shutdown_background();
    for p in 0..2 {
        mock.partition_leader(&rollups, p, Some(1)).expect("leader back");
    }

    let (stop, worker, metrics) = spawn_worker(settings(&brokers, group, &topics, DeliveryMode::AtLeastOnce));
    let done = wait_until(Duration::from_secs(90), || {
        input_done(&brokers, &topics, group, DeliveryMode::AtLeastOnce, &metrics, total)
    })
    .await;
    assert!(done, "the successor did not finish the input");
    assert!(metrics.events(dedupd::metrics::Bucket::replayed) > 0, "the successor met the held batches again");
    assert!(metrics.republished_rollups() > 0, "and published their hours' totals");
    let _ = stop.send(());
    worker.await.expect("join").expect("run");
    check_outcome(&brokers, &topics, group, &s, DeliveryMode::AtLeastOnce);
    let (totals, late) = rollup_totals(&read_topic(&brokers, &rollups));
    assert!(late.is_empty(), "no event of the scenario is later than 48 hours: {late:?}");
    assert_eq!(
        totals,
        output_totals(&read_topic(&brokers, &topics.output)),
        "rollups topic against the accepted events"
    );
}

/// At least once, the output topic and the rollups topic acknowledge a
/// batch apart: its events can land on the output while its rollups and
/// adjustments do not. The retry, after repair has read the events back,
/// finds them replayed, not accepted, and must publish their hours' totals
/// and their adjustments again; otherwise the rollups topic stays short of
/// the output for every hour no later event touches.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn at_least_once_rollups_lost_beside_published_events_are_published_on_the_retry() {
    let mut topics = topics("alo-rollups");
    let rollups = "alo-rollups-rollups".to_owned();
    topics.rollups = Some(rollups.clone());
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let mut s = scenario(1500, 20, 5, 5);
    let late = add_late_events(&mut s, 5);
    // The late events in the middle of the traffic, so in each partition's
    // first batch (up to 500 records of ~520), which is the one that fails
    // below, and after events that set their counters' watermarks.
    let late_records: Vec<_> = s.records.drain(s.records.len() - late.len()..).collect();
    let middle = s.records.len() / 2;
    s.records.splice(middle..middle, late_records);
    let producer = traffic_producer(&brokers);
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records).await.expect("produce");
    // No leader for the rollups topic: its records wait, then time out,
    // while the output's are acknowledged.
    for p in 0..2 {
        mock.partition_leader(&rollups, p, None).expect("leaderless");
    }
    let mut st = settings(&brokers, "alo-rollups", &topics, DeliveryMode::AtLeastOnce);
    st.kafka_properties.push(("message.timeout.ms".into(), "1500".into()));
    let (stop, worker, metrics) = spawn_worker(st);
    let retries = |m: &dedupd::metrics::Metrics| -> f64 {
        m.encode()
            .lines()
            .filter(|l| l.starts_with("dedupd_publish_retries_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    let output_taken = || high_watermarks(&brokers, &topics.output, PARTITIONS).iter().sum::<i64>() > 0;
    assert!(
        wait_until(Duration::from_secs(60), || retries(&metrics) >= 4.0 && output_taken()).await,
        "publishes must fail on the rollups topic after the output took their events"
    );
    for p in 0..2 {
        mock.partition_leader(&rollups, p, Some(1)).expect("leader back");
    }
    let total = s.records.len() as u64;
    let done = wait_until(Duration::from_secs(90), || {
        input_done(&brokers, &topics, "alo-rollups", DeliveryMode::AtLeastOnce, &metrics, total)
    })
    .await;
    assert!(done, "the worker did not finish the input");
    assert!(metrics.republished_rollups() > 0, "the retries published their replays' rollups again");
    let _ = stop.send(());
    worker.await.expect("join").expect("run");
    check_outcome(&brokers, &topics, "alo-rollups", &s, DeliveryMode::AtLeastOnce);
    let output = read_topic(&brokers, &topics.output);
    let (totals, mut adjusted) = rollup_totals(&read_topic(&brokers, &rollups));
    let mut want_adjusted = late.clone();
    adjusted.sort();
    want_adjusted.sort();
    assert_eq!(adjusted, want_adjusted, "every late event's adjustment is on the rollups topic");
    // Late events are adjustments, not part of any hour's rollup.
    let on_time: Vec<ReadRecord> = output
        .into_iter()
        .filter(|r| {
            let v: serde_json::Value = serde_json::from_slice(r.value.as_deref().unwrap_or_default()).expect("JSON");
            !late.iter().any(|id| v["event_id"] == id.as_str())
        })
        .collect();
    assert_eq!(totals, output_totals(&on_time), "rollups topic against the accepted events");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_workers_in_one_group_publish_each_id_once_through_rebalances() {
    let topics = topics("pair");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(4000, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    let third = s.records.len() / 3;
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[..third]).await.expect("produce");
    let (stop_a, worker_a, metrics_a) = spawn_worker(settings(&brokers, "pair", &topics, DeliveryMode::AtLeastOnce));
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics_a) > 0).await);
    let (stop_b, worker_b, metrics_b) = spawn_worker(settings(&brokers, "pair", &topics, DeliveryMode::AtLeastOnce));
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[third..2 * third]).await.expect("produce");
    tokio::time::sleep(Duration::from_secs(3)).await;
    // A leaves cleanly mid-stream: its partitions move to B.
    let _ = stop_a.send(());
    worker_a.await.expect("join").expect("run a");
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[2 * third..]).await.expect("produce");
    let done = wait_until(Duration::from_secs(90), || {
        committed(&brokers, "pair", &topics.input, PARTITIONS) == high_watermarks(&brokers, &topics.input, PARTITIONS)
    })
    .await;
    assert!(done, "B did not finish the input");
    let _ = stop_b.send(());
    worker_b.await.expect("join").expect("run b");
    let _ = metrics_b;
    check_outcome(&brokers, &topics, "pair", &s, DeliveryMode::AtLeastOnce);
}

/// The value of an unlabelled metric on `m`'s page.
fn metric_value(m: &dedupd::metrics::Metrics, name: &str) -> f64 {
    let page = m.encode();
    page.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok()).unwrap_or(0.0)
}

/// Warm standbys through rebalances (`--standby-replicas 1`; the mock
/// cluster cannot describe groups, so each worker follows every partition
/// it does not own). In-memory state, so a partition a task releases loses
/// its checkpoint under whoever follows it next. Partitions move to a
/// joining member (their owner's tasks end while standbys start following
/// them), back to the survivor when that member leaves (followers hand over
/// to tasks), and the output stays exactly once throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn standbys_follow_and_hand_partitions_over_through_rebalances_and_output_stays_exactly_once() {
    let topics = topics("standbys");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(6000, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    let quarter = s.records.len() / 4;
    let with_standby = || {
        let mut settings = settings(&brokers, "standbys", &topics, DeliveryMode::AtLeastOnce);
        settings.standby_replicas = 1;
        settings
    };
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[..quarter]).await.expect("produce");
    let (stop_a, worker_a, metrics_a) = spawn_worker(with_standby());
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics_a) > 0).await);
    // B joins: partitions move to it, and each follows the other's.
    let (stop_b, worker_b, metrics_b) = spawn_worker(with_standby());
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[quarter..2 * quarter]).await.expect("produce");
    let following = wait_until(Duration::from_secs(60), || {
        metric_value(&metrics_a, "dedupd_standby_partitions") >= 1.0
            && metric_value(&metrics_b, "dedupd_standby_partitions") >= 1.0
    })
    .await;
    assert!(following, "the two workers never followed each other's partitions");
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[2 * quarter..3 * quarter]).await.expect("produce");
    // Until the group has committed the third quarter and B's standbys have
    // stopped applying (unchanged for 1.5 s): a fixed wait assumed both
    // happen within 6 s, which two busy cores need not keep.
    let caught_up = wait_until(Duration::from_secs(60), || {
        committed(&brokers, "standbys", &topics.input, PARTITIONS)
            == high_watermarks(&brokers, &topics.input, PARTITIONS)
    })
    .await;
    assert!(caught_up, "the group did not finish the third quarter");
    let settle = Instant::now() + Duration::from_secs(30);
    let mut applied = metric_value(&metrics_b, "dedupd_standby_records_total");
    let mut since = Instant::now();
    while since.elapsed() < Duration::from_millis(1500) {
        assert!(Instant::now() < settle, "B's standbys kept applying for 30 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = metric_value(&metrics_b, "dedupd_standby_records_total");
        if now != applied {
            (applied, since) = (now, Instant::now());
        }
    }
    // A leaves cleanly mid-stream: B's followers hand its partitions over,
    // so B's repair of them reads at most A's last couple of batches (its
    // standbys apply every half second), not A's whole output.
    let repaired_before = metrics_b.repair_records();
    let _ = stop_a.send(());
    let report_a = worker_a.await.expect("join").expect("run a");
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records[3 * quarter..]).await.expect("produce");
    let done = wait_until(Duration::from_secs(90), || {
        committed(&brokers, "standbys", &topics.input, PARTITIONS)
            == high_watermarks(&brokers, &topics.input, PARTITIONS)
    })
    .await;
    assert!(done, "B did not finish the input");
    assert!(metric_value(&metrics_b, "dedupd_standby_records_total") > 0.0, "B's standbys applied nothing");
    let repaired = metrics_b.repair_records() - repaired_before;
    eprintln!("A accepted {} events; B's takeover repair read {repaired} records", report_a.accepted);
    assert!(repaired <= 1000, "B's takeover repair read {repaired} records: its standbys were not warm");
    assert!(report_a.accepted > 2000, "A published too little for the takeover to show anything");
    let _ = stop_b.send(());
    worker_b.await.expect("join").expect("run b");
    check_outcome(&brokers, &topics, "standbys", &s, DeliveryMode::AtLeastOnce);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_refuses_to_start_when_input_and_output_are_not_co_partitioned() {
    let topics = topics("mismatch");
    let mock = cluster(&topics, PARTITIONS + 1);
    let brokers = mock.bootstrap_servers();
    let (parts, _) = parts();
    let err = run(settings(&brokers, "mismatch", &topics, DeliveryMode::AtLeastOnce), parts, std::future::pending())
        .await
        .expect_err("must refuse");
    assert!(matches!(err, KafkaError::PartitionMismatch { input_partitions: 3, output_partitions: 4, .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exactly_once_refuses_a_broker_without_transactions_and_names_at_least_once() {
    let topics = topics("notxn");
    let mock = cluster(&topics, PARTITIONS);
    mock.apiversion(RDKafkaApiKey::EndTxn, None, None).expect("disable EndTxn");
    let brokers = mock.bootstrap_servers();
    let (parts, _) = parts();
    let err = run(settings(&brokers, "notxn", &topics, DeliveryMode::ExactlyOnce), parts, std::future::pending())
        .await
        .expect_err("must refuse");
    assert!(matches!(err, KafkaError::TransactionsUnsupported { .. }), "{err}");
    assert!(err.to_string().contains("--delivery at-least-once"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn demo_traffic_lands_in_the_expected_buckets_including_hostile_records() {
    let (parts, metrics) = parts();
    let settings =
        DemoSettings { events: 2000, metrics_addr: None, wave_pause: Duration::from_millis(100), ..Default::default() };
    let report = demo(settings, parts).await.expect("demo");
    let e = report.expected;
    assert_eq!(report.run.accepted, e.accepted, "{}", report.table());
    assert_eq!(report.run.duplicate + report.run.replayed, e.duplicate, "{}", report.table());
    assert_eq!(report.run.conflict, e.conflict, "{}", report.table());
    assert_eq!(report.run.rejected, e.rejected, "{}", report.table());
    assert_eq!(metrics.unkeyed_records(), e.unkeyed);
    // The demo's producer follows the keying contract.
    assert_eq!(metrics.misrouted_records(), 0);
}

/// librdkafka's own `murmur2` and `consistent` partitioners (the Java
/// client's default and librdkafka's default for keyed records) put identity
/// keys exactly where `--partitioner murmur2|crc32` expects them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn librdkafkas_partitioners_place_identity_keys_where_dedupd_expects_them() {
    use dedupd::event::{id_hash, identity_key, Partitioner};
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let mock = MockCluster::new(1).expect("mock cluster");
    let brokers = mock.bootstrap_servers();
    for (name, partitioner, ours) in
        [("murmur2", "murmur2", Partitioner::Murmur2), ("crc32", "consistent", Partitioner::Crc32)]
    {
        let topic = format!("placement-{name}");
        mock.create_topic(&topic, 7, 1).expect("topic");
        let producer: FutureProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &brokers)
            .set("partitioner", partitioner)
            .create()
            .expect("producer");
        let ids: Vec<(String, String)> =
            (0..200).map(|i| (["acme", "globex"][i % 2].to_owned(), format!("evt-{i}-\u{e9}"))).collect();
        for (tenant, event) in &ids {
            let key = identity_key(tenant, event);
            let record: FutureRecord<'_, [u8], [u8]> =
                FutureRecord::to(&topic).key(key.as_slice()).payload(b"{}".as_slice());
            producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).expect("delivered");
        }
        let read = read_topic(&brokers, &topic);
        assert_eq!(read.len(), ids.len());
        let mut used = std::collections::HashSet::new();
        for r in &read {
            let key = r.key.as_deref().expect("keyed");
            let text = std::str::from_utf8(key).expect("utf-8");
            let (tenant, event) = text.split_once('\0').expect("identity key");
            let expected = ours.partition_of(&id_hash(tenant, event), tenant, event, 7);
            assert_eq!(r.partition, expected, "{name}: {text:?}");
            used.insert(r.partition);
        }
        assert_eq!(used.len(), 7, "{name}: 200 keys should reach every partition");
    }
}

/// `dedupd route` between producers that key and partition any way and the
/// worker: exactly once (transactions, with aborts injected), every raw
/// record is routed or rejected once, none reaches the worker on the wrong
/// partition, and the output holds every valid id once with its first payload.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_router_places_records_keyed_any_way_on_their_identitys_partition_exactly_once() {
    use dedupd::kafka::records::H_REASON;
    use dedupd::kafka::router::{route, RouteSettings};
    const RAW_PARTITIONS: i32 = 5;
    let topics = topics("route");
    let mock = cluster(&topics, PARTITIONS);
    let raw = "route-raw";
    mock.create_topic(raw, RAW_PARTITIONS, 1).expect("raw topic");
    let brokers = mock.bootstrap_servers();
    let s = scenario(3000, 50, 10, 10);
    let (first, later) = raw_waves(&s, RAW_PARTITIONS);
    let unroutable =
        s.records.iter().filter(|r| validator().identity_of(r.value.as_deref().unwrap_or_default()).is_err()).count()
            as u64;
    assert!(unroutable > 0 && unroutable < s.invalid, "{unroutable} of {}", s.invalid);
    let producer = traffic_producer(&brokers);
    produce_wave(&producer, raw, &first).await;

    let mut rs = RouteSettings::new(&brokers, "route-router", raw, &topics.input, &topics.rejected);
    rs.run.instance_id = Some("r1".into());
    rs.run.batch.max_records = 400;
    rs.run.batch.max_wait = Duration::from_millis(10);
    let router_metrics = std::sync::Arc::new(dedupd::metrics::Metrics::new());
    let (router_stop, router_rx) = tokio::sync::oneshot::channel::<()>();
    let router = tokio::spawn(route(rs, validator(), router_metrics.clone(), async move {
        let _ = router_rx.await;
    }));
    let routed = |m: &dedupd::metrics::Metrics| m.routed_records("routed") + m.routed_records("rejected");
    assert!(
        wait_until(Duration::from_secs(60), || routed(&router_metrics) >= first.len() as u64).await,
        "the first wave was not routed"
    );
    // The router alone is transactional now: these abort its transactions
    // (the produce errors are retried inside the idempotent producer).
    mock.request_errors(RDKafkaApiKey::AddPartitionsToTxn, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_PRODUCER_ID; 2]);
    mock.request_errors(RDKafkaApiKey::Produce, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_NOT_ENOUGH_REPLICAS; 2]);
    produce_wave(&producer, raw, &later).await;

    let total = s.records.len() as u64;
    assert!(
        wait_until(Duration::from_secs(90), || routed(&router_metrics) >= total).await,
        "the router did not catch up"
    );
    let mut settings = settings(&brokers, "route-worker", &topics, DeliveryMode::ExactlyOnce);
    settings.on_misrouted = dedupd::kafka::OnMisrouted::Reject;
    let (stop, worker, metrics) = spawn_worker(settings);
    let to_classify = total - unroutable;
    assert!(
        wait_until(Duration::from_secs(90), || buckets_total(&metrics) >= to_classify).await,
        "the worker did not catch up"
    );
    let _ = router_stop.send(());
    let report = router.await.expect("join").expect("route");
    let _ = stop.send(());
    worker.await.expect("join").expect("run");

    // Exactly once through aborts: each raw record routed or rejected once.
    assert_eq!(report.routed, to_classify, "{report:?}");
    assert_eq!(report.rejected, unroutable, "{report:?}");
    // The aborts happened, and their batches were read again.
    assert!(router_metrics.transactions(false) > 0, "no router transaction was aborted");
    assert!(report.batches_rewound > 0, "{report:?}");
    assert_eq!(buckets_total(&metrics), to_classify);
    assert_eq!(metrics.misrouted_records(), 0, "the router placed a record where the worker does not expect it");
    let input = read_topic(&brokers, &topics.input);
    assert_eq!(input.len() as u64, to_classify);
    let rejected = read_topic(&brokers, &topics.rejected);
    assert_eq!(rejected_count(&rejected) as u64, s.invalid);
    assert!(rejected.iter().all(|r| r.header(H_REASON) != Some(b"misrouted".as_slice())));
    assert_exactly_once(&read_topic(&brokers, &topics.output), &s);
}

/// Records placed on the wrong partition for their identity are counted,
/// and with `--on-misrouted reject` land on the rejected topic with reason
/// `misrouted` instead of being billed; every other id is published once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn misrouted_records_are_counted_and_rejected_with_their_reason() {
    use dedupd::kafka::demo::{home_partition, produce_placed};
    use dedupd::kafka::records::H_REASON;
    let topics = topics("misrouted");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let mut s = scenario(900, 20, 10, 10);
    // Every delivery of one id in seven goes to the next partition over.
    let misplaced = |key: &[u8]| key.last().is_some_and(|b| b % 7 == 0);
    let now = dedupd::classify::Clock::now_ms(&dedupd::classify::SystemClock);
    let mut placed = Vec::new();
    let mut wrong_valid = 0u64;
    for r in &s.records {
        let key = r.key.as_deref().expect("scenario records are keyed");
        let home = home_partition(key, PARTITIONS);
        let valid = validator().validate(r.value.as_deref().unwrap_or_default(), now).is_ok();
        if misplaced(key) {
            placed.push(((home + 1) % PARTITIONS, r));
            wrong_valid += u64::from(valid);
        } else {
            placed.push((home, r));
        }
    }
    assert!(wrong_valid > 50, "{wrong_valid}");
    let producer = traffic_producer(&brokers);
    produce_placed(&producer, &topics.input, &placed).await.expect("produce");

    let mut settings = settings(&brokers, "misrouted", &topics, DeliveryMode::ExactlyOnce);
    settings.on_misrouted = dedupd::kafka::OnMisrouted::Reject;
    let (stop, worker, metrics) = spawn_worker(settings);
    let total = s.records.len() as u64;
    assert!(wait_until(Duration::from_secs(90), || buckets_total(&metrics) >= total).await, "worker did not catch up");
    let _ = stop.send(());
    worker.await.expect("join").expect("run");

    assert_eq!(metrics.misrouted_records(), wrong_valid);
    assert_eq!(metrics.rejected(dedupd::event::RejectReason::Misrouted), wrong_valid);
    let rejected = read_topic(&brokers, &topics.rejected);
    let by_reason = |reason: &str| rejected.iter().filter(|r| r.header(H_REASON) == Some(reason.as_bytes())).count();
    assert_eq!(by_reason("misrouted") as u64, wrong_valid);
    // Exactly the correctly placed ids are billed, each once.
    s.first_payload.retain(|k, _| !misplaced(k));
    let output = read_topic(&brokers, &topics.output);
    assert!(output.iter().all(|r| !misplaced(r.key.as_deref().unwrap_or_default())));
    assert_exactly_once(&output, &s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn state_ahead_of_a_recreated_output_topic_stops_the_worker_before_it_publishes() {
    let topics = topics("recreated");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(800, 0, 0, 0);
    let producer = traffic_producer(&brokers);
    produce_traffic(&producer, &topics.input, PARTITIONS, &s.records).await.expect("produce");
    let state = tempfile::tempdir().expect("state dir");

    // A first life publishes everything and applies it to durable state.
    let (stop, first, metrics1) =
        spawn_worker_with(settings(&brokers, "recreated", &topics, DeliveryMode::AtLeastOnce), parts_in(state.path()));
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics1) >= s.records.len() as u64).await);
    let _ = stop.send(());
    first.await.expect("join").expect("first life");

    // The output topic is "recreated" (here: a new, empty one). The state
    // still says it applied output up to some offset of every partition.
    let mut recreated = topics.clone();
    recreated.output = "recreated-out-2".into();
    mock.create_topic(&recreated.output, PARTITIONS, 1).expect("topic");
    let (parts2, _) = parts_in(state.path());
    let err = tokio::time::timeout(
        Duration::from_secs(60),
        run(settings(&brokers, "recreated-2", &recreated, DeliveryMode::AtLeastOnce), parts2, std::future::pending()),
    )
    .await
    .expect("the worker must stop on its own")
    .expect_err("state ahead of the output must stop the worker");
    assert!(matches!(err, KafkaError::StateAheadOfOutput { .. }), "{err}");
    assert_eq!(high_watermarks(&brokers, &recreated.output, PARTITIONS), vec![0; PARTITIONS as usize], "published");
}

/// A worker over in-memory state whose engine limits are `limits`.
fn parts_with_limits(
    limits: dedupd::event::Limits,
) -> (dedupd::kafka::WorkerParts, std::sync::Arc<dedupd::metrics::Metrics>) {
    use dedupd::config::EngineSettings;
    use dedupd::kafka::StateEngine;
    use dedupd::state::LocalState;
    let metrics = std::sync::Arc::new(dedupd::metrics::Metrics::new());
    let engine = EngineSettings { limits, ..EngineSettings::default() };
    let parts = dedupd::kafka::WorkerParts {
        validator: engine.validator(),
        engine: Box::new(StateEngine::new(LocalState::in_memory(engine.clone(), true), engine.validator())),
        clock: std::sync::Arc::new(dedupd::classify::SystemClock),
        metrics: metrics.clone(),
    };
    (parts, metrics)
}

/// The record of the report: ~33 KB of input whose canonical form is ~98 KB
/// (sixteen dimensions of 1 KiB of `\b`, each 6 bytes once escaped).
fn escape_heavy(id: &str) -> dedupd::kafka::demo::TrafficRecord {
    let now = dedupd::classify::Clock::now_ms(&dedupd::classify::SystemClock);
    let mut v = format!(
        r#"{{"event_id":"{id}","tenant_id":"acme","customer_id":"c","meter":"m","quantity":1,"timestamp":{now},"dimensions":{{"#
    );
    for d in 0..16 {
        if d > 0 {
            v.push(',');
        }
        v.push_str(&format!("\"d{d:02}\":\"{}\"", "\\b".repeat(1024)));
    }
    v.push_str("}}");
    dedupd::kafka::demo::TrafficRecord { key: Some(format!("acme\0{id}").into_bytes()), value: Some(v.into_bytes()) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_too_large_to_publish_is_rejected_and_the_committed_offset_passes_it() {
    let topics = topics("poison");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(600, 0, 0, 0);
    let producer = traffic_producer(&brokers);
    // The poison record sits in the middle of partition 0's input.
    let (head, tail) = s.records.split_at(300);
    produce_traffic(&producer, &topics.input, PARTITIONS, head).await.expect("produce");
    let poison = escape_heavy("poison");
    produce_traffic(&producer, &topics.input, PARTITIONS, std::slice::from_ref(&poison)).await.expect("produce");
    produce_traffic(&producer, &topics.input, PARTITIONS, tail).await.expect("produce");

    // The producer sends at most 50 kB: the poison's canonical form (~98 KB)
    // could never be published, so acceptance must turn it away.
    let mut settings = settings(&brokers, "poison", &topics, DeliveryMode::AtLeastOnce);
    settings.kafka_properties.push(("producer.message.max.bytes".into(), "50000".into()));
    settings.max_rejected_raw_bytes = 8 << 10;
    let limits = dedupd::event::Limits { max_output_bytes: 32 << 10, ..Default::default() };
    let (stop, worker, metrics) = spawn_worker_with(settings, parts_with_limits(limits));
    let total = s.records.len() as u64 + 1;
    let done = wait_until(Duration::from_secs(60), || {
        buckets_total(&metrics) >= total
            && committed(&brokers, "poison", &topics.input, PARTITIONS)
                == high_watermarks(&brokers, &topics.input, PARTITIONS)
    })
    .await;
    assert!(done, "the committed offsets never passed the poison record");
    let _ = stop.send(());
    let report = worker.await.expect("join").expect("run");
    assert_eq!(report.rejected, 1);
    assert_exactly_once(&read_topic(&brokers, &topics.output), &s);
    let rejected = read_topic(&brokers, &topics.rejected);
    assert_eq!(rejected.len(), 1, "exactly the poison on the rejected topic");
    assert_eq!(rejected[0].header(dedupd::kafka::records::H_REASON), Some(&b"record_too_large"[..]));
    assert_eq!(rejected[0].value.as_ref().map(Vec::len), Some(8 << 10), "raw bytes truncated to the bound");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transaction_commit_delayed_past_its_timeout_is_resumed_and_the_worker_catches_up() {
    let topics = topics("slow-commit");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(3000, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    let (half1, half2) = s.records.split_at(s.records.len() / 2);
    produce_traffic(&producer, &topics.input, PARTITIONS, half1).await.expect("produce");

    let mut settings = settings(&brokers, "slow-commit", &topics, DeliveryMode::ExactlyOnce);
    settings.instance_id = Some("w1".into());
    // Short timeouts, so the injected delay outlasts several calls.
    settings.operation_timeout = Duration::from_secs(2);
    settings.revoke_timeout = Duration::from_secs(60);
    settings.kafka_properties.push(("producer.transaction.timeout.ms".into(), "60000".into()));
    let (stop, worker, metrics) = spawn_worker(settings);
    assert!(wait_until(Duration::from_secs(60), || metrics.transactions(true) > 0).await, "no first commit");

    // Every broker answers 3 s late for a while: commits (and anything else
    // mid-transaction) time out on the client, whose outcome is unknown.
    for b in 1..=3 {
        mock.broker_round_trip_time(b, Duration::from_secs(3)).expect("rtt");
    }
    produce_traffic(&producer, &topics.input, PARTITIONS, half2).await.expect("produce");
    // The delay stays until it has caused a fault: calls timed out and were
    // resumed or aborted. (A fixed 8 s left ~3 s of margin: the mock answers
    // each fetch 3 s late, so the worker met the second half ~6 s in.)
    let faults = || metrics.transaction_resumes() + metrics.transactions(false) + metrics.publish_retries("timeout");
    let faulted = wait_until(Duration::from_secs(60), || faults() > 0).await;
    for b in 1..=3 {
        mock.broker_round_trip_time(b, Duration::ZERO).expect("rtt");
    }
    assert!(faulted, "the injected delay caused no resumed or aborted transaction in 60 s");
    let total = s.records.len() as u64;
    assert!(
        wait_until(Duration::from_secs(120), || buckets_total(&metrics) >= total).await,
        "the worker did not catch up once the delay was removed"
    );
    assert!(metrics.is_healthy(), "the worker recovered");
    stop_and_check_exactly_once((stop, worker), &brokers, &topics, "slow-commit", &s).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_fenced_by_another_process_with_its_instance_id_stops_and_says_so() {
    let topics = topics("fenced");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(300, 0, 0, 0);
    produce_traffic(&traffic_producer(&brokers), &topics.input, PARTITIONS, &s.records).await.expect("produce");
    let mut settings = settings(&brokers, "fenced", &topics, DeliveryMode::AtLeastOnce);
    settings.instance_id = Some("pod-0".into());
    let (_stop, worker, metrics) = spawn_worker(settings);
    assert!(wait_until(Duration::from_secs(60), || metrics.is_ready()).await, "never ready");
    // What the coordinator answers a static member whose instance id another
    // process has taken over (KIP-345). The mock cluster does not fence on
    // its own, so the answer is injected.
    mock.request_errors(RDKafkaApiKey::Heartbeat, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_FENCED_INSTANCE_ID; 20]);
    let err = tokio::time::timeout(Duration::from_secs(60), worker)
        .await
        .expect("a fenced worker must stop on its own")
        .expect("join")
        .expect_err("and fail");
    let text = err.to_string();
    assert!(matches!(err, KafkaError::ConsumerFatal { .. }), "{text}");
    assert!(text.contains("FencedInstanceId") && text.contains("--instance-id") && text.contains("pod-0"), "{text}");
    assert!(!metrics.is_healthy(), "/healthz fails while it stops");
}

/// An exactly-once worker (`instance`, group `name`) that has processed the
/// first half of `s` and is retrying every batch of the second: each
/// transaction aborts (AddPartitionsToTxn answered UNKNOWN_PRODUCER_ID) and
/// at least three have. Its revoke timeout outlasts the tests' waits, so a
/// revoke that tried to finish the retrying batches fails the test instead
/// of aborting the test process.
struct RetryingWorker {
    mock: MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    brokers: String,
    topics: Topics,
    stop: tokio::sync::oneshot::Sender<()>,
    worker: tokio::task::JoinHandle<Result<dedupd::kafka::RunReport, KafkaError>>,
    metrics: std::sync::Arc<dedupd::metrics::Metrics>,
    /// Keys of the second half's records.
    second_half: std::collections::HashSet<Vec<u8>>,
}

async fn every_batch_retrying(name: &str, instance: &str, s: &Scenario) -> RetryingWorker {
    let topics = topics(name);
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let producer = traffic_producer(&brokers);
    let (half1, half2) = s.records.split_at(s.records.len() / 2);
    produce_traffic(&producer, &topics.input, PARTITIONS, half1).await.expect("produce");
    let mut settings = settings(&brokers, name, &topics, DeliveryMode::ExactlyOnce);
    settings.instance_id = Some(instance.into());
    settings.revoke_timeout = Duration::from_secs(120);
    let (stop, worker, metrics) = spawn_worker(settings);
    let first = half1.len() as u64;
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics) >= first).await, "first half");
    let aborted_before = metrics.transactions(false);
    mock.request_errors(
        RDKafkaApiKey::AddPartitionsToTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_UNKNOWN_PRODUCER_ID; 5000],
    );
    produce_traffic(&producer, &topics.input, PARTITIONS, half2).await.expect("produce");
    assert!(
        wait_until(Duration::from_secs(60), || metrics.transactions(false) >= aborted_before + 3).await,
        "the fault did not happen: no batch is retrying"
    );
    let second_half = half2.iter().filter_map(|r| r.key.clone()).collect();
    RetryingWorker { mock, brokers, topics, stop, worker, metrics, second_half }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fenced_worker_gives_up_its_retrying_batches_instead_of_publishing_behind_the_new_owner() {
    let s = scenario(2000, 0, 0, 0);
    let r = every_batch_retrying("fenced-retrying", "pod-0", &s).await;
    let (mock, brokers, topics, metrics) = (&r.mock, &r.brokers, &r.topics, &r.metrics);
    // ...when another process takes over this worker's --instance-id.
    mock.request_errors(RDKafkaApiKey::Heartbeat, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_FENCED_INSTANCE_ID; 20]);
    // The partitions are no longer this process's: it must give them up at
    // once, not go on retrying batches the new owner will consume.
    let released = wait_until(Duration::from_secs(30), || metrics.assigned_partitions() == 0).await;
    // Only now could a retry succeed: one that did would publish the second
    // half behind the new owner's repair, which in at-least-once mode (or
    // with a broker slow to fence) bills it twice.
    mock.clear_request_errors(RDKafkaApiKey::AddPartitionsToTxn);
    assert!(released, "a fenced worker kept retrying its batches instead of giving its partitions up");
    let err = tokio::time::timeout(Duration::from_secs(60), r.worker)
        .await
        .expect("a fenced worker must stop on its own")
        .expect("join")
        .expect_err("and fail");
    assert!(matches!(err, KafkaError::ConsumerFatal { .. }), "{err}");
    let late = read_topic(brokers, &topics.output)
        .iter()
        .filter(|o| o.key.as_ref().is_some_and(|k| r.second_half.contains(k)))
        .count();
    assert_eq!(late, 0, "a fenced worker published after losing its partitions");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_assignment_abandons_its_batches_and_output_stays_exactly_once() {
    let topics = topics("lost");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(4000, 20, 5, 5);
    let producer = traffic_producer(&brokers);
    let (half1, half2) = s.records.split_at(s.records.len() / 2);
    produce_traffic(&producer, &topics.input, PARTITIONS, half1).await.expect("produce");
    let (stop, worker, metrics) = spawn_worker(settings(&brokers, "lost", &topics, DeliveryMode::AtLeastOnce));
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics) > 0).await);
    // The coordinator no longer knows this generation: librdkafka revokes
    // everything as lost, then rejoins.
    let (p2, input, rest) = (producer.clone(), topics.input.clone(), half2.to_vec());
    let late = tokio::spawn(async move { produce_traffic(&p2, &input, PARTITIONS, &rest).await });
    mock.request_errors(RDKafkaApiKey::Heartbeat, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION; 3]);
    // The next heartbeat meets the error. Waited for here, while the worker
    // runs: it once came only while the worker was stopping (its revoke
    // waited three seconds), and the test then showed nothing mid-stream.
    use dedupd::metrics::Rebalanced;
    let lost = wait_until(Duration::from_secs(30), || Rebalanced::count(&metrics, "lost") >= 1).await;
    assert!(lost, "the fault did not happen: no lost assignment while the worker ran");
    late.await.expect("join").expect("produce");
    let total = s.records.len() as u64;
    let caught_up = wait_until(Duration::from_secs(90), || {
        buckets_total(&metrics) >= total
            && committed(&brokers, "lost", &topics.input, PARTITIONS)
                == high_watermarks(&brokers, &topics.input, PARTITIONS)
    })
    .await;
    assert!(caught_up, "worker did not catch up after losing its assignment");
    let _ = stop.send(());
    let report = worker.await.expect("join").expect("run");
    assert!(report.assignments_lost >= 1, "the report did not count the lost assignment");
    assert!(Rebalanced::count(&metrics, "assign") >= 1);
    check_outcome(&brokers, &topics, "lost", &s, DeliveryMode::AtLeastOnce);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_lost_assignment_abandons_the_batch_it_was_retrying_and_output_stays_exactly_once() {
    let s = scenario(3000, 20, 5, 5);
    let r = every_batch_retrying("lost-retrying", "w1", &s).await;
    let (mock, brokers, topics, metrics) = (&r.mock, &r.brokers, &r.topics, &r.metrics);
    let (stop, worker) = (r.stop, r.worker);
    use dedupd::metrics::Rebalanced;
    let (lost_before, assigned_before) = (Rebalanced::count(metrics, "lost"), Rebalanced::count(metrics, "assign"));
    // The coordinator no longer knows this generation: librdkafka revokes
    // everything as lost, then rejoins and is assigned again, once the
    // revoke callback has returned.
    mock.request_errors(RDKafkaApiKey::Heartbeat, &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_ILLEGAL_GENERATION; 3]);
    let rejoined = wait_until(Duration::from_secs(60), || {
        Rebalanced::count(metrics, "lost") > lost_before && Rebalanced::count(metrics, "assign") > assigned_before
    })
    .await;
    // Publishing works again only now: a revoke that tried to finish the
    // retrying batches would still be waiting on them, and no new
    // assignment could have come.
    mock.clear_request_errors(RDKafkaApiKey::AddPartitionsToTxn);
    assert!(rejoined, "no rejoin after the lost assignment: the revoke waited on the retrying batches");
    // Counted by accepted events, not by records: the mock keeps no offsets
    // committed in a transaction, so the new assignment reads the input
    // from its start again, and the first half comes back as replays (which
    // it is only if the new assignment's repair restored what the lost one
    // knew: a worker without a state directory must read its output again).
    let valid = s.first_payload.len() as u64;
    let accepted = || metrics.events(dedupd::metrics::Bucket::accepted);
    assert!(wait_until(Duration::from_secs(90), || accepted() >= valid).await, "no catch-up");
    let _ = stop.send(());
    let report = worker.await.expect("join").expect("run");
    assert!(report.batches_abandoned >= 1, "no in-flight batch was abandoned: {report:?}");
    assert_exactly_once(&read_topic(brokers, &topics.output), &s);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_least_once_publish_waits_for_every_record_handed_over_before_it_reports_a_failure() {
    use dedupd::kafka::publisher::{PublishError, Publisher};
    use dedupd::kafka::records::{Destination, OutRecord};
    use rdkafka::consumer::{BaseConsumer, Consumer};
    let topics = topics("handed-over");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    // A long linger: a publish that reported the failure without waiting
    // would leave the first record in the producer's queue for seconds.
    let producer: rdkafka::producer::FutureProducer = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &brokers)
        .set("enable.idempotence", "true")
        .set("linger.ms", "3000")
        .set("message.max.bytes", "10000")
        .create()
        .expect("producer");
    // Created (and connected) up front, so reading the end of the output
    // right after the failure takes milliseconds, not a linger.
    let probe: BaseConsumer = rdkafka::ClientConfig::new().set("bootstrap.servers", &brokers).create().expect("probe");
    assert_eq!(probe.fetch_watermarks(&topics.output, 0, Duration::from_secs(10)).expect("watermarks").1, 0);
    let record = |len: usize| OutRecord {
        destination: Destination::Output,
        partition: 0,
        key: Some(b"k".to_vec()),
        value: Some(vec![b'x'; len]),
        headers: vec![],
        passthrough_headers: vec![],
        timestamp_ms: 1,
    };
    let publisher = Publisher::Idempotent { producer: producer.clone(), topics: std::sync::Arc::new(topics.clone()) };
    // The first record is handed to the producer (and lingers); the second
    // is refused at once. The failure must come back only once the first
    // is acknowledged or failed, never while it may still land.
    let err = publisher
        .publish(0, vec![record(10), record(50_000)], Some(1), Default::default())
        .await
        .expect_err("too large");
    assert!(matches!(err, PublishError::Permanent { .. }), "{err}");
    let (_, end) = probe.fetch_watermarks(&topics.output, 0, Duration::from_secs(10)).expect("watermarks");
    assert_eq!(end, 1, "the failure was reported while the first record had not landed yet");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_lag_gauge_reaches_zero_once_the_input_is_consumed_in_exactly_once_mode() {
    let topics = topics("eos-lag");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let s = scenario(1500, 20, 5, 5);
    produce_traffic(&traffic_producer(&brokers), &topics.input, PARTITIONS, &s.records).await.expect("produce");
    let mut settings = settings(&brokers, "eos-lag", &topics, DeliveryMode::ExactlyOnce);
    settings.instance_id = Some("w1".into());
    let (stop, worker, metrics) = spawn_worker(settings);
    let total = s.records.len() as u64;
    assert!(wait_until(Duration::from_secs(60), || buckets_total(&metrics) >= total).await, "not consumed");
    // Offsets commit through the transaction, out of the consumer's sight:
    // the gauge must follow what was processed, not the consumer's commits.
    let lags = || (0..PARTITIONS).map(|p| metrics.consumer_lag(p)).collect::<Vec<_>>();
    let zero = wait_until(Duration::from_secs(20), || lags().iter().all(|l| *l == Some(0))).await;
    assert!(zero, "lag gauge still {:?} after all input was processed", lags());
    let _ = stop.send(());
    worker.await.expect("join").expect("run");
    // Side topics exactly, as exactly-once promises. The mock writes no
    // transaction markers, so an aborted transaction's side records would
    // stay visible; with no abort in this fault-free run, each conflict and
    // reject must be there exactly once.
    let aborted = metrics.transactions(false);
    let conflicts = read_topic(&brokers, &topics.conflicts).len() as u64;
    let rejected = rejected_count(&read_topic(&brokers, &topics.rejected)) as u64;
    if aborted == 0 {
        assert_eq!((conflicts, rejected), (s.conflicts, s.invalid), "side topics in exactly-once mode");
    } else {
        assert!(conflicts >= s.conflicts && rejected >= s.invalid, "{aborted} aborts, side topics short");
    }
    assert_exactly_once(&read_topic(&brokers, &topics.output), &s);
}

/// Local state whose upkeep fails as a poisoned store's does (a failed
/// fsync or background flush): every other call goes to the real engine.
struct FailingUpkeep(Box<dyn dedupd::kafka::engine::Engine>);

impl dedupd::kafka::engine::Engine for FailingUpkeep {
    fn assign(&mut self, partition: i32, now_ms: i64) -> Result<(), dedupd::kafka::engine::EngineError> {
        self.0.assign(partition, now_ms)
    }
    fn assign_all(&mut self, partitions: &[i32], now_ms: i64) -> Result<(), dedupd::kafka::engine::EngineError> {
        self.0.assign_all(partitions, now_ms)
    }
    fn revoke(&mut self, partition: i32) {
        self.0.revoke(partition)
    }
    fn checkpoint(&self, partition: i32) -> Option<i64> {
        self.0.checkpoint(partition)
    }
    fn furthest_checkpoint(&self, partition: i32) -> Option<i64> {
        self.0.furthest_checkpoint(partition)
    }
    fn horizon(&self) -> Duration {
        self.0.horizon()
    }
    fn validator(&self) -> dedupd::event::Validator {
        self.0.validator()
    }
    fn classify_validated(
        &self,
        partition: i32,
        batch: dedupd::classify::Validated,
        now_ms: i64,
    ) -> Result<dedupd::kafka::engine::Classified, dedupd::kafka::engine::EngineError> {
        self.0.classify_validated(partition, batch, now_ms)
    }
    fn apply_published(
        &self,
        partition: i32,
        events: &[dedupd::kafka::engine::StoredEvent],
        now_ms: i64,
    ) -> Result<(), dedupd::kafka::engine::EngineError> {
        self.0.apply_published(partition, events, now_ms)
    }
    fn original(
        &self,
        partition: i32,
        id: &dedupd::event::IdHash,
        first_seen_ms: i64,
    ) -> Option<dedupd::event::UsageEvent> {
        self.0.original(partition, id, first_seen_ms)
    }
    fn ledger_preview(
        &self,
        partition: i32,
        accepted: &[(&dedupd::event::UsageEvent, i64)],
        replays: &dedupd::ledger::Replays<'_>,
    ) -> Result<Option<dedupd::ledger::Preview>, dedupd::kafka::engine::EngineError> {
        self.0.ledger_preview(partition, accepted, replays)
    }
    fn usage(
        &self,
        query: &dedupd::ledger::UsageQuery,
    ) -> Result<Option<dedupd::ledger::UsageAnswer>, dedupd::kafka::engine::EngineError> {
        self.0.usage(query)
    }
    fn stats(&self, now_ms: i64) -> dedupd::kafka::engine::EngineStats {
        self.0.stats(now_ms)
    }
    fn maintain(&mut self, _now_ms: i64) -> Result<(), dedupd::kafka::engine::EngineError> {
        Err(dedupd::kafka::engine::EngineError {
            operation: "maintain",
            partition: -1,
            source: "usage store is poisoned after an earlier failure (fsync: Input/output error)".into(),
        })
    }
    fn close(&mut self) -> Result<(), dedupd::kafka::engine::EngineError> {
        self.0.close()
    }
}

/// A worker whose local state can no longer be maintained (the usage store
/// poisoned by a failed fsync, say) stops with the error, even while its
/// partitions are idle, instead of staying up and ready on a store that
/// refuses every write: the restart recovers. Until 2026-11-27 it only
/// logged a warning and this test timed out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_local_state_upkeep_fails_stops_with_the_error() {
    let topics = topics("upkeep");
    let mock = cluster(&topics, PARTITIONS);
    let brokers = mock.bootstrap_servers();
    let (mut parts, _) = parts();
    parts.engine = Box::new(FailingUpkeep(parts.engine));
    let mut settings = settings(&brokers, "upkeep", &topics, DeliveryMode::AtLeastOnce);
    settings.maintain_interval = Duration::from_millis(200);
    let ended = tokio::time::timeout(Duration::from_secs(60), run(settings, parts, std::future::pending())).await;
    let err = ended.expect("the worker kept running on local state it could not maintain").expect_err("must stop");
    assert!(
        matches!(&err, KafkaError::Engine(e) if e.operation == "maintain" && e.to_string().contains("maintain")),
        "{err}"
    );
    assert!(format!("{err:?}").contains("poisoned"), "{err:?}");
}
