//! The usage ledger: what billing asks of the accepted events.
//!
//! Accepted events (never duplicates, conflicts or rejects) fold into hourly
//! rollups per (tenant, customer, meter, hour, partition) with `sum`,
//! `count`, `max`, `last` and the hour's latest event time. Each counter
//! (tenant, customer, meter) has a watermark per partition, the largest event
//! time folded in; an event more than the lateness window `L` behind it does
//! not rewrite its hour but becomes an explicit [`Adjustment`] (reason
//! `late`) against its period.
//!
//! Partitioned on purpose: one customer's events are spread over every input
//! partition (they are placed by event identity), so each partition's ledger
//! holds that partition's share, and a total is a sum over partitions. Each
//! partition's ledger is a pure function of its output partition in offset
//! order, so it is a tier of local state like the others: checkpointed by
//! output offset, idempotent, rebuilt by repair.
//!
//! - `rollup`: the fold (pure).
//! - `period`: calendar months in UTC (pure).
//! - `book`: periods closed and reopened, snapshots, pending (pure, plus the
//!   state directory's `periods.json`).
//! - `query`: filtering and grouping rollups (pure).
//! - `check`: comparing held rollups with refolded events (pure).
//! - `store`: the durable tier in `<state-dir>/ledger` (sync, RocksDB).

mod book;
mod check;
#[cfg(test)]
mod model_tests;
mod period;
mod query;
mod rollup;
mod store;

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

pub use book::{
    period_totals, CounterOfTenant, CounterTotal, PeriodAction, PeriodBook, PeriodChange, PeriodLine, PeriodRecord,
    PeriodReport, PeriodStatus, PERIODS_FILE,
};
pub use check::{compare_rollups, unexplained_rollups, HeldRollups};
pub use period::Period;
pub use query::{parse_bound, GroupBy, UsageAnswer, UsageQuery, NO_DIMENSION};
pub use rollup::{
    checked_difference, checked_sum, checked_total, hour_of, hour_order, Adjustment, AdjustmentReason, CounterKey,
    FoldError, Folded, HourKey, Lateness, LedgerMaps, Rollup, DEFAULT_LATENESS_MS, HOUR_MS,
};
pub use store::{LedgerError, LedgerStore, Preview, Replays, TenantLedger, WRITE_BEHIND};

use rollup::CounterRef;

use crate::event::UsageEvent;

/// One partition's ledger kept in memory (state without a directory).
#[derive(Clone, Default)]
pub struct MemoryPartition {
    maps: LedgerMaps,
    adjustments: Vec<Adjustment>,
    checkpoint: Option<i64>,
}

/// The ledger tier of local state: in memory, or durable in a state
/// directory. Both fold the same way; see the module doc. Shared by every
/// partition's apply: the durable store locks per partition (see
/// [`LedgerStore`]); the memory one, kept only without a state directory,
/// has one lock.
#[derive(Debug)]
pub enum Ledger {
    Memory(Mutex<BTreeMap<i32, MemoryPartition>>),
    Durable(Box<LedgerStore>),
}

/// Rare and a sign of a producer's bug (a quantity near 10^28, or more
/// digits than a sum holds): said once per batch, with the first such
/// event, since nothing else shows it.
fn warn_of_set_aside(partition: i32, adjustments: &[Adjustment]) {
    let mut set_aside = adjustments.iter().filter(|a| a.reason == AdjustmentReason::SumLimit);
    if let Some(first) = set_aside.next() {
        tracing::warn!(
            partition,
            events = 1 + set_aside.count(),
            tenant = %first.counter.tenant_id,
            customer = %first.counter.customer_id,
            meter = %first.counter.meter,
            event_id = %first.event_id,
            "accepted events set aside as sum_limit adjustments: their hour's sum cannot take them exactly"
        );
    }
}

fn held(parts: &Mutex<BTreeMap<i32, MemoryPartition>>) -> MutexGuard<'_, BTreeMap<i32, MemoryPartition>> {
    parts.lock().unwrap_or_else(PoisonError::into_inner)
}

impl std::fmt::Debug for MemoryPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryPartition").field("hours", &self.maps.hours.len()).finish()
    }
}

impl Ledger {
    pub fn in_memory() -> Ledger {
        Ledger::Memory(Mutex::default())
    }

    pub fn checkpoint(&self, partition: i32) -> Result<Option<i64>, LedgerError> {
        match self {
            Ledger::Memory(parts) => Ok(held(parts).get(&partition).and_then(|p| p.checkpoint)),
            Ledger::Durable(store) => store.checkpoint(partition),
        }
    }

