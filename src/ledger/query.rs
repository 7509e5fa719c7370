//! Usage queries over rollups (pure): filter by tenant, customer, meter and
//! time range, group, and sum across partitions.

use std::collections::BTreeMap;

use super::period::civil_from_days;
use super::rollup::{HourKey, Rollup, HOUR_MS};
use super::Period;

/// The row of events without the grouping dimension.
pub const NO_DIMENSION: &str = "(none)";

/// How a query's rows are grouped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupBy {
    Hour,
    Day,
    Period,
    Customer,
    Meter,
    /// By the value of one dimension (`dimension:KEY`). Rollups are kept per
    /// customer, meter and hour, not per dimension value (values are
    /// unbounded), so this grouping is answered by refolding the accepted
    /// events themselves: [`UsageAnswer::of_events`].
    Dimension(String),
}

impl GroupBy {
    pub fn parse(s: &str) -> Result<GroupBy, String> {
        match s {
            "hour" => Ok(GroupBy::Hour),
            "day" => Ok(GroupBy::Day),
            "period" => Ok(GroupBy::Period),
            "customer" => Ok(GroupBy::Customer),
            "meter" => Ok(GroupBy::Meter),
            other => match other.strip_prefix("dimension:") {
                Some(key) if !key.is_empty() => Ok(GroupBy::Dimension(key.to_owned())),
                _ => Err(format!("group-by {other:?}: expected hour, day, period, customer, meter or dimension:KEY")),
            },
        }
    }
}

/// What to total.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UsageQuery {
    pub tenant_id: String,
    pub customer_id: Option<String>,
    pub meter: Option<String>,
    /// Inclusive, epoch milliseconds; rounded down to its hour.
    pub from_ms: i64,
    /// Exclusive, epoch milliseconds; an hour that starts before it counts.
    pub to_ms: i64,
    pub group_by: Option<GroupBy>,
}

impl UsageQuery {
    /// A query from its textual parts (the command line's flags, the HTTP
    /// endpoint's parameters), each error naming the part.
    pub fn parse(
        tenant: Option<String>,
        customer: Option<String>,
        meter: Option<String>,
        from: Option<&str>,
        to: Option<&str>,
        group_by: Option<&str>,
    ) -> Result<UsageQuery, String> {
        let bound = |name: &str, v: Option<&str>| {
            let v = v.ok_or_else(|| format!("{name} is required"))?;
            parse_bound(v).map_err(|why| format!("{name}: {why}"))
        };
        let query = UsageQuery {
            tenant_id: tenant.filter(|t| !t.is_empty()).ok_or("tenant is required")?,
            customer_id: customer,
            meter,
            from_ms: bound("from", from)?,
            to_ms: bound("to", to)?,
            group_by: group_by.map(GroupBy::parse).transpose()?,
        };
        query.check()?;
        Ok(query)
    }

    /// Refuses a range that selects nothing by construction.
    pub fn check(&self) -> Result<(), String> {
        if self.to_ms <= self.from_ms {
            return Err(format!(
                "the range is backwards or empty: --from {} is not before --to {}",
                crate::event::format_timestamp_ms(self.from_ms),
                crate::event::format_timestamp_ms(self.to_ms)
            ));
        }
        Ok(())
    }

    /// Whether a rollup's counter-hour is selected. Hours are the unit: an
    /// hour is in when it starts inside `[from, to)`, at both ends alike, so
    /// ranges that meet (`--to` of one the `--from` of the next) never count
    /// an hour twice, on the hour or not. (`from` was rounded down to its
    /// hour: an hour straddling the meeting point was in both ranges.)
    pub fn selects(&self, key: &HourKey) -> bool {
        key.counter.tenant_id == self.tenant_id
            && self.customer_id.as_ref().is_none_or(|c| *c == key.counter.customer_id)
            && self.meter.as_ref().is_none_or(|m| *m == key.counter.meter)
            && key.hour_ms >= self.from_ms
            && key.hour_ms < self.to_ms
    }

