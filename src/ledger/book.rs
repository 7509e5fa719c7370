//! Billing periods closed and reopened: the period book.
//!
//! Closing a (tenant, month) freezes what the rollups say about it, per
//! customer and meter: quantity, usage events, corrections and the counter's
//! watermark at that moment. From then on usage into the month is rejected
//! (`closed_period`); corrections and retractions are still accepted, and so
//! is anything a worker accepted before it learnt of the close. None of that
//! rewrites the snapshot: it shows as **pending** on top of it, and `net` is
//! what the month holds now. Reopening discards the snapshot; closing again
//! takes a new one.
//!
//! Why pending is "the month now minus the snapshot" and not a list kept by
//! the workers: the ledger stays a pure function of the output (repair
//! rebuilds it from the output topic alone, whatever periods were closed
//! when), and the difference is exact whichever worker accepted what when.
//! The price is that pending is per customer and meter (quantity, usage
//! events and corrections), not per event; the events themselves are on the
//! output topic, and late ones are itemised as adjustments.
//!
//! A period's record carries its whole history (every close and reopen with
//! its time), so the latest record of a key, which is all a compacted topic
//! keeps, says everything. The book is the latest record of each (tenant,
//! period); it lives on a compacted periods topic shared by every worker, or
//! in `<state-dir>/periods.json` offline.

use std::collections::BTreeMap;
use std::path::Path;

use rust_decimal::Decimal;

use super::rollup::{checked_difference, checked_sum, checked_total, Adjustment, FoldError, HourKey, Rollup};
use super::Period;
use crate::event::{format_timestamp_ms, ClosedPeriod, EventKind};

/// Whether a period takes usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeriodStatus {
    Open,
    Closed,
}

impl PeriodStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            PeriodStatus::Open => "open",
            PeriodStatus::Closed => "closed",
        }
    }
}

/// One close or reopen, with when it was done (epoch milliseconds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeriodChange {
    pub status: PeriodStatus,
    pub at_ms: i64,
}

/// One counter's share of a period: what the snapshot freezes, and what the
/// month holds now.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CounterTotal {
    /// Usage plus corrections and retractions (signed), late ones included.
    pub quantity: Decimal,
    /// Usage events.
    pub events: u64,
    /// Corrections and retractions.
    pub corrections: u64,
    /// The counter's watermark (largest on-time event time, any month).
    pub watermark_ms: Option<i64>,
}

/// (customer, meter)
pub type CounterOfTenant = (String, String);

/// The latest word on one (tenant, period).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeriodRecord {
    pub tenant_id: String,
    pub period: Period,
    /// Every close and reopen, oldest first; the last one is the status.
    pub history: Vec<PeriodChange>,
    /// The frozen totals of the last close; empty while open.
    pub snapshot: BTreeMap<CounterOfTenant, CounterTotal>,
}

impl PeriodRecord {
    pub fn status(&self) -> PeriodStatus {
        self.history.last().map_or(PeriodStatus::Open, |c| c.status)
    }

    /// When the period was last closed, if it is closed now.
    pub fn closed_at_ms(&self) -> Option<i64> {
        self.history.last().filter(|c| c.status == PeriodStatus::Closed).map(|c| c.at_ms)
    }

    /// The record's key on the compacted periods topic: one per (tenant,
    /// period), so compaction keeps exactly the latest word.
    pub fn key(&self) -> Vec<u8> {
        format!("period\0{}\0{}", self.tenant_id, self.period).into_bytes()
    }

    pub fn to_json(&self) -> serde_json::Value {
        let dec = |d: Decimal| d.normalize().to_string();
        let history: Vec<serde_json::Value> = self
            .history
            .iter()
            .map(|c| serde_json::json!({"status": c.status.as_str(), "at": format_timestamp_ms(c.at_ms)}))
            .collect();
        let snapshot: Vec<serde_json::Value> = self
            .snapshot
            .iter()
            .map(|((customer, meter), t)| {
                serde_json::json!({
                    "customer_id": customer,
                    "meter": meter,
                    "quantity": dec(t.quantity),
                    "events": t.events,
                    "corrections": t.corrections,
                    "watermark": t.watermark_ms.map(format_timestamp_ms),
                })
            })
            .collect();
        serde_json::json!({
            "type": "period",
            "tenant_id": self.tenant_id,
            "period": self.period.to_string(),
            "status": self.status().as_str(),
            "history": history,
            "snapshot": snapshot,
        })
    }

