//! Validation: from a [`WireEvent`] to a [`UsageEvent`], or a [`Rejection`]
//! with exactly one reason code (DESIGN §4).
//!
//! Rules apply in a fixed order, so a record breaking several gets the first:
//! size, JSON shape, unknown fields, field types, missing fields, empty fields,
//! lengths, dimension count, quantity, timestamp, correction reference, closed
//! period.

use rust_decimal::Decimal;

use super::identity::IdDeriver;
use super::model::{CorrectionRef, EventKind, UsageEvent};
use super::quantity::{parse_decimal, QuantityError};
use super::reason::{RejectReason, Rejection};
use super::wire::{self, Scalar, Text, WireEvent, WireField};

/// Validation limits. Every one is configurable; the defaults are documented
/// in the README.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest record accepted, in bytes, before any parsing.
    pub max_record_bytes: usize,
    /// Longest identifier (`event_id`, `tenant_id`, `customer_id`, `meter`,
    /// `resource_id`, `correction_ref.original_event_id`, dimension keys), in bytes.
    pub max_id_bytes: usize,
    /// Longest free-text field (`unit`, `source`, `correction_ref.reason`,
    /// dimension values), in bytes.
    pub max_field_bytes: usize,
    /// Most dimensions per event.
    pub max_dimensions: usize,
    /// How far in the future an event time may be.
    pub max_future_skew_ms: i64,
    /// How far in the past an event time may be.
    pub max_event_age_ms: i64,
    /// Largest canonical output record (the published JSON) an accepted
    /// event may have, in bytes. Escaping can make the canonical form longer
    /// than the input (a `\b` in a string is 2 bytes in, `\u0008` 6 bytes
    /// out), so acceptance checks it: an event whose output could not be
    /// published, or read back by repair, is rejected instead of wedging the
    /// partition. At most [`OUTPUT_READ_CEILING_BYTES`].
    pub max_output_bytes: usize,
}

/// The most bytes one output record may have when dedupd reads its own
/// output back (repair, the offline output file). Fixed, not configured: the
/// output was written under whatever limits were in force then, and lowering
/// a limit must never make existing output unreadable. It only bounds memory
/// against a foreign or corrupt line.
pub const OUTPUT_READ_CEILING_BYTES: usize = 16 << 20;

/// Bytes the canonical form can add to an event beyond 3× its input size:
/// the default `kind`, a derived `event_id` and its flag, a quantity written
/// out in full (`1e27` becomes 28 digits) and an RFC 3339 timestamp.
const CANONICAL_GROWTH_BYTES: usize = 512;

/// Which records a validation is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reading {
    /// A producer's input record: every limit and time window applies.
    Input,
    /// One of dedupd's own output records: it passed validation when it was
    /// accepted, so only its shape is checked, never a configurable limit.
    Output,
}

pub const DAY_MS: i64 = 24 * 60 * 60 * 1000;

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_record_bytes: 64 * 1024,
            max_id_bytes: 256,
            max_field_bytes: 1024,
            max_dimensions: 16,
            max_future_skew_ms: 60 * 60 * 1000,
            max_event_age_ms: 35 * DAY_MS,
            max_output_bytes: 512 << 10,
        }
    }
}

impl Limits {
    /// How long after an event's first arrival a retry of it can still
    /// pass the age check: its stamp may be up to `max_future_skew_ms`
    /// ahead of that arrival, and it is accepted until `max_event_age_ms`
    /// after its stamp, inclusive (hence the millisecond). A dedupe window
    /// any shorter lets such a retry through as new.
    pub fn window_needed_ms(&self) -> i64 {
        self.max_event_age_ms.saturating_add(self.max_future_skew_ms.max(0)).saturating_add(1)
    }
}

/// A (tenant, calendar month UTC) closed for usage: invoices for it are final.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClosedPeriod {
    pub tenant_id: String,
    pub year: i32,
    pub month: u8,
}

