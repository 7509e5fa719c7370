//! Hourly rollups, counter watermarks and the lateness rule (pure, no I/O).
//!
//! A partition's ledger is a function of the accepted events of its output
//! partition, in output-offset order: the same records folded again give the
//! same rollups, watermarks and adjustments. That is what lets repair rebuild
//! the ledger from the output topic like every other tier, and what makes a
//! rollup published in a batch's transaction equal to what local state holds
//! after the batch is applied.

use std::collections::BTreeMap;
use std::sync::Arc;

use hashbrown::{Equivalent, HashMap};
use rust_decimal::Decimal;

use crate::event::{EventKind, UsageEvent};

/// One hour in epoch milliseconds.
pub const HOUR_MS: i64 = 3_600_000;

/// The counter an event adds to: one customer's usage of one meter.
///
/// Carries the hash of its three names, computed once when it is built: a
/// batch looks each event's counter and hour up in several maps, and
/// hashing three strings each time was most of the ledger's cost. Order
/// and equality are those of the names (the hash is the last field and
/// equal names have equal hashes). Build it with [`CounterKey::new`] or
/// [`CounterKey::of`]; the names are read-only in spirit.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct CounterKey {
    pub tenant_id: String,
    pub customer_id: String,
    pub meter: String,
    hash: u64,
}

impl CounterKey {
    pub fn new(tenant_id: String, customer_id: String, meter: String) -> CounterKey {
        let hash = counter_hash(&tenant_id, &customer_id, &meter);
        CounterKey { tenant_id, customer_id, meter, hash }
    }

    pub fn of(event: &UsageEvent) -> CounterKey {
        let r = CounterRef::of(event);
        CounterKey {
            tenant_id: event.tenant_id.clone(),
            customer_id: event.customer_id.clone(),
            meter: event.meter.clone(),
            hash: r.hash,
        }
    }
}

impl std::hash::Hash for CounterKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl std::fmt::Debug for CounterKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CounterKey")
            .field("tenant_id", &self.tenant_id)
            .field("customer_id", &self.customer_id)
            .field("meter", &self.meter)
            .finish()
    }
}

/// The names' hash: one seeded hasher for the whole process, so a counter
/// built from stored names and one borrowed from an event agree.
fn counter_hash(tenant_id: &str, customer_id: &str, meter: &str) -> u64 {
    use std::hash::BuildHasher;
    static HASHER: std::sync::OnceLock<hashbrown::DefaultHashBuilder> = std::sync::OnceLock::new();
    HASHER.get_or_init(Default::default).hash_one((tenant_id, customer_id, meter))
}

/// An event's counter, borrowed: finds a held counter without building one
/// (three strings and a reference count) per event. Hashes as the
/// [`CounterKey`] of the same names does.
pub(crate) struct CounterRef<'a> {
    tenant_id: &'a str,
    customer_id: &'a str,
    meter: &'a str,
    hash: u64,
}

impl<'a> CounterRef<'a> {
    pub(crate) fn of(event: &'a UsageEvent) -> CounterRef<'a> {
        CounterRef {
            tenant_id: &event.tenant_id,
            customer_id: &event.customer_id,
            meter: &event.meter,
            hash: counter_hash(&event.tenant_id, &event.customer_id, &event.meter),
        }
    }
}

impl std::hash::Hash for CounterRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl Equivalent<Arc<CounterKey>> for CounterRef<'_> {
    fn equivalent(&self, key: &Arc<CounterKey>) -> bool {
        self.hash == key.hash
            && self.tenant_id == key.tenant_id
            && self.customer_id == key.customer_id
            && self.meter == key.meter
    }
}

/// A counter's hour: the unit rollups are kept and published in (per
/// partition; a reader sums partitions). The counter is shared: one batch
/// builds each event's counter once, and every map it lands in holds a
/// reference, not a copy of three strings.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HourKey {
    pub counter: Arc<CounterKey>,
    /// Start of the hour, epoch milliseconds UTC.
    pub hour_ms: i64,
}