    /// The row label of a selected counter-hour.
    pub fn label(&self, key: &HourKey) -> String {
        match self.group_by {
            None => "total".to_owned(),
            Some(GroupBy::Hour) => crate::event::format_timestamp_ms(key.hour_ms),
            Some(GroupBy::Day) => {
                let (y, m, d) = civil_from_days(key.hour_ms.div_euclid(24 * HOUR_MS));
                format!("{y:04}-{m:02}-{d:02}")
            }
            Some(GroupBy::Period) => Period::of_ms(key.hour_ms).to_string(),
            Some(GroupBy::Customer) => key.counter.customer_id.clone(),
            Some(GroupBy::Meter) => key.counter.meter.clone(),
            // Not a property of the hour; see `of_events`.
            Some(GroupBy::Dimension(_)) => "total".to_owned(),
        }
    }

    /// Whether the query needs the accepted events, not only the rollups.
    pub fn needs_events(&self) -> bool {
        matches!(self.group_by, Some(GroupBy::Dimension(_)))
    }

    /// The row label of a selected event: its hour's, or the value of the
    /// grouping dimension (`(none)` when the event does not carry it).
    fn event_label(&self, key: &HourKey, event: &crate::event::UsageEvent) -> String {
        match &self.group_by {
            Some(GroupBy::Dimension(d)) => event
                .dimensions
                .iter()
                .find(|(k, _)| k == d)
                .map_or_else(|| NO_DIMENSION.to_owned(), |(_, v)| v.clone()),
            _ => self.label(key),
        }
    }

