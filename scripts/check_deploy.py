#!/usr/bin/env python3
"""Validates dedupd's deployment files without a Docker engine or a cluster.

Run through `scripts/check-deploy`, which installs the tools (promtool from
Debian, the Python validators pinned in deploy/check-requirements.txt) and
calls this file. What is checked, and against what:

- deploy/prometheus: `promtool check rules`, `promtool test rules` (alert unit
  tests), `promtool check config` on both Prometheus configurations; every
  alert has a severity, a summary, a description, an absolute runbook link
  (dedupd's /runbook page) whose anchor exists in docs/runbook.md, and a unit
  test.
- deploy/grafana/dedupd.json: valid JSON, sound panel layout, every query
  parses as PromQL (through promtool) and the views the issue asks for exist.
- Metric names: every metric, label and label value that an alert or a
  dashboard query uses must be exported by the binary. The reference is
  deploy/metrics.txt (DESIGN §8); with `--metrics FILE` (a `/metrics` scrape
  of the real binary) the scrape is the reference and deploy/metrics.txt is
  checked against it too; `--live BINARY` takes that scrape itself, running
  `BINARY run` against a Tansu broker on loopback until /healthz and /readyz
  answer.
- docker-compose.yml: the compose-spec JSON schema, plus the keys that make
  the stack what it claims (KRaft broker, one-shot topic job, exactly-once
  dedupd, Prometheus with the rules, Grafana with the dashboard).
- deploy/k8s: every manifest against the Kubernetes OpenAPI schemas
  (kubernetes-validate --strict) plus the keys that matter here (volume per
  pod, pod name as instance id, probes, resources, PDB, scrape annotations).
- The TOML configurations: every key is a `dedupd run` flag, values have the
  flag's form; ports, paths, uids and topic names agree across files.
- deploy/Dockerfile: hadolint, plus the build and runtime facts the brief
  fixes. deploy/compose/create-topics.sh: shellcheck.

`--self-test` breaks copies of the files in known ways and checks that each
break is caught, so a checker that passes everything fails its own test.
Exit status: 0 when every check passes. The last line is `N passed, N failed`.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

# --------------------------------------------------------------------------
# Facts the files must agree with.

TOPIC_KEYS = ["input_topic", "output_topic", "conflicts_topic", "rejected_topic"]
# Labels Prometheus itself attaches to every scraped series (both configs).
TARGET_LABELS = {"job", "instance", "namespace", "pod", "service", "environment"}
# Series Prometheus creates itself: allowed in queries, not exported by dedupd.
PROMETHEUS_SERIES = {"up", "ALERTS", "ALERTS_FOR_STATE", "scrape_duration_seconds", "scrape_samples_scraped"}
PROMQL_KEYWORDS = {"and", "or", "unless", "offset", "bool", "inf", "nan", "atan2", "by", "without", "on",
                   "ignoring", "group_left", "group_right"}
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}

# The alerts issue #6 asks for, by name.
REQUIRED_ALERTS = {
    "DedupdConflictDetected", "DedupdDedupeWindowBelowFloor", "DedupdConsumerLagGrowing",
    "DedupdRepairTakingTooLong", "DedupdRepairFromEmptyState", "DedupdRecoveryFallback",
    "DedupdRejectedRateSpike",
}
SEVERITIES = {"page", "ticket"}
# The dashboard views issue #6 asks for: (what, metric queried, label it is split by or None).
REQUIRED_VIEWS = [
    ("buckets over time", "dedupd_events_total", "bucket"),
    ("duplicate rate", "dedupd_events_total", None),
    ("conflicts by tenant", "dedupd_conflicts_total", "tenant"),
    ("window per tier", "dedupd_dedupe_window_seconds", "tier"),
    ("lag per partition", "dedupd_consumer_lag_records", "partition"),
    ("batch latency by stage", "dedupd_batch_duration_seconds_bucket", "stage"),
    ("fsync latency", "dedupd_wal_fsync_duration_seconds_bucket", None),
]
# Runbook sections other files link to or the issue asks for.
REQUIRED_RUNBOOK_ANCHORS = {
    "adding-partitions", "moving-a-partitions-state", "dedupd-verify-and-dedupd-inspect",
    "restoring-after-losing-a-volume", "resource-sizing", "kubernetes",
}


# --------------------------------------------------------------------------
# Reporting.

class CheckFailed(Exception):
    """One check found a problem; the message says what and where."""


class SkipCheck(Exception):
    """A check that does not apply to this run."""


@dataclass
class Context:
    root: Path
    tools: Path
    metrics_file: Path | None
    quiet: bool = False
    results: list[tuple[str, bool, str]] = field(default_factory=list)

    def tool(self, name: str) -> str:
        local = self.tools / name
        if local.exists():
            return str(local)
        found = shutil.which(name)
        if found is None:
            raise CheckFailed(f"tool {name} not found (scripts/check-deploy installs it)")
        return found

    def run(self, *cmd: str, cwd: Path | None = None) -> str:
        proc = subprocess.run(cmd, cwd=cwd or self.root, capture_output=True, text=True)
        out = (proc.stdout + proc.stderr).strip()
        if proc.returncode != 0:
            raise CheckFailed(f"{' '.join(Path(c).name if i == 0 else c for i, c in enumerate(cmd))}:\n{out}")
        return out

    def path(self, rel: str) -> Path:
        p = self.root / rel
        if not p.exists():
            raise CheckFailed(f"{rel} is missing")
        return p

    def yaml(self, rel: str) -> object:
        try:
            return yaml.safe_load(self.path(rel).read_text())
        except yaml.YAMLError as e:
            raise CheckFailed(f"{rel} is not valid YAML: {e}") from e


CHECKS: list[tuple[str, Callable[[Context], None]]] = []


def check(name: str):
    def register(fn: Callable[[Context], None]) -> Callable[[Context], None]:
        CHECKS.append((name, fn))
        return fn
    return register


def expect(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


def dig(obj: object, *keys: object) -> object:
    """obj[k1][k2]... or None when any step is missing."""
    for k in keys:
        if isinstance(obj, dict) and k in obj:
            obj = obj[k]
        elif isinstance(obj, list) and isinstance(k, int) and k < len(obj):
            obj = obj[k]
        else:
            return None
    return obj


# --------------------------------------------------------------------------
# Metric names: the contract file and live scrapes.

@dataclass
class MetricSpec:
    name: str
    kind: str
    labels: dict[str, set[str] | None]


def load_contract(ctx: Context) -> dict[str, MetricSpec]:
    specs: dict[str, MetricSpec] = {}
    for n, line in enumerate(ctx.path("deploy/metrics.txt").read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        expect(len(parts) >= 2, f"deploy/metrics.txt:{n}: expected `<name> <type> [labels]`")
        name, kind = parts[0], parts[1]
        expect(kind in {"counter", "gauge", "histogram"}, f"deploy/metrics.txt:{n}: unknown type {kind}")
        # dedupd's own metrics, and the standard process_* collector's.
        expect(name.startswith(("dedupd_", "process_")),
               f"deploy/metrics.txt:{n}: {name} lacks the dedupd_ (or standard process_) prefix")
        expect(kind != "counter" or name.endswith("_total"), f"deploy/metrics.txt:{n}: counter {name} needs _total")
        labels: dict[str, set[str] | None] = {}
        for spec in parts[2:]:
            label, _, values = spec.partition("=")
            labels[label] = set(values.split("|")) if values else None
        specs[name] = MetricSpec(name, kind, labels)
    return specs


def sample_names(spec: MetricSpec) -> dict[str, set[str]]:
    """Series names a metric produces, each with its label names."""
    labels = set(spec.labels)
    if spec.kind == "histogram":
        return {spec.name + "_bucket": labels | {"le"}, spec.name + "_sum": labels, spec.name + "_count": labels}
    return {spec.name: labels}


@dataclass
class Scrape:
    types: dict[str, str]
    samples: dict[str, set[str]]
    values: dict[tuple[str, str], set[str]]


SAMPLE_RE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+\S+')
LABEL_RE = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:\\.|[^"\\])*)"')


def parse_scrape(text: str) -> Scrape:
    types: dict[str, str] = {}
    samples: dict[str, set[str]] = {}
    values: dict[tuple[str, str], set[str]] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            parts = line.split()
            if len(parts) >= 4:
                types[parts[2]] = parts[3]
            continue
        if not line or line.startswith("#"):
            continue
        m = SAMPLE_RE.match(line)
        if not m:
            continue
        name = m.group(1)
        labels = samples.setdefault(name, set())
        for label, value in LABEL_RE.findall(m.group(3) or ""):
            labels.add(label)
            values.setdefault((name, label), set()).add(value)
    return Scrape(types, samples, values)


def scrape_family(scrape: Scrape, spec: MetricSpec) -> str | None:
    """The TYPE the scrape declares for a contract metric (OpenMetrics names a
    counter family without its `_total`; the classic format with it)."""
    candidates = [spec.name]
    if spec.kind == "counter":
        candidates.insert(0, spec.name[: -len("_total")])
    for c in candidates:
        if c in scrape.types:
            return scrape.types[c]
    return None


@dataclass
class Exported:
    """What queries may use: series name -> label names (None = unknown,
    anything goes) and label -> allowed values."""
    labels: dict[str, set[str] | None]
    values: dict[tuple[str, str], set[str]]


def exported_from_contract(specs: dict[str, MetricSpec]) -> Exported:
    labels: dict[str, set[str] | None] = {}
    values: dict[tuple[str, str], set[str]] = {}
    for spec in specs.values():
        for series, names in sample_names(spec).items():
            labels[series] = names
            for label, allowed in spec.labels.items():
                if allowed is not None:
                    values[(series, label)] = allowed
    return Exported(labels, values)


def exported_from_scrape(scrape: Scrape, specs: dict[str, MetricSpec]) -> Exported:
    labels: dict[str, set[str] | None] = {}
    for name, kind in scrape.types.items():
        if kind == "counter":
            base = name[: -len("_total")] if name.endswith("_total") else name
            series = {base + "_total": None}
        elif kind == "histogram":
            series = {name + "_bucket": None, name + "_sum": None, name + "_count": None}
        elif kind == "summary":
            series = {name: None, name + "_sum": None, name + "_count": None}
        else:
            series = {name: None}
        labels.update(series)
    for name, names in scrape.samples.items():
        labels[name] = set(names)
    # A family with no sample yet (a labelled counter before its first
    # increment) shows no labels: fall back to the contract's for it.
    contract = exported_from_contract(specs)
    for name, names in list(labels.items()):
        if names is None or (not names and contract.labels.get(name)):
            labels[name] = contract.labels.get(name)
    return Exported(labels, contract.values)


def exported(ctx: Context) -> Exported:
    specs = load_contract(ctx)
    if ctx.metrics_file is None:
        return exported_from_contract(specs)
    return exported_from_scrape(parse_scrape(ctx.metrics_file.read_text()), specs)


# --------------------------------------------------------------------------
# A small PromQL reader: enough to find selectors and grouping labels. The
# syntax itself is checked by promtool (see check_promql_syntax).

TOKEN_RE = re.compile(
    r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`|\[[^\]]*\]'
    r'|(?:\d+(?:ms|s|m|h|d|w|y))+\b'  # a duration (offset 10m, 1h30m)
    r'|[A-Za-z_:][A-Za-z0-9_:]*'
    r'|\d+(?:\.\d+)?(?:[eE][+-]?\d+)?|=~|!~|!=|==|>=|<=|\s+|.'
)


@dataclass
class Selector:
    metric: str | None
    matchers: list[tuple[str, str, str]]


@dataclass
class Query:
    selectors: list[Selector]
    grouping: set[str]


def parse_promql(expr: str) -> Query:
    toks = [t for t in TOKEN_RE.findall(expr) if not t.isspace()]
    selectors: list[Selector] = []
    grouping: set[str] = set()
    i = 0

    def matchers(start: int) -> tuple[list[tuple[str, str, str]], int]:
        out = []
        j = start + 1
        while j < len(toks) and toks[j] != "}":
            if toks[j] == ",":
                j += 1
                continue
            label, op, value = toks[j], toks[j + 1], toks[j + 2]
            out.append((label, op, value[1:-1]))
            j += 3
        return out, j + 1

    while i < len(toks):
        t = toks[i]
        nxt = toks[i + 1] if i + 1 < len(toks) else ""
        if t in GROUPING and nxt == "(":
            j = i + 2
            while j < len(toks) and toks[j] != ")":
                if toks[j] != ",":
                    grouping.add(toks[j])
                j += 1
            i = j + 1
        elif re.match(r"^[A-Za-z_:]", t) and (nxt == "(" or nxt in ("by", "without")):
            i += 1  # a function, or an aggregation with its grouping first
        elif re.match(r"^[A-Za-z_:]", t) and t not in PROMQL_KEYWORDS:
            if nxt == "{":
                ms, i = matchers(i + 1)
            else:
                ms, i = [], i + 1
            selectors.append(Selector(t, ms))
        elif t == "{":
            ms, i = matchers(i)
            name = [v for (label, op, v) in ms if label == "__name__" and op == "="]
            selectors.append(Selector(name[0] if name else None, ms))
        else:
            i += 1
    return Query(selectors, grouping)


def check_query(expr: str, where: str, exp: Exported) -> list[str]:
    """Problems with one query's metric names, labels and label values."""
    problems = []
    q = parse_promql(expr)
    expect(q.selectors, f"{where}: no metric selector in {expr!r}")
    known_labels = set(TARGET_LABELS)
    free = False
    for sel in q.selectors:
        if sel.metric is None:
            problems.append(f"{where}: selector without a metric name in {expr!r}")
            continue
        if sel.metric in PROMETHEUS_SERIES:
            free = True
            continue
        if sel.metric not in exp.labels:
            problems.append(f"{where}: metric {sel.metric} is not exported by dedupd")
            continue
        labels = exp.labels[sel.metric]
        if labels is None:
            free = True
            continue
        known_labels |= labels
        for label, op, value in sel.matchers:
            if label not in labels | TARGET_LABELS | {"__name__"}:
                problems.append(f"{where}: {sel.metric} has no label {label}")
                continue
            allowed = exp.values.get((sel.metric, label))
            if allowed is None or "$" in value:
                continue
            wanted = [value] if op in ("=", "!=") else value.split("|") if re.match(r"^[\w|]+$", value) else []
            for v in wanted:
                if v not in allowed:
                    problems.append(f"{where}: {sel.metric}{{{label}}} never has the value {v!r}")
    if not free:
        for label in q.grouping - known_labels:
            problems.append(f"{where}: groups by {label}, which none of its metrics has")
    return problems


