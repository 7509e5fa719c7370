//! A real Kafka-protocol broker for the end-to-end tests and the benchmark:
//! Tansu (DESIGN §11), started on a free loopback port in its own temp
//! directory and killed on drop.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use dedupd::kafka::Topics;

fn tansu_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("TANSU_BIN") {
        return Some(PathBuf::from(p));
    }
    let mut dirs: Vec<PathBuf> =
        std::env::var_os("PATH").map(|p| std::env::split_paths(&p).collect()).unwrap_or_default();
    if let Some(home) = std::env::var_os("HOME").map(PathBuf::from) {
        // scripts/setup's pinned install comes first, then cargo's own.
        let tools = std::env::var_os("DEDUPD_TOOLS").map(PathBuf::from);
        dirs.insert(0, tools.unwrap_or_else(|| home.join(".cache/dedupd-tools")).join("bin"));
        dirs.push(home.join(".cargo/bin"));
    }
    dirs.into_iter().map(|d| d.join("tansu")).find(|p| p.is_file())
}

pub struct Tansu {
    child: Child,
    bin: PathBuf,
    url: String,
    /// `host:port` for `bootstrap.servers`.
    pub brokers: String,
    dir: Option<tempfile::TempDir>,
    /// The sqlite database file, when that is the storage engine.
    sqlite: Option<PathBuf>,
    indexed: std::cell::Cell<bool>,
}

impl Tansu {
    /// The broker's process id (for its CPU time, `scripts/bench`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether a consumer can resume or stop at an offset on this broker:
    /// the sqlite engine can; the memory engine answers the latest offset
    /// short of the last batch's end (DESIGN §11), so a repair waiting for
    /// every record never finishes there.
    pub fn seeks(&self) -> bool {
        self.sqlite.is_some()
    }

    /// Starts the broker. A missing `tansu` binary fails the test, however
    /// the suite is run: an end-to-end test that passes without its broker
    /// checked nothing. Storage is sqlite unless `DEDUPD_TANSU_STORAGE` names
    /// another engine (`memory://tansu/`).
    pub fn start() -> Tansu {
        let Some(bin) = tansu_binary() else {
            panic!(
                "the `tansu` broker is not installed, so this end-to-end test cannot run: install it with \
                 `DEDUPD_E2E=1 scripts/setup` (or `cargo install tansu --version 0.6.0 --locked --features \
                 dynostore,libsql`, or point TANSU_BIN at it)"
            );
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let dir = tempfile::tempdir().expect("tempdir");
        eprintln!("tansu on 127.0.0.1:{port}, data and log in {}", dir.path().display());
        let url = format!("tcp://127.0.0.1:{port}");
        let storage = std::env::var("DEDUPD_TANSU_STORAGE").unwrap_or_else(|_| "sqlite://tansu.db".into());
        let log = std::fs::File::create(dir.path().join("tansu.log")).expect("log");
        let child = Command::new(&bin)
            .arg("broker")
            .args(["--storage-engine", &storage])
            .args(["--listener-url", &url, "--advertised-listener-url", &url])
            .current_dir(dir.path())
            // Never more than warn: Tansu's debug level writes gigabytes a
            // minute under load and fills the disk.
            .env("RUST_LOG", "warn")
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start tansu");
        let sqlite = storage.strip_prefix("sqlite://").map(|f| dir.path().join(f));
        Tansu {
            child,
            bin,
            url,
            brokers: format!("127.0.0.1:{port}"),
            dir: Some(dir),
            sqlite,
            indexed: std::cell::Cell::new(false),
        }
    }

    /// Indexes Tansu 0.6's sqlite `header` table by record. Tansu creates it
    /// without one and looks up every fetched record's headers by
    /// (topition, offset_id), so each fetched record scans every header ever
    /// written: reading dedupd's output (four headers per record) back
    /// slows quadratically, until repair and the tests' readers stall for
    /// minutes. The index changes no answer, only the broker's speed. Runs
    /// once the broker has created its schema (after the first topic).
    fn index_headers(&self) {
        let Some(db) = &self.sqlite else { return };
        if self.indexed.replace(true) {
            return;
        }
        let script = "import sqlite3, sys\n\
                      c = sqlite3.connect(sys.argv[1], timeout=30)\n\
                      c.execute('create index if not exists dedupd_test_header_by_record on header (topition, offset_id)')\n\
                      c.commit()\n";
        let out = Command::new("python3").args(["-c", script]).arg(db).output().expect("python3 (for sqlite3)");
        assert!(
            out.status.success(),
            "indexing tansu's header table in {}: {}",
            db.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Retention, as the broker's log cleaner would apply it: deletes every
    /// record of `topic` partition `p` below `log_start[p]` and moves the
    /// partition's log start there. Tansu 0.6's sqlite engine does not
    /// implement DeleteRecords (`todo!()`), so this edits its database the
    /// way retention would leave it: ListOffsets(earliest) answers the
    /// smallest stored offset, which is then `log_start[p]`.
    pub fn apply_retention(&self, topic: &str, log_start: &[i64]) {
        let db = self.sqlite.as_ref().expect("retention is applied through the sqlite engine's database");
        let script = "import sqlite3, sys\n\
                      c = sqlite3.connect(sys.argv[1], timeout=30)\n\
                      for p, keep in enumerate(int(x) for x in sys.argv[3].split(',')):\n\
                      \x20   (tp,) = c.execute('select tp.id from topition tp join topic t on tp.topic = t.id \
                      where t.name = ? and tp.partition = ?', (sys.argv[2], p)).fetchone()\n\
                      \x20   c.execute('delete from header where topition = ? and offset_id < ?', (tp, keep))\n\
                      \x20   c.execute('delete from record where topition = ? and offset_id < ?', (tp, keep))\n\
                      \x20   c.execute('update watermark set low = ? where topition = ?', (keep, tp))\n\
                      c.commit()\n";
        let starts = log_start.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
        let out = Command::new("python3")
            .args(["-c", script])
            .arg(db)
            .arg(topic)
            .arg(&starts)
            .output()
            .expect("python3 (for sqlite3)");
        assert!(
            out.status.success(),
            "applying retention to {topic} in {}: {}",
            db.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Creates a topic, retrying until the broker answers.
    pub fn create_topic(&self, name: &str, partitions: i32) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let out = Command::new(&self.bin)
                .args(["topic", "create", name, "--partitions", &partitions.to_string(), "--broker", &self.url])
                .output()
                .expect("tansu topic create");
            if out.status.success() {
                self.index_headers();
                return;
            }
            assert!(Instant::now() < deadline, "tansu never created {name}: {}", String::from_utf8_lossy(&out.stderr));
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// The four topics, input and output co-partitioned.
    pub fn create_topics(&self, t: &Topics, partitions: i32) {
        self.create_topic(&t.input, partitions);
        self.create_topic(&t.output, partitions);
        self.create_topic(&t.conflicts, 1);
        self.create_topic(&t.rejected, 1);
        if let Some(rollups) = &t.rollups {
            self.create_topic(rollups, 2);
        }
        if let Some(periods) = &t.periods {
            self.create_topic(periods, 1);
        }
    }
}

impl Drop for Tansu {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        // `DEDUPD_KEEP_TANSU=1` keeps the broker's data and log for a
        // post-mortem.
        if let (Some(dir), true) = (self.dir.take(), std::env::var_os("DEDUPD_KEEP_TANSU").is_some()) {
            eprintln!("kept tansu dir {}", dir.keep().display());
        }
    }
}
