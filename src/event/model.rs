//! The validated usage event: what every later stage works on.
//!
//! A `UsageEvent` exists only after validation succeeded, so its fields hold
//! the invariants of DESIGN §2/§4: strings are non-empty and within their
//! limits, the quantity is an exact, normalised decimal, the timestamp is epoch
//! milliseconds, dimensions are sorted by key and unique.

use rust_decimal::Decimal;

/// What an event does to a customer's usage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EventKind {
    /// Ordinary usage; its quantity must be >= 0.
    Usage,
    /// Adjusts an earlier event; may be negative; needs `correction_ref`.
    Correction,
    /// Withdraws an earlier event; may be negative; needs `correction_ref`.
    Retraction,
}

impl EventKind {
    /// The wire spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            EventKind::Usage => "usage",
            EventKind::Correction => "correction",
            EventKind::Retraction => "retraction",
        }
    }

    /// Parses the wire spelling.
    pub fn parse(s: &str) -> Option<EventKind> {
        match s {
            "usage" => Some(EventKind::Usage),
            "correction" => Some(EventKind::Correction),
            "retraction" => Some(EventKind::Retraction),
            _ => None,
        }
    }

    /// A stable small number, used by binary encodings (canonical hash, segments).
    pub fn code(self) -> u8 {
        match self {
            EventKind::Usage => 0,
            EventKind::Correction => 1,
            EventKind::Retraction => 2,
        }
    }

    /// Inverse of [`EventKind::code`].
    pub fn from_code(code: u8) -> Option<EventKind> {
        match code {
            0 => Some(EventKind::Usage),
            1 => Some(EventKind::Correction),
            2 => Some(EventKind::Retraction),
            _ => None,
        }
    }
}

/// The event a correction or retraction refers to.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct CorrectionRef {
    pub original_event_id: String,
    pub reason: Option<String>,
}

/// A validated, normalised usage event.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct UsageEvent {
    /// As sent, or derived from the business tuple when absent (DESIGN §3).
    pub event_id: String,
    /// True when dedupd derived `event_id`; visible in the output.
    pub event_id_derived: bool,
    pub tenant_id: String,
    /// The billed entity.
    pub customer_id: String,
    pub meter: String,
    /// Exact decimal, normalised (no trailing zeros, no negative zero).
    pub quantity: Decimal,
    /// Event time, epoch milliseconds UTC.
    pub timestamp_ms: i64,
    pub kind: EventKind,
    pub correction_ref: Option<CorrectionRef>,
    pub resource_id: Option<String>,
    pub unit: Option<String>,
    pub source: Option<String>,
    /// Sorted by key, keys unique.
    pub dimensions: Vec<(String, String)>,
}

impl UsageEvent {
    /// An event with every field empty (no allocation): what an event
    /// moved out of a place leaves behind, and a base for building one.
    pub fn blank() -> UsageEvent {
        UsageEvent {
            event_id: String::new(),
            event_id_derived: false,
            tenant_id: String::new(),
            customer_id: String::new(),
            meter: String::new(),
            quantity: Decimal::ZERO,
            timestamp_ms: 0,
            kind: EventKind::Usage,
            correction_ref: None,
            resource_id: None,
            unit: None,
            source: None,
            dimensions: Vec::new(),
        }
    }

    /// The event id this event is *placed* by: its own, except for a
    /// correction or retraction, which is placed by the event it corrects,
    /// so it lands on the partition whose state knows that event (its own
    /// retries carry the same reference, so they land there too).
    pub fn placement_id(&self) -> &str {
        match (&self.kind, &self.correction_ref) {
            (EventKind::Correction | EventKind::Retraction, Some(r)) => &r.original_event_id,
            _ => &self.event_id,
        }
    }

    /// Names of the payload fields whose values differ between two events
    /// of the same id, in schema order: what a conflict report shows.
    pub fn differing_fields(&self, other: &UsageEvent) -> Vec<&'static str> {
        let mut out = Vec::new();
        let mut check = |name: &'static str, same: bool| {
            if !same {
                out.push(name);
            }
        };
        check("customer_id", self.customer_id == other.customer_id);
        check("meter", self.meter == other.meter);
        check("quantity", self.quantity.normalize() == other.quantity.normalize());
        check("timestamp", self.timestamp_ms == other.timestamp_ms);
        check("kind", self.kind == other.kind);
        check("correction_ref", self.correction_ref == other.correction_ref);
        check("resource_id", self.resource_id == other.resource_id);
        check("unit", self.unit == other.unit);
        check("source", self.source == other.source);
        check("dimensions", self.dimensions == other.dimensions);
        out
    }
}