/// A counter's hour, borrowed: finds a held [`HourKey`] without cloning
/// its counter. Hashes as the `HourKey` of the same counter and hour does
/// (the derived hash: the counter's, then the hour's).
pub(crate) struct HourRef<'a> {
    pub(crate) counter: &'a Arc<CounterKey>,
    pub(crate) hour_ms: i64,
}

impl std::hash::Hash for HourRef<'_> {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.counter.hash(state);
        self.hour_ms.hash(state);
    }
}

impl From<&HourRef<'_>> for HourKey {
    fn from(r: &HourRef<'_>) -> HourKey {
        HourKey { counter: r.counter.clone(), hour_ms: r.hour_ms }
    }
}

impl Equivalent<HourKey> for HourRef<'_> {
    fn equivalent(&self, key: &HourKey) -> bool {
        self.hour_ms == key.hour_ms && (Arc::ptr_eq(self.counter, &key.counter) || self.counter == &key.counter)
    }
}

/// The order a fold lists the hours it changed in, and a publish its
/// rollups: by the counter's precomputed hash, then the hour, the names
/// only to break a tie. Ordering by the names was a string comparison per
/// step of a sort, a thousand hours a batch (perf: 5% of a worker's CPU
/// with rollups published). The hash is seeded per process, so the order
/// is fixed within a process, not across processes: enough for a
/// compacted topic, where a publish carries each hour once.
pub fn hour_order(a: &HourKey, b: &HourKey) -> std::cmp::Ordering {
    (a.counter.hash, a.hour_ms).cmp(&(b.counter.hash, b.hour_ms)).then_with(|| a.cmp(b))
}

/// The start of the hour `ms` falls in.
pub fn hour_of(ms: i64) -> i64 {
    ms.div_euclid(HOUR_MS) * HOUR_MS
}

/// What one counter-hour of one partition holds.
///
/// `sum` is the billed quantity: usage plus corrections and retractions,
/// which carry signed deltas (a retraction of 5 units is sent as `-5`).
/// `count`, `max` and `last` describe usage events only, so a correction
/// never shows as the hour's largest or latest reading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rollup {
    pub sum: Decimal,
    /// Usage events folded in.
    pub count: u64,
    /// Corrections and retractions folded in.
    pub corrections: u64,
    /// Largest usage quantity.
    pub max: Option<Decimal>,
    /// The usage event with the latest event time: (event time, quantity).
    /// On equal times the one later in output order wins.
    pub last: Option<(i64, Decimal)>,
    /// Largest event time folded into this hour.
    pub latest_event_ms: i64,
}

impl Default for Rollup {
    fn default() -> Rollup {
        Rollup { sum: Decimal::ZERO, count: 0, corrections: 0, max: None, last: None, latest_event_ms: i64::MIN }
    }
}

impl Rollup {
    /// Folds one accepted event in. Exact: `Decimal` addition, and a sum
    /// that would overflow 96 bits saturates nothing, it is an error the
    /// caller reports (see [`FoldError`]).
    pub fn fold(&mut self, event: &UsageEvent) -> Result<(), FoldError> {
        self.sum = exact_sum(self.sum, event.quantity).ok_or_else(|| FoldError::Overflow {
            counter: CounterKey::of(event),
            hour_ms: hour_of(event.timestamp_ms),
        })?;
        self.latest_event_ms = self.latest_event_ms.max(event.timestamp_ms);
        if event.kind == EventKind::Usage {
            self.count += 1;
            self.max = Some(self.max.map_or(event.quantity, |m| m.max(event.quantity)));
            if self.last.is_none_or(|(t, _)| event.timestamp_ms >= t) {
                self.last = Some((event.timestamp_ms, event.quantity));
            }
        } else {
            self.corrections += 1;
        }
        Ok(())
    }

    /// Adds another partition's rollup of the same counter-hour (or another
    /// hour, for coarser groups): what a reader does across partitions.
    /// Each sum is within bounds, their total need not be: an error then,
    /// and `self` unchanged.
    pub fn merge(&mut self, other: &Rollup) -> Result<(), FoldError> {
        self.sum = checked_total(self.sum, other.sum, "the usage total of a row")?;
        self.count += other.count;
        self.corrections += other.corrections;
        self.max = match (self.max, other.max) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
        self.last = match (self.last, other.last) {
            (Some(a), Some(b)) => Some(if b.0 > a.0 { b } else { a }),
            (a, b) => a.or(b),
        };
        self.latest_event_ms = self.latest_event_ms.max(other.latest_event_ms);
        Ok(())
    }
}

