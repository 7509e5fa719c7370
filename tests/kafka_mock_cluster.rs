//! The worker against librdkafka's in-process mock cluster, with injected
//! faults: produce errors, transaction aborts, a broker outage, coordinator
//! moves, crashes and rebalances. After each, the output topic must hold
//! every valid id exactly once with its first payload, and input offsets
//! must cover everything (never ahead of output: a crash after an offset
//! commit that ran ahead would show up as a missing id).

mod kafka_common;

use std::time::Duration;

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
    let handle = tokio::spawn(run(settings, parts, async move {
        let _ = rx.await;
    }));
    (tx, handle, metrics)
}

fn buckets_total(m: &dedupd::metrics::Metrics) -> u64 {
    use dedupd::metrics::Bucket;
    Bucket::ALL.iter().map(|b| m.events(*b)).sum()
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
    mock.request_errors(
        RDKafkaApiKey::AddPartitionsToTxn,
        &[RDKafkaRespErr::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED],
    );
    produce_traffic(&producer, &topics.input, PARTITIONS, half2).await.expect("produce");
    // Move the transaction and group coordinators mid-stream.
    mock.coordinator(MockCoordinator::Transaction("dedupd-eos-faults-w1".into()), 2).expect("coordinator");
    mock.coordinator(MockCoordinator::Group("eos-faults".into()), 3).expect("coordinator");

    let total = s.records.len() as u64;
    assert!(wait_until(Duration::from_secs(90), || buckets_total(&metrics) >= total).await, "worker did not catch up");
    let _ = stop.send(());
    let report = worker.await.expect("join").expect("run");
    assert_eq!(report.conflict, s.conflicts);
    assert_eq!(report.rejected, s.invalid);
    check_outcome(&brokers, &topics, "eos-faults", &s, DeliveryMode::ExactlyOnce);
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
        let topics = topics(&format!("crash-{delivery}"));
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
    }
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
