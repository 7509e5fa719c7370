//! A live scrape of the real binary: `dedupd demo` runs the worker on an
//! in-process Kafka and serves `/metrics`; while it runs, the page is
//! scraped. Every metric `deploy/metrics.txt` lists (and so every metric the
//! dashboard and alerts query, which `scripts/check-deploy` checks against
//! that list) must be on the page. The page is saved for
//! `scripts/check-deploy --metrics` (run by `scripts/test`).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn scrape(addr: SocketAddr) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(500)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").ok()?;
    let mut buf = String::new();
    s.read_to_string(&mut buf).ok()?;
    let (head, body) = buf.split_once("\r\n\r\n")?;
    head.starts_with("HTTP/1.1 200").then(|| body.to_owned())
}

/// A page split into its families: each `# HELP` line starts one, and its
/// `# TYPE` line and samples follow.
fn families(page: &str) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = Vec::new();
    for line in page.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split_whitespace().next().unwrap_or_default().to_owned();
            out.push((name, String::new()));
        }
        if let Some((_, block)) = out.last_mut() {
            block.push_str(line);
            block.push('\n');
        }
    }
    out
}

/// The family names a page declares (`# TYPE name kind`), with the suffix a
/// query uses: counters as `name_total` when the page names them so.
fn declared(page: &str) -> Vec<String> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn metrics_page_of_the_running_demo_names_every_deployed_metric() {
    let port = TcpListener::bind("127.0.0.1:0").expect("free port").local_addr().expect("addr").port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().expect("addr");
    let mut child = Command::new(env!("CARGO_BIN_EXE_dedupd"))
        .args(["demo", "--events", "3000", "--metrics-addr", &addr.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn demo");
    let started = Instant::now();
    // Families labelled by partition exist only while a partition is owned
    // and observed (lag from the first statistics tick, gone at revoke;
    // repair figures from the first repair), so no single scrape is sure to
    // hold every family at once. Keep each family's latest block from every
    // scrape of this one process: the page checked is the union, every block
    // of it printed by the binary.
    let mut seen: Vec<(String, String)> = Vec::new();
    let mut scraped = false;
    while started.elapsed() < Duration::from_secs(120) {
        if let Some(page) = scrape(addr) {
            scraped = true;
            for (name, block) in families(&page) {
                match seen.iter_mut().find(|(n, _)| *n == name) {
                    Some(slot) => slot.1 = block,
                    None => seen.push((name, block)),
                }
            }
        }
        if child.try_wait().expect("try_wait").is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = child.wait().expect("demo exits");
    assert!(status.success(), "demo failed");
    assert!(scraped, "scraped /metrics at least once while the demo ran");
    let page: String = seen.into_iter().map(|(_, block)| block).collect();
    let accepted = page
        .lines()
        .find_map(|l| l.strip_prefix("dedupd_events_total{bucket=\"accepted\"} "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(accepted > 0.0, "the page kept was scraped after events flowed:\n{page}");

    let names = declared(&page);
    let listed = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/metrics.txt")).expect("list");
    for line in listed.lines().filter(|l| !l.starts_with('#') && !l.trim().is_empty()) {
        let name = line.split_whitespace().next().expect("name");
        let family = name.strip_suffix("_total").unwrap_or(name);
        assert!(
            names.iter().any(|n| n == name || n == family),
            "deploy/metrics.txt lists {name}, which the binary does not export"
        );
    }
    let out = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dedupd-metrics-scrape.txt");
    std::fs::write(&out, &page).expect("save scrape");
}