/// A fold that cannot be exact.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FoldError {
    #[error("the sum of {counter:?} in hour {hour_ms} does not fit an exact decimal (at most 28 significant digits)")]
    Overflow { counter: CounterKey, hour_ms: i64 },
    /// A total over hours, partitions or counters (each within bounds)
    /// that is not: an answer must say so, not print a wrong number or
    /// stop the process.
    #[error("{what} does not fit an exact decimal (at most 28 significant digits)")]
    TotalOverflow { what: String },
}

/// `a + b`, when a `Decimal` holds it exactly. `checked_add` fails only
/// past the largest value: a sum that needs more than its 28 or so
/// significant digits (10^19 + 10^-10) comes back rounded. Rounding always
/// leaves fewer decimal places than the operands, so a sum that kept them
/// is exact; fewer places happen exactly too (a zero operand gives back the
/// other as it is: `0.0 + 3` is `3`), so then the sum is checked by taking
/// `a` back off it.
pub fn exact_sum(a: Decimal, b: Decimal) -> Option<Decimal> {
    let s = a.checked_add(b)?;
    if s.scale() >= a.scale().max(b.scale()) || s.checked_sub(a) == Some(b) {
        Some(s)
    } else {
        None
    }
}

/// `a + b` exactly, or the error naming `what` was being totalled.
pub fn checked_total(a: Decimal, b: Decimal, what: &str) -> Result<Decimal, FoldError> {
    exact_sum(a, b).ok_or_else(|| FoldError::TotalOverflow { what: what.to_owned() })
}

/// `a - b` exactly, or the error naming `what` was being totalled.
pub fn checked_difference(a: Decimal, b: Decimal, what: &str) -> Result<Decimal, FoldError> {
    exact_sum(a, -b).ok_or_else(|| FoldError::TotalOverflow { what: what.to_owned() })
}

/// The exact sum of `values`, or the error naming `what` they are.
pub fn checked_sum(values: impl IntoIterator<Item = Decimal>, what: &str) -> Result<Decimal, FoldError> {
    values.into_iter().try_fold(Decimal::ZERO, |acc, v| checked_total(acc, v, what))
}

/// How far behind its counter's watermark an event may be and still update
/// its hour: `L` of the stripemeter ADR, 48 hours unless a meter says
/// otherwise.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lateness {
    pub default_ms: i64,
    pub per_meter: BTreeMap<String, i64>,
}

/// `L` when nothing is configured.
pub const DEFAULT_LATENESS_MS: i64 = 48 * HOUR_MS;

impl Default for Lateness {
    fn default() -> Lateness {
        Lateness { default_ms: DEFAULT_LATENESS_MS, per_meter: BTreeMap::new() }
    }
}

impl Lateness {
    pub fn window_ms(&self, meter: &str) -> i64 {
        self.per_meter.get(meter).copied().unwrap_or(self.default_ms)
    }

    /// An event is late when its time is more than `L` behind the largest
    /// event time its counter has folded in on this partition.
    pub fn is_late(&self, event: &UsageEvent, watermark_ms: Option<i64>) -> bool {
        watermark_ms.is_some_and(|w| event.timestamp_ms < w.saturating_sub(self.window_ms(&event.meter)))
    }
}

/// Why an accepted event became an adjustment instead of updating its hour.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AdjustmentReason {
    /// Later than the lateness window behind its counter's watermark.
    Late,
    /// On time, but its hour's sum with it would not fit an exact decimal
    /// (past the largest value, or needing more than 28 significant
    /// digits). The event is published already, so the fold cannot fail:
    /// failing it stopped the run after the output was written, and every
    /// later run, repairing from that output, failed the same way.
    SumLimit,
}

impl AdjustmentReason {
    pub fn as_str(self) -> &'static str {
        match self {
            AdjustmentReason::Late => "late",
            AdjustmentReason::SumLimit => "sum_limit",
        }
    }

    pub fn parse(s: &str) -> Option<AdjustmentReason> {
        match s {
            "late" => Some(AdjustmentReason::Late),
            "sum_limit" => Some(AdjustmentReason::SumLimit),
            _ => None,
        }
    }
}