    /// Sums the selected rollups (of any partitions) into rows by label.
    pub fn total<'a>(
        &self,
        rollups: impl IntoIterator<Item = (&'a HourKey, &'a Rollup)>,
    ) -> Result<BTreeMap<String, Rollup>, super::FoldError> {
        let mut rows: BTreeMap<String, Rollup> = BTreeMap::new();
        for (key, rollup) in rollups {
            if self.selects(key) {
                rows.entry(self.label(key)).or_default().merge(rollup)?;
            }
        }
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::CounterKey;
    use rust_decimal::Decimal;

    fn key(customer: &str, hour_ms: i64) -> HourKey {
        HourKey { counter: std::sync::Arc::new(CounterKey::new("t".into(), customer.into(), "m".into())), hour_ms }
    }

    fn rollup(sum: i64) -> Rollup {
        Rollup { sum: Decimal::from(sum), count: 1, ..Rollup::default() }
    }

    #[test]
    fn rows_group_by_day_and_sum_partitions() {
        let day = 1_700_006_400_000; // 2023-11-15T00:00Z
        let data = [(key("a", day), rollup(1)), (key("a", day), rollup(2)), (key("b", day + 25 * HOUR_MS), rollup(4))];
        let q = UsageQuery {
            tenant_id: "t".into(),
            customer_id: None,
            meter: None,
            from_ms: day,
            to_ms: day + 48 * HOUR_MS,
            group_by: Some(GroupBy::Day),
        };
        let rows = q.total(data.iter().map(|(k, r)| (k, r))).expect("total");
        assert_eq!(rows.len(), 2);
        assert_eq!(rows["2023-11-15"].sum, Decimal::from(3));
        assert_eq!(rows["2023-11-16"].sum, Decimal::from(4));
        let only_b = UsageQuery { customer_id: Some("b".into()), group_by: None, ..q.clone() };
        assert_eq!(only_b.total(data.iter().map(|(k, r)| (k, r))).expect("total")["total"].sum, Decimal::from(4));
        let backwards = UsageQuery { to_ms: day, ..q };
        assert!(backwards.check().unwrap_err().contains("backwards"));
    }

    #[test]
    fn ranges_that_meet_off_the_hour_count_each_hour_once() {
        let h9 = 1_700_038_800_000; // 2023-11-15T09:00Z
        let data: Vec<(HourKey, Rollup)> = (0..4).map(|i| (key("a", h9 + i * HOUR_MS), rollup(1 << i))).collect();
        let sum = |from_ms: i64, to_ms: i64| {
            let q =
                UsageQuery { tenant_id: "t".into(), customer_id: None, meter: None, from_ms, to_ms, group_by: None };
            q.total(data.iter().map(|(k, r)| (k, r))).expect("total").get("total").map_or(Decimal::ZERO, |r| r.sum)
        };
        let half = HOUR_MS / 2;
        // Hours starting at 10:00 and 11:00 lie in [09:30, 11:30); 10:00 in
        // [09:30, 10:30) only, 11:00 in [10:30, 11:30) only.
        assert_eq!(sum(h9 + half, h9 + HOUR_MS + half), Decimal::from(2));
        assert_eq!(sum(h9 + HOUR_MS + half, h9 + 2 * HOUR_MS + half), Decimal::from(4));
        assert_eq!(sum(h9 + half, h9 + 2 * HOUR_MS + half), Decimal::from(6));
        // On the hour, as before: [09:00, 11:00) is 09:00 and 10:00.
        assert_eq!(sum(h9, h9 + 2 * HOUR_MS), Decimal::from(3));
    }

    #[test]
    fn rows_by_dimension_come_from_the_events_and_agree_with_the_rollups() {
        use crate::storage::testutil::sample_event_at;
        let day = 1_700_006_400_000;
        let mut partitions: Vec<Vec<(i64, crate::event::UsageEvent)>> = vec![Vec::new(), Vec::new()];
        for n in 0..40u64 {
            let mut e = sample_event_at(n, 0, 0, day).event;
            e.tenant_id = "t".into();
            e.kind = crate::event::EventKind::Usage;
            e.quantity = Decimal::from(n);
            e.timestamp_ms = day + (n as i64 % 5) * HOUR_MS;
            e.dimensions = match n % 3 {
                0 => vec![("region".into(), "eu".into())],
                1 => vec![("region".into(), "us".into()), ("tier".into(), "gold".into())],
                _ => Vec::new(),
            };
            let log = &mut partitions[(n % 2) as usize];
            log.push((log.len() as i64, e));
        }
        let q = UsageQuery {
            tenant_id: "t".into(),
            customer_id: None,
            meter: None,
            from_ms: day,
            to_ms: day + 24 * HOUR_MS,
            group_by: Some(GroupBy::parse("dimension:region").expect("grouping")),
        };
        let lateness = crate::ledger::Lateness::default();
        let by_region = UsageAnswer::of_events(&q, &lateness, partitions.iter().map(Vec::as_slice)).expect("fold");
        let want = |r: u64| Decimal::from((0..40u64).filter(|n| n % 3 == r).sum::<u64>());
        assert_eq!(by_region.rows["eu"].sum, want(0));
        assert_eq!(by_region.rows["us"].sum, want(1));
        assert_eq!(by_region.rows[NO_DIMENSION].sum, want(2));
        // The same events by day equal what their rollups say.
        let by_day = UsageQuery { group_by: Some(GroupBy::Day), ..q };
        let from_events = UsageAnswer::of_events(&by_day, &lateness, partitions.iter().map(Vec::as_slice)).expect("f");
        let mut rollups = Vec::new();
        for events in &partitions {
            let mut maps = crate::ledger::LedgerMaps::default();
            maps.fold(&lateness, events.iter().map(|(o, e)| (e, *o))).expect("fold");
            rollups.extend(maps.hours);
        }
        let from_rollups = UsageAnswer::of(&by_day, rollups.iter().map(|(k, r)| (k, r)), Vec::new()).expect("answer");
        assert_eq!(from_events.rolled_up(), from_rollups.rolled_up());
        assert_eq!(from_events.rows["2023-11-15"].count, 40);
        assert!(GroupBy::parse("dimension:").is_err());
    }
}

/// A query's answer: rows of summed rollups, and the adjustments (events
/// too late to rewrite their hour) of the selected counters whose event time
/// falls in the range, which billing applies on top.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct UsageAnswer {
    pub rows: BTreeMap<String, Rollup>,
    pub adjustments: Vec<super::Adjustment>,
}