    /// Reads a record back; every missing or malformed field is named.
    pub fn from_json(bytes: &[u8]) -> Result<PeriodRecord, String> {
        let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| format!("not JSON: {e}"))?;
        PeriodRecord::from_value(&v)
    }

    fn from_value(v: &serde_json::Value) -> Result<PeriodRecord, String> {
        let text = |v: &serde_json::Value, k: &str| v[k].as_str().map(str::to_owned).ok_or_else(|| format!("no {k}"));
        let time = |s: String| super::parse_bound(&s);
        if v["type"].as_str() != Some("period") {
            return Err(format!("type {:?} is not period", v["type"]));
        }
        let status = |s: &str| match s {
            "open" => Ok(PeriodStatus::Open),
            "closed" => Ok(PeriodStatus::Closed),
            other => Err(format!("status {other:?} is neither open nor closed")),
        };
        let mut history = Vec::new();
        for c in v["history"].as_array().ok_or("no history")? {
            history.push(PeriodChange { status: status(&text(c, "status")?)?, at_ms: time(text(c, "at")?)? });
        }
        let mut snapshot = BTreeMap::new();
        for line in v["snapshot"].as_array().ok_or("no snapshot")? {
            let quantity = text(line, "quantity")?;
            let total = CounterTotal {
                quantity: quantity.parse().map_err(|e| format!("quantity {quantity:?}: {e}"))?,
                events: line["events"].as_u64().ok_or("no events")?,
                corrections: line["corrections"].as_u64().ok_or("no corrections")?,
                watermark_ms: line["watermark"].as_str().map(|s| time(s.to_owned())).transpose()?,
            };
            snapshot.insert((text(line, "customer_id")?, text(line, "meter")?), total);
        }
        let record = PeriodRecord {
            tenant_id: text(v, "tenant_id")?,
            period: Period::parse(&text(v, "period")?)?,
            history,
            snapshot,
        };
        if text(v, "status")? != record.status().as_str() {
            return Err(format!("status {:?} disagrees with the history", v["status"]));
        }
        Ok(record)
    }
}

/// What `dedupd period` is asked to do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeriodAction {
    Close,
    Reopen,
    Show,
}

/// The latest record of every (tenant, period) ever closed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeriodBook {
    records: BTreeMap<(String, Period), PeriodRecord>,
}

impl PeriodBook {
    /// Takes `record` as the latest word on its (tenant, period).
    pub fn insert(&mut self, record: PeriodRecord) {
        self.records.insert((record.tenant_id.clone(), record.period), record);
    }

    /// Forgets a period (a tombstone on the periods topic).
    pub fn remove(&mut self, tenant_id: &str, period: Period) {
        self.records.remove(&(tenant_id.to_owned(), period));
    }

    pub fn get(&self, tenant_id: &str, period: Period) -> Option<&PeriodRecord> {
        self.records.get(&(tenant_id.to_owned(), period))
    }

    pub fn records(&self) -> impl Iterator<Item = &PeriodRecord> {
        self.records.values()
    }

    /// The periods closed now: what validation rejects usage into.
    pub fn closed(&self) -> Vec<ClosedPeriod> {
        self.records
            .values()
            .filter(|r| r.status() == PeriodStatus::Closed)
            .map(|r| ClosedPeriod { tenant_id: r.tenant_id.clone(), year: r.period.year, month: r.period.month })
            .collect()
    }