/// An accepted event that does not rewrite history: billing applies it as
/// an explicit line against its period.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Adjustment {
    pub counter: CounterKey,
    /// The calendar month (UTC) of the event's time.
    pub period: super::Period,
    pub event_id: String,
    pub kind: EventKind,
    pub amount: Decimal,
    pub event_ms: i64,
    pub reason: AdjustmentReason,
    /// Where the accepted event sits in the output: its identity in the log.
    pub output_offset: i64,
}

impl Adjustment {
    /// Whether this is what `event`, published at `output_offset`, became
    /// (by identity: two tenants may use the same event id).
    pub fn made_of(&self, event: &UsageEvent, output_offset: i64) -> bool {
        self.output_offset == output_offset
            && self.event_id == event.event_id
            && self.counter.tenant_id == event.tenant_id
    }
}

/// A partition's ledger held in maps: what the durable store loads for a
/// batch (the counters and hours it touches), and the whole ledger in
/// memory-only state and in the reference model of the tests. Hash maps:
/// a batch looks up each event's counter and hour, and ordered maps over
/// three strings cost a dozen string comparisons a lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LedgerMaps {
    pub hours: HashMap<HourKey, Rollup>,
    /// Largest event time folded in per counter (late events excluded).
    /// Also where a batch finds each event's shared counter.
    pub watermarks: HashMap<Arc<CounterKey>, i64>,
}

/// What folding a batch changed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Folded {
    /// Hours whose rollup changed, each once, in [`hour_order`].
    pub hours: Vec<HourKey>,
    /// Counters whose watermark moved.
    pub counters: Vec<Arc<CounterKey>>,
    pub adjustments: Vec<Adjustment>,
}

/// Where a fold reads and writes a partition's counters and hours: the
/// maps of a [`LedgerMaps`], or the durable store's cache (which finds each
/// event's counter before the fold, and may keep what it overwrites). One
/// fold, so every holder of a ledger applies the lateness rule alike.
pub(crate) trait Tally {
    /// The counter of the `i`th event of the batch, shared, and its
    /// watermark (`None`: this partition has never folded the counter).
    fn counter(&mut self, i: usize, event: &UsageEvent) -> (Arc<CounterKey>, Option<i64>);
    fn set_watermark(&mut self, counter: &Arc<CounterKey>, ms: i64);
    /// The rollup of the counter's hour, created empty when the hour has
    /// none yet, and whether this is the first time this fold touches it
    /// (a holder that cannot tell says yes; the fold removes repeats).
    fn hour(&mut self, counter: &Arc<CounterKey>, hour_ms: i64) -> (&mut Rollup, bool);
}

impl Tally for LedgerMaps {
    fn counter(&mut self, _: usize, event: &UsageEvent) -> (Arc<CounterKey>, Option<i64>) {
        // A counter with hours always has a watermark: a counter is built
        // only the first time a partition folds it.
        match self.watermarks.get_key_value(&CounterRef::of(event)) {
            Some((counter, w)) => (counter.clone(), Some(*w)),
            None => (Arc::new(CounterKey::of(event)), None),
        }
    }

    fn set_watermark(&mut self, counter: &Arc<CounterKey>, ms: i64) {
        self.watermarks.insert(counter.clone(), ms);
    }

    fn hour(&mut self, counter: &Arc<CounterKey>, hour_ms: i64) -> (&mut Rollup, bool) {
        // Found by reference: a held hour's counter is the shared one, so
        // equality is a pointer check, and no counter is cloned unless the
        // hour is new (an owned key compared three strings and cloned the
        // counter per event).
        (self.hours.entry_ref(&HourRef { counter, hour_ms }).or_default(), true)
    }
}