    /// What folding `events` would change, read-only in effect (the durable
    /// store folds into its cache and undoes it unless the same events are
    /// applied next; see [`LedgerStore::preview`]): the rollups a batch
    /// publishes in its own transaction.
    /// `replays` are events already folded, met again (see [`Replays`]):
    /// their hours' current rollups and their adjustments join the preview.
    pub fn preview(
        &self,
        partition: i32,
        lateness: &Lateness,
        events: &[(&UsageEvent, i64)],
        replays: &Replays<'_>,
    ) -> Result<Preview, LedgerError> {
        match self {
            Ledger::Durable(store) => store.preview(partition, lateness, events, replays),
            Ledger::Memory(parts) => {
                let parts = held(parts);
                let held = parts.get(&partition);
                let mut maps = LedgerMaps::default();
                if let Some(held) = held {
                    for (e, _) in events.iter().chain(replays) {
                        let counter = std::sync::Arc::new(CounterKey::of(e));
                        let hour = HourKey { counter: counter.clone(), hour_ms: hour_of(e.timestamp_ms) };
                        if let Some(r) = held.maps.hours.get(&hour) {
                            maps.hours.insert(hour, r.clone());
                        }
                        if let Some(w) = held.maps.watermarks.get(&counter) {
                            maps.watermarks.insert(counter, *w);
                        }
                    }
                }
                let folded = maps.fold(lateness, events.iter().copied())?;
                let mut preview = Preview::of(folded, replays, |k| maps.hours.get(k));
                if let Some(held) = held {
                    let watermark = |e: &UsageEvent| held.maps.watermarks.get(&CounterRef::of(e)).copied();
                    preview.republished = store::late_replays(replays, lateness, watermark)
                        .filter_map(|(e, offset)| held.adjustments.iter().find(|a| a.made_of(e, *offset)))
                        .cloned()
                        .collect();
                }
                Ok(preview)
            }
        }
    }

    /// Folds `events` in; those at or below the checkpoint are skipped.
    /// What changed is not returned: a batch's rollups are published from
    /// its [`preview`](Self::preview), before the apply.
    pub fn apply(&self, partition: i32, lateness: &Lateness, events: &[(&UsageEvent, i64)]) -> Result<(), LedgerError> {
        match self {
            Ledger::Durable(store) => {
                warn_of_set_aside(partition, &store.apply(partition, lateness, events)?.adjustments)
            }
            Ledger::Memory(parts) => {
                let mut parts = held(parts);
                let held = parts.entry(partition).or_default();
                let checkpoint = held.checkpoint;
                let fresh = events.iter().copied().filter(|(_, o)| checkpoint.is_none_or(|c| *o > c));
                let adjustments = held.maps.fold_in(lateness, fresh)?;
                warn_of_set_aside(partition, &adjustments);
                held.adjustments.extend(adjustments);
                if let Some((_, last)) = events.last() {
                    held.checkpoint = Some(checkpoint.map_or(*last, |c| c.max(*last)));
                }
            }
        }
        Ok(())
    }

    /// Every rollup of `tenant` (and `customer`), with its partition.
    pub fn rollups(
        &self,
        tenant_id: &str,
        customer_id: Option<&str>,
        mut f: impl FnMut(HourKey, i32, Rollup),
    ) -> Result<(), LedgerError> {
        match self {
            Ledger::Durable(store) => store.rollups(tenant_id, customer_id, f),
            Ledger::Memory(parts) => {
                for (p, held) in held(parts).iter() {
                    for (k, r) in &held.maps.hours {
                        if k.counter.tenant_id == tenant_id && customer_id.is_none_or(|c| c == k.counter.customer_id) {
                            f(k.clone(), *p, r.clone());
                        }
                    }
                }
                Ok(())
            }
        }
    }

    /// Answers `query` from this ledger: its rollups of the query's tenant
    /// (and customer) and their adjustments.
    pub fn answer(&self, query: &UsageQuery) -> Result<UsageAnswer, LedgerError> {
        if query.needs_events() {
            return Err(LedgerError::Query(
                "grouping by dimension is answered from the accepted events, not from rollups".into(),
            ));
        }
        let (rollups, adjustments) = self.tenant_ledger(&query.tenant_id, query.customer_id.as_deref())?;
        Ok(UsageAnswer::of(query, rollups.iter().map(|(k, r)| (k, r)), adjustments)?)
    }