    /// The record that closes `period` of `tenant` at `at_ms` with
    /// `snapshot` (the caller publishes or saves it). Closing a closed
    /// period is refused: the first snapshot is what was invoiced.
    pub fn close(
        &self,
        tenant_id: &str,
        period: Period,
        at_ms: i64,
        snapshot: BTreeMap<CounterOfTenant, CounterTotal>,
    ) -> Result<PeriodRecord, String> {
        let mut record = self.get(tenant_id, period).cloned().unwrap_or_else(|| PeriodRecord {
            tenant_id: tenant_id.to_owned(),
            period,
            history: Vec::new(),
            snapshot: BTreeMap::new(),
        });
        if let Some(at) = record.closed_at_ms() {
            return Err(format!(
                "{period} of tenant {tenant_id:?} is already closed (since {}); reopen it first to take a new snapshot",
                format_timestamp_ms(at)
            ));
        }
        record.history.push(PeriodChange { status: PeriodStatus::Closed, at_ms });
        record.snapshot = snapshot;
        Ok(record)
    }

    /// The record that reopens `period` of `tenant` at `at_ms`, discarding
    /// its snapshot. Reopening a period that is not closed is refused.
    pub fn reopen(&self, tenant_id: &str, period: Period, at_ms: i64) -> Result<PeriodRecord, String> {
        let mut record = self
            .get(tenant_id, period)
            .filter(|r| r.status() == PeriodStatus::Closed)
            .cloned()
            .ok_or_else(|| format!("{period} of tenant {tenant_id:?} is not closed; nothing to reopen"))?;
        record.history.push(PeriodChange { status: PeriodStatus::Open, at_ms });
        record.snapshot.clear();
        Ok(record)
    }

    /// Does `action` on `period` of `tenant` at `at_ms`, given what the
    /// month holds now: the record to publish or save (none for `show`) and
    /// the report to print. Wherever the book lives, this is the one place
    /// that decides.
    pub fn act(
        &self,
        action: PeriodAction,
        tenant_id: &str,
        period: Period,
        at_ms: i64,
        now: &BTreeMap<CounterOfTenant, CounterTotal>,
    ) -> Result<(Option<PeriodRecord>, PeriodReport), String> {
        let changed = match action {
            PeriodAction::Close => Some(self.close(tenant_id, period, at_ms, now.clone())?),
            PeriodAction::Reopen => Some(self.reopen(tenant_id, period, at_ms)?),
            PeriodAction::Show => None,
        };
        let report = PeriodReport::of(tenant_id, period, changed.as_ref().or(self.get(tenant_id, period)), now)
            .map_err(|e| e.to_string())?;
        Ok((changed, report))
    }

    /// The book saved in a state directory (`periods.json`); none yet is an
    /// empty book.
    pub fn load(state_dir: &Path) -> Result<PeriodBook, String> {
        let path = state_dir.join(PERIODS_FILE);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(PeriodBook::default()),
            Err(e) => return Err(format!("reading {}: {e}", path.display())),
        };
        let bad = |why: String| format!("{} is not a period book: {why}", path.display());
        let v: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
        if v["format"].as_u64() != Some(1) {
            return Err(bad(format!("format {:?}, this dedupd reads format 1", v["format"])));
        }
        let mut book = PeriodBook::default();
        for r in v["periods"].as_array().ok_or_else(|| bad("no periods".into()))? {
            book.insert(PeriodRecord::from_value(r).map_err(bad)?);
        }
        Ok(book)
    }

    /// An exclusive lock on a state directory's book (`periods.lock`), held
    /// from a change's load to its save: two `period close` at once (other
    /// tenants, other months) each load the book, and without it the later
    /// save drops the earlier's record, after both reported success. A
    /// flock, waited for (a change takes milliseconds), released when the
    /// value drops or the process dies. Readers need none: a save replaces
    /// the file whole.
    pub fn lock_for_change(state_dir: &Path) -> Result<std::fs::File, String> {
        use fs4::fs_std::FileExt;
        let path = state_dir.join(PERIODS_LOCK_FILE);
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| format!("opening {}: {e}", path.display()))?;
        file.lock_exclusive().map_err(|e| format!("locking {}: {e}", path.display()))?;
        Ok(file)
    }

    /// Saves the book in a state directory, atomically and durably.
    pub fn save(&self, state_dir: &Path) -> Result<(), String> {
        let periods: Vec<serde_json::Value> = self.records.values().map(PeriodRecord::to_json).collect();
        let text = serde_json::to_vec_pretty(&serde_json::json!({"format": 1, "periods": periods}))
            .map_err(|e| e.to_string())?;
        let path = state_dir.join(PERIODS_FILE);
        crate::storage::write_file_atomic(&path, &text).map_err(|e| format!("writing {}: {e}", path.display()))
    }
}

