//! The operator commands on a state directory: `dedupd verify`,
//! `dedupd inspect`, `dedupd usage` and `dedupd period`.

use std::fmt::Write as _;
use std::path::Path;

use crate::config::EngineSettings;
use crate::event::{format_timestamp_ms, id_hash, to_canonical_json};
use crate::ledger::{
    compare_rollups, unexplained_rollups, Adjustment, HeldRollups, LedgerMaps, LedgerStore, Period, PeriodAction,
    PeriodBook, PeriodReport, UsageAnswer, UsageQuery,
};
use crate::storage::FileStatus;

use super::{locked, LocalState, StateError, StoredEvent};

/// `dedupd verify`: every checksum of the usage store (WAL frames, segment
/// footers, sidecars, manifests), every block of the key store, and every
/// entry of the ledger. Changes
/// nothing, and may run beside the worker (what it is writing right now may
/// show as a torn WAL tail, which is not corruption). Returns the report and
/// whether everything is intact.
pub fn verify_state_dir(state_dir: &Path) -> Result<(String, bool), StateError> {
    // A mistyped path or an unmounted volume is not a clean state
    // directory: each store would read as absent, and verify said ok.
    super::check_state_dir(state_dir)?;
    let mut out = String::new();
    let mut clean = true;
    let usage_dir = state_dir.join("usage");
    if usage_dir.exists() {
        let report = crate::storage::verify(&usage_dir)?;
        let _ =
            writeln!(out, "usage store {} (manifest generation {:?})", usage_dir.display(), report.manifest_generation);
        for f in &report.files {
            let status = match &f.status {
                FileStatus::Ok => "ok".to_owned(),
                FileStatus::TornTail { offset } => format!("torn tail at byte {offset} (truncated on next open)"),
                FileStatus::Corrupt { error } => format!("CORRUPT: {error}"),
                FileStatus::Missing => "MISSING (named by the manifest)".to_owned(),
                FileStatus::Unreferenced => "unreferenced (removed on next open)".to_owned(),
            };
            let _ = writeln!(out, "  {:<8} {}: {} [{}]", f.kind.as_str(), f.path.display(), status, f.detail);
        }
        clean &= report.is_clean();
    } else {
        let _ = writeln!(out, "usage store {}: absent", usage_dir.display());
    }
    let keys_dir = state_dir.join("keystore");
    if keys_dir.exists() {
        match crate::keystore::verify(&keys_dir) {
            Ok(report) => {
                let _ = writeln!(out, "key store {}", keys_dir.display());
                for (cf, n) in &report.column_families {
                    let _ = writeln!(out, "  column family {cf}: {n} entries, checksums ok");
                }
                for log in &report.logs {
                    let status = match (log.damaged_at, log.newest) {
                        (None, _) => "checksums ok".to_owned(),
                        (Some(at), true) => format!("torn tail at offset {at} (open replays up to it)"),
                        (Some(at), false) => {
                            format!("CORRUPT at offset {at}: later applies are lost, repair brings them back")
                        }
                    };
                    let _ = writeln!(out, "  log {}: {} frames, {status}", log.path.display(), log.frames);
                }
                clean &= report.is_clean();
            }
            Err(e) => {
                let _ = writeln!(out, "key store {}: CORRUPT: {e}", keys_dir.display());
                clean = false;
            }
        }
    } else {
        let _ = writeln!(out, "key store {}: absent", keys_dir.display());
    }
    let ledger_dir = state_dir.join("ledger");
    if ledger_dir.exists() {
        match LedgerStore::open_read_only(&ledger_dir).and_then(|l| l.verify().map(|n| (l, n))) {
            Ok((ledger, n)) => {
                let _ = writeln!(out, "ledger {}: {n} entries decoded, checksums ok", ledger_dir.display());
                if usage_dir.exists() {
                    notes_of_a_usage_store_behind_its_ledger(&usage_dir, &ledger, &mut out)?;
                }
            }
            Err(e) => {
                let _ = writeln!(out, "ledger {}: CORRUPT: {e}", ledger_dir.display());
                clean = false;
            }
        }
    } else {
        let _ = writeln!(out, "ledger {}: absent", ledger_dir.display());
    }
    let _ = writeln!(out, "{}", if clean { "verify: ok" } else { "verify: CORRUPTION FOUND" });
    Ok((out, clean))
}

