//! Comparing a ledger with the accepted events it was folded from (pure):
//! what `dedupd usage verify` reports, for a state directory and for the
//! topics alike.

use std::collections::BTreeMap;

use super::{HourKey, Rollup};

/// Rollups held somewhere (a ledger, a rollups topic), by hour and partition.
pub type HeldRollups = BTreeMap<(HourKey, i32), Rollup>;

/// Compares partition `p`'s rollups refolded from its events with those
/// `held`, removing each compared one from `held`; one line per difference
/// goes to `drift`. `held_by` and `events_from` name the two sides in the
/// lines ("ledger", "events"). Returns how many hours were compared.
pub fn compare_rollups(
    p: i32,
    refolded: impl IntoIterator<Item = (HourKey, Rollup)>,
    held: &mut HeldRollups,
    (held_by, events_from): (&str, &str),
    drift: &mut Vec<String>,
) -> usize {
    // Reported in key order, whatever order the refold kept them in.
    let refolded: BTreeMap<HourKey, Rollup> = refolded.into_iter().collect();
    let compared = refolded.len();
    for (key, want) in refolded {
        let hour = crate::event::format_timestamp_ms(key.hour_ms);
        match held.remove(&(key.clone(), p)) {
            Some(got) if got == want => {}
            Some(got) => drift.push(format!(
                "partition {p} {:?} hour {hour}: {held_by} has sum {} count {}, {events_from} say sum {} count {}",
                key.counter, got.sum, got.count, want.sum, want.count
            )),
            None => drift.push(format!(
                "partition {p} {:?} hour {hour}: no rollup in the {held_by} ({events_from} say sum {})",
                key.counter, want.sum
            )),
        }
    }
    compared
}

/// The rollups `held` that no accepted event explains (what
/// [`compare_rollups`] left).
pub fn unexplained_rollups(held: HeldRollups, (held_by, events_from): (&str, &str), drift: &mut Vec<String>) {
    for ((key, p), got) in held {
        drift.push(format!(
            "partition {p} {:?} hour {}: the {held_by}'s sum {} has no accepted events behind it in the {events_from}",
            key.counter,
            crate::event::format_timestamp_ms(key.hour_ms),
            got.sum
        ));
    }
}