impl UsageAnswer {
    /// Answers `query` from rollups and adjustments of any partitions.
    pub fn of<'a>(
        query: &UsageQuery,
        rollups: impl IntoIterator<Item = (&'a HourKey, &'a Rollup)>,
        adjustments: impl IntoIterator<Item = super::Adjustment>,
    ) -> Result<UsageAnswer, super::FoldError> {
        UsageAnswer { rows: query.total(rollups)?, adjustments: selected_adjustments(query, adjustments) }.checked()
    }

    /// The answer, once its totals are known to be exact.
    fn checked(self) -> Result<UsageAnswer, super::FoldError> {
        self.totals()?;
        Ok(self)
    }

    /// Answers `query` from the accepted events themselves, each
    /// partition's in output order (what its rollups were folded from):
    /// each partition is refolded with `lateness` so late events are
    /// adjustments exactly as in the ledger, and on-time events are summed
    /// into rows by [`UsageQuery`]'s label, or by dimension value. Any
    /// grouping works; only `dimension:KEY` needs it.
    pub fn of_events<'a>(
        query: &UsageQuery,
        lateness: &super::Lateness,
        partitions: impl IntoIterator<Item = &'a [(i64, crate::event::UsageEvent)]>,
    ) -> Result<UsageAnswer, super::FoldError> {
        let mut rows: BTreeMap<String, Rollup> = BTreeMap::new();
        let mut adjustments = Vec::new();
        for events in partitions {
            let mut maps = super::LedgerMaps::default();
            let folded = maps.fold(lateness, events.iter().map(|(o, e)| (e, *o)))?;
            let late: std::collections::BTreeSet<i64> = folded.adjustments.iter().map(|a| a.output_offset).collect();
            adjustments.extend(folded.adjustments);
            for (offset, e) in events {
                let key = HourKey {
                    counter: std::sync::Arc::new(super::CounterKey::of(e)),
                    hour_ms: super::hour_of(e.timestamp_ms),
                };
                if !late.contains(offset) && query.selects(&key) {
                    rows.entry(query.event_label(&key, e)).or_default().fold(e)?;
                }
            }
        }
        UsageAnswer { rows, adjustments: selected_adjustments(query, adjustments) }.checked()
    }

    /// Sum of every row.
    pub fn rolled_up(&self) -> Result<rust_decimal::Decimal, super::FoldError> {
        super::checked_sum(self.rows.values().map(|r| r.sum), "the rolled-up total")
    }

    /// Sum of the adjustments.
    pub fn adjusted(&self) -> Result<rust_decimal::Decimal, super::FoldError> {
        super::checked_sum(self.adjustments.iter().map(|a| a.amount), "the adjustments' total")
    }

    /// Rolled up, adjusted and net, each exact, or the one that is not.
    pub fn totals(&self) -> Result<AnswerTotals, super::FoldError> {
        let (rolled_up, adjusted) = (self.rolled_up()?, self.adjusted()?);
        Ok(AnswerTotals { rolled_up, adjusted, net: super::checked_total(rolled_up, adjusted, "the net total")? })
    }

    pub fn to_json(&self) -> Result<serde_json::Value, super::FoldError> {
        let AnswerTotals { rolled_up, adjusted, net } = self.totals()?;
        let dec = |d: rust_decimal::Decimal| d.normalize().to_string();
        let rows: Vec<serde_json::Value> = self
            .rows
            .iter()
            .map(|(group, r)| {
                serde_json::json!({
                    "group": group,
                    "sum": dec(r.sum),
                    "count": r.count,
                    "corrections": r.corrections,
                    "max": r.max.map(dec),
                    "last": r.last.map(|(_, q)| dec(q)),
                    "latest_event": (r.latest_event_ms != i64::MIN)
                        .then(|| crate::event::format_timestamp_ms(r.latest_event_ms)),
                })
            })
            .collect();
        let adjustments: Vec<serde_json::Value> = self
            .adjustments
            .iter()
            .map(|a| {
                serde_json::json!({
                    "period": a.period.to_string(),
                    "customer_id": a.counter.customer_id,
                    "meter": a.counter.meter,
                    "event_id": a.event_id,
                    "kind": a.kind.as_str(),
                    "amount": dec(a.amount),
                    "timestamp": crate::event::format_timestamp_ms(a.event_ms),
                    "reason": a.reason.as_str(),
                })
            })
            .collect();
        Ok(serde_json::json!({
            "rows": rows,
            "rolled_up": dec(rolled_up),
            "adjustments": adjustments,
            "adjusted": dec(adjusted),
            "net": dec(net),
        }))
    }

    /// A fixed-width table for a terminal.
    pub fn to_table(&self) -> Result<String, super::FoldError> {
        use std::fmt::Write;
        let AnswerTotals { rolled_up, adjusted, net } = self.totals()?;
        let dec = |d: rust_decimal::Decimal| d.normalize().to_string();
        let mut out = String::new();
        let width = self.rows.keys().map(String::len).max().unwrap_or(5).max(5);
        let _ =
            writeln!(out, "{:<width$}  {:>20}  {:>10}  {:>11}  {:>14}", "group", "sum", "count", "corrections", "max");
        for (group, r) in &self.rows {
            let _ = writeln!(
                out,
                "{group:<width$}  {:>20}  {:>10}  {:>11}  {:>14}",
                dec(r.sum),
                r.count,
                r.corrections,
                r.max.map(dec).unwrap_or_else(|| "-".into())
            );
        }
        let _ = writeln!(out, "rolled up {}", dec(rolled_up));
        for a in &self.adjustments {
            let _ = writeln!(
                out,
                "adjustment {} {} {} {} {} ({}, {})",
                a.period,
                a.counter.customer_id,
                a.counter.meter,
                a.event_id,
                dec(a.amount),
                a.reason.as_str(),
                crate::event::format_timestamp_ms(a.event_ms)
            );
        }
        let _ = writeln!(out, "adjusted {}  net {}", dec(adjusted), dec(net));
        Ok(out)
    }
}