/// Notes, not corruption: partitions whose usage store holds fewer accepted
/// events than the ledger folded (its checkpoint behind the ledger's).
/// After a crash that is expected (a batch's usage-store append is made
/// beside the next batch, and the ledger writes behind), and the next start
/// repairs the usage store from the output; but it is also what a lost
/// newest WAL file looks like, which checksums alone cannot show.
fn notes_of_a_usage_store_behind_its_ledger(
    usage_dir: &Path,
    ledger: &LedgerStore,
    out: &mut String,
) -> Result<(), StateError> {
    let Ok(stored) = crate::storage::stored_checkpoints(usage_dir) else {
        // Unreadable WAL files are reported above, with their cause.
        return Ok(());
    };
    for (p, folded) in ledger.written_checkpoints()? {
        let held = stored.get(&p).copied();
        if held.is_none_or(|h| h < folded) {
            let held = held.map_or_else(|| "none".to_owned(), |h| h.to_string());
            let _ = writeln!(
                out,
                "  note: partition {p}: the usage store holds accepted events through output offset {held}, the \
                 ledger folded them through {folded}: expected after a crash (the next start repairs the usage \
                 store from the output); otherwise usage-store files were lost"
            );
        }
    }
    Ok(())
}

/// `dedupd inspect`: whether an event is known, where and when it was first
/// seen, and its canonical payload. Opens (and so locks) the state
/// directory: run it against a stopped worker or a copy of its directory.
pub fn inspect(
    state_dir: &Path,
    tenant_id: &str,
    event_id: &str,
    settings: EngineSettings,
) -> Result<serde_json::Value, StateError> {
    let id = id_hash(tenant_id, event_id);
    let state = LocalState::open_for_reading(state_dir, settings)?;
    let mut answer = serde_json::json!({
        "tenant_id": tenant_id,
        "event_id": event_id,
        "id_hash": id.to_hex(),
        "known": false,
    });
    if let Some(d) = &state.durable {
        let stored = locked(&d.usage).get(None, &id)?;
        if let Some(stored) = stored {
            let k = stored.key;
            answer["known"] = true.into();
            answer["bucket"] = "accepted".into();
            answer["first_seen_ms"] = k.first_seen_ms.into();
            answer["first_seen"] = format_timestamp_ms(k.first_seen_ms).into();
            answer["payload_hash"] = k.payload_hash.to_hex().into();
            answer["source"] = serde_json::json!({"partition": k.source.partition, "offset": k.source.offset});
            answer["output"] = serde_json::json!({"partition": k.output.partition, "offset": k.output.offset});
            answer["event"] = serde_json::from_str::<serde_json::Value>(&to_canonical_json(&stored.event))
                .unwrap_or(serde_json::Value::Null);
        }
        let mut in_keystore = Vec::new();
        let partitions = locked(&d.usage).partitions();
        for p in partitions {
            let mut answer = Vec::with_capacity(1);
            d.keys.lookup_many(p, &[id], &mut answer)?;
            if let Some(Some(k)) = answer.pop() {
                in_keystore.push(serde_json::json!({
                    "partition": p,
                    "payload_hash": k.payload_hash.to_hex(),
                    "first_seen_ms": k.first_seen_ms,
                    "output_offset": k.output.offset,
                }));
            }
        }
        if !in_keystore.is_empty() {
            answer["known"] = true.into();
        }
        answer["keystore"] = in_keystore.into();
        answer["note"] =
            "dedupd keeps the first accepted copy; duplicates and conflicts are counted and reported, not stored"
                .into();
    }
    // Dropped, not closed: closing flushes the usage store's memtable into a
    // segment, and the memtable is where the worker's next start finds the
    // batches its ledger folded but had not written (a crash's). A tool that
    // only reads must leave that to the worker.
    drop(state);
    Ok(answer)
}

/// Answers a usage query from the ledger of a state directory. Read-only
/// and without the directory's lock, so it works beside a running worker
/// (seeing the ledger as of the moment it opens). A worker holds only its
/// partitions' share: the whole deployment's totals are on the rollups topic.
pub fn usage(state_dir: &Path, query: &UsageQuery) -> Result<UsageAnswer, StateError> {
    super::check_state_dir(state_dir)?;
    let store = LedgerStore::open_read_only(&state_dir.join("ledger"))?;
    Ok(crate::ledger::Ledger::Durable(Box::new(store)).answer(query)?)
}