impl ClosedPeriod {
    /// Parses `tenant:YYYY-MM`. The tenant may itself contain `:`; the month
    /// is after the last one.
    pub fn parse(s: &str) -> Result<ClosedPeriod, String> {
        let (tenant, ym) = s.rsplit_once(':').ok_or_else(|| format!("{s:?} is not tenant:YYYY-MM"))?;
        let (y, m) = ym.split_once('-').ok_or_else(|| format!("{s:?} is not tenant:YYYY-MM"))?;
        let year: i32 = y.parse().map_err(|_| format!("{s:?}: bad year"))?;
        let month: u8 = m.parse().map_err(|_| format!("{s:?}: bad month"))?;
        if tenant.is_empty() || y.len() != 4 || m.len() != 2 || !(1..=12).contains(&month) {
            return Err(format!("{s:?} is not tenant:YYYY-MM"));
        }
        Ok(ClosedPeriod { tenant_id: tenant.to_owned(), year, month })
    }
}

/// The (tenant, month) pairs closed for usage right now, shared: every
/// validator cloned from one set sees a period close the moment whoever
/// follows the periods (the worker's periods-topic reader, or the state
/// directory's period book offline) replaces the set. The set changes only
/// when an operator closes or reopens a period, and is read per usage event.
#[derive(Clone, Default)]
pub struct ClosedPeriods(std::sync::Arc<ClosedSet>);

/// The months closed per tenant: found by the event's tenant as borrowed,
/// with no key built per event.
type ClosedMonths = std::collections::BTreeMap<String, std::collections::BTreeSet<(i32, u8)>>;

#[derive(Default)]
struct ClosedSet {
    months: std::sync::RwLock<ClosedMonths>,
    /// Whether any period is closed, read without the lock: with none (most
    /// runs, and every run without a period book), the check per event is
    /// one load. The lock and its shared count were 2% of `dedupd dedupe`'s
    /// CPU. Set after the months are written, so a reader that sees it set
    /// finds them; a reader that reads it a moment before a close misses
    /// that close, as a reader that took the lock a moment before did.
    any: std::sync::atomic::AtomicBool,
}

impl ClosedPeriods {
    pub fn of(list: impl IntoIterator<Item = ClosedPeriod>) -> ClosedPeriods {
        let set = ClosedPeriods::default();
        set.replace(list);
        set
    }

    /// Makes `list` the closed set, for every validator sharing it.
    pub fn replace(&self, list: impl IntoIterator<Item = ClosedPeriod>) {
        let mut fresh = ClosedMonths::new();
        for p in list {
            fresh.entry(p.tenant_id).or_default().insert((p.year, p.month));
        }
        let any = !fresh.is_empty();
        // The flag is stored under the write lock: two replacements at once
        // cannot leave it saying "none" over a set that has some.
        let mut months = self.0.months.write().unwrap_or_else(std::sync::PoisonError::into_inner);
        *months = fresh;
        self.0.any.store(any, std::sync::atomic::Ordering::Release);
    }

    /// Every closed period, by tenant, year and month.
    pub fn list(&self) -> Vec<ClosedPeriod> {
        let months = self.0.months.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        months
            .iter()
            .flat_map(|(tenant, ms)| {
                ms.iter().map(move |&(year, month)| ClosedPeriod { tenant_id: tenant.clone(), year, month })
            })
            .collect()
    }

    /// The closed period `timestamp_ms` falls in for `tenant_id`, if any.
    fn find(&self, tenant_id: &str, timestamp_ms: i64) -> Option<(i32, u8)> {
        if !self.0.any.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let months = self.0.months.read().unwrap_or_else(std::sync::PoisonError::into_inner);
        let closed = months.get(tenant_id)?;
        let t = time::OffsetDateTime::from_unix_timestamp_nanos(i128::from(timestamp_ms) * 1_000_000).ok()?;
        let month = (t.year(), u8::from(t.month()));
        closed.contains(&month).then_some(month)
    }
}

impl std::fmt::Debug for ClosedPeriods {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_set().entries(self.list().iter().map(|p| format!("{}:{}-{:02}", p.tenant_id, p.year, p.month))).finish()
    }
}

/// Two sets are equal when they hold the same periods now (settings compare
/// by what they say, not by which handle they share).
impl PartialEq for ClosedPeriods {
    fn eq(&self, other: &ClosedPeriods) -> bool {
        self.list() == other.list()
    }
}