/// The adjustments `query` selects, by event time and id.
fn selected_adjustments(
    query: &UsageQuery,
    adjustments: impl IntoIterator<Item = super::Adjustment>,
) -> Vec<super::Adjustment> {
    let mut selected: Vec<super::Adjustment> = adjustments
        .into_iter()
        .filter(|a| {
            query.selects(&HourKey {
                counter: std::sync::Arc::new(a.counter.clone()),
                hour_ms: super::hour_of(a.event_ms),
            })
        })
        .collect();
    selected.sort_by(|a, b| (a.event_ms, &a.event_id).cmp(&(b.event_ms, &b.event_id)));
    selected
}

/// An answer's three totals.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AnswerTotals {
    pub rolled_up: rust_decimal::Decimal,
    pub adjusted: rust_decimal::Decimal,
    pub net: rust_decimal::Decimal,
}

/// Parses a query bound: `YYYY-MM` (the month's first instant), `YYYY-MM-DD`
/// (midnight UTC) or an RFC 3339 timestamp.
pub fn parse_bound(s: &str) -> Result<i64, String> {
    if let Ok(p) = Period::parse(s) {
        return Ok(p.start_ms());
    }
    if s.len() == 10 {
        if let Some((ym, d)) = s.rsplit_once('-') {
            if let (Ok(p), Ok(day)) = (Period::parse(ym), d.parse::<u8>()) {
                if d.len() == 2 && day >= 1 && i64::from(day) <= (p.end_ms() - p.start_ms()) / (24 * HOUR_MS) {
                    return Ok(p.start_ms() + i64::from(day - 1) * 24 * HOUR_MS);
                }
            }
        }
    }
    let t = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339)
        .map_err(|_| format!("{s:?} is not a time: expected YYYY-MM, YYYY-MM-DD or an RFC 3339 timestamp"))?;
    i64::try_from(t.unix_timestamp_nanos() / 1_000_000).map_err(|_| format!("{s:?} is out of range"))
}

#[cfg(test)]
mod bound_tests {
    use super::*;

    #[test]
    fn bounds_read_months_days_and_timestamps() {
        assert_eq!(parse_bound("2023-11"), Ok(1_698_796_800_000));
        assert_eq!(parse_bound("2023-11-15"), Ok(1_700_006_400_000));
        assert_eq!(parse_bound("2023-11-15T01:00:00Z"), Ok(1_700_010_000_000));
        for bad in ["2023-11-31", "2023-13", "yesterday", "2023-11-15 01:00"] {
            assert!(parse_bound(bad).is_err(), "{bad:?}");
        }
    }
}