def grafana_to_promql(expr: str) -> str:
    """Replaces Grafana's variables with values Prometheus accepts."""
    expr = expr.replace("$__rate_interval", "5m").replace("$__interval", "1m").replace("$__range", "1h")
    return re.sub(r"\$\{?\w+\}?", ".*", expr)


# --------------------------------------------------------------------------
# Prometheus.

def alert_rules(ctx: Context) -> list[dict]:
    doc = ctx.yaml("deploy/prometheus/alerts.yml")
    groups = dig(doc, "groups")
    expect(isinstance(groups, list) and groups, "alerts.yml: no rule groups")
    rules = [r for g in groups for r in (g.get("rules") or [])]
    return [r for r in rules if "alert" in r]


@check("promtool check rules deploy/prometheus/alerts.yml")
def check_rules(ctx: Context) -> None:
    ctx.run(ctx.tool("promtool"), "check", "rules", str(ctx.path("deploy/prometheus/alerts.yml")))


@check("promtool test rules deploy/prometheus/alerts_test.yml (alert unit tests)")
def check_rule_tests(ctx: Context) -> None:
    ctx.run(ctx.tool("promtool"), "test", "rules", "alerts_test.yml", cwd=ctx.path("deploy/prometheus"))


@check("promtool check config deploy/prometheus/prometheus.yml")
def check_prom_config(ctx: Context) -> None:
    ctx.run(ctx.tool("promtool"), "check", "config", str(ctx.path("deploy/prometheus/prometheus.yml")))
    doc = ctx.yaml("deploy/prometheus/prometheus.yml")
    expect("alerts.yml" in (dig(doc, "rule_files") or []), "prometheus.yml does not load alerts.yml")
    jobs = {j.get("job_name"): j for j in dig(doc, "scrape_configs") or []}
    expect("dedupd" in jobs, "prometheus.yml: no scrape job named dedupd (the alerts select job=\"dedupd\")")