/// The period book's file in a state directory.
pub const PERIODS_FILE: &str = "periods.json";

/// The lock a change of the period book holds (see
/// [`PeriodBook::lock_for_change`]).
pub const PERIODS_LOCK_FILE: &str = "periods.lock";

/// What one tenant's `period` holds now, per (customer, meter), from any
/// partitions' rollups and adjustments: the hours of the month plus the
/// adjustments against it. The watermark is the counter's, over every hour
/// given (so pass the tenant's whole ledger, not only the month's hours).
pub fn period_totals<'a>(
    tenant_id: &str,
    period: Period,
    rollups: impl IntoIterator<Item = (&'a HourKey, &'a Rollup)>,
    adjustments: impl IntoIterator<Item = &'a Adjustment>,
) -> Result<BTreeMap<CounterOfTenant, CounterTotal>, FoldError> {
    const WHAT: &str = "a counter's total for the period";
    let mut watermarks: BTreeMap<CounterOfTenant, i64> = BTreeMap::new();
    let mut totals: BTreeMap<CounterOfTenant, CounterTotal> = BTreeMap::new();
    for (k, r) in rollups {
        if k.counter.tenant_id != tenant_id {
            continue;
        }
        let counter = (k.counter.customer_id.clone(), k.counter.meter.clone());
        if r.latest_event_ms != i64::MIN {
            let w = watermarks.entry(counter.clone()).or_insert(r.latest_event_ms);
            *w = (*w).max(r.latest_event_ms);
        }
        if period.contains(k.hour_ms) {
            let t = totals.entry(counter).or_default();
            t.quantity = checked_total(t.quantity, r.sum, WHAT)?;
            t.events += r.count;
            t.corrections += r.corrections;
        }
    }
    for a in adjustments {
        if a.counter.tenant_id != tenant_id || a.period != period {
            continue;
        }
        let t = totals.entry((a.counter.customer_id.clone(), a.counter.meter.clone())).or_default();
        t.quantity = checked_total(t.quantity, a.amount, WHAT)?;
        if a.kind == EventKind::Usage {
            t.events += 1;
        } else {
            t.corrections += 1;
        }
    }
    for (counter, t) in &mut totals {
        t.watermark_ms = watermarks.get(counter).copied();
    }
    Ok(totals)
}

/// One (customer, meter) line of `dedupd period show`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeriodLine {
    pub customer_id: String,
    pub meter: String,
    /// The snapshot's totals; `None` while the period is open or when the
    /// counter had nothing in the month at close.
    pub frozen: Option<CounterTotal>,
    /// Quantity, usage events and corrections accepted into the month since
    /// the snapshot (zero while open: nothing is pending on an open month).
    pub pending_quantity: Decimal,
    pub pending_events: i64,
    pub pending_corrections: i64,
    /// What the month holds now: frozen plus pending.
    pub net: Decimal,
}

/// `dedupd period show`: a period's status, history and lines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeriodReport {
    pub tenant_id: String,
    pub period: Period,
    pub status: PeriodStatus,
    pub history: Vec<PeriodChange>,
    pub lines: Vec<PeriodLine>,
}

