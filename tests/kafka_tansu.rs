//! End to end on a real Kafka-protocol broker (Tansu, DESIGN §11), in
//! at-least-once mode: the worker runs as a separate process and is
//! SIGKILLed at random points under load, then restarted; afterwards the
//! output topic must hold every valid id exactly once with its first payload.
//!
//! The worker process is this test binary re-executed with
//! `DEDUPD_CHILD_WORKER` set (see [`child_worker_process_entry`]), so the test
//! needs nothing but the library; it runs the same `dedupd::kafka::run` the
//! `dedupd run` command does.
//!
//! Needs the `tansu` binary (`cargo install tansu --locked --features
//! dynostore,libsql`, or `TANSU_BIN`); without it every test here says so
//! loudly and passes without checking anything.

mod kafka_common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use dedupd::kafka::demo::produce_traffic;
use dedupd::kafka::{run, shutdown_signal, DeliveryMode, Topics};

use kafka_common::*;

const PARTITIONS: i32 = 4;

fn tansu_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TANSU_BIN") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME") {
        dirs.push(PathBuf::from(home).join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join("tansu")).find(|p| p.is_file())
}

/// A Tansu broker on a free loopback port, in its own temp directory,
/// killed on drop.
struct Tansu {
    child: Child,
    bin: PathBuf,
    url: String,
    brokers: String,
    _dir: tempfile::TempDir,
}

