//! Event builders for tests and benchmarks (not part of the stable API).

use rust_decimal::Decimal;

use super::StoredEvent;
use crate::classify::SeenKey;
use crate::event::{id_hash, payload_hash, CorrectionRef, EventKind, Position, UsageEvent};

/// A deterministic event `n` on `partition` at output offset `offset`,
/// first seen at `1_700_000_000_000 + n` ms. Fields vary with `n` so every
/// column (optional strings, dimensions, corrections) gets exercised.
pub fn sample_event(n: u64, partition: i32, offset: i64) -> StoredEvent {
    sample_event_at(n, partition, offset, 1_700_000_000_000 + n as i64)
}

/// [`sample_event`] with an explicit `first_seen_ms`.
pub fn sample_event_at(n: u64, partition: i32, offset: i64, first_seen_ms: i64) -> StoredEvent {
    let kind = match n % 7 {
        5 => EventKind::Correction,
        6 => EventKind::Retraction,
        _ => EventKind::Usage,
    };
    let event = UsageEvent {
        event_id: format!("evt_{n:08}"),
        event_id_derived: n % 11 == 3,
        tenant_id: format!("tenant_{}", n % 5),
        customer_id: format!("cus_{}", n % 997),
        meter: ["api_calls", "storage_gb", "egress_bytes"][(n % 3) as usize].to_string(),
        quantity: Decimal::new((n % 100_000) as i64 * if kind == EventKind::Usage { 1 } else { -1 }, (n % 4) as u32),
        timestamp_ms: 1_699_990_000_000 + (n as i64) * 7,
        kind,
        correction_ref: (kind != EventKind::Usage).then(|| CorrectionRef {
            original_event_id: format!("evt_{:08}", n / 2),
            reason: (n % 2 == 0).then(|| "late fix".to_string()),
        }),
        resource_id: (n % 3 != 0).then(|| format!("req-{n}")),
        unit: (n % 4 == 0).then(|| "requests".to_string()),
        source: (n % 5 != 1).then(|| format!("edge-{}", n % 8)),
        dimensions: (0..(n % 4)).map(|i| (format!("k{i}"), format!("v{}", n % (i + 2)))).collect(),
    };
    let key = SeenKey {
        id_hash: id_hash(&event.tenant_id, &event.event_id),
        payload_hash: payload_hash(&event),
        first_seen_ms,
        source: Position::new(partition, offset * 2 + 1),
        output: Position::new(partition, offset),
    };
    StoredEvent { key, event }
}
