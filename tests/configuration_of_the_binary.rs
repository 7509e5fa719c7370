//! The binary's configuration as an operator meets it: Kafka properties from
//! file, environment and flags merged key by key, secrets that never appear
//! in `--help`, `check-config` or the start-up log, and JSON logs.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const SECRET: &str = "hunter2-do-not-print";
const SALT: &str = "pepper-do-not-print";

fn dedupd() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dedupd"));
    // Only what each test sets: no DEDUPD_* or RUST_LOG from the caller.
    c.env_clear().env("PATH", std::env::var_os("PATH").unwrap_or_default());
    c
}

/// A config file with the deployment's base properties, a secret file, and
/// the run flags every test shares.
fn setup(dir: &std::path::Path) -> Vec<String> {
    let config = dir.join("dedupd.toml");
    std::fs::write(
        &config,
        r#"
brokers = "127.0.0.1:1"
group = "billing"
input_topic = "usage-events"
output_topic = "usage-accepted"
conflicts_topic = "usage-conflicts"
rejected_topic = "usage-rejected"
delivery = "at-least-once"
kafka_properties = ["security.protocol=plaintext", "queued.max.messages.kbytes=16384", "sasl.mechanism=PLAIN"]
"#,
    )
    .expect("config");
    let secret = dir.join("kafka-password");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
    [
        "--config".into(),
        config.display().to_string(),
        "--kafka-property".into(),
        "queued.max.messages.kbytes=8192".into(),
        "--kafka-secret".into(),
        format!("sasl.password=file:{}", secret.display()),
    ]
    .to_vec()
}

#[test]
fn help_never_prints_secret_environment_values() {
    let out = dedupd()
        .args(["run", "--help"])
        .env("DEDUPD_KAFKA_PROPERTIES", format!("sasl.password={SECRET}"))
        .env("DEDUPD_DERIVE_SALT", SALT)
        .output()
        .expect("run --help");
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("--kafka-secret") && help.contains("DEDUPD_KAFKA_PROPERTIES"), "{help}");
    assert!(!help.contains(SECRET) && !help.contains(SALT), "--help printed a secret:\n{help}");
}

#[test]
fn check_config_merges_file_env_and_flags_key_by_key_and_masks_secrets() {
    let dir = tempfile::tempdir().expect("tmp");
    let args = setup(dir.path());
    let out = dedupd()
        .arg("check-config")
        .args(&args)
        .env("DEDUPD_KAFKA_PROPERTIES", "sasl.mechanism=SCRAM-SHA-512\nsasl.username=billing-svc\n")
        .env("DEDUPD_DERIVE_SALT", SALT)
        .output()
        .expect("check-config");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "check-config failed:\n{stdout}\n{stderr}");
    assert!(stdout.contains("configuration ok"), "{stdout}");
    // The file's key kept, the env's override, the flag's override, the secret masked.
    for want in [
        "security.protocol=plaintext",
        "sasl.mechanism=SCRAM-SHA-512",
        "sasl.username=billing-svc",
        "queued.max.messages.kbytes=8192",
        "sasl.password=***",
    ] {
        assert!(stdout.contains(want), "{want} missing from:\n{stdout}");
    }
    assert!(!stdout.contains("queued.max.messages.kbytes=16384"), "the flag did not win:\n{stdout}");
    assert!(!stdout.contains(SECRET) && !stdout.contains(SALT), "a secret was printed:\n{stdout}");
}

/// `DEDUPD_KAFKA_SECRETS` (one `KEY=file:PATH|env:VAR` per line) is read
/// like every other flag's variable; it was ignored, so a deployment that
/// set its SASL password there connected without one.
#[test]
fn kafka_secrets_are_read_from_their_variable_too() {
    let dir = tempfile::tempdir().expect("tmp");
    let config = dir.path().join("plain.toml");
    std::fs::write(&config, "brokers = \"127.0.0.1:1\"\ngroup = \"g\"\ninput_topic = \"i\"\noutput_topic = \"o\"\nconflicts_topic = \"c\"\nrejected_topic = \"r\"\n").expect("config");
    let secret = dir.path().join("password");
    std::fs::write(&secret, format!("{SECRET}\n")).expect("secret");
    let check = |secrets: &str| {
        dedupd()
            .arg("check-config")
            .arg("--config")
            .arg(&config)
            .env("DEDUPD_KAFKA_SECRETS", secrets)
            .env("TOKEN_VAR", "t0ken-do-not-print")
            .output()
            .expect("check-config")
    };
    let ok = check(&format!("sasl.password=file:{}\nsasl.oauthbearer.config=env:TOKEN_VAR\n", secret.display()));
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{stdout}{}", String::from_utf8_lossy(&ok.stderr));
    assert!(stdout.contains("sasl.password=***") && stdout.contains("sasl.oauthbearer.config=***"), "{stdout}");
    assert!(!stdout.contains(SECRET) && !stdout.contains("t0ken"), "a secret was printed:\n{stdout}");
    let missing = check("sasl.password=env:NO_SUCH_VARIABLE");
    assert_eq!(missing.status.code(), Some(2), "{missing:?}");
    assert!(String::from_utf8_lossy(&missing.stderr).contains("DEDUPD_KAFKA_SECRETS"), "{missing:?}");
}

