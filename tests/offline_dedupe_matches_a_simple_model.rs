//! Property test: `dedupd dedupe` (the library entry point, in memory)
//! against a trivial model, a map from (tenant, event_id) to the first
//! payload. Deliveries are retried with other spellings, mutated, shared
//! across tenants and mixed with invalid lines. A second run, in memory or
//! with a state directory of its own (where batches are validated a batch
//! ahead on another thread), must give the same counts and output bytes.

use std::collections::HashMap;

use proptest::prelude::*;

use dedupd::classify::ManualClock;
use dedupd::config::EngineSettings;
use dedupd::offline::{run_dedupe, DedupeOptions, Stdio, Summary};

/// 2026-11-21T12:00:00Z
const NOW_MS: i64 = 1_795_262_400_000;

#[derive(Clone, Debug)]
struct Base {
    tenant: usize,
    id: usize,
    customer: usize,
    quantity_milli: u32,
    ts_offset_s: u32,
}

#[derive(Clone, Debug)]
enum Delivery {
    /// A delivery of base event `i`, spelled by `spelling`, with its
    /// quantity bumped by `mutation` (0 = unchanged).
    Event {
        i: usize,
        spelling: u8,
        mutation: u8,
    },
    Invalid(u8),
}

const TENANTS: [&str; 3] = ["acme", "globex", "initech"];

fn render(b: &Base, spelling: u8, mutation: u8) -> String {
    let q = b.quantity_milli + u32::from(mutation);
    let int = q / 1000;
    let frac = q % 1000;
    let quantity = match spelling % 4 {
        0 => format!("\"{int}.{frac:03}\""),
        1 => format!("{int}.{frac:03}0"),
        2 => format!("{}e-3", q),
        _ => format!("\"{int}.{frac:03}000\""),
    };
    let ts_ms = NOW_MS - 86_400_000 + i64::from(b.ts_offset_s) * 1000;
    let timestamp = if spelling & 4 == 0 {
        ts_ms.to_string()
    } else {
        let secs = ts_ms / 1000;
        let t = time::OffsetDateTime::from_unix_timestamp(secs).expect("in range");
        format!(
            "\"{:04}-{:02}-{:02}T{:02}:{:02}:{:02}.000Z\"",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        )
    };
    let mut fields = [
        format!("\"tenant_id\":\"{}\"", TENANTS[b.tenant]),
        format!("\"event_id\":\"evt_{}\"", b.id),
        format!("\"customer_id\":\"cus_{}\"", b.customer),
        "\"meter\":\"api_calls\"".to_owned(),
        format!("\"quantity\":{quantity}"),
        format!("\"timestamp\":{timestamp}"),
    ];
    if spelling & 8 != 0 {
        fields.reverse();
    }
    let sep = if spelling & 16 != 0 { " , " } else { "," };
    format!("{{{}}}", fields.join(sep))
}

const INVALID: [&str; 6] = [
    "{not json",
    "",
    r#"{"tenant_id":"acme","event_id":"x","customer_id":"c","meter":"m","quantity":"-1","timestamp":1795262400000}"#,
    r#"{"tenant_id":"acme","customer_id":"c","meter":"m","quantity":"1"}"#,
    r#"{"tenant_id":"acme","event_id":"x","customer_id":"c","meter":"m","quantity":"1","timestamp":1795262400000,"extra":1}"#,
    "\u{1}\u{2}garbage",
];

fn model(bases: &[Base], deliveries: &[Delivery]) -> Summary {
    let mut first: HashMap<(usize, usize), (usize, u32)> = HashMap::new();
    let mut s = Summary::default();
    for d in deliveries {
        match d {
            Delivery::Invalid(_) => s.rejected += 1,
            Delivery::Event { i, mutation, .. } => {
                let b = &bases[*i];
                // The payload, as the model sees it: everything but spelling.
                let payload =
                    (b.customer * 1_000_003 + b.ts_offset_s as usize, b.quantity_milli + u32::from(*mutation));
                match first.get(&(b.tenant, b.id)) {
                    None => {
                        first.insert((b.tenant, b.id), payload);
                        s.accepted += 1;
                    }
                    Some(p) if *p == payload => s.duplicates += 1,
                    Some(_) => s.conflicts += 1,
                }
            }
        }
    }
    s
}

fn base_strategy() -> impl Strategy<Value = Base> {
    (0..3usize, 0..12usize, 0..3usize, 0..5000u32, 0..3600u32).prop_map(
        |(tenant, id, customer, quantity_milli, ts_offset_s)| Base {
            tenant,
            id,
            customer,
            quantity_milli,
            ts_offset_s,
        },
    )
}

/// One `dedupd dedupe` of `input`; `with_state` gives it a state directory
/// of its own (batches are then validated a batch ahead on another thread).
fn run(input: &str, batch_records: usize, with_state: bool) -> (Summary, Vec<u8>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let in_path = dir.path().join("in.ndjson");
    let out_path = dir.path().join("out.ndjson");
    std::fs::write(&in_path, input).expect("write input");
    let opts = DedupeOptions {
        input: Stdio::File(in_path),
        output: Stdio::File(out_path.clone()),
        state_dir: with_state.then(|| dir.path().join("state")),
        rejected: None,
        conflicts: None,
        batch_records,
    };
    let summary = run_dedupe(&opts, &EngineSettings::default(), &ManualClock::new(NOW_MS)).expect("run");
    (summary, std::fs::read(out_path).expect("read output"))
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, .. ProptestConfig::default() })]

    #[test]
    fn counts_equal_the_model_and_reruns_are_byte_identical(
        bases in prop::collection::vec(base_strategy(), 1..30),
        picks in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), prop::option::weighted(0.15, 1..3u8), prop::option::weighted(0.08, 0..6u8)), 1..120),
        batch_records in 1..40usize,
        with_state in any::<bool>(),
    ) {
        let deliveries: Vec<Delivery> = picks
            .iter()
            .map(|(idx, spelling, mutation, invalid)| match invalid {
                Some(k) => Delivery::Invalid(*k),
                None => Delivery::Event { i: idx.index(bases.len()), spelling: *spelling, mutation: mutation.unwrap_or(0) },
            })
            .collect();
        let input: String = deliveries
            .iter()
            .map(|d| match d {
                Delivery::Invalid(k) => INVALID[*k as usize].to_owned(),
                Delivery::Event { i, spelling, mutation } => render(&bases[*i], *spelling, *mutation),
            })
            .collect::<Vec<_>>()
            .join("\n")
            + "\n";
        let (summary, output) = run(&input, batch_records, false);
        prop_assert_eq!(summary, model(&bases, &deliveries));
        prop_assert_eq!(output.iter().filter(|&&b| b == b'\n').count() as u64, summary.accepted);
        let (again, output_again) = run(&input, batch_records, with_state);
        prop_assert_eq!(again, summary);
        prop_assert_eq!(output_again, output);
    }
}
