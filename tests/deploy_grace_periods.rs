//! The orchestrators' grace periods cover dedupd's shutdown budget with a
//! margin. A SIGTERM starts an orderly shutdown that may take the revoke
//! timeout (in-flight batches) plus two operation timeouts (producer flush,
//! leaving the group); a grace period shorter than that SIGKILLs it half way.

use std::time::Duration;

use dedupd::kafka::{RunSettings, Topics};

/// Margin over the budget: a tenth of it, and at least 15 s for process
/// start-up of the signal path and scheduling on a busy node.
fn required(budget: Duration) -> Duration {
    budget + (budget / 10).max(Duration::from_secs(15))
}

fn default_budget() -> Duration {
    RunSettings::new("b", "g", Topics::of("i", "o", "c", "r")).shutdown_budget()
}

/// The value of the first line `key: N<unit>` in a deployment file.
fn seconds_of(file: &str, key: &str) -> Duration {
    seconds_after(file, "", key)
}

/// The value of the first line `key: N<unit>` after the first line that
/// starts with `section` (once trimmed) in a deployment file.
fn seconds_after(file: &str, section: &str, key: &str) -> Duration {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let line = text
        .lines()
        .map(str::trim)
        .skip_while(|l| !l.starts_with(section))
        .find(|l| l.starts_with(&format!("{key}:")))
        .unwrap_or_else(|| panic!("{file} has no {key}"));
    let value = line[key.len() + 1..].trim();
    let digits = value.trim_end_matches('s');
    Duration::from_secs(digits.parse().unwrap_or_else(|_| panic!("{file}: {key}: {value:?} is not seconds")))
}

#[test]
fn kubernetes_and_compose_grace_periods_exceed_the_shutdown_budget_with_margin() {
    let budget = default_budget();
    assert_eq!(budget, Duration::from_secs(120), "the deployment comments quote 60s + 2 x 30s");
    for (file, key) in
        [("deploy/k8s/statefulset.yaml", "terminationGracePeriodSeconds"), ("docker-compose.yml", "stop_grace_period")]
    {
        let grace = seconds_of(file, key);
        assert!(
            grace >= required(budget),
            "{file}: {key} {grace:?} does not cover the shutdown budget {budget:?} plus margin ({:?})",
            required(budget)
        );
    }
}

#[test]
fn the_routers_grace_periods_exceed_its_shutdown_budget_with_margin() {
    let budget = dedupd::kafka::router::RouteSettings::new("b", "g", "raw", "i", "r").shutdown_budget();
    assert_eq!(budget, Duration::from_secs(150), "the deployment comments quote 60s + 30s + 2 x 30s");
    for (file, section, key) in [
        ("deploy/k8s/router.yaml", "", "terminationGracePeriodSeconds"),
        ("docker-compose.yml", "dedupd-route:", "stop_grace_period"),
    ] {
        let grace = seconds_after(file, section, key);
        assert!(
            grace >= required(budget),
            "{file}: {key} {grace:?} does not cover the router's shutdown budget {budget:?} plus margin ({:?})",
            required(budget)
        );
    }
}