#[test]
fn check_config_refuses_a_bad_configuration_naming_the_key() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut args = setup(dir.path());
    args.extend(["--hot-ttl".into(), "1d".into(), "--horizon".into(), "2d".into()]);
    let out = dedupd().arg("check-config").args(&args).output().expect("check-config");
    assert_eq!(out.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("horizon") && stderr.contains("max_event_age"), "{stderr}");

    let missing = dedupd()
        .arg("check-config")
        .args(&setup(dir.path())[..4])
        .args(["--kafka-secret", "sasl.password=env:KAFKA_PASSWORD"])
        .output()
        .expect("check-config");
    assert_eq!(missing.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("KAFKA_PASSWORD") && stderr.contains("sasl.password"), "{stderr}");
}

/// A pass-through of a property a guarantee rests on (input offsets
/// committed only after the publish, committed reads, fencing) with
/// another value than dedupd's own is refused from any source, scoped or
/// not, naming the key; dedupd's own value may be repeated, and other
/// properties pass.
#[test]
fn kafka_properties_that_would_turn_a_guarantee_off_are_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let check = |extra: &[&str], env: Option<&str>| {
        let mut c = dedupd();
        c.arg("check-config").args(setup(dir.path())).args(extra);
        if let Some(lines) = env {
            c.env("DEDUPD_KAFKA_PROPERTIES", lines);
        }
        c.output().expect("check-config")
    };
    for (key, bad, own) in [
        ("consumer.enable.auto.commit", "true", Some("false")),
        ("enable.auto.offset.store", "true", Some("false")),
        ("consumer.isolation.level", "read_uncommitted", Some("read_committed")),
        ("auto.offset.reset", "latest", Some("earliest")),
        ("group.id", "other", None),
        ("consumer.group.instance.id", "w9", None),
        ("producer.transactional.id", "shared", None),
        ("enable.idempotence", "false", Some("true")),
        ("partition.assignment.strategy", "range", Some("cooperative-sticky")),
    ] {
        let entry = format!("{key}={bad}");
        for (flags, env) in [(vec!["--kafka-property", entry.as_str()], None), (vec![], Some(entry.as_str()))] {
            let out = check(&flags, env);
            assert_eq!(out.status.code(), Some(2), "{key} via {flags:?} {env:?} was accepted");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(stderr.contains(&format!("`{key}`")) && stderr.contains("kafka_properties"), "{stderr}");
        }
        if let Some(own) = own {
            let same = check(&["--kafka-property", &format!("{key}={own}")], None);
            assert!(same.status.success(), "{key}={own}: {}", String::from_utf8_lossy(&same.stderr));
        }
    }
    let fine = check(&["--kafka-property", "consumer.session.timeout.ms=6000"], None);
    assert!(fine.status.success(), "{}", String::from_utf8_lossy(&fine.stderr));
}

/// `run` refuses settings that contradict each other (here a stall
/// timeout shorter than one broker call) before any I/O: its state
/// directory is not made, let alone opened and recovered.
#[test]
fn run_refuses_contradicting_settings_before_making_its_state_directory() {
    let dir = tempfile::tempdir().expect("tmp");
    let state = dir.path().join("state");
    let out = dedupd()
        .arg("run")
        .args(setup(dir.path()))
        .args(["--stall-timeout", "1s", "--state-dir"])
        .arg(&state)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("stall_timeout"), "{out:?}");
    assert!(!state.exists(), "run made its state directory before refusing its settings");

    // Zero timeouts no broker call can meet are refused, naming the key.
    for (key, zero) in [("operation-timeout", "0s"), ("revoke-timeout", "0s"), ("operation-timeout", "500us")] {
        let out = dedupd().arg("check-config").args(setup(dir.path())).args([&format!("--{key}"), zero]).output();
        let out = out.expect("check-config");
        assert_eq!(out.status.code(), Some(2), "{key} {zero}: {out:?}");
        assert!(String::from_utf8_lossy(&out.stderr).contains(&key.replace('-', "_")), "{out:?}");
    }
}