/// Folds accepted events, in output order, each with its output offset,
/// into `tally`. Late events become adjustments and leave hours and
/// watermarks alone. With [`Listing::AdjustmentsOnly`] the returned
/// `hours` and `counters` are empty, whatever changed: only
/// [`LedgerMaps::fold_in`] asks for that, and returns the adjustments
/// alone.
pub(crate) fn fold_into<'a>(
    tally: &mut impl Tally,
    lateness: &Lateness,
    events: impl IntoIterator<Item = (&'a UsageEvent, i64)>,
    listing: Listing,
) -> Result<Folded, FoldError> {
    let events = events.into_iter();
    let listed = listing == Listing::Changes;
    // A holder that cannot tell repeats lists an hour per event.
    let mut hours: Vec<HourKey> = Vec::with_capacity(if listed { events.size_hint().0 } else { 0 });
    let mut counters: Vec<Arc<CounterKey>> = Vec::new();
    let mut adjustments = Vec::new();
    for (i, (event, offset)) in events.enumerate() {
        let (counter, watermark) = tally.counter(i, event);
        let adjustment = |reason| Adjustment {
            period: super::Period::of_ms(event.timestamp_ms),
            counter: CounterKey::clone(&counter),
            event_id: event.event_id.clone(),
            kind: event.kind,
            amount: event.quantity,
            event_ms: event.timestamp_ms,
            reason,
            output_offset: offset,
        };
        if lateness.is_late(event, watermark) {
            adjustments.push(adjustment(AdjustmentReason::Late));
            continue;
        }
        let hour_ms = hour_of(event.timestamp_ms);
        let (rollup, first) = tally.hour(&counter, hour_ms);
        // A failed fold changes nothing (a new hour's first event always
        // fits): the event becomes an adjustment, leaving its hour and the
        // watermark alone as a late one does. The hour is listed even so
        // when this was its first touch in the fold: a holder tells the
        // first touch once, and a later event of the batch that fits would
        // change the hour unlisted, so never written nor published. Listed
        // unchanged, it is written again as it is (totals, not deltas).
        if rollup.fold(event).is_err() {
            if first && listed {
                hours.push(HourKey { counter: counter.clone(), hour_ms });
            }
            adjustments.push(adjustment(AdjustmentReason::SumLimit));
            continue;
        }
        if first && listed {
            hours.push(HourKey { counter: counter.clone(), hour_ms });
        }
        if watermark.is_none_or(|w| event.timestamp_ms > w) {
            tally.set_watermark(&counter, event.timestamp_ms);
            if listed {
                counters.push(counter);
            }
        }
    }
    // One entry per hour and counter, in an order fixed by the keys (see
    // `hour_order`; the counters alike).
    hours.sort_unstable_by(hour_order);
    hours.dedup();
    counters.sort_unstable_by(|a, b| a.hash.cmp(&b.hash).then_with(|| a.cmp(b)));
    counters.dedup();
    Ok(Folded { hours, counters, adjustments })
}

/// Whether a fold lists the hours and counters it changed. A preview
/// publishes the changed hours' rollups and the durable store writes them
/// behind; the in-memory ledger's apply only updates its maps, and listing,
/// sorting and deduplicating a batch's hours for nothing was 7% of the
/// offline path's instructions (callgrind, a thousand hours a batch).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Listing {
    Changes,
    AdjustmentsOnly,
}

impl LedgerMaps {
    /// Folds accepted events, in output order, each with its output offset.
    /// Late events become adjustments and leave hours and watermarks alone.
    pub fn fold<'a>(
        &mut self,
        lateness: &Lateness,
        events: impl IntoIterator<Item = (&'a UsageEvent, i64)>,
    ) -> Result<Folded, FoldError> {
        fold_into(self, lateness, events, Listing::Changes)
    }