impl Tansu {
    fn start() -> Option<Tansu> {
        let Some(bin) = tansu_binary() else {
            eprintln!("\n*** SKIPPED: the `tansu` binary is not installed (cargo install tansu --locked --features dynostore,libsql); this end-to-end test checked NOTHING ***\n");
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let dir = tempfile::tempdir().expect("tempdir");
        let url = format!("tcp://127.0.0.1:{port}");
        let log = std::fs::File::create(dir.path().join("tansu.log")).expect("log");
        let child = Command::new(&bin)
            .arg("broker")
            .args(["--storage-engine", "sqlite://tansu.db"])
            .args(["--listener-url", &url, "--advertised-listener-url", &url])
            .current_dir(dir.path())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start tansu");
        Some(Tansu { child, bin, url, brokers: format!("127.0.0.1:{port}"), _dir: dir })
    }

    /// Creates a topic, retrying until the broker answers.
    fn create_topic(&self, name: &str, partitions: i32) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new(&self.bin)
                .args(["topic", "create", name, "--partitions", &partitions.to_string(), "--broker", &self.url])
                .output()
                .expect("tansu topic create");
            if out.status.success() {
                return;
            }
            assert!(Instant::now() < deadline, "tansu never created {name}: {}", String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn create_topics(&self, t: &Topics) {
        self.create_topic(&t.input, PARTITIONS);
        self.create_topic(&t.output, PARTITIONS);
        self.create_topic(&t.conflicts, 1);
        self.create_topic(&t.rejected, 1);
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts a worker process on `brokers`; its stderr goes to a file (a pipe
/// nobody drains could block it).
fn spawn_worker(brokers: &str, group: &str, topics: &Topics, instance: &str) -> Child {
    let exe = std::env::current_exe().expect("test binary");
    let log = std::env::temp_dir().join(format!("dedupd-child-{}-{group}-{instance}.log", std::process::id()));
    let log = std::fs::OpenOptions::new().create(true).append(true).open(log).expect("child log");
    Command::new(exe)
        .args(["child_worker_process_entry", "--exact", "--nocapture", "--ignored", "--test-threads=1"])
        .env("DEDUPD_CHILD_WORKER", "1")
        .env("DEDUPD_CHILD_BROKERS", brokers)
        .env("DEDUPD_CHILD_GROUP", group)
        .env(
            "DEDUPD_CHILD_TOPICS",
            format!("{},{},{},{}", topics.input, topics.output, topics.conflicts, topics.rejected),
        )
        .env("DEDUPD_CHILD_INSTANCE", instance)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("spawn worker process")
}

fn signal(child: &Child, sig: i32) {
    let pid = i32::try_from(child.id()).expect("pid");
    // SAFETY: kill(2) on our own child's pid; no memory is touched.
    let rc = unsafe { libc::kill(pid, sig) };
    assert_eq!(rc, 0, "kill({pid}, {sig})");
}

fn stderr_of(_child: &mut Child) -> String {
    format!("see {}/dedupd-child-{}-*.log", std::env::temp_dir().display(), std::process::id())
}

/// The worker process: runs only when re-executed by a test.
#[test]
#[ignore = "entry point of the worker child process; run by the Tansu tests"]
fn child_worker_process_entry() {
    if std::env::var("DEDUPD_CHILD_WORKER").is_err() {
        return;
    }
    let var = |k: &str| std::env::var(k).unwrap_or_else(|_| panic!("{k} missing"));
    let t: Vec<String> = var("DEDUPD_CHILD_TOPICS").split(',').map(str::to_owned).collect();
    let topics = Topics { input: t[0].clone(), output: t[1].clone(), conflicts: t[2].clone(), rejected: t[3].clone() };
    let mut s = settings(&var("DEDUPD_CHILD_BROKERS"), &var("DEDUPD_CHILD_GROUP"), &topics, DeliveryMode::AtLeastOnce);
    s.instance_id = Some(var("DEDUPD_CHILD_INSTANCE"));
    s.batch.max_records = 2000;
    s.batch.max_wait = Duration::from_millis(20);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    let (parts, _) = parts();
    match runtime.block_on(run(s, parts, shutdown_signal())) {
        Ok(report) => {
            eprintln!("worker stopped cleanly: {report:?}");
            std::process::exit(0);
        }
        Err(e) => {
            eprintln!("worker failed: {e}");
            std::process::exit(1);
        }
    }
}

fn all_input_done(brokers: &str, group: &str, topic: &str) -> bool {
    committed(brokers, group, topic, PARTITIONS) == high_watermarks(brokers, topic, PARTITIONS)
}

fn distinct_sources(records: &[ReadRecord]) -> usize {
    use dedupd::kafka::records::{H_SOURCE_OFFSET, H_SOURCE_PARTITION};
    let set: std::collections::HashSet<(Vec<u8>, Vec<u8>)> = records
        .iter()
        .map(|r| {
            (
                r.header(H_SOURCE_PARTITION).unwrap_or_default().to_vec(),
                r.header(H_SOURCE_OFFSET).unwrap_or_default().to_vec(),
            )
        })
        .collect();
    set.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_sigkilled_ten_times_under_load_still_publishes_every_id_exactly_once() {
    let Some(tansu) = Tansu::start() else { return };
    let topics = topics("crashloop");
    tansu.create_topics(&topics);
    let brokers = tansu.brokers.clone();
    let s = scenario(200_000, 10, 1, 5);
    eprintln!(
        "crash loop: {} input records ({} retries, {} conflicts, {} invalid)",
        s.records.len(),
        s.retries,
        s.conflicts,
        s.invalid
    );
    let producer = traffic_producer(&brokers);
    let (p, input, records) = (producer.clone(), topics.input.clone(), s.records.clone());
    let load = tokio::spawn(async move { produce_traffic(&p, &input, PARTITIONS, &records).await });

    let mut rng_state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng_state ^= rng_state << 13;
        rng_state ^= rng_state >> 7;
        rng_state ^= rng_state << 17;
        rng_state
    };
    let mut kills = 0;
    while kills < 10 {
        let mut child = spawn_worker(&brokers, "crashloop", &topics, "w1");
        let wait_ms = 1000 + next() % 4000;
        tokio::time::sleep(Duration::from_millis(wait_ms)).await;
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("worker exited on its own with {status}: {}", stderr_of(&mut child));
        }
        signal(&child, libc::SIGKILL);
        let _ = child.wait();
        kills += 1;
        eprintln!("SIGKILL #{kills} after {wait_ms} ms");
    }
    load.await.expect("join").expect("produce");

    let mut child = spawn_worker(&brokers, "crashloop", &topics, "w1");
    let deadline = Instant::now() + Duration::from_secs(400);
    while !all_input_done(&brokers, "crashloop", &topics.input) {
        assert!(Instant::now() < deadline, "final worker did not finish the input");
        if let Some(status) = child.try_wait().expect("try_wait") {
            panic!("worker exited on its own with {status}: {}", stderr_of(&mut child));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    signal(&child, libc::SIGTERM);
    let stop_deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            break status;
        }
        assert!(Instant::now() < stop_deadline, "worker did not exit within 60 s of SIGTERM");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let err = stderr_of(&mut child);
    assert!(status.success(), "SIGTERM must end the worker with exit 0, got {status}: {err}");

    let output = read_topic(&brokers, &topics.output);
    assert_exactly_once(&output, &s);
    // At-least-once mode: side topics may hold a record twice after a crash
    // (a conflict or reject published, then the offset commit lost), so the
    // check is on distinct input positions.
    let conflicts = read_topic(&brokers, &topics.conflicts);
    assert_eq!(distinct_sources(&conflicts) as u64, s.conflicts, "conflicts on the conflicts topic");
    let rejected = read_topic(&brokers, &topics.rejected);
    assert_eq!(distinct_sources(&rejected) as u64, s.invalid, "rejects on the rejected topic");
    eprintln!(
        "crash loop: output {} records for {} ids; conflicts topic {} ({} distinct); rejected {} ({} distinct)",
        output.len(),
        s.first_payload.len(),
        conflicts.len(),
        distinct_sources(&conflicts),
        rejected.len(),
        distinct_sources(&rejected)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn survivor_takes_over_a_sigkilled_peers_partitions_and_output_stays_exactly_once() {
    let Some(tansu) = Tansu::start() else { return };
    let topics = topics("pair");
    tansu.create_topics(&topics);
    let brokers = tansu.brokers.clone();
    let s = scenario(40_000, 10, 1, 5);
    let producer = traffic_producer(&brokers);
    let (p, input, records) = (producer.clone(), topics.input.clone(), s.records.clone());
    let load = tokio::spawn(async move { produce_traffic(&p, &input, PARTITIONS, &records).await });

    // The dead peer's partitions move when its session times out; the
    // survivor must repair them from the output topic before consuming.
    let mut a = spawn_worker(&brokers, "pair", &topics, "a");
    let mut b = spawn_worker(&brokers, "pair", &topics, "b");
    tokio::time::sleep(Duration::from_secs(6)).await;
    signal(&a, libc::SIGKILL);
    let _ = a.wait();
    load.await.expect("join").expect("produce");
    let deadline = Instant::now() + Duration::from_secs(300);
    while !all_input_done(&brokers, "pair", &topics.input) {
        assert!(Instant::now() < deadline, "survivor did not finish the input");
        if let Some(status) = b.try_wait().expect("try_wait") {
            panic!("survivor exited with {status}: {}", stderr_of(&mut b));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    signal(&b, libc::SIGTERM);
    let status = b.wait().expect("wait");
    assert!(status.success(), "survivor exit: {status}");
    let output = read_topic(&brokers, &topics.output);
    assert_exactly_once(&output, &s);
}