/// What acceptance does with a field schema v1 does not define.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum UnknownFields {
    /// Reject the event as `unknown_field` (the default): a field dedupd does
    /// not know may carry billing meaning (a discount, a unit change) that
    /// the output would silently drop. The record is kept whole on the
    /// rejected topic and can be replayed once the schema or this setting
    /// changes.
    #[default]
    Reject,
    /// Accept the event without the field. The field is not part of the
    /// canonical form, so it never enters the payload hash: a producer that
    /// starts sending it does not turn its retries into conflicts.
    Ignore,
}

impl UnknownFields {
    pub fn parse(s: &str) -> Result<UnknownFields, String> {
        match s.trim() {
            "reject" => Ok(UnknownFields::Reject),
            "ignore" => Ok(UnknownFields::Ignore),
            other => Err(format!("{other:?} is neither reject nor ignore")),
        }
    }
}

/// Turns record bytes into validated events. Holds everything validation
/// needs besides the current time, which each call passes in (the clock seam).
#[derive(Clone, Debug)]
pub struct Validator {
    limits: Limits,
    closed: ClosedPeriods,
    deriver: IdDeriver,
    unknown_fields: UnknownFields,
}

impl Validator {
    pub fn new(limits: Limits, closed: Vec<ClosedPeriod>, derive_salt: &str) -> Validator {
        Validator::sharing(limits, ClosedPeriods::of(closed), derive_salt)
    }

    /// A validator that rejects usage into whatever `closed` holds at the
    /// moment of each call.
    pub fn sharing(limits: Limits, closed: ClosedPeriods, derive_salt: &str) -> Validator {
        Validator { limits, closed, deriver: IdDeriver::new(derive_salt), unknown_fields: UnknownFields::Reject }
    }

    /// The closed set this validator reads (shared, see [`ClosedPeriods`]).
    pub fn closed_periods(&self) -> &ClosedPeriods {
        &self.closed
    }

