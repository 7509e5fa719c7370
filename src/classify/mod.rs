//! Classification: accepted, duplicate, conflict or replayed (DESIGN §5).
//!
//! Pure: no I/O. The long-horizon tier is reached through the
//! [`LongHorizon`] trait, which the RocksDB key store implements.

mod classifier;
mod clock;
mod hot_cache;
mod outcome;
mod seen;

pub use classifier::{
    Candidate, ClassifierSettings, FirstSeen, HorizonError, IdBuildHasher, LongHorizon, NoLongHorizon,
    PartitionClassifier, Tier, Verdict,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use hot_cache::{HotCache, HotEvictions, MAX_KEYS as MAX_HOT_CACHE_KEYS};
pub use outcome::{
    classify_records, classify_validated, validate_records, Classified, InputRecord, OnMisrouted, Outcome, Placement,
    Validated,
};
pub use seen::SeenKey;
