//! Where a record sits in a Kafka topic (or the offline stand-in for one).

/// A (partition, offset) pair. Offline mode uses partition 0 and a running
/// sequence number in place of offsets.
///
/// Positions order by partition, then offset; a checkpoint is the position of
/// the last output record applied to a piece of local state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Position {
    pub partition: i32,
    pub offset: i64,
}

impl Position {
    pub const fn new(partition: i32, offset: i64) -> Position {
        Position { partition, offset }
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.partition, self.offset)
    }
}