    /// The same validator with `policy` for fields schema v1 does not define.
    pub fn with_unknown_fields(mut self, policy: UnknownFields) -> Validator {
        self.unknown_fields = policy;
        self
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Validates one input record at time `now_ms`.
    pub fn validate(&self, bytes: &[u8], now_ms: i64) -> Result<UsageEvent, Rejection> {
        self.validate_with(bytes, now_ms, Reading::Input)
    }

    /// Reads back one of dedupd's own output records (canonical JSON). No
    /// limit, time window or closed period applies: the event was valid when
    /// it was accepted, and repair must be able to read it whatever the
    /// configuration is now.
    pub fn read_output(&self, bytes: &[u8]) -> Result<UsageEvent, Rejection> {
        self.validate_with(bytes, 0, Reading::Output)
    }

    /// The identity of one input record, `(tenant_id, event_id)`, reading
    /// only what identity needs: the router places records with it, and
    /// leaves judging the rest (quantity, time window, limits, unknown
    /// fields) to the dedupe stage. For every record [`validate`] accepts,
    /// this is the accepted event's `(tenant_id, event_id)`; an error names
    /// why the record has no identity (not JSON, no tenant, and for an event
    /// without `event_id`, no customer, meter or readable timestamp).
    ///
    /// [`validate`]: Validator::validate
    pub fn identity_of(&self, bytes: &[u8]) -> Result<(String, String), Rejection> {
        self.check_record_size(bytes)?;
        let w = wire::decode(bytes, false).map_err(|e| Rejection::new(RejectReason::MalformedJson, e.0))?;
        self.identity_of_wire(&w)
    }

    /// `record_too_large` for an input record over `max_record_bytes`,
    /// before any parsing. The router judges it too, whatever its identity:
    /// the dedupe stage would reject it anyway, and a record near the
    /// broker's limit that the router re-keyed could be refused by its
    /// producer, stopping the router on that raw offset at every start.
    fn check_record_size(&self, bytes: &[u8]) -> Result<(), Rejection> {
        if bytes.len() > self.limits.max_record_bytes {
            return Err(Rejection::new(
                RejectReason::RecordTooLarge,
                format!("{} bytes, limit {}", bytes.len(), self.limits.max_record_bytes),
            ));
        }
        Ok(())
    }

    /// The `(tenant_id, event_id)` a record is placed by: its identity, or
    /// for a correction or retraction with `correction_ref.original_event_id`,
    /// the original's ([`UsageEvent::placement_id`]). What `dedupd route`
    /// keys and partitions by; for every record [`validate`] accepts, the
    /// accepted event's `(tenant_id, placement_id())`.
    ///
    /// [`validate`]: Validator::validate
    pub fn placement_of(&self, bytes: &[u8]) -> Result<(String, String), Rejection> {
        self.check_record_size(bytes)?;
        let w = wire::decode(bytes, false).map_err(|e| Rejection::new(RejectReason::MalformedJson, e.0))?;
        let (tenant_id, event_id) = self.identity_of_wire(&w)?;
        let corrects = matches!(optional_str(&w.kind).and_then(EventKind::parse), Some(k) if k != EventKind::Usage);
        let original = match &w.correction_ref {
            WireField::Value(c) => optional_str(&c.original_event_id).filter(|o| !o.is_empty()),
            _ => None,
        };
        match original {
            Some(o) if corrects => Ok((tenant_id, o.to_owned())),
            _ => Ok((tenant_id, event_id)),
        }
    }

    fn identity_of_wire(&self, w: &WireEvent<'_>) -> Result<(String, String), Rejection> {
        check_types(w)?;
        let tenant_id = required_str(&w.tenant_id, "tenant_id")?;
        let event_id = optional_str(&w.event_id);
        if tenant_id.is_empty() {
            return Err(Rejection::new(RejectReason::EmptyField, "`tenant_id` is empty"));
        }
        let event_id = match event_id {
            Some("") => return Err(Rejection::new(RejectReason::EmptyField, "`event_id` is empty")),
            Some(id) => id.to_owned(),
            None => {
                let customer_id = required_str(&w.customer_id, "customer_id")?;
                let meter = required_str(&w.meter, "meter")?;
                let resource_id = optional_str(&w.resource_id);
                let timestamp = match &w.timestamp {
                    WireField::Value(t) => parse_timestamp(t)?,
                    _ => return Err(Rejection::new(RejectReason::MissingField, "`timestamp` is required")),
                };
                for (name, v) in
                    [("customer_id", Some(customer_id)), ("meter", Some(meter)), ("resource_id", resource_id)]
                {
                    if v.is_some_and(str::is_empty) {
                        return Err(Rejection::new(RejectReason::EmptyField, format!("`{name}` is empty")));
                    }
                }
                self.deriver.derive(tenant_id, customer_id, meter, resource_id, timestamp)
            }
        };
        Ok((tenant_id.to_owned(), event_id))
    }

    fn validate_with(&self, bytes: &[u8], now_ms: i64, reading: Reading) -> Result<UsageEvent, Rejection> {
        use RejectReason::*;
        let input = reading == Reading::Input;
        if input {
            self.check_record_size(bytes)?;
        }
        let w = wire::decode(bytes, !input).map_err(|e| Rejection::new(MalformedJson, e.0))?;
        // Output records are dedupd's canonical form, which has no unknown
        // fields: one there means a foreign line, never to be trusted.
        let reject_unknown = !input || self.unknown_fields == UnknownFields::Reject;
        let unknown = w.unknown_field.as_ref().or(match &w.correction_ref {
            WireField::Value(c) => c.unknown_field.as_ref(),
            _ => None,
        });
        if let (true, Some(f)) = (reject_unknown, unknown) {
            return Err(Rejection::new(UnknownField, format!("`{f}` is not a field of schema v1")));
        }
        check_types(&w)?;

        let tenant_id = required_str(&w.tenant_id, "tenant_id")?;
        let customer_id = required_str(&w.customer_id, "customer_id")?;
        let meter = required_str(&w.meter, "meter")?;
        let quantity = match &w.quantity {
            WireField::Value(q) => q,
            _ => return Err(Rejection::new(MissingField, "`quantity` is required")),
        };
        let timestamp = match &w.timestamp {
            WireField::Value(t) => t,
            _ => return Err(Rejection::new(MissingField, "`timestamp` is required")),
        };
        let event_id = optional_str(&w.event_id);
        let resource_id = optional_str(&w.resource_id);
        let unit = optional_str(&w.unit);
        let source = optional_str(&w.source);
        let kind_text = optional_str(&w.kind);
        let correction = match &w.correction_ref {
            WireField::Value(c) => Some(c),
            _ => None,
        };
        let original_event_id = match correction {
            Some(c) => Some(required_str(&c.original_event_id, "correction_ref.original_event_id")?),
            None => None,
        };
        let correction_reason = correction.and_then(|c| optional_str(&c.reason));
        let dims: &[(Text<'_>, WireField<Text<'_>>)] = match &w.dimensions {
            WireField::Value(d) => d,
            _ => &[],
        };

        // Empty strings: an empty id would make "absent" and "empty" two
        // spellings of one thing, so every present string must have content.
        // Dimension values may be empty (a legitimate "none" value).
        let ids = [
            ("event_id", event_id),
            ("tenant_id", Some(tenant_id)),
            ("customer_id", Some(customer_id)),
            ("meter", Some(meter)),
            ("resource_id", resource_id),
            ("correction_ref.original_event_id", original_event_id),
        ];
        let texts =
            [("unit", unit), ("source", source), ("kind", kind_text), ("correction_ref.reason", correction_reason)];
        for (name, v) in ids.iter().chain(texts.iter()) {
            if v.is_some_and(str::is_empty) {
                return Err(Rejection::new(EmptyField, format!("`{name}` is empty")));
            }
        }
        for (k, _) in dims {
            if k.is_empty() {
                return Err(Rejection::new(EmptyField, "a dimension key is empty"));
            }
        }

        if input {
            self.check_sizes(&ids, &texts, dims)?;
            // Input only: output accepted before this check must stay
            // readable.
            if let Some((name, _)) = ids.iter().find(|(_, v)| v.is_some_and(|v| v.contains('\0'))) {
                return Err(Rejection::new(
                    InvalidIdentifier,
                    format!(
                        "`{name}` holds a NUL character: dedupd's record keys join identifiers with NUL, so two \
                         different ids could share one key"
                    ),
                ));
            }
        }
        if input && dims.len() > self.limits.max_dimensions {
            return Err(Rejection::new(
                TooManyDimensions,
                format!("{} dimensions, limit {}", dims.len(), self.limits.max_dimensions),
            ));
        }

        let kind = match kind_text {
            None => EventKind::Usage,
            Some(k) => EventKind::parse(k).ok_or_else(|| {
                Rejection::new(MalformedJson, format!("`kind` must be usage, correction or retraction, not {k:?}"))
            })?,
        };

        let quantity = parse_quantity(quantity)?;
        // A retraction takes billed usage away, and usage is summed as sent:
        // one sent as +5 would bill 5 more instead of 5 less. Checked in the
        // reason table's order (before `negative_quantity`), at the input
        // only, so output an older version accepted still reads back.
        if input && kind == EventKind::Retraction && quantity.is_sign_positive() && !quantity.is_zero() {
            return Err(Rejection::new(
                InvalidQuantity,
                format!("retraction quantity {quantity} is above 0: a retraction of 5 units is sent as -5"),
            ));
        }
        if kind == EventKind::Usage && quantity.is_sign_negative() && !quantity.is_zero() {
            return Err(Rejection::new(NegativeQuantity, format!("usage quantity {quantity} is below 0")));
        }

        let timestamp_ms = parse_timestamp(timestamp)?;
        if input {
            if timestamp_ms > now_ms.saturating_add(self.limits.max_future_skew_ms) {
                return Err(Rejection::new(
                    TimestampInFuture,
                    format!(
                        "{} ms ahead of now, skew limit {} ms",
                        timestamp_ms - now_ms,
                        self.limits.max_future_skew_ms
                    ),
                ));
            }
            if timestamp_ms < now_ms.saturating_sub(self.limits.max_event_age_ms) {
                return Err(Rejection::new(
                    TimestampTooOld,
                    format!(
                        "{} ms old, age limit {} ms",
                        now_ms.saturating_sub(timestamp_ms),
                        self.limits.max_event_age_ms
                    ),
                ));
            }
        }

        if kind != EventKind::Usage && original_event_id.is_none() {
            return Err(Rejection::new(
                MissingCorrectionRef,
                format!("a {} needs `correction_ref.original_event_id`", kind.as_str()),
            ));
        }
        if kind == EventKind::Usage && input {
            if let Some((year, month)) = self.closed.find(tenant_id, timestamp_ms) {
                return Err(Rejection::new(
                    ClosedPeriod,
                    format!(
                        "{year}-{month:02} is closed for tenant {tenant_id:?}: if this event was accepted before \
                         the close it is a retry and is billed already; otherwise send a correction"
                    ),
                ));
            }
        }

        let mut dimensions: Vec<(String, String)> = dims
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    WireField::Value(s) => s.as_ref().to_owned(),
                    _ => String::new(),
                };
                (k.as_ref().to_owned(), v)
            })
            .collect();
        // Wire order carries no meaning; the canonical order is by key.
        dimensions.sort_unstable();

        let derived_flag = matches!(w.event_id_derived, WireField::Value(true));
        let (event_id, event_id_derived) = match event_id {
            Some(id) => (id.to_owned(), derived_flag),
            None => (self.deriver.derive(tenant_id, customer_id, meter, resource_id, timestamp_ms), true),
        };
        let event = UsageEvent {
            event_id,
            event_id_derived,
            tenant_id: tenant_id.to_owned(),
            customer_id: customer_id.to_owned(),
            meter: meter.to_owned(),
            quantity,
            timestamp_ms,
            kind,
            correction_ref: original_event_id.map(|o| CorrectionRef {
                original_event_id: o.to_owned(),
                reason: correction_reason.map(str::to_owned),
            }),
            resource_id: resource_id.map(str::to_owned),
            unit: unit.map(str::to_owned),
            source: source.map(str::to_owned),
            dimensions,
        };
        if input {
            self.check_output_size(&event, bytes.len())?;
        }
        Ok(event)
    }

    fn check_sizes(
        &self,
        ids: &[(&str, Option<&str>)],
        texts: &[(&str, Option<&str>)],
        dims: &[(Text<'_>, WireField<Text<'_>>)],
    ) -> Result<(), Rejection> {
        for (name, v) in ids {
            check_len(name, *v, self.limits.max_id_bytes)?;
        }
        for (name, v) in texts {
            check_len(name, *v, self.limits.max_field_bytes)?;
        }
        for (k, v) in dims {
            check_len("dimension key", Some(k), self.limits.max_id_bytes)?;
            // The field's name is only built for the error: a name per
            // dimension per event was an allocation for nothing.
            if let WireField::Value(v) = v {
                check_len_named(|| format!("dimensions.{k}"), Some(v), self.limits.max_field_bytes)?;
            }
        }
        Ok(())
    }

    /// Rejects an event whose canonical output would exceed
    /// `max_output_bytes`. Rendering costs as much as the publish itself, so
    /// it is done only when the cheap bound (every string byte escaped to 3×,
    /// plus what the canonical form adds) says the limit could be reached.
    fn check_output_size(&self, event: &UsageEvent, input_bytes: usize) -> Result<(), Rejection> {
        let bound = input_bytes.saturating_mul(3).saturating_add(CANONICAL_GROWTH_BYTES);
        if bound <= self.limits.max_output_bytes {
            return Ok(());
        }
        let out = super::canonical::to_canonical_json(event).len();
        if out > self.limits.max_output_bytes {
            return Err(Rejection::new(
                RejectReason::RecordTooLarge,
                format!(
                    "its canonical output would be {out} bytes (escaping expands it), limit max_output_bytes {}",
                    self.limits.max_output_bytes
                ),
            ));
        }
        Ok(())
    }
}