@check("promtool check config deploy/prometheus/prometheus-k8s.yml")
def check_prom_k8s_config(ctx: Context) -> None:
    # Debian's promtool is built without Kubernetes service discovery, so the
    # real parser checks a copy whose kubernetes_sd_configs are swapped for a
    # static target (everything else, relabel regexes included, unchanged),
    # and the discovery block itself is checked here.
    doc = ctx.yaml("deploy/prometheus/prometheus-k8s.yml")
    jobs = {j.get("job_name"): j for j in dig(doc, "scrape_configs") or []}
    expect("dedupd" in jobs, "prometheus-k8s.yml: no scrape job named dedupd")
    job = jobs["dedupd"]
    sds = job.get("kubernetes_sd_configs")
    expect(isinstance(sds, list) and len(sds) == 1, "prometheus-k8s.yml: dedupd needs one kubernetes_sd_configs entry")
    sd = sds[0]
    expect(set(sd) <= {"role", "namespaces", "selectors", "api_server", "kubeconfig_file", "attach_metadata"},
           f"prometheus-k8s.yml: unknown kubernetes_sd_configs keys {sorted(set(sd))}")
    expect(sd.get("role") == "pod", "prometheus-k8s.yml: discovery role must be pod (scrape annotations are on pods)")
    relabels = job.get("relabel_configs") or []
    annotations = {s for r in relabels for s in r.get("source_labels", [])}
    for a in ("scrape", "port", "path"):
        expect(f"__meta_kubernetes_pod_annotation_prometheus_io_{a}" in annotations,
               f"prometheus-k8s.yml: the prometheus.io/{a} annotation is not used")
    with tempfile.TemporaryDirectory() as tmp:
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["10.0.0.1:9464"]}]
        Path(tmp, "prometheus.yml").write_text(yaml.safe_dump(doc))
        shutil.copy(ctx.path("deploy/prometheus/alerts.yml"), Path(tmp, "alerts.yml"))
        ctx.run(ctx.tool("promtool"), "check", "config", str(Path(tmp, "prometheus.yml")))


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@check("prometheus: the real server loads the compose config, scrapes a dedupd page and fires a conflict alert")
def check_prometheus_server(ctx: Context) -> None:
    # promtool parses; this runs Prometheus itself on loopback with the
    # compose configuration (targets pointed at a local page, intervals
    # shortened) and the rules file, against a page in the binary's format
    # holding one conflict, and waits for DedupdConflictDetected to fire.
    page = (SCRAPE_OK.replace("# TYPE dedupd_conflicts_total counter\n",
                              "# TYPE dedupd_conflicts_total counter\ndedupd_conflicts_total{tenant=\"acme\"} 1\n"))

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
            body = page.encode()
            self.send_response(200 if self.path == "/metrics" else 404)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prom_port = free_port()
    doc = ctx.yaml("deploy/prometheus/prometheus.yml")
    doc["global"].update({"scrape_interval": "1s", "evaluation_interval": "1s"})
    for job in doc["scrape_configs"]:
        port = server.server_address[1] if job["job_name"] == "dedupd" else prom_port
        for sc in job.get("static_configs", []):
            sc["targets"] = [f"127.0.0.1:{port}"]
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "prometheus.yml").write_text(yaml.safe_dump(doc))
        shutil.copy(ctx.path("deploy/prometheus/alerts.yml"), Path(tmp, "alerts.yml"))
        proc = subprocess.Popen(
            [ctx.tool("prometheus"), f"--config.file={tmp}/prometheus.yml", f"--storage.tsdb.path={tmp}/data",
             f"--web.listen-address=127.0.0.1:{prom_port}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        api = f"http://127.0.0.1:{prom_port}/api/v1"
        firing: list[dict] = []
        rules: list[str] = []
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(f"{api}/rules", timeout=2) as r:
                        groups = json.load(r)["data"]["groups"]
                    rules = [rule["name"] for g in groups for rule in g["rules"]]
                    with urllib.request.urlopen(f"{api}/alerts", timeout=2) as r:
                        alerts = json.load(r)["data"]["alerts"]
                    firing = [a for a in alerts if a["labels"].get("alertname") == "DedupdConflictDetected"
                              and a["state"] == "firing"]
                    if firing:
                        break
                except OSError:
                    pass
                time.sleep(0.5)
        finally:
            proc.terminate()
            try:
                _, err = proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, err = proc.communicate()
            server.shutdown()
        expect(set(r["alert"] for r in alert_rules(ctx)) <= set(rules),
               f"Prometheus loaded rules {sorted(rules)}; log:\n{err[-2000:]}")
        expect(bool(firing) and firing[0]["labels"].get("tenant") == "acme",
               f"DedupdConflictDetected did not fire for tenant acme within 30 s; log:\n{err[-2000:]}")


# An alert's runbook link: absolute, the page dedupd serves at /runbook on the
# metrics port unless Prometheus's external label dedupd_runbook_url names
# where the runbook is published (alerts.yml's header explains).
RUNBOOK_URL = r'\{\{ or \$externalLabels\.dedupd_runbook_url "http://localhost:(\d+)/runbook" \}\}#([\w-]+)'


@check("alerts: severity, summary, description, runbook link and a unit test for every alert")
def check_alert_annotations(ctx: Context) -> None:
    rules = alert_rules(ctx)
    names = [r["alert"] for r in rules]
    expect(len(names) == len(set(names)), f"alerts.yml: duplicate alert names in {names}")
    missing = REQUIRED_ALERTS - set(names)
    expect(not missing, f"alerts.yml: missing required alerts {sorted(missing)}")
    anchors = runbook_anchors(ctx)
    tests = ctx.yaml("deploy/prometheus/alerts_test.yml")
    tested = {c.get("alertname") for t in dig(tests, "tests") or [] for c in t.get("alert_rule_test") or []
              if c.get("exp_alerts")}
    problems = []
    for r in rules:
        name = r["alert"]
        if dig(r, "labels", "severity") not in SEVERITIES:
            problems.append(f"{name}: severity must be one of {sorted(SEVERITIES)}")
        for a in ("summary", "description", "runbook_url"):
            if not dig(r, "annotations", a):
                problems.append(f"{name}: no {a} annotation")
        url = dig(r, "annotations", "runbook_url") or ""
        m = re.fullmatch(RUNBOOK_URL, url)
        if not m:
            problems.append(f"{name}: runbook_url {url!r} is not the absolute /runbook#<anchor> link")
        elif m.group(2) not in anchors:
            problems.append(f"{name}: docs/runbook.md has no heading for #{m.group(2)}")
        elif m.group(1) != "9464" or "9464:9464" not in ctx.path("docker-compose.yml").read_text():
            problems.append(f"{name}: runbook_url's port {m.group(1)} is not the metrics port compose publishes")
        if name not in tested:
            problems.append(f"{name}: alerts_test.yml never expects it to fire")
    expect(not problems, "\n".join(problems))


@check("alerts: every metric, label and label value is exported by dedupd")
def check_alert_metrics(ctx: Context) -> None:
    exp = exported(ctx)
    problems = []
    for r in alert_rules(ctx):
        problems += check_query(r["expr"], f"alert {r['alert']}", exp)
    expect(not problems, "\n".join(problems))


# --------------------------------------------------------------------------
# Grafana.

def dashboard(ctx: Context) -> dict:
    try:
        return json.loads(ctx.path("deploy/grafana/dedupd.json").read_text())
    except json.JSONDecodeError as e:
        raise CheckFailed(f"deploy/grafana/dedupd.json is not valid JSON: {e}") from e


def dashboard_queries(d: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and annotation."""
    out = []
    panels = list(d.get("panels") or [])
    for p in list(panels):
        panels += p.get("panels") or []
    for p in panels:
        for t in p.get("targets") or []:
            out.append((f"panel {p.get('title')!r} {t.get('refId')}", t.get("expr", "")))
    for a in dig(d, "annotations", "list") or []:
        if a.get("expr"):
            out.append((f"annotation {a.get('name')!r}", a["expr"]))
    return out


LABEL_VALUES_RE = re.compile(r"^\s*label_values\((.+),\s*([a-zA-Z_]\w*)\s*\)\s*$")


@check("grafana: dedupd.json is a valid dashboard with the required views")
def check_dashboard_shape(ctx: Context) -> None:
    d = dashboard(ctx)
    for key in ("uid", "title", "panels", "schemaVersion", "templating"):
        expect(key in d, f"dedupd.json: no {key}")
    problems = []
    ids = [p.get("id") for p in d["panels"]]
    if len(ids) != len(set(ids)):
        problems.append("panel ids are not unique")
    cells: dict[tuple[int, int], str] = {}
    for p in d["panels"]:
        title = p.get("title")
        g = p.get("gridPos") or {}
        if not all(isinstance(g.get(k), int) for k in ("x", "y", "w", "h")):
            problems.append(f"panel {title!r}: gridPos needs integer x, y, w, h")
            continue
        if g["x"] + g["w"] > 24:
            problems.append(f"panel {title!r}: wider than the 24-column grid")
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                if (x, y) in cells:
                    problems.append(f"panel {title!r} overlaps {cells[(x, y)]!r}")
                    break
                cells[(x, y)] = title
            else:
                continue
            break
        if p.get("type") == "row":
            continue
        if dig(p, "datasource", "uid") != "${datasource}":
            problems.append(f"panel {title!r}: datasource must be the ${{datasource}} variable")
        refs = [t.get("refId") for t in p.get("targets") or []]
        if not refs or len(refs) != len(set(refs)) or not all(t.get("expr") for t in p["targets"]):
            problems.append(f"panel {title!r}: needs targets with an expr and unique refIds")
    variables = {v.get("name"): v for v in dig(d, "templating", "list") or []}
    if dig(variables, "datasource", "type") != "datasource":
        problems.append("no datasource variable")
    queries = [(w, parse_promql(grafana_to_promql(e))) for w, e in dashboard_queries(d)]
    for what, metric, label in REQUIRED_VIEWS:
        if not any(any(s.metric == metric for s in q.selectors) and (label is None or label in q.grouping)
                   for _, q in queries):
            problems.append(f"no panel shows {what} ({metric}" + (f" by {label})" if label else ")"))
    expect(not problems, "dedupd.json:\n" + "\n".join(problems))


@check("grafana: every query parses as PromQL (promtool)")
def check_promql_syntax(ctx: Context) -> None:
    d = dashboard(ctx)
    rules = [{"record": f"dashboard:query_{n}", "expr": grafana_to_promql(e)}
             for n, (_, e) in enumerate(dashboard_queries(d))]
    with tempfile.TemporaryDirectory() as tmp:
        f = Path(tmp, "dashboard-queries.yml")
        f.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
        try:
            ctx.run(ctx.tool("promtool"), "check", "rules", str(f))
        except CheckFailed as e:
            listing = "\n".join(f"dashboard:query_{n} = {where}" for n, (where, _) in enumerate(dashboard_queries(d)))
            raise CheckFailed(f"{e}\n{listing}") from e


@check("grafana: every metric, label and label value is exported by dedupd")
def check_dashboard_metrics(ctx: Context) -> None:
    exp = exported(ctx)
    d = dashboard(ctx)
    problems = []
    for where, expr in dashboard_queries(d):
        problems += check_query(grafana_to_promql(expr), where, exp)
    for v in dig(d, "templating", "list") or []:
        if v.get("type") != "query":
            continue
        q = dig(v, "query", "query") if isinstance(v.get("query"), dict) else v.get("query")
        m = LABEL_VALUES_RE.match(q or "")
        if not m:
            problems.append(f"variable {v.get('name')}: only label_values(<selector>, <label>) is supported here")
            continue
        where = f"variable {v.get('name')}"
        problems += check_query(grafana_to_promql(m.group(1)), where, exp)
        sel = parse_promql(m.group(1)).selectors[0].metric
        labels = exp.labels.get(sel or "")
        if labels is not None and m.group(2) not in labels | TARGET_LABELS:
            problems.append(f"{where}: {sel} has no label {m.group(2)}")
    expect(not problems, "\n".join(problems))


@check("grafana: provisioning points at the dashboard and at Prometheus")
def check_grafana_provisioning(ctx: Context) -> None:
    ds = ctx.yaml("deploy/grafana/provisioning/datasources/prometheus.yml")
    sources = dig(ds, "datasources") or []
    expect(any(s.get("type") == "prometheus" and s.get("url") == "http://prometheus:9090" for s in sources),
           "datasources/prometheus.yml: no prometheus data source at http://prometheus:9090")
    prov = ctx.yaml("deploy/grafana/provisioning/dashboards/dedupd.yml")
    paths = [dig(p, "options", "path") for p in dig(prov, "providers") or []]
    compose = ctx.yaml("docker-compose.yml")
    mounts = dig(compose, "services", "grafana", "volumes") or []
    dashboard_mount = "./deploy/grafana/dedupd.json:/var/lib/grafana/dashboards/dedupd.json:ro"
    expect(dashboard_mount in mounts, "docker-compose.yml: grafana does not mount deploy/grafana/dedupd.json")
    expect("/var/lib/grafana/dashboards" in paths,
           "dashboards/dedupd.yml: provider does not read /var/lib/grafana/dashboards")


# --------------------------------------------------------------------------
# dedupd's own configuration.

def dedupd_binary(ctx: Context) -> str:
    """The dedupd binary whose `check-config` is the authority on
    configuration: $DEDUPD_BIN, else cargo's debug build."""
    explicit = os.environ.get("DEDUPD_BIN")
    target = Path(os.environ.get("CARGO_TARGET_DIR", str(ctx.root / "target")))
    for candidate in ([Path(explicit)] if explicit else []) + [target / "debug" / "dedupd"]:
        if candidate.is_file():
            return str(candidate)
    raise CheckFailed("no dedupd binary: run `cargo build` first (or set DEDUPD_BIN)")


def check_config(ctx: Context, text: str) -> subprocess.CompletedProcess[str]:
    """`dedupd check-config` on a TOML text, with no DEDUPD_ variable from
    the caller's environment but a salt (the k8s file keeps it in a Secret)."""
    with tempfile.NamedTemporaryFile("w", suffix=".toml") as f:
        f.write(text)
        f.flush()
        env = {"PATH": os.environ.get("PATH", ""), "DEDUPD_DERIVE_SALT": "check-deploy"}
        return subprocess.run([dedupd_binary(ctx), "check-config", "--config", f.name], env=env,
                              capture_output=True, text=True)


def check_toml(ctx: Context, text: str, where: str) -> list[str]:
    """The file through `dedupd check-config`, the same code path as `run`
    (every key, type, unit and cross-setting rule), then what only a
    deployment needs: the keys it must set and four distinct topics."""
    problems = []
    proc = check_config(ctx, text)
    if proc.returncode != 0:
        problems.append(f"{where}: dedupd check-config refuses it: {proc.stderr.strip()}")
    cfg = parse_toml(text, where)
    for key in ["brokers", "group", "state_dir", "metrics_addr", "delivery", *TOPIC_KEYS]:
        if key not in cfg:
            problems.append(f"{where}: {key} is not set")
    topics = [cfg.get(k) for k in TOPIC_KEYS]
    if len(set(topics)) != len(topics):
        problems.append(f"{where}: the four topics must be distinct, got {topics}")
    return problems


def binary_env_names(ctx: Context) -> set[str]:
    """Every DEDUPD_* variable `dedupd run` reads, from its own --help, plus
    DEDUPD_KAFKA_PROPERTIES (read beside the flags, named in their help)."""
    out = subprocess.run([dedupd_binary(ctx), "run", "--help"], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"\[env: DEDUPD_([A-Z_]+)", out)) | {"KAFKA_PROPERTIES"}


def parse_toml(text: str, where: str) -> dict:
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CheckFailed(f"{where}: not valid TOML: {e}") from e


def compose_toml(ctx: Context) -> dict:
    return parse_toml(ctx.path("deploy/compose/dedupd.toml").read_text(), "deploy/compose/dedupd.toml")


def k8s_docs(ctx: Context) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for f in sorted(ctx.path("deploy/k8s").glob("*.yaml")):
        if f.name == "kustomization.yaml":
            continue
        try:
            out[f.name] = [d for d in yaml.safe_load_all(f.read_text()) if d]
        except yaml.YAMLError as e:
            raise CheckFailed(f"deploy/k8s/{f.name} is not valid YAML: {e}") from e
    return out


def k8s_kind(ctx: Context, kind: str) -> dict:
    found = [d for docs in k8s_docs(ctx).values() for d in docs if d.get("kind") == kind]
    expect(len(found) == 1, f"deploy/k8s: expected one {kind}, found {len(found)}")
    return found[0]


def k8s_toml(ctx: Context) -> dict:
    cm = k8s_kind(ctx, "ConfigMap")
    text = dig(cm, "data", "dedupd.toml")
    expect(isinstance(text, str), "configmap.yaml: no data key dedupd.toml")
    return parse_toml(text, "deploy/k8s/configmap.yaml dedupd.toml")


@check("config: both TOML files pass `dedupd check-config`; every DEDUPD_ variable is one dedupd reads")
def check_configs(ctx: Context) -> None:
    compose_text = ctx.path("deploy/compose/dedupd.toml").read_text()
    problems = check_toml(ctx, compose_text, "deploy/compose/dedupd.toml")
    k8s = k8s_toml(ctx)
    problems += check_toml(ctx, dig(k8s_kind(ctx, "ConfigMap"), "data", "dedupd.toml"), "deploy/k8s/configmap.yaml")
    if "derive_salt" in k8s:
        problems.append("deploy/k8s/configmap.yaml: derive_salt belongs in the Secret, not the ConfigMap")
    if k8s.get("delivery") != "exactly-once":
        problems.append("deploy/k8s/configmap.yaml: production runs exactly-once")
    env_refs: set[str] = set()
    for rel in ("docker-compose.yml", "deploy/Dockerfile", "deploy/k8s/statefulset.yaml"):
        env_refs |= set(re.findall(r"\bDEDUPD_([A-Z_]+)\b", ctx.path(rel).read_text()))
    known = binary_env_names(ctx)
    for name in sorted(env_refs - {"PARTITIONS"}):
        if name not in known:
            problems.append(f"DEDUPD_{name} is not a variable `dedupd run` reads")
    expect(not problems, "\n".join(problems))


# --------------------------------------------------------------------------
# docker-compose.

@check("compose: docker-compose.yml matches the compose-spec schema")
def check_compose_schema(ctx: Context) -> None:
    compose = str(ctx.path("docker-compose.yml"))
    ctx.run(ctx.tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", compose)


@check("compose: KRaft broker, topic job, exactly-once dedupd, Prometheus with rules, Grafana with dashboard")
def check_compose_stack(ctx: Context) -> None:
    doc = ctx.yaml("docker-compose.yml")
    services = dig(doc, "services") or {}
    problems = []
    for s in ("kafka", "kafka-init", "dedupd", "prometheus", "grafana"):
        if s not in services:
            problems.append(f"no service {s}")
    if problems:
        raise CheckFailed("\n".join(problems))
    if any("zookeeper" in str(s.get("image", "")) for s in services.values()):
        problems.append("a ZooKeeper service: the broker must run in KRaft mode")
    kafka = services["kafka"]
    env = kafka.get("environment") or {}
    if not str(kafka.get("image", "")).startswith("apache/kafka:"):
        problems.append("kafka: use the official apache/kafka image")
    if set(str(env.get("KAFKA_PROCESS_ROLES", "")).split(",")) != {"broker", "controller"}:
        problems.append("kafka: KAFKA_PROCESS_ROLES must be broker,controller (single-node KRaft)")
    if str(env.get("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR")) != "1":
        problems.append("kafka: one broker needs KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR=1 for transactions")
    if str(env.get("KAFKA_AUTO_CREATE_TOPICS_ENABLE")) != "false":
        problems.append("kafka: auto-created topics would break co-partitioning")
    if not kafka.get("healthcheck"):
        problems.append("kafka: no healthcheck (kafka-init waits for it)")
    init = services["kafka-init"]
    if dig(init, "depends_on", "kafka", "condition") != "service_healthy":
        problems.append("kafka-init must wait for kafka to be healthy")
    if init.get("restart") not in (None, "no"):
        problems.append("kafka-init is a one-shot job: restart must be \"no\"")
    dd = services["dedupd"]
    if dig(dd, "depends_on", "kafka-init", "condition") != "service_completed_successfully":
        problems.append("dedupd must wait for kafka-init to complete successfully")
    if dig(dd, "build", "dockerfile") != "deploy/Dockerfile" or dig(dd, "build", "context") != ".":
        problems.append("dedupd must build deploy/Dockerfile with the repository root as context")
    cmd = dd.get("command") or []
    if cmd[:1] != ["run"] or "--config" not in cmd:
        problems.append("dedupd: command must be run --config <file>")
    cfg_path = cmd[cmd.index("--config") + 1] if "--config" in cmd else None
    mounts = dd.get("volumes") or []
    if not any(m.startswith("./deploy/compose/dedupd.toml:" + (cfg_path or "")) for m in mounts):
        problems.append(f"dedupd: deploy/compose/dedupd.toml is not mounted at {cfg_path}")
    cfg = compose_toml(ctx)
    if cfg.get("delivery") != "exactly-once":
        problems.append("dedupd: the compose stack runs --delivery exactly-once")
    if not any(m.split(":")[1:2] == [cfg.get("state_dir")] and not m.startswith(".") for m in mounts):
        problems.append(f"dedupd: state_dir {cfg.get('state_dir')} is not on a named volume")
    port = str(cfg.get("metrics_addr", "")).rsplit(":", 1)[-1]
    if not any(str(p).endswith(f":{port}") for p in dd.get("ports") or []):
        problems.append(f"dedupd: metrics port {port} is not published")
    prom = ctx.yaml("deploy/prometheus/prometheus.yml")
    targets = [t for j in dig(prom, "scrape_configs") or [] if j.get("job_name") == "dedupd"
               for s in j.get("static_configs") or [] for t in s.get("targets") or []]
    if f"dedupd:{port}" not in targets:
        problems.append(f"prometheus.yml: the dedupd job does not scrape dedupd:{port}")
    pm = services["prometheus"].get("volumes") or []
    for f in ("prometheus.yml", "alerts.yml"):
        if not any(m.startswith(f"./deploy/prometheus/{f}:/etc/prometheus/{f}") for m in pm):
            problems.append(f"prometheus: deploy/prometheus/{f} is not mounted at /etc/prometheus/{f}")
    for name, svc in services.items():
        for m in svc.get("volumes") or []:
            src = str(m).split(":")[0]
            if src.startswith(".") and not (ctx.root / src).exists():
                problems.append(f"{name}: mounts {src}, which does not exist")
    script = ctx.path("deploy/compose/create-topics.sh").read_text()
    for key in TOPIC_KEYS:
        default = re.search(rf'{key.upper()}:-([\w.-]+)', script)
        if not default or default.group(1) != cfg.get(key):
            problems.append(f"create-topics.sh: default {key.upper()} does not match {key} = {cfg.get(key)!r}")
    expect(not problems, "docker-compose.yml:\n" + "\n".join(problems))


# A stand-in for kafka-topics.sh: remembers created topics (with their
# partition count) in a directory and answers --describe like Kafka does.
FAKE_KAFKA_TOPICS = r"""#!/bin/bash
set -eu
state="$FAKE_KAFKA_STATE"
echo "$*" >>"$state/calls"
topic=""; partitions=""; describe=0; create=0
while [ $# -gt 0 ]; do
    case "$1" in
        --topic) topic="$2"; shift ;;
        --partitions) partitions="$2"; shift ;;
        --describe) describe=1 ;;
        --create) create=1 ;;
    esac
    shift
done
if [ "$create" = 1 ] && [ ! -f "$state/$topic" ]; then echo "$partitions" >"$state/$topic"; fi
if [ "$describe" = 1 ]; then
    count="$(cat "$state/$topic")"
    printf 'Topic: %s\tTopicId: x\tPartitionCount: %s\tReplicationFactor: 1\tConfigs:\n' "$topic" "$count"
    printf '\tTopic: %s\tPartition: 0\tLeader: 1\n' "$topic"
fi
"""


@check("compose: create-topics.sh creates the four topics and refuses mismatched partition counts")
def check_create_topics(ctx: Context) -> None:
    script = ctx.path("deploy/compose/create-topics.sh")
    cfg = compose_toml(ctx)
    with tempfile.TemporaryDirectory() as tmp:
        fake = Path(tmp, "kafka-topics.sh")
        fake.write_text(FAKE_KAFKA_TOPICS)
        fake.chmod(0o755)

        def run(state: Path) -> subprocess.CompletedProcess:
            state.mkdir(exist_ok=True)
            env = {**os.environ, "KAFKA_TOPICS_SH": str(fake), "FAKE_KAFKA_STATE": str(state), "PARTITIONS": "6"}
            return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)

        fresh = Path(tmp, "fresh")
        proc = run(fresh)
        expect(proc.returncode == 0, f"create-topics.sh failed on an empty broker:\n{proc.stdout}{proc.stderr}")
        for key in TOPIC_KEYS:
            topic = cfg[key]
            expect((fresh / topic).exists(), f"create-topics.sh did not create {topic}")
            expect((fresh / topic).read_text().strip() == "6", f"{topic} not created with PARTITIONS=6")
        calls = (fresh / "calls").read_text()
        output = f"--topic {cfg['output_topic']} "
        out_create = next((c for c in calls.splitlines() if "--create" in c and output in c + " "), "")
        expect("retention.ms=" in out_create and "message.timestamp.type=CreateTime" in out_create,
               "the output topic must be created with retention.ms and message.timestamp.type=CreateTime")
        again = run(fresh)
        expect(again.returncode == 0, f"create-topics.sh is not idempotent:\n{again.stdout}{again.stderr}")
        skewed = Path(tmp, "skewed")
        skewed.mkdir()
        (skewed / cfg["output_topic"]).write_text("4\n")
        proc = run(skewed)
        expect(proc.returncode != 0 and "must match" in proc.stderr,
               f"create-topics.sh accepted input with 6 partitions and output with 4:\n{proc.stdout}{proc.stderr}")


@check("shellcheck deploy/compose/create-topics.sh")
def check_shell(ctx: Context) -> None:
    ctx.run(ctx.tool("shellcheck"), str(ctx.path("deploy/compose/create-topics.sh")))


@check("yamllint on every YAML file")
def check_yamllint(ctx: Context) -> None:
    files = ["docker-compose.yml", *sorted(str(p.relative_to(ctx.root)) for p in (ctx.root / "deploy").rglob("*.y*ml"))]
    config = ("{extends: default, rules: {line-length: {max: 120}, document-start: disable, "
              "truthy: {check-keys: false}, comments: {min-spaces-from-content: 1}}}")
    ctx.run(ctx.tool("yamllint"), "--strict", "-d", config, *files)


# --------------------------------------------------------------------------
# Kubernetes.

@check("k8s: every manifest validates against the Kubernetes schemas (strict)")
def check_k8s_schema(ctx: Context) -> None:
    files = [str(ctx.root / "deploy/k8s" / f) for f in k8s_docs(ctx)]
    ctx.run(ctx.tool("kubernetes-validate"), "--strict", "--quiet", *files)
    kust = ctx.yaml("deploy/k8s/kustomization.yaml")
    listed = set(dig(kust, "resources") or [])
    expect(listed == set(k8s_docs(ctx)), f"kustomization.yaml resources {sorted(listed)} != {sorted(k8s_docs(ctx))}")


@check("k8s: StatefulSet, headless Service, ConfigMap, probes, resources, PDB and scrape annotations agree")
def check_k8s_semantics(ctx: Context) -> None:
    sts = k8s_kind(ctx, "StatefulSet")
    svc = k8s_kind(ctx, "Service")
    pdb = k8s_kind(ctx, "PodDisruptionBudget")
    cm = k8s_kind(ctx, "ConfigMap")
    cfg = k8s_toml(ctx)
    problems = []
    spec = sts.get("spec") or {}
    pod = dig(spec, "template", "spec") or {}
    labels = dig(spec, "template", "metadata", "labels") or {}
    containers = pod.get("containers") or []
    c = next((c for c in containers if c.get("name") == "dedupd"), {})
    if not c:
        raise CheckFailed("statefulset.yaml: no container named dedupd")

    def selects(selector: dict | None) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    if not selects(dig(spec, "selector", "matchLabels")):
        problems.append("StatefulSet selector does not match its pod labels")
    if svc.get("spec", {}).get("clusterIP") != "None":
        problems.append("Service must be headless (clusterIP: None)")
    if spec.get("serviceName") != dig(svc, "metadata", "name"):
        problems.append("StatefulSet serviceName is not the headless Service")
    if not selects(dig(svc, "spec", "selector")):
        problems.append("Service selector does not match the pods")
    if not selects(dig(pdb, "spec", "selector", "matchLabels")):
        problems.append("PodDisruptionBudget selector does not match the pods")
    if dig(pdb, "spec", "maxUnavailable") != 1:
        problems.append("PodDisruptionBudget must allow at most one pod down")
    claims = spec.get("volumeClaimTemplates") or []
    mounts = {m.get("name"): m for m in c.get("volumeMounts") or []}
    state = next((cl for cl in claims if dig(cl, "metadata", "name") in mounts), None)
    if not state:
        problems.append("no volumeClaimTemplate mounted into the container (one volume per pod)")
    else:
        if dig(state, "spec", "accessModes") != ["ReadWriteOnce"]:
            problems.append("state volume must be ReadWriteOnce")
        if dig(mounts, dig(state, "metadata", "name"), "mountPath") != cfg.get("state_dir"):
            problems.append(f"state volume is not mounted at state_dir {cfg.get('state_dir')}")
    env = {e.get("name"): e for e in c.get("env") or []}
    if dig(env, "DEDUPD_INSTANCE_ID", "valueFrom", "fieldRef", "fieldPath") != "metadata.name":
        problems.append("DEDUPD_INSTANCE_ID must be the pod name (static membership)")
    if not dig(env, "DEDUPD_DERIVE_SALT", "valueFrom", "secretKeyRef", "name"):
        problems.append("DEDUPD_DERIVE_SALT must come from a Secret")
    args = c.get("args") or []
    if args[:1] != ["run"] or "--config" not in args:
        problems.append("container args must be run --config <file>")
    else:
        cfg_path = Path(args[args.index("--config") + 1])
        cm_volumes = {v.get("name") for v in pod.get("volumes") or []
                      if dig(v, "configMap", "name") == dig(cm, "metadata", "name")}
        if not any(m.get("name") in cm_volumes and m.get("mountPath") == str(cfg_path.parent) for m in mounts.values()):
            problems.append(f"--config {cfg_path}: the ConfigMap is not mounted at {cfg_path.parent}")
        if cfg_path.name not in (cm.get("data") or {}):
            problems.append(f"--config {cfg_path}: the ConfigMap has no key {cfg_path.name}")
    port = int(str(cfg.get("metrics_addr", ":0")).rsplit(":", 1)[-1])
    ports = {p.get("name"): p.get("containerPort") for p in c.get("ports") or []}
    if ports.get("metrics") != port:
        problems.append(f"container port metrics must be {port} (metrics_addr)")
    probes = {"startupProbe": "/healthz", "livenessProbe": "/healthz", "readinessProbe": "/readyz"}
    for probe, path in probes.items():
        if dig(c, probe, "httpGet", "path") != path or dig(c, probe, "httpGet", "port") not in ("metrics", port):
            problems.append(f"{probe} must GET {path} on the metrics port")
    annotations = dig(spec, "template", "metadata", "annotations") or {}
    if annotations.get("prometheus.io/scrape") != "true" or annotations.get("prometheus.io/port") != str(port) \
            or annotations.get("prometheus.io/path") != "/metrics":
        problems.append(f"pod needs prometheus.io/scrape=true, port={port}, path=/metrics annotations")
    for kind in ("cpu", "memory"):
        if not dig(c, "resources", "requests", kind):
            problems.append(f"no {kind} request")
    if not dig(c, "resources", "limits", "memory"):
        problems.append("no memory limit")
    sc = pod.get("securityContext") or {}
    if sc.get("runAsNonRoot") is not True:
        problems.append("pod must run as non-root")
    uid = re.search(r"^USER (\d+)", ctx.path("deploy/Dockerfile").read_text(), re.M)
    if not uid or sc.get("runAsUser") != int(uid.group(1)) or sc.get("fsGroup") != int(uid.group(1)):
        problems.append("runAsUser and fsGroup must be the image's USER uid")
    if dig(c, "securityContext", "readOnlyRootFilesystem") is not True:
        problems.append("root filesystem must be read-only (state lives on the volume)")
    expect(not problems, "deploy/k8s:\n" + "\n".join(problems))


# Memory model of one pod (docs/runbook.md#resource-sizing). Budgets, not
# measurements: tests/deploy_sizing.rs checks the hot cache stays within its
# budget; the key-store figures are its defaults (keystore options).
HOT_CACHE_BYTES_PER_ENTRY = 96
KEYSTORE_DISK_BYTES_PER_KEY = 64           # issue #4's ceiling; converts the byte cap into keys
KEYSTORE_FILTER_INDEX_BYTES_PER_KEY = 1.5  # filters + index at 50M keys (benches/keystore.rs), outside the block cache
KEYSTORE_MEMTABLES = 3                     # max_write_buffer_number of the keys column family
KEYSTORE_META_BYTES = 16 << 20             # the meta column family's memtables
PROCESS_BASE_BYTES = 256 << 20             # runtime, batches in flight, allocator slack
LIBRDKAFKA_DEFAULT_KBYTES = {"queued.max.messages.kbytes": 65536, "queue.buffering.max.kbytes": 1048576}
QUANTITY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9,
                  "T": 10**12, "": 1}


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T|)", str(q))
    if not m:
        raise CheckFailed(f"cannot read the quantity {q!r}")
    return int(float(m.group(1)) * QUANTITY_UNITS[m.group(2)])