    /// Folds as [`fold`](Self::fold) does, and returns only the
    /// adjustments: for a holder that needs no list of what changed.
    pub fn fold_in<'a>(
        &mut self,
        lateness: &Lateness,
        events: impl IntoIterator<Item = (&'a UsageEvent, i64)>,
    ) -> Result<Vec<Adjustment>, FoldError> {
        Ok(fold_into(self, lateness, events, Listing::AdjustmentsOnly)?.adjustments)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::testutil::sample_event_at;

    fn usage(customer: &str, ts: i64, qty: i64) -> UsageEvent {
        let mut e = sample_event_at(0, 0, 0, ts).event;
        e.customer_id = customer.to_owned();
        e.timestamp_ms = ts;
        e.quantity = Decimal::from(qty);
        e.kind = EventKind::Usage;
        e.correction_ref = None;
        e
    }

    #[test]
    fn a_merge_past_the_exact_range_is_an_error_and_changes_nothing() {
        let half = Decimal::MAX / Decimal::from(2) + Decimal::ONE;
        let one = Rollup { sum: half, count: 1, ..Rollup::default() };
        let mut total = one.clone();
        assert!(matches!(total.merge(&one), Err(FoldError::TotalOverflow { .. })));
        assert_eq!(total, one, "a failed merge leaves the row as it was");
        assert!(matches!(checked_sum([half, half], "x"), Err(FoldError::TotalOverflow { what }) if what == "x"));
        assert_eq!(checked_sum([half, -half], "x"), Ok(Decimal::ZERO));
    }

    #[test]
    fn an_event_its_hour_cannot_sum_exactly_becomes_an_adjustment_and_moves_nothing() {
        let t = 1_700_000_000_000 - 1_700_000_000_000 % HOUR_MS;
        let at = |customer: &str, qty: &str| {
            let mut e = usage(customer, t + 60_000, 0);
            e.quantity = qty.parse().expect("decimal");
            e
        };
        let huge = "50000000000000000000000000000";
        // Past the largest value, and more digits than a Decimal holds: both
        // were folded before, the first by failing the batch after it was
        // published, the second by rounding the sum with no word.
        for (first, second) in [(huge, huge), ("10000000000000000000", "0.0000000001")] {
            let mut maps = LedgerMaps::default();
            maps.fold(&Lateness::default(), [(&at("c", first), 0)]).expect("fold");
            let before = maps.clone();
            let folded = maps.fold(&Lateness::default(), [(&at("c", second), 1)]).expect("fold never fails");
            assert_eq!(maps, before, "{second}: the hour and the watermark are as they were");
            assert_eq!(folded.adjustments.len(), 1, "{second}");
            let a = &folded.adjustments[0];
            assert_eq!(
                (a.amount, a.reason, a.output_offset),
                (at("c", second).quantity, AdjustmentReason::SumLimit, 1)
            );
            assert_eq!(AdjustmentReason::parse(a.reason.as_str()), Some(AdjustmentReason::SumLimit));
            // Another counter's hour is its own.
            assert!(maps.fold(&Lateness::default(), [(&at("d", second), 2)]).expect("fold").adjustments.is_empty());
        }
        assert_eq!(exact_sum(Decimal::new(10, 1), Decimal::new(5, 2)), Some(Decimal::new(105, 2)));
        // An hour whose usage was retracted holds a zero with decimal
        // places; the next whole quantity is billed in it, not set aside.
        let mut maps = LedgerMaps::default();
        let mut retraction = at("c", "-2.5");
        retraction.kind = EventKind::Retraction;
        let events = [at("c", "2.5"), retraction, at("c", "3")];
        let folded = maps.fold(&Lateness::default(), events.iter().zip(0..)).expect("fold");
        assert!(folded.adjustments.is_empty(), "{:?}", folded.adjustments);
        assert_eq!(maps.hours[&folded.hours[0]].sum, Decimal::from(3));
        // A zero with decimal places (an hour whose usage was retracted)
        // plus a whole number is exact, with fewer places than the zero.
        assert_eq!(exact_sum(Decimal::new(0, 1), Decimal::from(3)), Some(Decimal::from(3)));
        assert_eq!(exact_sum(Decimal::from(3), Decimal::new(0, 4)), Some(Decimal::from(3)));
        assert_eq!(exact_sum("10000000000000000000".parse().expect("d"), "0.0000000001".parse().expect("d")), None);
    }

    #[test]
    fn an_hour_keeps_sum_count_max_and_last_by_event_time() {
        let t = 1_700_000_000_000 - 1_700_000_000_000 % HOUR_MS;
        let mut maps = LedgerMaps::default();
        let events = [usage("c", t + 50, 3), usage("c", t + 10, 7), usage("c", t + 50, 2)];
        let folded = maps.fold(&Lateness::default(), events.iter().zip(0..)).expect("fold");
        assert_eq!(folded.hours.len(), 1);
        let r = &maps.hours[&folded.hours[0]];
        assert_eq!((r.sum, r.count, r.max), (Decimal::from(12), 3, Some(Decimal::from(7))));
        // Equal event times: the one later in output order is the last.
        assert_eq!(r.last, Some((t + 50, Decimal::from(2))));
        assert_eq!(maps.watermarks[&CounterKey::of(&events[0])], t + 50);
    }

    #[test]
    fn an_event_later_than_the_window_becomes_an_adjustment_and_moves_nothing() {
        let t = 1_700_000_000_000;
        let lateness = Lateness { default_ms: 10 * HOUR_MS, per_meter: BTreeMap::new() };
        let mut maps = LedgerMaps::default();
        maps.fold(&lateness, [(&usage("c", t, 1), 0)]).expect("fold");
        let before = maps.clone();
        // Exactly L behind is still on time; one millisecond more is late.
        let on_time = usage("c", t - 10 * HOUR_MS, 4);
        let late = usage("c", t - 10 * HOUR_MS - 1, 5);
        let folded = maps.fold(&lateness, [(&late, 1)]).expect("fold");
        assert_eq!(maps, before, "a late event rewrites no hour and no watermark");
        assert_eq!(folded.adjustments.len(), 1);
        let a = &folded.adjustments[0];
        assert_eq!((a.amount, a.reason, a.output_offset), (Decimal::from(5), AdjustmentReason::Late, 1));
        let folded = maps.fold(&lateness, [(&on_time, 2)]).expect("fold");
        assert!(folded.adjustments.is_empty());
        // A per-meter window overrides the default.
        let strict = Lateness { default_ms: 10 * HOUR_MS, per_meter: [(on_time.meter.clone(), HOUR_MS)].into() };
        assert!(strict.is_late(&on_time, Some(t)));
    }

    proptest::proptest! {
        /// The in-memory ledger's apply folds without listing what changed:
        /// the maps and adjustments it leaves must be the listed fold's,
        /// late events and repeated hours included.
        #[test]
        fn folding_without_a_list_leaves_what_a_listed_fold_leaves(
            batches in proptest::collection::vec(
                proptest::collection::vec((0..3usize, 0..40i64, 0..HOUR_MS, -3..10i64, proptest::bool::ANY), 0..12),
                1..6,
            )
        ) {
            let t = 1_700_000_000_000 - 1_700_000_000_000 % HOUR_MS;
            let lateness = Lateness { default_ms: 10 * HOUR_MS, per_meter: BTreeMap::new() };
            let (mut listed, mut unlisted) = (LedgerMaps::default(), LedgerMaps::default());
            let mut offset = 0;
            for batch in batches {
                let events: Vec<(UsageEvent, i64)> = batch
                    .into_iter()
                    .map(|(customer, hour, ms, qty, fix)| {
                        let mut e = usage(["a", "b", "c"][customer], t + hour * HOUR_MS + ms, qty);
                        if fix || qty < 0 {
                            e.kind = EventKind::Correction;
                        }
                        offset += 1;
                        (e, offset)
                    })
                    .collect();
                let folded = listed.fold(&lateness, events.iter().map(|(e, o)| (e, *o))).expect("fold");
                let adjustments = unlisted.fold_in(&lateness, events.iter().map(|(e, o)| (e, *o))).expect("fold");
                proptest::prop_assert_eq!(&adjustments, &folded.adjustments);
                proptest::prop_assert_eq!(&unlisted, &listed);
            }
        }
    }

    #[test]
    fn corrections_move_the_sum_but_not_the_usage_figures() {
        let t = 1_700_000_000_000;
        let mut maps = LedgerMaps::default();
        let mut fix = usage("c", t + 5, -2);
        fix.kind = EventKind::Correction;
        maps.fold(&Lateness::default(), [(&usage("c", t, 5), 0), (&fix, 1)]).expect("fold");
        let r = maps.hours.values().next().expect("one hour");
        assert_eq!((r.sum, r.count, r.corrections), (Decimal::from(3), 1, 1));
        assert_eq!((r.max, r.last), (Some(Decimal::from(5)), Some((t, Decimal::from(5)))));
    }
}
