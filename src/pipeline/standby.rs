//! Which output partitions a worker follows as a warm standby
//! (`--standby-replicas N`, issue #13): a pure function of the consumer
//! group's membership, so every member computes the same answer from the
//! same description of the group, and nothing but the group is needed to
//! agree on it.
//!
//! A standby reads another owner's output partition and applies it to its
//! own local state, so that when the group gives it that partition its
//! repair starts from a recent checkpoint instead of the horizon's start.
//! Ownership stays with the group: a standby never publishes.
//!
//! The rule, with the members sorted by member id into a ring:
//! - when the group says who owns partition `p` (Kafka's `DescribeGroups`
//!   carries each member's assignment), `p`'s standbys are the `N` members
//!   after its owner on the ring;
//! - when it does not (a broker that lists members without assignments,
//!   Tansu 0.6; or the moment between two rebalances), `p`'s candidates are
//!   the `N + 1` members from ring position `p mod M`, and each of them that
//!   does not own `p` follows it: `N` standbys when the owner is among them,
//!   `N + 1` when not. One reader too many costs a little broker traffic;
//!   one too few is the slow failover standbys exist to avoid.
//!
//! `N` is capped at the number of other members. For a worker the
//! description does not list, the rule gives nothing; the worker then keeps
//! what it follows until it is listed (`crate::kafka::standby`).

use std::collections::BTreeSet;

/// One member of the consumer group, as the group's description gives it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMember {
    pub id: String,
    /// The input partitions the group assigned it, when the broker says.
    pub owns: Option<Vec<i32>>,
}

/// The input (= output) partitions `me` follows as a standby, given the
/// group's `members`, the topic's `partitions`, `replicas` (`N`) and the
/// partitions `me` owns now (never followed, whatever the description says:
/// it may be older than this member's last rebalance).
pub fn standby_partitions(
    members: &[GroupMember],
    me: &str,
    partitions: u32,
    replicas: u32,
    owned_by_me: &BTreeSet<i32>,
) -> BTreeSet<i32> {
    let mut ring: Vec<&GroupMember> = members.iter().collect();
    ring.sort_by(|a, b| a.id.cmp(&b.id));
    ring.dedup_by(|a, b| a.id == b.id);
    let m = ring.len();
    let Some(my_index) = ring.iter().position(|g| g.id == me) else { return BTreeSet::new() };
    let n = usize::try_from(replicas).unwrap_or(usize::MAX).min(m.saturating_sub(1));
    if n == 0 {
        return BTreeSet::new();
    }
    // Ring distance from `from` forward to me.
    let distance = |from: usize| (my_index + m - from) % m;
    let mut followed = BTreeSet::new();
    for p in 0..i32::try_from(partitions).unwrap_or(i32::MAX) {
        if owned_by_me.contains(&p) {
            continue;
        }
        let owner = ring.iter().position(|g| g.owns.as_ref().is_some_and(|owns| owns.contains(&p)));
        let follow = match owner {
            Some(o) => o != my_index && distance(o) <= n,
            None => {
                let start = usize::try_from(p).unwrap_or(0) % m;
                distance(start) <= n
            }
        };
        if follow {
            followed.insert(p);
        }
    }
    followed
}

/// The partitions of `topic` in a member's assignment as the consumer
/// protocol encodes it in a group description (`ConsumerProtocolAssignment`:
/// version `i16`, then an array of topic name and `i32` partitions; user
/// data after that is ignored). `None` when the bytes are empty (the broker
/// did not say) or malformed.
pub fn assigned_partitions(bytes: &[u8], topic: &str) -> Option<Vec<i32>> {
    let mut r = Reader(bytes);
    if bytes.is_empty() {
        return None;
    }
    let _version = r.i16()?;
    let topics = r.i32()?;
    let mut found = Vec::new();
    for _ in 0..topics.max(0) {
        let len = usize::try_from(r.i16()?).ok()?;
        let name = r.take(len)?;
        let count = r.i32()?;
        for _ in 0..count.max(0) {
            let p = r.i32()?;
            if name == topic.as_bytes() {
                found.push(p);
            }
        }
    }
    Some(found)
}

