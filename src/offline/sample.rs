//! Sample traffic for demos and benchmarks: usage events from several
//! tenants with the faults real producers make: retries (respelled, seconds to
//! minutes later), a retry storm, conflicting re-sends, and records that break
//! the schema or the policy.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// What the generator put in, so a demo can show the expected buckets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampleCounts {
    pub distinct_events: u64,
    pub retries: u64,
    pub conflicts: u64,
    pub invalid: u64,
}

/// One generated record: its bytes (JSON, or garbage) and whether it is a
/// retry, a conflict or invalid, for checking.
#[derive(Clone, Debug)]
pub struct SampleRecord {
    pub bytes: Vec<u8>,
    /// Stable key for Kafka: tenant and event id, so retries share a partition.
    pub key: Option<String>,
}

const TENANTS: [&str; 4] = ["acme", "globex", "initech", "umbrella"];
const METERS: [&str; 3] = ["api_calls", "storage_gb_hours", "egress_bytes"];

fn event_json(
    tenant: &str,
    id: u64,
    customer: u64,
    meter: &str,
    quantity_milli: u64,
    ts_ms: i64,
    spelling: u32,
) -> String {
    let q = if spelling % 2 == 0 {
        format!("\"{}.{:03}\"", quantity_milli / 1000, quantity_milli % 1000)
    } else {
        format!("{}e-3", quantity_milli)
    };
    let fields = [
        format!("\"event_id\":\"evt_{id:08}\""),
        format!("\"tenant_id\":\"{tenant}\""),
        format!("\"customer_id\":\"cus_{customer}\""),
        format!("\"meter\":\"{meter}\""),
        format!("\"quantity\":{q}"),
        format!("\"timestamp\":{ts_ms}"),
        "\"dimensions\":{\"region\":\"eu\",\"tier\":\"pro\"}".to_owned(),
    ];
    if spelling % 3 == 0 {
        let mut r = fields.to_vec();
        r.reverse();
        format!("{{{}}}", r.join(","))
    } else {
        format!("{{{}}}", fields.join(", "))
    }
}

/// Generates `n` distinct events plus faults, deterministic for a seed.
/// `now_ms` anchors event times inside the validity window.
pub fn generate(n: u64, seed: u64, now_ms: i64) -> (Vec<SampleRecord>, SampleCounts) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut out: Vec<SampleRecord> = Vec::with_capacity((n + n / 5) as usize);
    let mut counts = SampleCounts::default();
    // Retries are delayed by a random number of later records, standing in for
    // "seconds to minutes apart".
    let mut delayed: Vec<(usize, SampleRecord)> = Vec::new();
    let storm_at = n / 2;
    for id in 0..n {
        let tenant = TENANTS[rng.random_range(0..TENANTS.len())];
        let customer = rng.random_range(1..200u64);
        let meter = METERS[rng.random_range(0..METERS.len())];
        let q = rng.random_range(0..100_000u64);
        let ts = now_ms - rng.random_range(0..6 * 3_600_000i64);
        let key = Some(format!("{tenant}/evt_{id:08}"));
        let rec =
            SampleRecord { bytes: event_json(tenant, id, customer, meter, q, ts, 0).into_bytes(), key: key.clone() };
        out.push(rec);
        counts.distinct_events += 1;
        let roll = rng.random_range(0..1000u32);
        if roll < 100 {
            // A retry, respelled, later.
            let spelling = rng.random_range(1..6u32);
            let r = SampleRecord {
                bytes: event_json(tenant, id, customer, meter, q, ts, spelling).into_bytes(),
                key: key.clone(),
            };
            delayed.push((out.len() + rng.random_range(1..500usize), r));
            counts.retries += 1;
        } else if roll < 110 {
            // A conflicting re-send: same id, another quantity.
            let r = SampleRecord {
                bytes: event_json(tenant, id, customer, meter, q + 1, ts, 0).into_bytes(),
                key: key.clone(),
            };
            delayed.push((out.len() + rng.random_range(1..500usize), r));
            counts.conflicts += 1;
        }
        if id == storm_at {
            // A retry storm: one client re-sends its last event 200 times.
            for k in 0..200u32 {
                out.push(SampleRecord {
                    bytes: event_json(tenant, id, customer, meter, q, ts, k).into_bytes(),
                    key: key.clone(),
                });
                counts.retries += 1;
            }
        }
        if rng.random_range(0..1000u32) < 20 {
            out.push(invalid_record(&mut rng, now_ms));
            counts.invalid += 1;
        }
        delayed.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
        while delayed.last().is_some_and(|(at, _)| *at <= out.len()) {
            if let Some((_, r)) = delayed.pop() {
                out.push(r);
            }
        }
    }
    while let Some((_, r)) = delayed.pop() {
        out.push(r);
    }
    (out, counts)
}

fn invalid_record(rng: &mut StdRng, now_ms: i64) -> SampleRecord {
    let bytes: Vec<u8> = match rng.random_range(0..8u32) {
        0 => b"{\"tenant_id\":\"acme\",\"customer_id\":".to_vec(),
        1 => vec![0xff, 0xfe, 0x00, 0x41],
        2 => br#"{"tenant_id":"acme","customer_id":"c","meter":"m","quantity":"-5","timestamp":TS}"#.to_vec(),
        3 => br#"{"tenant_id":"acme","customer_id":"c","meter":"m","quantity":"5","timestamp":TS,"price":"9.99"}"#
            .to_vec(),
        4 => br#"{"tenant_id":"acme","customer_id":"c","meter":"m","quantity":"lots","timestamp":TS}"#.to_vec(),
        5 => br#"{"tenant_id":"acme","customer_id":"c","meter":"m","quantity":"1","timestamp":FUTURE}"#.to_vec(),
        6 => {
            br#"{"tenant_id":"acme","customer_id":"c","meter":"m","quantity":"1","timestamp":"last tuesday"}"#.to_vec()
        }
        _ => br#"{"tenant_id":"acme","meter":"m","quantity":"1","timestamp":TS}"#.to_vec(),
    };
    let text = String::from_utf8_lossy(&bytes)
        .replace("FUTURE", &(now_ms + 86_400_000).to_string())
        .replace("TS", &now_ms.to_string());
    let bytes = if bytes.first() == Some(&0xff) { bytes } else { text.into_bytes() };
    SampleRecord { bytes, key: None }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_deterministic_and_counts_what_it_made() {
        let (a, ca) = generate(2000, 7, 1_795_262_400_000);
        let (b, cb) = generate(2000, 7, 1_795_262_400_000);
        assert_eq!(ca, cb);
        assert_eq!(a.len(), b.len());
        assert!(a.iter().zip(&b).all(|(x, y)| x.bytes == y.bytes));
        assert_eq!(a.len() as u64, ca.distinct_events + ca.retries + ca.conflicts + ca.invalid);
        assert!(ca.retries > 200 && ca.conflicts > 0 && ca.invalid > 0, "{ca:?}");
    }
}