/// `--standby-replicas` from the flag or the file reaches the settings; a
/// standby beside a key store that drops revoked partitions is refused,
/// naming both settings.
#[test]
fn standby_replicas_are_resolved_and_refused_beside_a_key_store_that_drops_revoked_partitions() {
    let dir = tempfile::tempdir().expect("tmp");
    let args = setup(dir.path());
    let ok = dedupd().arg("check-config").args(&args).args(["--standby-replicas", "2"]).output().expect("check-config");
    let stdout = String::from_utf8_lossy(&ok.stdout);
    assert!(ok.status.success(), "{stdout}{}", String::from_utf8_lossy(&ok.stderr));
    assert!(stdout.contains("standby_replicas=2"), "{stdout}");
    let from_file = dir.path().join("standby.toml");
    let base = std::fs::read_to_string(dir.path().join("dedupd.toml")).expect("config");
    std::fs::write(&from_file, format!("{base}standby_replicas = 1\n")).expect("config");
    let out = dedupd().arg("check-config").arg("--config").arg(&from_file).output().expect("check-config");
    assert!(String::from_utf8_lossy(&out.stdout).contains("standby_replicas=1"), "{out:?}");

    let refused = dedupd()
        .arg("check-config")
        .args(&args)
        .args(["--standby-replicas", "1", "--keep-revoked-partitions", "false"])
        .output()
        .expect("check-config");
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--standby-replicas 1") && stderr.contains("--keep-revoked-partitions true"), "{stderr}");
    let negative =
        dedupd().arg("check-config").args(&args).args(["--standby-replicas", "-1"]).output().expect("check-config");
    assert_eq!(negative.status.code(), Some(2), "{negative:?}");
}

/// A rollups topic is what billing reads; the ledger is what fills it. With
/// the ledger off a worker would publish no rollups, and every reader of
/// that topic would see no usage: refused, from flags and from the file,
/// by `check-config` as by `run` (which refuses before connecting).
#[test]
fn a_rollups_topic_with_the_ledger_off_is_refused() {
    let dir = tempfile::tempdir().expect("tmp");
    let args = setup(dir.path());
    let with_rollups = |extra: &[&str]| {
        dedupd()
            .arg("check-config")
            .args(&args)
            .args(["--rollups-topic", "usage-rollups"])
            .args(extra)
            .output()
            .expect("run")
    };
    let ok = with_rollups(&[]);
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    for refused in [
        with_rollups(&["--ledger", "false"]),
        dedupd()
            .arg("run")
            .args(&args)
            .args(["--rollups-topic", "usage-rollups", "--ledger", "false"])
            .output()
            .expect("run"),
    ] {
        assert_eq!(refused.status.code(), Some(2), "{refused:?}");
        let stderr = String::from_utf8_lossy(&refused.stderr);
        assert!(stderr.contains("--rollups-topic usage-rollups needs --ledger true"), "{stderr}");
    }
    let from_file = dir.path().join("no-ledger.toml");
    let base = std::fs::read_to_string(dir.path().join("dedupd.toml")).expect("config");
    std::fs::write(&from_file, format!("{base}rollups_topic = \"usage-rollups\"\nledger = false\n")).expect("config");
    let out = dedupd().arg("check-config").arg("--config").arg(&from_file).output().expect("check-config");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
}