impl PeriodReport {
    /// The report of `record` (none: a period never closed) against what the
    /// month holds now.
    pub fn of(
        tenant_id: &str,
        period: Period,
        record: Option<&PeriodRecord>,
        now: &BTreeMap<CounterOfTenant, CounterTotal>,
    ) -> Result<PeriodReport, FoldError> {
        let status = record.map_or(PeriodStatus::Open, PeriodRecord::status);
        let empty = BTreeMap::new();
        let frozen = match (status, record) {
            (PeriodStatus::Closed, Some(r)) => &r.snapshot,
            _ => &empty,
        };
        let mut counters: Vec<&CounterOfTenant> = frozen.keys().chain(now.keys()).collect();
        counters.sort();
        counters.dedup();
        let zero = CounterTotal::default();
        let lines = counters
            .into_iter()
            .map(|c| {
                let current = now.get(c).unwrap_or(&zero);
                let f = frozen.get(c);
                let base = f.unwrap_or(&zero);
                let (pending_quantity, pending_events, pending_corrections) = if status == PeriodStatus::Closed {
                    (
                        checked_difference(current.quantity, base.quantity, "a counter's pending quantity")?,
                        current.events as i64 - base.events as i64,
                        current.corrections as i64 - base.corrections as i64,
                    )
                } else {
                    (Decimal::ZERO, 0, 0)
                };
                Ok(PeriodLine {
                    customer_id: c.0.clone(),
                    meter: c.1.clone(),
                    frozen: f.cloned(),
                    pending_quantity,
                    pending_events,
                    pending_corrections,
                    net: current.quantity,
                })
            })
            .collect::<Result<Vec<_>, FoldError>>()?;
        let report = PeriodReport {
            tenant_id: tenant_id.to_owned(),
            period,
            status,
            history: record.map(|r| r.history.clone()).unwrap_or_default(),
            lines,
        };
        report.totals()?;
        Ok(report)
    }

    pub fn frozen_total(&self) -> Result<Decimal, FoldError> {
        checked_sum(self.lines.iter().filter_map(|l| l.frozen.as_ref()).map(|f| f.quantity), "the frozen total")
    }

    pub fn pending_total(&self) -> Result<Decimal, FoldError> {
        checked_sum(self.lines.iter().map(|l| l.pending_quantity), "the pending total")
    }

    pub fn net_total(&self) -> Result<Decimal, FoldError> {
        checked_sum(self.lines.iter().map(|l| l.net), "the net total")
    }

    /// Frozen, pending and net over every line, each exact, or the one
    /// that is not.
    pub fn totals(&self) -> Result<(Decimal, Decimal, Decimal), FoldError> {
        Ok((self.frozen_total()?, self.pending_total()?, self.net_total()?))
    }

    pub fn to_json(&self) -> Result<serde_json::Value, FoldError> {
        let (frozen, pending, net) = self.totals()?;
        let dec = |d: Decimal| d.normalize().to_string();
        let lines: Vec<serde_json::Value> = self
            .lines
            .iter()
            .map(|l| {
                serde_json::json!({
                    "customer_id": l.customer_id,
                    "meter": l.meter,
                    "frozen": l.frozen.as_ref().map(|f| serde_json::json!({
                        "quantity": dec(f.quantity),
                        "events": f.events,
                        "corrections": f.corrections,
                        "watermark": f.watermark_ms.map(format_timestamp_ms),
                    })),
                    "pending": {
                        "quantity": dec(l.pending_quantity),
                        "events": l.pending_events,
                        "corrections": l.pending_corrections,
                    },
                    "net": dec(l.net),
                })
            })
            .collect();
        let history: Vec<serde_json::Value> = self
            .history
            .iter()
            .map(|c| serde_json::json!({"status": c.status.as_str(), "at": format_timestamp_ms(c.at_ms)}))
            .collect();
        Ok(serde_json::json!({
            "tenant_id": self.tenant_id,
            "period": self.period.to_string(),
            "status": self.status.as_str(),
            "history": history,
            "lines": lines,
            "frozen": dec(frozen),
            "pending": dec(pending),
            "net": dec(net),
        }))
    }