def effective_engine(ctx: Context, text: str) -> dict[str, int]:
    """The engine settings `dedupd check-config` resolves from a TOML file,
    defaults included: the numbers sizing needs, never a copy of them."""
    proc = check_config(ctx, text)
    if proc.returncode != 0:
        raise CheckFailed(f"dedupd check-config refuses the file: {proc.stderr.strip()}")
    engine = next((ln for ln in proc.stdout.splitlines() if ln.startswith("engine: ")), "")
    values = {k: int(v) for k, v in re.findall(r"(\w+): (?:Some\()?(\d+)\b", engine)}
    for key in ("hot_capacity", "keystore_block_cache_bytes", "keystore_write_buffer_bytes"):
        if key not in values:
            raise CheckFailed(f"dedupd check-config printed no {key}: {engine!r}")
    return values


def pod_memory_need(cfg: dict, partitions: int, engine: dict[str, int]) -> dict[str, int]:
    props = dict(p.split("=", 1) for p in cfg.get("kafka_properties", []))
    kbytes = {k: int(props.get(k, v)) for k, v in LIBRDKAFKA_DEFAULT_KBYTES.items()}
    keys = engine.get("keystore_max_bytes", 0) // KEYSTORE_DISK_BYTES_PER_KEY
    return {
        "hot caches": partitions * engine["hot_capacity"] * HOT_CACHE_BYTES_PER_ENTRY,
        "key store filters and indexes": int(keys * KEYSTORE_FILTER_INDEX_BYTES_PER_KEY),
        "key store cache and memtables": engine["keystore_block_cache_bytes"]
        + KEYSTORE_MEMTABLES * engine["keystore_write_buffer_bytes"] + KEYSTORE_META_BYTES,
        "librdkafka fetch queues": partitions * kbytes["queued.max.messages.kbytes"] * 1024,
        "librdkafka producer queue": kbytes["queue.buffering.max.kbytes"] * 1024,
        "process": PROCESS_BASE_BYTES,
    }