/// `state_dir` in a config file is a worker's key. `dedupe` ignored it: a
/// worker's file reused offline ran on in-memory state, counted every event
/// again and emptied the output. Taking it would point an offline run at a
/// worker's own state, so the run is refused before any file is touched;
/// `--state-dir` names an offline run's directory and wins over the file.
#[test]
fn dedupe_refuses_a_config_file_naming_a_state_dir_unless_the_flag_names_its_own() {
    let dir = tempfile::tempdir().expect("tmp");
    let worker_state = dir.path().join("worker-state");
    let config = dir.path().join("worker.toml");
    std::fs::write(&config, format!("state_dir = {:?}\n", worker_state.display().to_string())).expect("config");
    let input = dir.path().join("in.ndjson");
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).expect("clock").as_millis();
    std::fs::write(
        &input,
        format!(
            r#"{{"event_id":"e1","tenant_id":"acme","customer_id":"c","meter":"m","quantity":"1","timestamp":{now}}}"#
        ) + "\n",
    )
    .expect("input");
    let output = dir.path().join("out.ndjson");
    std::fs::write(&output, "kept\n").expect("an earlier output");
    let dedupe = |state: Option<&std::path::Path>| {
        let mut c = dedupd();
        c.args(["dedupe", "--config"]).arg(&config).arg("--input").arg(&input).arg("--output").arg(&output);
        if let Some(s) = state {
            c.arg("--state-dir").arg(s);
        }
        c.output().expect("dedupe")
    };
    let refused = dedupe(None);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("a worker's state directory") && stderr.contains("--state-dir"), "{stderr}");
    assert_eq!(std::fs::read_to_string(&output).expect("output"), "kept\n", "the output was touched");
    assert!(!worker_state.exists(), "the worker's state directory was made");

    std::fs::remove_file(&output).expect("a fresh output for a fresh state directory");
    let own = dir.path().join("offline-state");
    let ran = dedupe(Some(&own));
    assert!(ran.status.success(), "{}", String::from_utf8_lossy(&ran.stderr));
    assert!(own.join("usage").is_dir() && !worker_state.exists(), "the flag's directory, not the file's");
}

#[test]
fn the_start_up_log_line_is_json_names_the_version_and_masks_secrets() {
    let dir = tempfile::tempdir().expect("tmp");
    let args = setup(dir.path());
    let mut child = dedupd()
        .arg("run")
        .args(&args)
        .args(["--log-format", "json"])
        .env("RUST_LOG", "info")
        .env("DEDUPD_DERIVE_SALT", SALT)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn run");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = Vec::new();
    let start = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if line.contains("dedupd starting") {
                    break line;
                }
                seen.push(line);
            }
            Err(_) => panic!("no start-up line within 30 s; stderr so far:\n{}", seen.join("\n")),
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    let v: serde_json::Value = serde_json::from_str(&start).unwrap_or_else(|e| panic!("not JSON ({e}): {start}"));
    let fields = &v["fields"];
    assert_eq!(fields["version"], env!("CARGO_PKG_VERSION"), "{start}");
    let run = fields["run"].as_str().expect("run settings");
    assert!(run.contains("sasl.password=***") && run.contains("queued.max.messages.kbytes=8192"), "{run}");
    assert!(!start.contains(SECRET) && !start.contains(SALT), "the start-up line printed a secret: {start}");
    assert!(!start.contains('\u{1b}'), "colour codes in a log that is not a terminal: {start}");
}

/// `--rollups-interval` defaults to 5 s, reads the flag or the file, and a
/// value past the 60 s bound is refused naming the key (a crash replays up
/// to that much input).
#[test]
fn the_rollups_interval_is_resolved_and_bounded() {
    let dir = tempfile::tempdir().expect("tmp");
    let args = setup(dir.path());
    let shown = |out: &std::process::Output| String::from_utf8_lossy(&out.stdout).into_owned();
    let default = dedupd().arg("check-config").args(&args).output().expect("check-config");
    assert!(default.status.success(), "{default:?}");
    assert!(shown(&default).contains("rollups_interval=5s"), "{}", shown(&default));
    let flag = dedupd().arg("check-config").args(&args).args(["--rollups-interval", "0s"]).output().expect("run");
    assert!(shown(&flag).contains("rollups_interval=0s"), "{}", shown(&flag));
    let from_file = dir.path().join("interval.toml");
    let base = std::fs::read_to_string(dir.path().join("dedupd.toml")).expect("config");
    std::fs::write(&from_file, format!("{base}rollups_interval = \"30s\"\n")).expect("config");
    let file = dedupd().arg("check-config").arg("--config").arg(&from_file).output().expect("check-config");
    assert!(shown(&file).contains("rollups_interval=30s"), "{file:?}");

    let refused = dedupd().arg("check-config").args(&args).args(["--rollups-interval", "2m"]).output().expect("run");
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("rollups_interval") && stderr.contains("60s"), "{stderr}");
}