    /// What one tenant's `period` holds now in this ledger, per customer
    /// and meter (see [`period_totals`]).
    pub fn period_totals(
        &self,
        tenant_id: &str,
        period: Period,
    ) -> Result<std::collections::BTreeMap<CounterOfTenant, CounterTotal>, LedgerError> {
        let (rollups, adjustments) = self.tenant_ledger(tenant_id, None)?;
        Ok(period_totals(tenant_id, period, rollups.iter().map(|(k, r)| (k, r)), adjustments.iter())?)
    }

    /// One tenant's rollups (of `customer`, when given) and adjustments as
    /// of one moment (see [`LedgerStore::tenant_ledger`]).
    pub fn tenant_ledger(&self, tenant_id: &str, customer_id: Option<&str>) -> Result<TenantLedger, LedgerError> {
        match self {
            Ledger::Durable(store) => store.tenant_ledger(tenant_id, customer_id),
            // One lock over both reads.
            Ledger::Memory(parts) => {
                let parts = held(parts);
                let mut rollups = Vec::new();
                let mut adjustments = Vec::new();
                for p in parts.values() {
                    for (k, r) in &p.maps.hours {
                        if k.counter.tenant_id == tenant_id && customer_id.is_none_or(|c| c == k.counter.customer_id) {
                            rollups.push((k.clone(), r.clone()));
                        }
                    }
                    adjustments.extend(p.adjustments.iter().filter(|a| a.counter.tenant_id == tenant_id).cloned());
                }
                Ok((rollups, adjustments))
            }
        }
    }

    /// Releases a revoked partition's share of the ledger's memory, after
    /// writing what it has pending (see [`LedgerStore::release`]). The
    /// in-memory ledger keeps it: it is all this process knows of it.
    pub fn release(&self, partition: i32) -> Result<(), LedgerError> {
        match self {
            Ledger::Durable(store) => store.release(partition),
            Ledger::Memory(_) => Ok(()),
        }
    }

    /// Every adjustment of `tenant`.
    pub fn adjustments(&self, tenant_id: &str) -> Result<Vec<Adjustment>, LedgerError> {
        match self {
            Ledger::Durable(store) => store.adjustments(tenant_id),
            Ledger::Memory(parts) => Ok(held(parts)
                .values()
                .flat_map(|p| p.adjustments.iter())
                .filter(|a| a.counter.tenant_id == tenant_id)
                .cloned()
                .collect()),
        }
    }

    /// Writes what the durable store has folded but not written (see
    /// [`LedgerStore`]); nothing to do in memory.
    pub fn write_pending(&self) -> Result<(), LedgerError> {
        match self {
            Ledger::Durable(store) => store.write_pending(),
            Ledger::Memory(_) => Ok(()),
        }
    }

    /// Tells the durable store the usage store's next segment id (see
    /// [`LedgerStore::note_usage_segment`]).
    pub fn note_usage_segment(&self, next_segment_id: u64) {
        if let Ledger::Durable(store) = self {
            store.note_usage_segment(next_segment_id);
        }
    }

    /// See [`LedgerStore::set_anchored`]; in memory there is nothing to
    /// catch up, so nothing to record (`true`).
    pub fn set_anchored(&self, partition: i32, anchored: bool) -> bool {
        match self {
            Ledger::Durable(store) => store.set_anchored(partition, anchored),
            Ledger::Memory(_) => true,
        }
    }

    /// See [`LedgerStore::unanchor_written`]; nothing to do in memory.
    pub fn unanchor_written(&self, partition: i32) -> Result<(), LedgerError> {
        match self {
            Ledger::Durable(store) => store.unanchor_written(partition),
            Ledger::Memory(_) => Ok(()),
        }
    }

    /// The usage store's next segment id at each partition's last write
    /// (see [`LedgerStore::written_usage_segments`]); none in memory.
    pub fn written_usage_segments(&self) -> Result<BTreeMap<i32, u64>, LedgerError> {
        match self {
            Ledger::Durable(store) => store.written_usage_segments(),
            Ledger::Memory(_) => Ok(BTreeMap::new()),
        }
    }

    /// Whether folded changes have waited long enough to be written.
    pub fn write_due(&self) -> bool {
        match self {
            Ledger::Durable(store) => store.write_due(),
            Ledger::Memory(_) => false,
        }
    }

    pub fn flush(&self) -> Result<(), LedgerError> {
        match self {
            Ledger::Durable(store) => store.flush(),
            Ledger::Memory(_) => Ok(()),
        }
    }
}