    /// A fixed-width table for a terminal.
    pub fn to_table(&self) -> Result<String, FoldError> {
        use std::fmt::Write;
        let (frozen, pending, net) = self.totals()?;
        let dec = |d: Decimal| d.normalize().to_string();
        let mut out = String::new();
        let _ = writeln!(out, "period {} of tenant {}: {}", self.period, self.tenant_id, self.status.as_str());
        for c in &self.history {
            let _ = writeln!(out, "  {} at {}", c.status.as_str(), format_timestamp_ms(c.at_ms));
        }
        let width = self.lines.iter().map(|l| l.customer_id.len() + l.meter.len() + 1).max().unwrap_or(8).max(8);
        let _ = writeln!(
            out,
            "{:<width$}  {:>18}  {:>8}  {:>18}  {:>8}  {:>11}  {:>18}",
            "counter", "frozen", "events", "pending", "events", "corrections", "net"
        );
        for l in &self.lines {
            let counter = format!("{}/{}", l.customer_id, l.meter);
            let (fq, fe) =
                l.frozen.as_ref().map_or(("-".to_owned(), "-".to_owned()), |f| (dec(f.quantity), f.events.to_string()));
            let _ = writeln!(
                out,
                "{counter:<width$}  {fq:>18}  {fe:>8}  {:>18}  {:>8}  {:>11}  {:>18}",
                dec(l.pending_quantity),
                l.pending_events,
                l.pending_corrections,
                dec(l.net)
            );
        }
        let _ = writeln!(out, "frozen {}  pending {}  net {}", dec(frozen), dec(pending), dec(net));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn total(q: i64, events: u64) -> CounterTotal {
        CounterTotal { quantity: Decimal::from(q), events, corrections: 0, watermark_ms: Some(1_700_000_000_000) }
    }

    #[test]
    fn a_record_reads_back_to_itself() {
        let p = Period::parse("2026-10").expect("period");
        let book = PeriodBook::default();
        let closed =
            book.close("t\"x", p, 1_800_000_000_000, [(("c".into(), "m".into()), total(12, 3))].into()).expect("close");
        assert_eq!(PeriodRecord::from_json(closed.to_json().to_string().as_bytes()), Ok(closed.clone()));
        let mut book = PeriodBook::default();
        book.insert(closed);
        let reopened = book.reopen("t\"x", p, 1_800_000_000_500).expect("reopen");
        assert!(reopened.snapshot.is_empty(), "reopen discards the snapshot");
        assert_eq!(reopened.history.len(), 2);
        assert_eq!(PeriodRecord::from_json(reopened.to_json().to_string().as_bytes()), Ok(reopened));
        for bad in [r#"{"type":"rollup"}"#, "[]", r#"{"type":"period","tenant_id":"t","period":"2026-13"}"#] {
            assert!(PeriodRecord::from_json(bad.as_bytes()).is_err(), "{bad}");
        }
    }

    #[test]
    fn closing_twice_and_reopening_an_open_period_are_refused() {
        let p = Period::parse("2026-10").expect("period");
        let mut book = PeriodBook::default();
        assert!(book.reopen("t", p, 1).expect_err("never closed").contains("not closed"));
        book.insert(book.close("t", p, 1, BTreeMap::new()).expect("close"));
        assert!(book.close("t", p, 2, BTreeMap::new()).expect_err("closed").contains("already closed"));
        assert_eq!(book.closed().len(), 1);
        book.insert(book.reopen("t", p, 3).expect("reopen"));
        assert!(book.closed().is_empty());
        assert!(book.close("t", p, 4, BTreeMap::new()).is_ok(), "a reopened period closes again");
    }

    #[test]
    fn pending_is_what_the_month_holds_beyond_its_snapshot() {
        let p = Period::parse("2026-10").expect("period");
        let mut book = PeriodBook::default();
        let c: CounterOfTenant = ("c".into(), "m".into());
        book.insert(book.close("t", p, 1, [(c.clone(), total(10, 2))].into()).expect("close"));
        let now = [(c.clone(), total(7, 2)), (("d".into(), "m".into()), total(4, 1))].into();
        let r = PeriodReport::of("t", p, book.get("t", p), &now).expect("report");
        assert_eq!(r.status, PeriodStatus::Closed);
        assert_eq!(r.totals(), Ok((10.into(), 1.into(), 11.into())));
        assert_eq!(r.lines[0].pending_quantity, Decimal::from(-3), "a retraction after close is pending");
        assert_eq!(r.lines[1].frozen, None);
        // Open: no frozen total, nothing pending, net is the month.
        let open = PeriodReport::of("t", p, None, &now).expect("report");
        assert_eq!(open.totals(), Ok((0.into(), 0.into(), 11.into())));
    }
}