/// Wrong JSON types are a malformed record: the bytes are JSON, but not an
/// event. Quantity and timestamp have their own reasons.
fn check_types(w: &WireEvent<'_>) -> Result<(), Rejection> {
    let strings = [
        ("event_id", &w.event_id),
        ("tenant_id", &w.tenant_id),
        ("customer_id", &w.customer_id),
        ("meter", &w.meter),
        ("kind", &w.kind),
        ("resource_id", &w.resource_id),
        ("unit", &w.unit),
        ("source", &w.source),
    ];
    for (name, f) in strings {
        if let WireField::WrongType(t) = f {
            return Err(wrong_type(name, t, "a string"));
        }
    }
    if let WireField::WrongType(t) = &w.quantity {
        return Err(Rejection::new(
            RejectReason::InvalidQuantity,
            format!("`quantity` must be a number or a decimal string, not {t}"),
        ));
    }
    if let WireField::WrongType(t) = &w.timestamp {
        return Err(Rejection::new(
            RejectReason::InvalidTimestamp,
            format!("`timestamp` must be an RFC 3339 string or epoch milliseconds, not {t}"),
        ));
    }
    match &w.correction_ref {
        WireField::WrongType(t) => return Err(wrong_type("correction_ref", t, "an object")),
        WireField::Value(c) => {
            if let WireField::WrongType(t) = &c.original_event_id {
                return Err(wrong_type("correction_ref.original_event_id", t, "a string"));
            }
            if let WireField::WrongType(t) = &c.reason {
                return Err(wrong_type("correction_ref.reason", t, "a string"));
            }
        }
        _ => {}
    }
    match &w.dimensions {
        WireField::WrongType(t) => return Err(wrong_type("dimensions", t, "an object of strings")),
        WireField::Value(d) => {
            for (k, v) in d {
                match v {
                    WireField::WrongType(t) => return Err(wrong_type(&format!("dimensions.{k}"), t, "a string")),
                    WireField::Null => return Err(wrong_type(&format!("dimensions.{k}"), "null", "a string")),
                    _ => {}
                }
            }
        }
        _ => {}
    }
    if let WireField::WrongType(t) = &w.event_id_derived {
        return Err(wrong_type("event_id_derived", t, "a boolean"));
    }
    Ok(())
}