/// `dedupd period close|reopen|show --state-dir`: the period book of a
/// state directory (`periods.json`), snapshots taken from its ledger.
/// Read-only on the ledger and without the directory's lock; a
/// `dedupd dedupe` already running keeps the closed set it started with, so
/// close periods between runs.
pub fn period(
    state_dir: &Path,
    action: PeriodAction,
    tenant_id: &str,
    period: Period,
    now_ms: i64,
) -> Result<PeriodReport, StateError> {
    super::check_state_dir(state_dir)?;
    // A change holds the book from its load to its save.
    let _changing = match action {
        PeriodAction::Show => None,
        PeriodAction::Close | PeriodAction::Reopen => {
            Some(PeriodBook::lock_for_change(state_dir).map_err(StateError::Period)?)
        }
    };
    let book = PeriodBook::load(state_dir).map_err(StateError::Period)?;
    let store = LedgerStore::open_read_only(&state_dir.join("ledger"))?;
    if action == PeriodAction::Close {
        refuse_a_ledger_behind_the_usage_store(state_dir, &store)?;
    }
    let ledger = crate::ledger::Ledger::Durable(Box::new(store));
    let now = ledger.period_totals(tenant_id, period)?;
    let (changed, report) = book.act(action, tenant_id, period, now_ms, &now).map_err(StateError::Period)?;
    if let Some(record) = changed {
        let mut book = book;
        book.insert(record);
        book.save(state_dir).map_err(StateError::Period)?;
    }
    Ok(report)
}

/// A close freezes what the ledger holds as the month's invoice, so the
/// ledger must hold every accepted event the usage store does. It lags
/// after a run that died (it writes behind, and the next run's start folds
/// the rest), beside a run still going, and after runs with `--ledger
/// false`; a close then froze a fraction of the month and reported
/// success.
fn refuse_a_ledger_behind_the_usage_store(state_dir: &Path, ledger: &LedgerStore) -> Result<(), StateError> {
    for (p, stored) in crate::storage::stored_checkpoints(&state_dir.join("usage"))? {
        let folded = ledger.checkpoint(p)?;
        if folded.is_none_or(|f| f < stored) {
            let folded = folded.map_or_else(|| "none".to_owned(), |f| f.to_string());
            return Err(StateError::Period(format!(
                "the ledger of {} is behind its usage store (partition {p}: accepted events stored through output \
                 offset {stored}, folded into the ledger through {folded}), so a close would freeze part of the \
                 month: a run on this directory is still going, or the last one stopped before its ledger caught \
                 up, or ran with --ledger false. Close after a run with the ledger on has ended (its start folds \
                 what the last one left)",
                state_dir.display()
            )));
        }
    }
    Ok(())
}

/// The accepted events of partition `p` in the usage store the ledger has
/// folded (up to its checkpoint), in output order: what its rollups were
/// folded from. Those past the checkpoint are only counted, with the range
/// of their output offsets: a drift line needs no more, and after an
/// emptied ledger they are the whole store.
struct PartitionEvents {
    folded: Vec<StoredEvent>,
    unfolded: Option<Unfolded>,
    checkpoint: Option<i64>,
}

struct Unfolded {
    count: u64,
    first: i64,
    last: i64,
}

fn partition_events(state: &LocalState, ledger: &LedgerStore, p: i32) -> Result<PartitionEvents, StateError> {
    let checkpoint = ledger.checkpoint(p)?;
    let mut folded = Vec::new();
    let mut unfolded: Option<Unfolded> = None;
    state.for_each_stored(p, |e| {
        let offset = e.key.output.offset;
        if checkpoint.is_some_and(|c| offset <= c) {
            folded.push(e.clone());
        } else {
            let u = unfolded.get_or_insert(Unfolded { count: 0, first: offset, last: offset });
            u.count += 1;
            u.first = u.first.min(offset);
            u.last = u.last.max(offset);
        }
    })?;
    folded.sort_by_key(|e| e.key.output.offset);
    Ok(PartitionEvents { folded, unfolded, checkpoint })
}

impl PartitionEvents {
    /// Accepted events the ledger never folded, as a drift line: `usage`
    /// leaves them out of every answer. After a crash, in a copy of a
    /// running worker, after a run with the ledger off, or with a ledger
    /// emptied or restored from an older copy. A worker's next start with
    /// the ledger on folds them, from the usage store when the ledger's
    /// last write recorded where they are, otherwise by repair from the
    /// output (a Kafka worker's reaches back only over the horizon).
    fn unfolded_drift(&self, p: i32) -> Option<String> {
        let Unfolded { count, first, last } = self.unfolded.as_ref()?;
        let checkpoint = self.checkpoint.map_or_else(|| "none".to_owned(), |c| c.to_string());
        Some(format!(
            "partition {p}: the usage store holds {count} accepted events the ledger has not folded (output offsets \
             {first}..={last}; ledger checkpoint {checkpoint}); usage answers leave them out until a worker starts \
             on this directory with the ledger on and folds them (from the usage store when the ledger's last \
             write says where they are, otherwise by repair from the output, within the horizon for a Kafka \
             worker)"
        ))
    }
}