@check("k8s: the memory limit covers hot caches, key store and Kafka buffers at the sized partition count")
def check_k8s_sizing(ctx: Context) -> None:
    sts = k8s_kind(ctx, "StatefulSet")
    cfg = k8s_toml(ctx)
    per_pod = dig(sts, "metadata", "annotations", "dedupd/sized-for-partitions-per-pod")
    expect(per_pod is not None and str(per_pod).isdigit(),
           "statefulset.yaml: annotation dedupd/sized-for-partitions-per-pod must say what the pod is sized for")
    expect("hot_capacity" in cfg and "keystore_max_bytes" in cfg,
           "configmap.yaml: set hot_capacity and keystore_max_bytes explicitly: the memory limit depends on them")
    c = next(c for c in dig(sts, "spec", "template", "spec", "containers") or [] if c.get("name") == "dedupd")
    limit = quantity_bytes(dig(c, "resources", "limits", "memory") or "0")
    request = quantity_bytes(dig(c, "resources", "requests", "memory") or "0")
    engine = effective_engine(ctx, dig(k8s_kind(ctx, "ConfigMap"), "data", "dedupd.toml"))
    need = pod_memory_need(cfg, int(per_pod), engine)
    total = sum(need.values())
    detail = ", ".join(f"{k} {v / (1 << 30):.2f} GiB" for k, v in need.items())
    expect(limit >= total, f"memory limit {limit / (1 << 30):.2f} GiB < {total / (1 << 30):.2f} GiB needed "
                           f"at {per_pod} partitions per pod ({detail})")
    expect(request == limit, "memory request must equal the limit (a hot cache is a fixed budget, not a burst)")