/// Big-endian reads over a byte slice, `None` past its end.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }

    fn i16(&mut self) -> Option<i16> {
        Some(i16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }

    fn i32(&mut self) -> Option<i32> {
        Some(i32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn member(id: &str, owns: Option<&[i32]>) -> GroupMember {
        GroupMember { id: id.into(), owns: owns.map(<[i32]>::to_vec) }
    }

    proptest! {
        /// With owners known, each partition has exactly min(N, M - 1)
        /// standbys; with its owner's assignment not described (a broker
        /// that lists members only, or a member mid-rebalance whose
        /// assignment is empty), between min(N, M - 1) and N + 1. The owner
        /// is never one of them.
        #[test]
        fn known_owners_get_exactly_n_standbys_and_unknown_ones_at_least_n(
            m in 1usize..7,
            partitions in 1u32..17,
            replicas in 0u32..4,
            seed in any::<u64>(),
            described in any::<u8>(),
        ) {
            let mut owns: Vec<Vec<i32>> = vec![Vec::new(); m];
            for p in 0..partitions {
                let who = usize::try_from((seed.rotate_left(p) ^ u64::from(p)) % m as u64).unwrap();
                owns[who].push(i32::try_from(p).unwrap());
            }
            let members: Vec<GroupMember> = (0..m)
                .map(|i| {
                    let id = format!("m-{:x}", seed.wrapping_mul(i as u64 + 1));
                    GroupMember { id, owns: (described & (1 << i) != 0).then(|| owns[i].clone()) }
                })
                .collect();
            prop_assume!({ let mut ids: Vec<_> = members.iter().map(|g| &g.id).collect(); ids.sort(); ids.dedup(); ids.len() == m });
            for p in 0..i32::try_from(partitions).unwrap() {
                // Each member knows what it owns itself, described or not.
                let f: Vec<String> = (0..m)
                    .filter(|&i| {
                        let mine: BTreeSet<i32> = owns[i].iter().copied().collect();
                        standby_partitions(&members, &members[i].id, partitions, replicas, &mine).contains(&p)
                    })
                    .map(|i| members[i].id.clone())
                    .collect();
                let owner = (0..m).find(|&i| owns[i].contains(&p)).unwrap();
                prop_assert!(!f.contains(&members[owner].id), "the owner follows its own partition {}", p);
                let n = (replicas as usize).min(m - 1);
                if members[owner].owns.is_some() {
                    prop_assert_eq!(f.len(), n, "partition {}: {:?}", p, f);
                } else {
                    prop_assert!(f.len() >= n && f.len() <= replicas as usize + 1, "partition {}: {:?}", p, f);
                }
            }
        }

        /// With no owner known (a broker that lists members only), each
        /// partition has at least min(N, M - 1) followers besides its owner,
        /// at most N + 1, and the answer does not depend on the order the
        /// members were listed in.
        #[test]
        fn unknown_owners_get_at_least_n_standbys_in_any_listing_order(
            m in 1usize..7,
            partitions in 1u32..17,
            replicas in 0u32..4,
            owner_of in proptest::collection::vec(0usize..7, 16),
            rotate in 0usize..7,
        ) {
            let ids: Vec<String> = (0..m).map(|i| format!("member-{i}")).collect();
            let owned = |i: usize| -> BTreeSet<i32> {
                (0..partitions).filter(|&p| owner_of[p as usize] % m == i).map(|p| i32::try_from(p).unwrap()).collect()
            };
            let listed: Vec<GroupMember> = ids.iter().map(|id| member(id, None)).collect();
            let mut shuffled = listed.clone();
            shuffled.rotate_left(rotate % m);
            for p in 0..i32::try_from(partitions).unwrap() {
                let owner = owner_of[p as usize] % m;
                let f: Vec<usize> = (0..m)
                    .filter(|&i| standby_partitions(&listed, &ids[i], partitions, replicas, &owned(i)).contains(&p))
                    .collect();
                prop_assert!(!f.contains(&owner));
                prop_assert!(f.len() >= (replicas as usize).min(m - 1), "partition {}: {:?}", p, f);
                prop_assert!(f.len() <= replicas as usize + 1);
                for (i, id) in ids.iter().enumerate() {
                    prop_assert_eq!(
                        standby_partitions(&listed, id, partitions, replicas, &owned(i)),
                        standby_partitions(&shuffled, id, partitions, replicas, &owned(i))
                    );
                }
            }
        }
    }

    #[test]
    fn a_worker_missing_from_the_description_or_alone_follows_nothing() {
        let members = [member("a", None), member("b", None)];
        assert!(standby_partitions(&members, "c", 4, 1, &BTreeSet::new()).is_empty());
        assert!(standby_partitions(&members[..1], "a", 4, 1, &BTreeSet::new()).is_empty());
        assert!(standby_partitions(&members, "a", 4, 0, &BTreeSet::new()).is_empty());
        // Two members, one replica, owners unknown: each follows every
        // partition it does not own.
        let mine: BTreeSet<i32> = [0, 1].into();
        assert_eq!(standby_partitions(&members, "a", 4, 1, &mine), [2, 3].into());
    }

    #[test]
    fn assignment_bytes_are_read_as_the_consumer_protocol_encodes_them() {
        let mut b = Vec::new();
        b.extend_from_slice(&1i16.to_be_bytes());
        b.extend_from_slice(&2i32.to_be_bytes());
        for (topic, parts) in [("other", &[0i32][..]), ("input", &[3, 1][..])] {
            b.extend_from_slice(&i16::try_from(topic.len()).unwrap().to_be_bytes());
            b.extend_from_slice(topic.as_bytes());
            b.extend_from_slice(&i32::try_from(parts.len()).unwrap().to_be_bytes());
            for p in parts {
                b.extend_from_slice(&p.to_be_bytes());
            }
        }
        b.extend_from_slice(&(-1i32).to_be_bytes()); // null user data
        assert_eq!(assigned_partitions(&b, "input"), Some(vec![3, 1]));
        assert_eq!(assigned_partitions(&b, "absent"), Some(vec![]));
        assert_eq!(assigned_partitions(&[], "input"), None, "no bytes: the broker did not say");
        assert_eq!(assigned_partitions(&b[..b.len() - 9], "input"), None, "truncated");
    }
}