fn wrong_type(name: &str, got: &str, want: &str) -> Rejection {
    Rejection::new(RejectReason::MalformedJson, format!("`{name}` must be {want}, not {got}"))
}

fn required_str<'a>(f: &'a WireField<Text<'_>>, name: &str) -> Result<&'a str, Rejection> {
    match f {
        WireField::Value(s) => Ok(s),
        _ => Err(Rejection::new(RejectReason::MissingField, format!("`{name}` is required"))),
    }
}

fn optional_str<'a>(f: &'a WireField<Text<'_>>) -> Option<&'a str> {
    match f {
        WireField::Value(s) => Some(s),
        _ => None,
    }
}

fn check_len(name: &str, v: Option<&str>, limit: usize) -> Result<(), Rejection> {
    check_len_named(|| name, v, limit)
}

/// [`check_len`] for a field whose name has to be built: only for the error.
fn check_len_named<N: std::fmt::Display>(
    name: impl FnOnce() -> N,
    v: Option<&str>,
    limit: usize,
) -> Result<(), Rejection> {
    match v {
        Some(s) if s.len() > limit => {
            Err(Rejection::new(RejectReason::FieldTooLong, format!("`{}` is {} bytes, limit {limit}", name(), s.len())))
        }
        _ => Ok(()),
    }
}