/// `dedupd usage --group-by dimension:KEY --state-dir`: the query answered
/// from the accepted events of the usage store (each partition refolded as
/// the ledger folded it), since rollups do not keep dimension values. Opens
/// (and locks) the directory like `usage verify`: run it on a stopped
/// worker or a copy, with the worker's `--lateness` and `--config`. Events
/// the usage store has aged out (`--retention`) are not in the answer.
pub fn usage_from_events(
    state_dir: &Path,
    query: &UsageQuery,
    settings: EngineSettings,
) -> Result<UsageAnswer, StateError> {
    let lateness = settings.lateness.clone();
    let state = LocalState::open_for_reading(state_dir, settings)?;
    let Some(crate::ledger::Ledger::Durable(ledger)) = state.ledger() else {
        return Err(StateError::Ledger(crate::ledger::LedgerError::Missing {
            dir: state_dir.join("ledger").display().to_string(),
        }));
    };
    let mut partitions = Vec::new();
    if let Some(d) = &state.durable {
        let stored = locked(&d.usage).partitions();
        for p in stored {
            let events = partition_events(&state, ledger, p)?.folded;
            partitions.push(events.into_iter().map(|e| (e.key.output.offset, e.event)).collect::<Vec<_>>());
        }
    }
    UsageAnswer::of_events(query, &lateness, partitions.iter().map(Vec::as_slice))
        .map_err(|e| StateError::Ledger(e.into()))
}

/// What `dedupd usage verify` found: the ledger refolded from the accepted
/// events of the usage store, against the ledger as stored.
#[derive(Debug, Default)]
pub struct LedgerCheck {
    /// Accepted events refolded.
    pub events: u64,
    /// Counter-hours compared.
    pub hours: usize,
    /// Adjustments compared.
    pub adjustments: usize,
    /// One line per difference; empty when the ledger holds what the
    /// events say.
    pub drift: Vec<String>,
}

/// `dedupd usage verify --state-dir`: refolds every partition's accepted
/// events from the usage store, in output order up to the ledger's
/// checkpoint, and compares every rollup and adjustment with the ledger.
/// Accepted events past the checkpoint (or in a partition the ledger has
/// no checkpoint for) are drift too: the ledger does not hold them.
/// Opens (and locks) the directory, like `inspect`. Hours whose events the
/// usage store has already aged out (`--retention`) are reported as drift:
/// keep retention at least as long as the periods still being billed.
pub fn verify_ledger(state_dir: &Path, settings: EngineSettings) -> Result<LedgerCheck, StateError> {
    use std::collections::BTreeMap;

    let lateness = settings.lateness.clone();
    let state = LocalState::open_for_reading(state_dir, settings)?;
    let Some(crate::ledger::Ledger::Durable(ledger)) = state.ledger() else {
        return Err(StateError::Ledger(crate::ledger::LedgerError::Missing {
            dir: state_dir.join("ledger").display().to_string(),
        }));
    };
    let mut check = LedgerCheck::default();
    const SIDES: (&str, &str) = ("ledger", "usage store's events");
    let mut stored: HeldRollups = BTreeMap::new();
    ledger.all_rollups(|k, p, r| {
        stored.insert((k, p), r);
    })?;
    let mut stored_adjustments: BTreeMap<(i32, i64), Adjustment> =
        ledger.all_adjustments()?.into_iter().map(|(p, a)| ((p, a.output_offset), a)).collect();
    let Some(d) = &state.durable else { return Ok(check) };
    let mut partitions = locked(&d.usage).partitions();
    for (k, p) in stored.keys() {
        let _ = k;
        partitions.push(*p);
    }
    partitions.sort_unstable();
    partitions.dedup();
    for p in partitions {
        let split = partition_events(&state, ledger, p)?;
        check.drift.extend(split.unfolded_drift(p));
        let events = split.folded;
        check.events += events.len() as u64;
        let mut maps = LedgerMaps::default();
        let folded = maps
            .fold(&lateness, events.iter().map(|e| (&e.event, e.key.output.offset)))
            .map_err(crate::ledger::LedgerError::from)?;
        check.hours += compare_rollups(p, maps.hours, &mut stored, SIDES, &mut check.drift);
        for want in folded.adjustments {
            check.adjustments += 1;
            match stored_adjustments.remove(&(p, want.output_offset)) {
                Some(got) if got == want => {}
                Some(got) => check.drift.push(format!(
                    "partition {p} adjustment at output offset {}: ledger has {} {}, events say {} {}",
                    want.output_offset, got.event_id, got.amount, want.event_id, want.amount
                )),
                None => check.drift.push(format!(
                    "partition {p} adjustment of event {} ({}) missing from the ledger",
                    want.event_id, want.amount
                )),
            }
        }
    }
    unexplained_rollups(stored, SIDES, &mut check.drift);
    for ((p, offset), a) in stored_adjustments {
        check.drift.push(format!(
            "partition {p} adjustment of event {} at output offset {offset} has no accepted event behind it",
            a.event_id
        ));
    }
    Ok(check)
}
