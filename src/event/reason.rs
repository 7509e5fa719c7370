//! Why a record was rejected: the reason codes of DESIGN §4.
//!
//! The strings are a contract with operators (metric labels, the rejected
//! topic, alerts): never rename one.

/// The reason a record landed in the rejected bucket.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum RejectReason {
    MalformedJson,
    UnknownField,
    MissingField,
    EmptyField,
    FieldTooLong,
    TooManyDimensions,
    InvalidQuantity,
    NegativeQuantity,
    InvalidTimestamp,
    TimestampInFuture,
    TimestampTooOld,
    MissingCorrectionRef,
    ClosedPeriod,
    RecordTooLarge,
    /// On an input partition other than the one its identity belongs on
    /// (`--on-misrouted reject`): its retries may be classified elsewhere.
    Misrouted,
    /// A correction or retraction of an event dedupd does not know within
    /// its horizon (never accepted, or forgotten): billing it would adjust
    /// usage that was never billed, or was billed under another id.
    UnknownOriginal,
    /// An identifier (`tenant_id`, `event_id`, `customer_id`, `meter`,
    /// `resource_id`, `correction_ref.original_event_id`) holding a NUL
    /// character: the keys of dedupd's records join identifiers with NUL,
    /// so two counters (or adjustments) could share one key and the
    /// compacted topic keep only one of them.
    InvalidIdentifier,
}

impl RejectReason {
    /// Every reason, for metrics pre-registration and documentation tests.
    pub const ALL: [RejectReason; 17] = [
        RejectReason::MalformedJson,
        RejectReason::UnknownField,
        RejectReason::MissingField,
        RejectReason::EmptyField,
        RejectReason::FieldTooLong,
        RejectReason::TooManyDimensions,
        RejectReason::InvalidQuantity,
        RejectReason::NegativeQuantity,
        RejectReason::InvalidTimestamp,
        RejectReason::TimestampInFuture,
        RejectReason::TimestampTooOld,
        RejectReason::MissingCorrectionRef,
        RejectReason::ClosedPeriod,
        RejectReason::RecordTooLarge,
        RejectReason::Misrouted,
        RejectReason::UnknownOriginal,
        RejectReason::InvalidIdentifier,
    ];

    /// The exact reason code.
    pub fn as_str(self) -> &'static str {
        match self {
            RejectReason::MalformedJson => "malformed_json",
            RejectReason::UnknownField => "unknown_field",
            RejectReason::MissingField => "missing_field",
            RejectReason::EmptyField => "empty_field",
            RejectReason::FieldTooLong => "field_too_long",
            RejectReason::TooManyDimensions => "too_many_dimensions",
            RejectReason::InvalidQuantity => "invalid_quantity",
            RejectReason::NegativeQuantity => "negative_quantity",
            RejectReason::InvalidTimestamp => "invalid_timestamp",
            RejectReason::TimestampInFuture => "timestamp_in_future",
            RejectReason::TimestampTooOld => "timestamp_too_old",
            RejectReason::MissingCorrectionRef => "missing_correction_ref",
            RejectReason::ClosedPeriod => "closed_period",
            RejectReason::RecordTooLarge => "record_too_large",
            RejectReason::Misrouted => "misrouted",
            RejectReason::UnknownOriginal => "unknown_original",
            RejectReason::InvalidIdentifier => "invalid_identifier",
        }
    }
}

impl std::fmt::Display for RejectReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A rejected record's reason and a human-readable detail (which field, what
/// limit). The detail is for people; the reason is for machines.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: RejectReason,
    pub detail: String,
}

impl Rejection {
    pub fn new(reason: RejectReason, detail: impl Into<String>) -> Rejection {
        Rejection { reason, detail: detail.into() }
    }
}

impl std::fmt::Display for Rejection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.reason, self.detail)
    }
}
