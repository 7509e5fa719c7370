//! Deliberate bugs the simulator must catch (issue #11, "the simulator
//! catches real bugs").
//!
//! Each [`Mutation`] reverses one ordering decision that exact billing rests
//! on. The switches exist only in test builds: in any other build
//! [`Mutations::has`] is a constant `false`, so `dedupd run` cannot be
//! mutated by configuration or by accident.

/// One deliberate bug. The documented set; `src/sim/world` asserts each is
/// caught by the default simulation run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mutation {
    /// Exactly-once: the input offsets are committed by a plain consumer
    /// commit beside the transaction instead of inside it, so they can
    /// survive a transaction that aborts (events lost).
    OffsetsOutsideTransaction,
    /// At-least-once: the input offsets are committed before the publish is
    /// acknowledged (events lost when the publish then fails).
    CommitBeforeAcknowledged,
    /// Local state remembers a batch before it is published: a failed
    /// publish leaves keys for events that never reached the output, and
    /// their retries are dropped as duplicates (events lost).
    ApplyBeforePublish,
    /// A newly assigned partition consumes input without reading its output
    /// back first (retries of events published by the previous owner are
    /// billed twice).
    SkipRepairOnAssign,
    /// Repair ends at the last stable offset it sees first instead of
    /// waiting until transactions open at its start have ended (a previous
    /// owner's transaction that commits later is billed twice).
    RepairEndsAtHighWatermark,
    /// A lost assignment finishes its in-flight batch as a revoke does,
    /// though the partition may already belong to another member (billed
    /// twice).
    RevokeFinishesLostBatch,
    /// A transaction commit that times out is taken as done instead of
    /// being repeated until it resolves: when the commit never reached the
    /// broker, the transaction aborts while local state remembers its
    /// events, and their retries are dropped as duplicates (events lost).
    CommitTimeoutNotResumed,
    /// A new WAL file is created without fsyncing its directory: a power
    /// loss can take the file's entry, and with it every frame fsynced into
    /// the file, although each append was acknowledged as durable (events
    /// lost from local state, or a store that cannot open).
    WalCreatedWithoutDirFsync,
    /// At-least-once with rollups held back: a batch's input offsets are
    /// committed as soon as it is published and applied, while its rollups
    /// still wait in memory. A crash before they go out loses them for good
    /// (nothing replays the batch), and the rollups topic stays short of
    /// the output (billing's totals miss usage).
    CommitWithRollupsHeld,
    /// Exactly-once: a batch's rollups are held back and published in a
    /// later transaction of their own (as at-least-once batches them)
    /// instead of in the transaction of their events. A crash between the
    /// two loses them: the events' transaction committed the input offsets.
    /// (After that publish the input offsets are also committed again by a
    /// plain commit, as at least once; that changes nothing.)
    RollupsAfterTheirTransaction,
}

impl Mutation {
    /// Every mutation, in a fixed order.
    pub const ALL: [Mutation; 10] = [
        Mutation::OffsetsOutsideTransaction,
        Mutation::CommitBeforeAcknowledged,
        Mutation::ApplyBeforePublish,
        Mutation::SkipRepairOnAssign,
        Mutation::RepairEndsAtHighWatermark,
        Mutation::RevokeFinishesLostBatch,
        Mutation::CommitTimeoutNotResumed,
        Mutation::WalCreatedWithoutDirFsync,
        Mutation::CommitWithRollupsHeld,
        Mutation::RollupsAfterTheirTransaction,
    ];

    fn bit(self) -> u16 {
        1 << (self as u16)
    }
}

/// A set of [`Mutation`]s switched on; empty by default and always empty
/// outside test builds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Mutations {
    #[cfg(test)]
    bits: u16,
}

impl Mutations {
    /// No mutation: the worker as shipped.
    pub const NONE: Mutations = Mutations {
        #[cfg(test)]
        bits: 0,
    };

    /// Just `m`.
    #[cfg(test)]
    pub fn only(m: Mutation) -> Mutations {
        Mutations { bits: m.bit() }
    }

    /// Whether `m` is switched on. Always `false` outside test builds.
    #[inline]
    pub fn has(self, m: Mutation) -> bool {
        #[cfg(test)]
        {
            self.bits & m.bit() != 0
        }
        #[cfg(not(test))]
        {
            let _ = m.bit();
            false
        }
    }
}