# --------------------------------------------------------------------------
# Dockerfile.

@check("hadolint deploy/Dockerfile")
def check_hadolint(ctx: Context) -> None:
    ctx.run(ctx.tool("hadolint"), "--no-color", str(ctx.path("deploy/Dockerfile")))


@check("Dockerfile: locked release build, slim non-root runtime, state volume")
def check_dockerfile(ctx: Context) -> None:
    text = ctx.path("deploy/Dockerfile").read_text()
    # Join continuation lines so each instruction is one line.
    lines = [ln.strip() for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    stages: list[list[str]] = []
    for ln in lines:
        if ln.upper().startswith("FROM "):
            stages.append([])
        if stages:
            stages[-1].append(ln)
    problems = []
    if len(stages) < 2:
        raise CheckFailed("deploy/Dockerfile: needs a builder stage and a runtime stage")
    builder, runtime = stages[0], stages[-1]
    if not any(re.search(r"cargo build --release --locked", ln) for ln in builder):
        problems.append("builder stage must run cargo build --release --locked")
    if not re.match(r"FROM debian:\S*slim", runtime[0]) and "DEBIAN_RELEASE}-slim" not in runtime[0]:
        problems.append("runtime stage must be a slim Debian image")
    install = " ".join(ln for ln in runtime if "apt-get install" in ln)
    for pkg in ("libssl3", "ca-certificates"):
        if pkg not in install.split():
            problems.append(f"runtime stage must install {pkg}")
    if not any(re.match(r"COPY --from=\S+ \S+ /usr/local/bin/dedupd$", ln) for ln in runtime):
        problems.append("runtime stage must copy the dedupd binary from the builder")
    user = [ln for ln in runtime if ln.startswith("USER ")]
    if not user or re.match(r"USER (0|root)\b", user[-1]):
        problems.append("runtime stage must switch to a non-root USER")
    if not any(re.match(r'VOLUME \["?/var/lib/dedupd"?\]', ln) for ln in runtime):
        problems.append("runtime stage must declare VOLUME /var/lib/dedupd")
    if not any(ln.startswith("ENTRYPOINT") and "dedupd" in ln for ln in runtime):
        problems.append("ENTRYPOINT must run dedupd")
    expect(not problems, "deploy/Dockerfile:\n" + "\n".join(problems))


# --------------------------------------------------------------------------
# Runbook.

def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def runbook_anchors(ctx: Context) -> set[str]:
    text = ctx.path("docs/runbook.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


@check("runbook: every docs/runbook.md#anchor referenced by deploy files exists")
def check_runbook_links(ctx: Context) -> None:
    anchors = runbook_anchors(ctx)
    problems = [f"docs/runbook.md has no section #{a}" for a in sorted(REQUIRED_RUNBOOK_ANCHORS - anchors)]
    files = [ctx.root / "docker-compose.yml", *[p for p in (ctx.root / "deploy").rglob("*") if p.is_file()]]
    if (ctx.root / "README.md").exists():
        files.append(ctx.root / "README.md")
    for f in files:
        for a in re.findall(r"docs/runbook\.md#([\w-]+)", f.read_text(errors="replace")):
            if a not in anchors:
                problems.append(f"{f.relative_to(ctx.root)} links docs/runbook.md#{a}, which does not exist")
    for a in re.findall(r"\]\(#([\w-]+)\)", ctx.path("docs/runbook.md").read_text()):
        if a not in anchors:
            problems.append(f"docs/runbook.md links #{a} inside itself, which does not exist")
    expect(not problems, "\n".join(sorted(set(problems))))


# --------------------------------------------------------------------------
# A live scrape.

@check("scrape: the binary exports every metric of deploy/metrics.txt, with its type and labels")
def check_scrape(ctx: Context) -> None:
    if ctx.metrics_file is None:
        raise SkipCheck("no --metrics FILE given (checked against deploy/metrics.txt only)")
    scrape = parse_scrape(ctx.metrics_file.read_text())
    problems = []
    for spec in load_contract(ctx).values():
        kind = scrape_family(scrape, spec)
        if kind is None:
            problems.append(f"{spec.name} ({spec.kind}) is not in the scrape")
            continue
        if kind != spec.kind:
            problems.append(f"{spec.name} is a {kind} in the scrape, {spec.kind} in deploy/metrics.txt")
        for series, labels in sample_names(spec).items():
            got = scrape.samples.get(series)
            if got and got != labels:
                problems.append(f"{series} has labels {sorted(got)} in the scrape, {sorted(labels)} expected")
            for label, allowed in spec.labels.items():
                extra = scrape.values.get((series, label), set()) - (allowed or set())
                if allowed is not None and extra:
                    problems.append(f"{series}{{{label}}} has values {sorted(extra)} outside {sorted(allowed)}")
    # The exposition itself must lint clean (issue #5: promtool check metrics passes).
    lint = subprocess.run([ctx.tool("promtool"), "check", "metrics"], input=ctx.metrics_file.read_text(),
                          capture_output=True, text=True)
    if lint.returncode != 0:
        problems.append("promtool check metrics:\n" + (lint.stdout + lint.stderr).strip())
    expect(not problems, f"{ctx.metrics_file}:\n" + "\n".join(problems))


# --------------------------------------------------------------------------
# Self-test: each mutation must make the named check fail.

MUTATIONS: list[tuple[str, str, Callable[[str], str], str]] = [
    ("a dashboard query naming a metric dedupd does not export", "deploy/grafana/dedupd.json",
     lambda s: s.replace("dedupd_consumer_lag_records", "dedupd_consumer_lag", 1),
     "grafana: every metric, label and label value"),
    ("a dashboard query using a bucket value that does not exist", "deploy/grafana/dedupd.json",
     lambda s: s.replace('bucket=\\"duplicate\\"', 'bucket=\\"duplicates\\"', 1),
     "grafana: every metric, label and label value"),
    ("a dashboard query that is not PromQL", "deploy/grafana/dedupd.json",
     lambda s: s.replace("sum by (bucket) (rate(", "sum by (bucket) (rate((", 1),
     "grafana: every query parses"),
    ("a dashboard without the lag-per-partition view", "deploy/grafana/dedupd.json",
     lambda s: s.replace("max by (partition) (dedupd_consumer_lag_records", "max(dedupd_consumer_lag_records"),
     "grafana: dedupd.json is a valid dashboard"),
    ("an alert grouping by a label its metric lacks", "deploy/prometheus/alerts.yml",
     lambda s: s.replace("max by (job, instance) (dedupd_dedupe_window_below_floor",
                         "max by (job, tenant) (dedupd_dedupe_window_below_floor", 1),
     "alerts: every metric, label and label value"),
    ("a Prometheus config whose dedupd job the alerts do not select", "deploy/prometheus/prometheus.yml",
     lambda s: s.replace("  - job_name: dedupd\n", "  - job_name: dedupd-worker\n", 1),
     "prometheus: the real server"),
    ("an alert whose runbook anchor does not exist", "deploy/prometheus/alerts.yml",
     lambda s: s.replace("#dedupdconsumerlaggrowing", "#consumer-lag", 1),
     "alerts: severity, summary"),
    ("an alert whose runbook link is relative to the source tree", "deploy/prometheus/alerts.yml",
     lambda s: s.replace("{{ or $externalLabels.dedupd_runbook_url \"http://localhost:9464/runbook\" }}#dedupddown",
                         "docs/runbook.md#dedupddown", 1),
     "alerts: severity, summary"),
    ("an alert that no longer fires on a new tenant's first conflict", "deploy/prometheus/alerts.yml",
     lambda s: s.replace("unless dedupd_conflicts_total{job=\"dedupd\"} offset 10m",
                         "and dedupd_conflicts_total{job=\"dedupd\"} offset 10m", 1),
     "promtool test rules"),
    ("a misspelled StatefulSet field", "deploy/k8s/statefulset.yaml",
     lambda s: s.replace("  replicas: 3", "  replcas: 3", 1),
     "k8s: every manifest validates"),
    ("a readiness probe on the liveness path", "deploy/k8s/statefulset.yaml",
     lambda s: s.replace("path: /readyz", "path: /healthz", 1),
     "k8s: StatefulSet, headless Service"),
    ("a hot cache too big for the pod's memory limit", "deploy/k8s/configmap.yaml",
     lambda s: s.replace("hot_capacity = 2000000", "hot_capacity = 5000000", 1),
     "k8s: the memory limit covers"),
    ("a topic script that lets mismatched partition counts through", "deploy/compose/create-topics.sh",
     lambda s: s.replace("    exit 1\n", "    true\n", 1),
     "compose: create-topics.sh"),
    ("a TOML key that is not a flag", "deploy/k8s/configmap.yaml",
     lambda s: s.replace('horizon = "35d"', 'dedupe_horizon = "35d"', 1),
     "config: both TOML files"),
    ("a compose dedupd that does not wait for its topics", "docker-compose.yml",
     lambda s: s.replace("condition: service_completed_successfully", "condition: service_started", 1),
     "compose: KRaft broker"),
    ("a compose file outside the compose spec", "docker-compose.yml",
     lambda s: s.replace("    stop_grace_period: 150s", "    stop_grace_periods: 150s", 1),
     "compose: docker-compose.yml matches"),
    ("a Dockerfile running as root", "deploy/Dockerfile",
     lambda s: s.replace("USER 10001:10001", "USER root", 1),
     "Dockerfile: locked release build"),
    ("a runbook without its adding-partitions section", "docs/runbook.md",
     lambda s: s.replace("## Adding partitions", "## Partitions", 1),
     "runbook: every docs/runbook.md#anchor"),
]

# A page in the text format 0.0.4 the binary serves, enough for the real
# Prometheus server check to scrape and fire a conflict alert from (counter
# families named with `_total`; a labelled family may have no sample yet).
SCRAPE_OK = """\
# HELP dedupd_events_total Input records by bucket.
# TYPE dedupd_events_total counter
dedupd_events_total{bucket="accepted"} 10
dedupd_events_total{bucket="duplicate"} 2
# HELP dedupd_conflicts_total Conflicts by tenant.
# TYPE dedupd_conflicts_total counter
# HELP dedupd_rejected_total Rejected records by reason code.
# TYPE dedupd_rejected_total counter
dedupd_rejected_total{reason="malformed_json"} 0
# HELP dedupd_dedupe_window_seconds Age of the oldest key still remembered, by tier.
# TYPE dedupd_dedupe_window_seconds gauge
dedupd_dedupe_window_seconds{tier="keystore"} 100.0
# HELP dedupd_dedupe_window_below_floor 1 when the key store window is below its floor.
# TYPE dedupd_dedupe_window_below_floor gauge
dedupd_dedupe_window_below_floor 0
# HELP dedupd_hot_cache_entries Keys in the hot caches.
# TYPE dedupd_hot_cache_entries gauge
dedupd_hot_cache_entries 5
# HELP dedupd_keystore_bytes Approximate size of the key store.
# TYPE dedupd_keystore_bytes gauge
dedupd_keystore_bytes 5
# HELP dedupd_batch_duration_seconds Time per batch, by stage.
# TYPE dedupd_batch_duration_seconds histogram
dedupd_batch_duration_seconds_bucket{stage="publish",le="0.001"} 0
dedupd_batch_duration_seconds_bucket{stage="publish",le="+Inf"} 1
dedupd_batch_duration_seconds_sum{stage="publish"} 0.1
dedupd_batch_duration_seconds_count{stage="publish"} 1
# HELP dedupd_wal_fsync_duration_seconds WAL fsync time.
# TYPE dedupd_wal_fsync_duration_seconds histogram
dedupd_wal_fsync_duration_seconds_bucket{le="0.001"} 0
dedupd_wal_fsync_duration_seconds_bucket{le="+Inf"} 1
dedupd_wal_fsync_duration_seconds_sum 0.1
dedupd_wal_fsync_duration_seconds_count 1
# HELP dedupd_repair_records_total Output records read back by repair.
# TYPE dedupd_repair_records_total counter
dedupd_repair_records_total 0
# HELP dedupd_recovery_segments_total Segments recovered at start, by path.
# TYPE dedupd_recovery_segments_total counter
dedupd_recovery_segments_total{path="sidecar"} 0
dedupd_recovery_segments_total{path="fallback"} 0
# HELP dedupd_consumer_lag_records Records behind, by input partition.
# TYPE dedupd_consumer_lag_records gauge
# HELP dedupd_assigned_partitions Input partitions owned.
# TYPE dedupd_assigned_partitions gauge
dedupd_assigned_partitions 3
# HELP dedupd_unkeyed_records_total Input records without a key.
# TYPE dedupd_unkeyed_records_total counter
dedupd_unkeyed_records_total 0
"""

# The checks whose outcome depends on --metrics.
SCRAPE_CHECKS = ("scrape:", "alerts: every metric", "grafana: every metric")

SCRAPE_MUTATIONS: list[tuple[str, Callable[[str], str], str]] = [
    ("a scrape missing a contract metric",
     lambda s: "".join(ln for ln in s.splitlines(keepends=True) if "dedupd_consumer_lag_records" not in ln),
     "scrape: the binary exports"),
    ("a scrape whose exposition does not lint",
     lambda s: s.replace("# TYPE dedupd_assigned_partitions gauge", "# TYPE dedupd_assigned_partitions counter"),
     "scrape: the binary exports"),
    ("a scrape with a bucket value outside the contract",
     lambda s: s.replace('bucket="accepted"', 'bucket="dropped"'), "scrape: the binary exports"),
    ("a scrape where a dashboard metric was renamed",
     lambda s: s.replace("dedupd_hot_cache_entries", "dedupd_hot_entries"), "grafana: every metric, label"),
]


def run_checks(ctx: Context, only: tuple[str, ...] = ()) -> tuple[int, int]:
    """Runs every check, or those whose name starts with one of `only`."""
    passed = failed = 0
    for name, fn in CHECKS:
        if only and not name.startswith(only):
            continue
        try:
            fn(ctx)
        except SkipCheck as e:
            ctx.results.append((name, True, f"skipped: {e}"))
            if not ctx.quiet:
                print(f"skip {name}: {e}")
            continue
        except CheckFailed as e:
            failed += 1
            ctx.results.append((name, False, str(e)))
            if not ctx.quiet:
                print(f"FAIL {name}\n" + "\n".join("     " + ln for ln in str(e).splitlines()))
            continue
        passed += 1
        ctx.results.append((name, True, ""))
        if not ctx.quiet:
            print(f"ok   {name}")
    return passed, failed


def copy_tree(root: Path, dst: Path) -> None:
    for rel in ("deploy", "docs"):
        shutil.copytree(root / rel, dst / rel)
    shutil.copy(root / "docker-compose.yml", dst / "docker-compose.yml")


def self_test(root: Path, tools: Path, scrape: Path | None) -> tuple[int, int]:
    passed = failed = 0

    # Only the check that must catch a break runs on it: the whole suite on
    # every broken copy would take minutes on a small machine.
    def outcome(what: str, ctx: Context, must_fail: str) -> None:
        nonlocal passed, failed
        run_checks(ctx, only=(must_fail,))
        if any(not ok for _, ok, _ in ctx.results):
            passed += 1
            print(f"ok   self-test: {what} is caught by `{must_fail}...`")
        else:
            failed += 1
            print(f"FAIL self-test: {what} passed `{must_fail}...`")

    with tempfile.TemporaryDirectory() as tmp:
        base = Context(root, tools, None, quiet=True)
        base_passed, base_failed = run_checks(base)
        if base_failed:
            print("FAIL self-test: the unmodified files do not pass; run without --self-test to see why")
            return passed, failed + 1
        for n, (what, rel, mutate, must_fail) in enumerate(MUTATIONS):
            dst = Path(tmp, f"m{n}")
            copy_tree(root, dst)
            before = (dst / rel).read_text()
            after = mutate(before)
            if after == before:
                failed += 1
                print(f"FAIL self-test: the mutation for {what} no longer applies to {rel}")
                continue
            (dst / rel).write_text(after)
            outcome(what, Context(dst, tools, None, quiet=True), must_fail)
        # The conforming scrape is the binary's own page when one is given
        # (scripts/test passes the one the tests saved), so the scrape checks
        # are proven against what dedupd serves today, not a copy that ages.
        if scrape is None:
            print("skip self-test of the scrape checks: no --metrics FILE (a /metrics page of the binary) given")
            return passed, failed
        conforming = scrape.read_text()
        for n, (what, mutate, must_fail) in enumerate(SCRAPE_MUTATIONS):
            if mutate(conforming) == conforming:
                failed += 1
                print(f"FAIL self-test: the mutation for {what} no longer applies to the scrape")
                continue
            good = Path(tmp, f"scrape-ok-{n}.txt")
            good.write_text(conforming)
            ok_ctx = Context(root, tools, good, quiet=True)
            run_checks(ok_ctx, only=SCRAPE_CHECKS)
            bad_ok = [n for n, ok, _ in ok_ctx.results if not ok]
            if bad_ok:
                failed += 1
                print(f"FAIL self-test: a conforming scrape fails {bad_ok}")
                continue
            bad = Path(tmp, f"scrape-bad-{n}.txt")
            bad.write_text(mutate(conforming))
            outcome(what, Context(root, tools, bad, quiet=True), must_fail)
    return passed, failed


def scrape_live_binary(binary: Path, tansu: str, out: Path) -> None:
    """Runs `binary run` against a Tansu broker on loopback (DESIGN §11: the
    sqlite engine, topics created first, at-least-once since Tansu has no
    EndTxn) and saves its /metrics page to `out` once /readyz says ready."""
    with tempfile.TemporaryDirectory() as tmp:
        kport, mport = free_port(), free_port()
        broker = f"127.0.0.1:{kport}"
        tansu_proc = subprocess.Popen(
            [tansu, "broker", f"--listener-url=tcp://{broker}", f"--advertised-listener-url=tcp://{broker}",
             "--storage-engine=sqlite://tansu.db", "--silent"],
            cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        dedupd = None
        try:
            topics = {"input": "deploy-check-in", "output": "deploy-check-out", "conflicts": "deploy-check-conflicts",
                      "rejected": "deploy-check-rejected"}
            for topic in topics.values():
                deadline = time.monotonic() + 30
                while True:
                    made = subprocess.run([tansu, "topic", "create", topic, f"--broker=tcp://{broker}",
                                           "--partitions=3"], capture_output=True, text=True)
                    if made.returncode == 0:
                        break
                    if time.monotonic() > deadline or tansu_proc.poll() is not None:
                        raise CheckFailed(f"tansu: cannot create {topic}: {made.stderr.strip()}")
                    time.sleep(0.5)
            dedupd = subprocess.Popen(
                [str(binary), "run", f"--brokers={broker}", "--group=deploy-check",
                 f"--input-topic={topics['input']}", f"--output-topic={topics['output']}",
                 f"--conflicts-topic={topics['conflicts']}", f"--rejected-topic={topics['rejected']}",
                 f"--state-dir={tmp}/state", f"--metrics-addr=127.0.0.1:{mport}", "--delivery=at-least-once",
                 "--kafka-property=fetch.wait.max.ms=5"],
                cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            base = f"http://127.0.0.1:{mport}"
            deadline = time.monotonic() + 60
            page = None
            while time.monotonic() < deadline:
                if dedupd.poll() is not None:
                    raise CheckFailed(f"{binary} run exited with {dedupd.returncode} before it was ready:\n"
                                      f"{dedupd.stderr.read()[-2000:] if dedupd.stderr else ''}")
                try:
                    with urllib.request.urlopen(f"{base}/healthz", timeout=2):
                        pass
                    with urllib.request.urlopen(f"{base}/readyz", timeout=2):
                        pass
                    with urllib.request.urlopen(f"{base}/metrics", timeout=2) as r:
                        page = r.read().decode()
                    break
                except OSError:
                    time.sleep(0.5)
            if page is None:
                raise CheckFailed(f"{binary} run did not answer /healthz, /readyz and /metrics within 60 s")
            out.write_text(page)
        finally:
            for proc in (dedupd, tansu_proc):
                if proc is None or proc.poll() is not None:
                    continue
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--tools", type=Path, default=Path(sys.executable).parent,
                    help="directory holding the Python validators' executables")
    ap.add_argument("--metrics", type=Path, help="a /metrics scrape of the real binary to check names against")
    ap.add_argument("--live", type=Path, metavar="BINARY",
                    help="run BINARY (`dedupd run`) against a Tansu broker on loopback and check its live /metrics")
    ap.add_argument("--self-test", action="store_true", help="check that broken copies of the files are caught")
    args = ap.parse_args()
    if args.live is not None:
        tansu = shutil.which("tansu")
        if tansu is None:
            print("--live needs tansu (cargo install tansu --locked --features dynostore,libsql)", file=sys.stderr)
            return 2
        args.metrics = Path(tempfile.mkdtemp(prefix="dedupd-scrape-"), "metrics.txt")
        try:
            scrape_live_binary(args.live.resolve(), tansu, args.metrics)
        except CheckFailed as e:
            print(f"FAIL live scrape of {args.live}\n" + "\n".join("     " + ln for ln in str(e).splitlines()))
            print("0 passed, 1 failed")
            return 1
        print(f"ok   live scrape of {args.live} saved to {args.metrics}")
    if args.metrics is not None and not args.metrics.is_file():
        print(f"--metrics {args.metrics}: no such file", file=sys.stderr)
        return 2
    if args.self_test:
        passed, failed = self_test(args.root, args.tools, args.metrics)
    else:
        passed, failed = run_checks(Context(args.root, args.tools, args.metrics))
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