fn parse_quantity(q: &Scalar) -> Result<Decimal, Rejection> {
    let text: &str = match q {
        Scalar::Str(s) => s,
        Scalar::Number(n) => n,
    };
    parse_decimal(text).map_err(|e| {
        let detail = match e {
            QuantityError::Syntax(_) => format!("`quantity` {e}"),
            QuantityError::OutOfRange(_) => format!("`quantity` {e}"),
        };
        Rejection::new(RejectReason::InvalidQuantity, detail)
    })
}

/// RFC 3339 text or integer epoch milliseconds, to epoch milliseconds.
/// Precision below the millisecond is truncated toward the past: the canonical
/// form (and so the payload hash) holds milliseconds (DESIGN §3).
pub fn parse_timestamp(t: &Scalar<'_>) -> Result<i64, Rejection> {
    let invalid = |why: String| Rejection::new(RejectReason::InvalidTimestamp, why);
    match t {
        Scalar::Number(n) => {
            n.parse::<i64>().map_err(|_| invalid(format!("`timestamp` number {n:?} is not integer epoch milliseconds")))
        }
        Scalar::Str(s) => {
            let dt = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).map_err(|e| {
                invalid(format!("`timestamp` {:?} is not RFC 3339: {e}", s.chars().take(64).collect::<String>()))
            })?;
            let ns = dt.unix_timestamp_nanos();
            i64::try_from(ns.div_euclid(1_000_000)).map_err(|_| invalid(format!("`timestamp` {s:?} is out of range")))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn october(tenant: &str) -> Vec<u8> {
        format!(
            r#"{{"event_id":"e","tenant_id":"{tenant}","customer_id":"c","meter":"m","quantity":1,"timestamp":"2026-10-15T00:00:00Z"}}"#
        )
        .into_bytes()
    }

    /// The router's identity reading judges a record's size as validation
    /// does: a record over `max_record_bytes` with a readable identity is
    /// `record_too_large`, never placed (re-keyed near the broker's limit,
    /// its produce was refused and stopped the router at every start).
    #[test]
    fn a_record_over_the_size_limit_has_no_placement() {
        let limits = Limits { max_record_bytes: 200, ..Limits::default() };
        let v = Validator::sharing(limits, ClosedPeriods::default(), "salt");
        let padded = |len: usize| {
            let mut r = october("acme");
            r.truncate(r.len() - 1);
            let pad = len - r.len() - r#","source":""}"#.len();
            r.extend_from_slice(format!(r#","source":"{}"}}"#, "x".repeat(pad)).as_bytes());
            assert_eq!(r.len(), len);
            r
        };
        assert!(v.placement_of(&padded(200)).is_ok() && v.identity_of(&padded(200)).is_ok());
        for read in [Validator::placement_of, Validator::identity_of, |v: &Validator, b: &[u8]| {
            v.validate(b, 1_793_000_000_000).map(|_| (String::new(), String::new()))
        }] {
            let r = read(&v, &padded(201)).expect_err("over the limit");
            assert_eq!(r.reason, RejectReason::RecordTooLarge, "{r:?}");
        }
    }

    #[test]
    fn a_period_closed_or_reopened_on_a_shared_set_reaches_every_validator_at_once() {
        let shared = ClosedPeriods::default();
        let worker = Validator::sharing(Limits::default(), shared.clone(), "salt");
        let other = Validator::sharing(Limits::default(), shared.clone(), "salt");
        // 2026-10-26T07:33Z: the events of 2026-10-15 are inside the default
        // age limit.
        let now = 1_793_000_000_000;
        let reason = |v: &Validator, tenant: &str| v.validate(&october(tenant), now).err().map(|r| r.reason);
        let closed = Some(RejectReason::ClosedPeriod);
        assert_eq!(reason(&worker, "acme"), None, "nothing closed yet");

        // The same month of another year, and the next month of this year:
        // October 2026 stays open (a lookup that ignored the year or the
        // month would close it).
        shared.replace(["acme:2025-10", "acme:2026-11"].map(|p| ClosedPeriod::parse(p).expect("valid period")));
        assert_eq!(reason(&worker, "acme"), None);

        shared.replace(
            ["zeta:2026-10", "acme:2026-11", "acme:2026-10", "acme:2025-10"]
                .map(|p| ClosedPeriod::parse(p).expect("valid period")),
        );
        for v in [&worker, &other] {
            assert_eq!(reason(v, "acme"), closed);
            assert_eq!(reason(v, "zeta"), closed);
            assert_eq!(reason(v, "other"), None, "another tenant's month is open");
        }
        let listed: Vec<String> =
            shared.list().iter().map(|p| format!("{}:{}-{:02}", p.tenant_id, p.year, p.month)).collect();
        assert_eq!(listed, ["acme:2025-10", "acme:2026-10", "acme:2026-11", "zeta:2026-10"]);

        shared.replace([ClosedPeriod::parse("zeta:2026-10").expect("valid period")]);
        assert_eq!(reason(&other, "acme"), None, "reopened");
        assert_eq!(reason(&other, "zeta"), closed);
        shared.replace([]);
        assert_eq!(reason(&worker, "zeta"), None, "every period reopened");
        assert!(shared.list().is_empty());
    }
}
