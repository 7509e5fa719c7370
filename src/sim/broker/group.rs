//! The group coordinator: classic consumer groups (JoinGroup, SyncGroup,
//! Heartbeat, LeaveGroup) with cooperative rebalancing (KIP-429), static
//! membership (KIP-345), committed offsets, and transactional offset
//! commits validated by group metadata (KIP-447).
//!
//! Simplifications, each chosen so a driver can run the protocol without a
//! real client library:
//! - **The assignor runs in the broker.** In Kafka the group leader runs the
//!   `cooperative-sticky` assignor and hands the result to SyncGroup; here
//!   the coordinator computes the same kind of result when a join round
//!   completes (see [`compute_assignment`]). Members report their owned
//!   partitions in JoinGroup, as the cooperative protocol's subscription
//!   user data does.
//! - **JoinGroup does not block.** Kafka parks a JoinGroup until every member
//!   has rejoined; the model answers [`JoinOutcome::Pending`] and the member
//!   calls JoinGroup again (same member id) until it gets
//!   [`JoinOutcome::Joined`]. A parked join keeps the member alive, as in
//!   Kafka.
//! - **No member-id round trip (KIP-394)**: a new member gets its id in the
//!   first JoinGroup answer.
//! - A member's JoinGroup with unchanged metadata in a stable group returns
//!   the current generation (an idempotent retry); any change, including a
//!   smaller owned set after a cooperative revocation, starts a rebalance.
//!   Kafka also rebalances when the leader rejoins; the model has no leader
//!   duty, so it does not.
//! - **A static member's new incarnation** (JoinGroup with its instance id
//!   and no member id) takes the old member's place, and the old member id
//!   is fenced (FENCED_INSTANCE_ID) from then on. Kafka's classic
//!   coordinator then answers with the old assignment and no rebalance when
//!   the group is Stable and the subscription unchanged, and rebalances in
//!   any other state. By default ([`StaticRejoin::RebalanceUnlessSettled`])
//!   the model takes that quiet path only when, besides, no cooperative
//!   hand-over is under way: every subscribed partition is assigned to a
//!   member of the generation and the old incarnation owned nothing outside
//!   its assignment. Otherwise it rebalances. This is a deliberate
//!   divergence: in Kafka, an incarnation killed after it was told to give a
//!   partition up (withheld from everyone for the cooperative second round)
//!   and before it rejoined leaves that partition assigned to no one until
//!   some other rebalance, because its replacement gets the old assignment
//!   quietly and the second round lived only in the killed process (see
//!   "A partition nobody owns" in `docs/runbook.md`). The simulator's
//!   liveness check would report every such schedule as a stall;
//!   [`StaticRejoin::Kafka`] keeps the faithful behaviour for the unit test
//!   that shows the stall.
//!
//! Cooperative invariant: a partition moves only through a generation in
//! which nobody is assigned it. When the target owner differs from the
//! member that reports owning it, the partition is withheld from both; the
//! old owner sees it missing from its assignment, revokes it, and rejoins
//! with a smaller owned set, and the next generation gives it to the new
//! owner.

use std::collections::{BTreeMap, BTreeSet};

use crate::sim::broker::log::TopicPartition;
use crate::sim::error::ErrorCode;

/// Kafka's classic group states, without `Dead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupState {
    Empty,
    PreparingRebalance,
    CompletingRebalance,
    Stable,
}

/// One member of a group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub member_id: String,
    pub instance_id: Option<String>,
    /// Subscription and owned partitions as reported in the last JoinGroup.
    pub topics: BTreeSet<String>,
    pub owned: BTreeSet<TopicPartition>,
    pub session_timeout_ms: i64,
    pub rebalance_timeout_ms: i64,
    /// Last JoinGroup, SyncGroup, Heartbeat or OffsetCommit from it.
    pub last_seen_ms: i64,
    /// Rejoined during the current PreparingRebalance round.
    pub joined: bool,
    /// Part of the group's current generation.
    pub in_generation: bool,
    /// Its assignment in the current generation.
    pub assignment: BTreeSet<TopicPartition>,
    pub synced: bool,
}

/// A committed offset. `record_seq` orders commit records as their position
/// in `__consumer_offsets` would: when a transaction commits, its offsets
/// win only over commits written before its TxnOffsetCommit (Kafka compares
/// the two records' log offsets).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedOffset {
    pub offset: i64,
    pub metadata: String,
    pub record_seq: u64,
}

/// One consumer group and its offsets.
#[derive(Debug, Clone)]
pub struct Group {
    pub group_id: String,
    pub state: GroupState,
    pub generation: i32,
    pub members: BTreeMap<String, Member>,
    /// group.instance.id → current member id.
    pub static_members: BTreeMap<String, String>,
    pub rebalance_deadline_ms: i64,
    pub committed: BTreeMap<TopicPartition, CommittedOffset>,
    /// Offsets of open transactions, by producer id: invisible until the
    /// transaction commits, dropped when it aborts.
    pub pending_txn: BTreeMap<i64, BTreeMap<TopicPartition, CommittedOffset>>,
}

/// A JoinGroup request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JoinGroupRequest {
    pub group_id: String,
    /// Empty for a member joining for the first time.
    pub member_id: String,
    pub group_instance_id: Option<String>,
    pub topics: BTreeSet<String>,
    /// Partitions the member still owns (cooperative protocol).
    pub owned: BTreeSet<TopicPartition>,
    pub session_timeout_ms: i64,
    pub rebalance_timeout_ms: i64,
}

/// The answer to a JoinGroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JoinOutcome {
    /// The round is still waiting for other members: call JoinGroup again
    /// with this member id.
    Pending { member_id: String },
    /// The member is part of `generation`; call SyncGroup for its assignment.
    Joined { member_id: String, generation: i32, leader_id: String, members: Vec<String> },
}

/// Group membership and offsets of one identity asking to commit.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct GroupMetadata {
    pub member_id: String,
    pub group_instance_id: Option<String>,
    /// -1 for a commit outside group management.
    pub generation: i32,
}

impl GroupMetadata {
    /// A commit from a client that does not use group management.
    pub fn simple() -> Self {
        GroupMetadata { member_id: String::new(), group_instance_id: None, generation: -1 }
    }
}

impl Group {
    fn new(group_id: &str) -> Self {
        Group {
            group_id: group_id.to_owned(),
            state: GroupState::Empty,
            generation: 0,
            members: BTreeMap::new(),
            static_members: BTreeMap::new(),
            rebalance_deadline_ms: 0,
            committed: BTreeMap::new(),
            pending_txn: BTreeMap::new(),
        }
    }

    /// Kafka's `validateMember`: a static member is checked by instance id,
    /// so a replaced incarnation learns it was fenced.
    fn validate_member(&self, member_id: &str, instance_id: Option<&str>) -> Result<(), ErrorCode> {
        if let Some(instance) = instance_id {
            return match self.static_members.get(instance) {
                None => Err(ErrorCode::UnknownMemberId),
                Some(current) if current != member_id => Err(ErrorCode::FencedInstanceId),
                Some(_) => Ok(()),
            };
        }
        if self.members.contains_key(member_id) {
            Ok(())
        } else {
            Err(ErrorCode::UnknownMemberId)
        }
    }

    /// Kafka's `ClassicGroup.validateOffsetCommit`.
    fn validate_offset_commit(&self, meta: &GroupMetadata, transactional: bool) -> Result<(), ErrorCode> {
        if meta.generation < 0 && self.state == GroupState::Empty {
            return Ok(());
        }
        if meta.generation >= 0 || !meta.member_id.is_empty() || meta.group_instance_id.is_some() {
            self.validate_member(&meta.member_id, meta.group_instance_id.as_deref())?;
            if meta.generation != self.generation {
                return Err(ErrorCode::IllegalGeneration);
            }
        } else if !transactional && self.state != GroupState::Empty {
            return Err(ErrorCode::UnknownMemberId);
        }
        // A member that has its JoinGroup answer but not yet its assignment
        // must not commit; transactional commits are exempt, as in Kafka.
        if !transactional && self.state == GroupState::CompletingRebalance {
            return Err(ErrorCode::RebalanceInProgress);
        }
        Ok(())
    }

    fn start_rebalance(&mut self, now_ms: i64) {
        self.state = GroupState::PreparingRebalance;
        for member in self.members.values_mut() {
            member.joined = false;
        }
        let timeout = self.members.values().map(|m| m.rebalance_timeout_ms).max().unwrap_or(0);
        self.rebalance_deadline_ms = now_ms.saturating_add(timeout);
    }

    fn try_complete_join(&mut self, partitions: &BTreeMap<String, i32>) {
        if self.state != GroupState::PreparingRebalance {
            return;
        }
        if self.members.is_empty() {
            self.state = GroupState::Empty;
            self.generation += 1;
            return;
        }
        if !self.members.values().all(|m| m.joined) {
            return;
        }
        self.generation += 1;
        let assignment = compute_assignment(&self.members, partitions);
        for (id, member) in self.members.iter_mut() {
            member.in_generation = true;
            member.synced = false;
            member.assignment = assignment.get(id).cloned().unwrap_or_default();
        }
        self.state = GroupState::CompletingRebalance;
    }

    /// A member left or was removed: the others must rebalance.
    fn on_membership_change(&mut self, now_ms: i64, partitions: &BTreeMap<String, i32>) {
        if self.members.is_empty() {
            if self.state != GroupState::Empty {
                self.state = GroupState::Empty;
                self.generation += 1;
            }
            return;
        }
        if self.state != GroupState::PreparingRebalance {
            self.start_rebalance(now_ms);
        }
        self.try_complete_join(partitions);
    }

    fn remove_member(&mut self, member_id: &str) {
        if let Some(member) = self.members.remove(member_id) {
            if let Some(instance) = member.instance_id {
                if self.static_members.get(&instance).is_some_and(|id| id == member_id) {
                    self.static_members.remove(&instance);
                }
            }
        }
    }

    fn joined_answer(&self, member_id: &str) -> JoinOutcome {
        match self.members.get(member_id) {
            Some(m) if m.in_generation && self.state != GroupState::PreparingRebalance => JoinOutcome::Joined {
                member_id: member_id.to_owned(),
                generation: self.generation,
                leader_id: self.members.keys().next().cloned().unwrap_or_default(),
                members: self.members.keys().cloned().collect(),
            },
            _ => JoinOutcome::Pending { member_id: member_id.to_owned() },
        }
    }

    /// No cooperative hand-over is under way: every partition of a
    /// subscribed topic is in the assignment of a member of the generation.
    fn nothing_withheld(&self, partitions: &BTreeMap<String, i32>) -> bool {
        let assigned: BTreeSet<&TopicPartition> =
            self.members.values().filter(|m| m.in_generation).flat_map(|m| m.assignment.iter()).collect();
        let topics: BTreeSet<&String> = self.members.values().flat_map(|m| m.topics.iter()).collect();
        topics.into_iter().all(|t| {
            (0..partitions.get(t).copied().unwrap_or(0)).all(|p| assigned.contains(&TopicPartition::new(t.clone(), p)))
        })
    }

    /// Which member each partition is assigned to in the current
    /// generation, counting only members that completed SyncGroup.
    pub fn synced_owners(&self) -> BTreeMap<TopicPartition, Vec<String>> {
        let mut owners: BTreeMap<TopicPartition, Vec<String>> = BTreeMap::new();
        for member in self.members.values().filter(|m| m.in_generation && m.synced) {
            for tp in &member.assignment {
                owners.entry(tp.clone()).or_default().push(member.member_id.clone());
            }
        }
        owners
    }
}

/// Bounds on the session timeout a member may ask for
/// (`group.min.session.timeout.ms`, `group.max.session.timeout.ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionBounds {
    pub min_ms: i64,
    pub max_ms: i64,
}

/// What the coordinator does when a static member's new incarnation
/// replaces the old one (see the module documentation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StaticRejoin {
    /// Kafka's classic coordinator: the old assignment and no rebalance
    /// whenever the group is Stable and the subscription unchanged, even in
    /// the middle of a cooperative hand-over (which then stalls).
    Kafka,
    /// As Kafka, but only when no partition is withheld and the old
    /// incarnation owned nothing outside its assignment; else a rebalance.
    #[default]
    RebalanceUnlessSettled,
}

/// All groups of the cluster.
#[derive(Debug, Clone, Default)]
pub struct GroupCoordinator {
    groups: BTreeMap<String, Group>,
    next_member: u64,
    next_record_seq: u64,
    pub static_rejoin: StaticRejoin,
}

impl GroupCoordinator {
    pub fn group(&self, group_id: &str) -> Option<&Group> {
        self.groups.get(group_id)
    }

    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.values()
    }

    fn next_seq(&mut self) -> u64 {
        self.next_record_seq += 1;
        self.next_record_seq
    }

    pub fn join(
        &mut self,
        req: JoinGroupRequest,
        now_ms: i64,
        bounds: SessionBounds,
        partitions: &BTreeMap<String, i32>,
    ) -> Result<JoinOutcome, ErrorCode> {
        if req.session_timeout_ms < bounds.min_ms || req.session_timeout_ms > bounds.max_ms {
            return Err(ErrorCode::InvalidSessionTimeout);
        }
        if req.group_id.is_empty() {
            return Err(ErrorCode::InvalidRequest);
        }
        self.next_member += 1;
        let fresh_id = format!("{}-{}", req.group_instance_id.as_deref().unwrap_or("member"), self.next_member);
        let static_rejoin = self.static_rejoin;
        let group = self.groups.entry(req.group_id.clone()).or_insert_with(|| Group::new(&req.group_id));

        let member_id = if req.member_id.is_empty() {
            let replaced =
                req.group_instance_id.as_ref().and_then(|instance| group.static_members.get(instance).cloned());
            match replaced {
                Some(old_id) => {
                    // Read before the old member leaves the map: its
                    // assignment counts.
                    let nothing_withheld = group.nothing_withheld(partitions);
                    // KIP-345: a static member restarting takes its old slot and
                    // assignment; the old incarnation is fenced from now on.
                    let Some(mut member) = group.members.remove(&old_id) else {
                        return Err(ErrorCode::UnknownMemberId);
                    };
                    member.member_id = fresh_id.clone();
                    member.last_seen_ms = now_ms;
                    member.session_timeout_ms = req.session_timeout_ms;
                    member.rebalance_timeout_ms = req.rebalance_timeout_ms;
                    let unchanged = member.topics == req.topics;
                    if let Some(instance) = &req.group_instance_id {
                        group.static_members.insert(instance.clone(), fresh_id.clone());
                    }
                    let settled = match static_rejoin {
                        StaticRejoin::Kafka => true,
                        StaticRejoin::RebalanceUnlessSettled => {
                            nothing_withheld && member.owned.is_subset(&member.assignment)
                        }
                    };
                    if group.state == GroupState::Stable && unchanged && member.in_generation && settled {
                        // The new incarnation learns its (old) assignment by
                        // SyncGroup; no rebalance, as in Kafka, which also
                        // stores the new incarnation's subscription (it owns
                        // nothing yet).
                        member.synced = false;
                        member.owned = req.owned;
                        group.members.insert(fresh_id.clone(), member);
                        return Ok(group.joined_answer(&fresh_id));
                    }
                    // Any other state (Kafka rebalances in CompletingRebalance
                    // too: the leader may be assigning under the old member
                    // id), or a hand-over under way: the new incarnation is
                    // not part of the generation, so the code below starts a
                    // rebalance (or joins the one being prepared).
                    member.in_generation = false;
                    member.synced = false;
                    group.members.insert(fresh_id.clone(), member);
                }
                None => {
                    if let Some(instance) = &req.group_instance_id {
                        group.static_members.insert(instance.clone(), fresh_id.clone());
                    }
                    group.members.insert(
                        fresh_id.clone(),
                        Member {
                            member_id: fresh_id.clone(),
                            instance_id: req.group_instance_id.clone(),
                            topics: BTreeSet::new(),
                            owned: BTreeSet::new(),
                            session_timeout_ms: req.session_timeout_ms,
                            rebalance_timeout_ms: req.rebalance_timeout_ms,
                            last_seen_ms: now_ms,
                            joined: false,
                            in_generation: false,
                            assignment: BTreeSet::new(),
                            synced: false,
                        },
                    );
                }
            }
            fresh_id
        } else {
            group.validate_member(&req.member_id, req.group_instance_id.as_deref())?;
            req.member_id.clone()
        };

        let Some(member) = group.members.get_mut(&member_id) else {
            return Err(ErrorCode::UnknownMemberId);
        };
        member.last_seen_ms = now_ms;
        member.session_timeout_ms = req.session_timeout_ms;
        member.rebalance_timeout_ms = req.rebalance_timeout_ms;
        let unchanged = member.in_generation && member.topics == req.topics && member.owned == req.owned;
        member.topics = req.topics;
        member.owned = req.owned;
        match group.state {
            GroupState::PreparingRebalance => {}
            GroupState::CompletingRebalance | GroupState::Stable if unchanged => {
                return Ok(group.joined_answer(&member_id));
            }
            GroupState::Empty | GroupState::CompletingRebalance | GroupState::Stable => {
                group.start_rebalance(now_ms);
            }
        }
        if let Some(member) = group.members.get_mut(&member_id) {
            member.joined = true;
        }
        group.try_complete_join(partitions);
        Ok(group.joined_answer(&member_id))
    }

    pub fn sync(
        &mut self,
        group_id: &str,
        meta: &GroupMetadata,
        now_ms: i64,
    ) -> Result<BTreeSet<TopicPartition>, ErrorCode> {
        let group = self.groups.get_mut(group_id).ok_or(ErrorCode::UnknownMemberId)?;
        group.validate_member(&meta.member_id, meta.group_instance_id.as_deref())?;
        if meta.generation != group.generation {
            return Err(ErrorCode::IllegalGeneration);
        }
        if group.state == GroupState::PreparingRebalance {
            return Err(ErrorCode::RebalanceInProgress);
        }
        let Some(member) = group.members.get_mut(&meta.member_id) else {
            return Err(ErrorCode::UnknownMemberId);
        };
        member.last_seen_ms = now_ms;
        member.synced = true;
        let assignment = member.assignment.clone();
        if group.members.values().all(|m| m.synced) {
            group.state = GroupState::Stable;
        }
        Ok(assignment)
    }

    pub fn heartbeat(&mut self, group_id: &str, meta: &GroupMetadata, now_ms: i64) -> Result<(), ErrorCode> {
        let group = self.groups.get_mut(group_id).ok_or(ErrorCode::UnknownMemberId)?;
        group.validate_member(&meta.member_id, meta.group_instance_id.as_deref())?;
        if let Some(member) = group.members.get_mut(&meta.member_id) {
            member.last_seen_ms = now_ms;
        }
        if meta.generation != group.generation {
            return Err(ErrorCode::IllegalGeneration);
        }
        if group.state == GroupState::PreparingRebalance {
            return Err(ErrorCode::RebalanceInProgress);
        }
        Ok(())
    }

    pub fn leave(
        &mut self,
        group_id: &str,
        meta: &GroupMetadata,
        now_ms: i64,
        partitions: &BTreeMap<String, i32>,
    ) -> Result<(), ErrorCode> {
        let group = self.groups.get_mut(group_id).ok_or(ErrorCode::UnknownMemberId)?;
        group.validate_member(&meta.member_id, meta.group_instance_id.as_deref())?;
        group.remove_member(&meta.member_id);
        group.on_membership_change(now_ms, partitions);
        Ok(())
    }

    /// Session expiry and the end of join rounds whose rebalance timeout
    /// passed. A removed member's assignment is lost to it: its next request
    /// fails with UNKNOWN_MEMBER_ID (or ILLEGAL_GENERATION once it rejoins).
    pub fn advance(&mut self, now_ms: i64, partitions: &BTreeMap<String, i32>) {
        for group in self.groups.values_mut() {
            let preparing = group.state == GroupState::PreparingRebalance;
            let expired: Vec<String> = group
                .members
                .values()
                .filter(|m| {
                    // A member parked in a join round is alive, as in Kafka
                    // where its JoinGroup request is held by the coordinator.
                    let parked = preparing && m.joined;
                    !parked && now_ms.saturating_sub(m.last_seen_ms) > m.session_timeout_ms
                })
                .map(|m| m.member_id.clone())
                .collect();
            let mut changed = !expired.is_empty();
            for id in &expired {
                group.remove_member(id);
            }
            if group.state == GroupState::PreparingRebalance && now_ms >= group.rebalance_deadline_ms {
                let late: Vec<String> =
                    group.members.values().filter(|m| !m.joined).map(|m| m.member_id.clone()).collect();
                for id in &late {
                    group.remove_member(id);
                }
                changed = true;
            }
            if changed {
                group.on_membership_change(now_ms, partitions);
            }
        }
    }

    fn group_for_commit(&mut self, group_id: &str, meta: &GroupMetadata) -> Result<&mut Group, ErrorCode> {
        if group_id.is_empty() {
            return Err(ErrorCode::InvalidRequest);
        }
        if !self.groups.contains_key(group_id) {
            if meta.generation >= 0 {
                // What OffsetCommit before v9 answers for an unknown group.
                return Err(ErrorCode::IllegalGeneration);
            }
            self.groups.insert(group_id.to_owned(), Group::new(group_id));
        }
        self.groups.get_mut(group_id).ok_or(ErrorCode::InvalidRequest)
    }

    pub fn commit_offsets(
        &mut self,
        group_id: &str,
        meta: &GroupMetadata,
        offsets: &[(TopicPartition, i64)],
        now_ms: i64,
    ) -> Result<(), ErrorCode> {
        let first_seq = self.next_record_seq;
        let group = self.group_for_commit(group_id, meta)?;
        group.validate_offset_commit(meta, false)?;
        if let Some(member) = group.members.get_mut(&meta.member_id) {
            member.last_seen_ms = now_ms;
        }
        let mut seq = first_seq;
        for (tp, offset) in offsets {
            seq += 1;
            group
                .committed
                .insert(tp.clone(), CommittedOffset { offset: *offset, metadata: String::new(), record_seq: seq });
        }
        self.next_record_seq = seq;
        Ok(())
    }

    /// TxnOffsetCommit: the offsets wait in the group until the
    /// transaction's marker reaches `__consumer_offsets`.
    pub fn txn_commit_offsets(
        &mut self,
        group_id: &str,
        producer_id: i64,
        meta: &GroupMetadata,
        offsets: &[(TopicPartition, i64)],
    ) -> Result<(), ErrorCode> {
        let first_seq = self.next_record_seq;
        let group = self.group_for_commit(group_id, meta)?;
        group.validate_offset_commit(meta, true)?;
        let pending = group.pending_txn.entry(producer_id).or_default();
        let mut seq = first_seq;
        for (tp, offset) in offsets {
            seq += 1;
            pending.insert(tp.clone(), CommittedOffset { offset: *offset, metadata: String::new(), record_seq: seq });
        }
        self.next_record_seq = seq;
        Ok(())
    }

    /// Applies a transaction marker to a group's pending offsets.
    pub fn complete_txn(&mut self, group_id: &str, producer_id: i64, commit: bool) {
        // Consume a sequence number so later plain commits order after it.
        let _ = self.next_seq();
        let Some(group) = self.groups.get_mut(group_id) else {
            return;
        };
        let Some(pending) = group.pending_txn.remove(&producer_id) else {
            return;
        };
        if !commit {
            return;
        }
        for (tp, offset) in pending {
            let newer = group.committed.get(&tp).is_none_or(|current| current.record_seq < offset.record_seq);
            if newer {
                group.committed.insert(tp, offset);
            }
        }
    }

    /// OffsetFetch. With `require_stable` (KIP-447), a partition that an
    /// open transaction holds offsets for answers UNSTABLE_OFFSET_COMMIT.
    pub fn fetch_offsets(
        &self,
        group_id: &str,
        partitions: &[TopicPartition],
        require_stable: bool,
    ) -> Vec<(TopicPartition, Result<Option<i64>, ErrorCode>)> {
        let group = self.groups.get(group_id);
        partitions
            .iter()
            .map(|tp| {
                let Some(group) = group else {
                    return (tp.clone(), Ok(None));
                };
                if require_stable && group.pending_txn.values().any(|p| p.contains_key(tp)) {
                    return (tp.clone(), Err(ErrorCode::UnstableOffsetCommit));
                }
                (tp.clone(), Ok(group.committed.get(tp).map(|c| c.offset)))
            })
            .collect()
    }
}

/// The broker-side stand-in for the `cooperative-sticky` assignor.
///
/// 1. Every partition of a subscribed topic that exactly one eligible member
///    reports owning stays with it (sticky).
/// 2. Unowned or contested partitions go to the eligible member with the
///    fewest, ties by member id.
/// 3. While a member has two or more partitions more than another member
///    eligible for one of them, one moves (partitions it does not own yet
///    first, to limit revocations).
/// 4. Cooperative step: a partition is withheld from its target when any
///    other member still reports owning it.
pub fn compute_assignment(
    members: &BTreeMap<String, Member>,
    partitions: &BTreeMap<String, i32>,
) -> BTreeMap<String, BTreeSet<TopicPartition>> {
    let topics: BTreeSet<&String> = members.values().flat_map(|m| m.topics.iter()).collect();
    let all: Vec<TopicPartition> = topics
        .into_iter()
        .flat_map(|t| {
            let count = partitions.get(t).copied().unwrap_or(0);
            (0..count).map(move |p| TopicPartition::new(t.clone(), p))
        })
        .collect();
    let mut claimants: BTreeMap<&TopicPartition, Vec<&String>> = BTreeMap::new();
    for member in members.values() {
        for tp in &member.owned {
            claimants.entry(tp).or_default().push(&member.member_id);
        }
    }
    let eligible = |id: &String, tp: &TopicPartition| members.get(id).is_some_and(|m| m.topics.contains(&tp.topic));
    let mut target: BTreeMap<String, BTreeSet<TopicPartition>> =
        members.keys().map(|id| (id.clone(), BTreeSet::new())).collect();
    let mut unassigned = Vec::new();
    for tp in &all {
        match claimants.get(tp).map(Vec::as_slice) {
            Some([only]) if eligible(only, tp) => {
                target.entry((*only).clone()).or_default().insert(tp.clone());
            }
            _ => unassigned.push(tp.clone()),
        }
    }
    for tp in unassigned {
        let pick = target
            .iter()
            .filter(|(id, _)| eligible(id, &tp))
            .min_by_key(|(id, set)| (set.len(), (*id).clone()))
            .map(|(id, _)| id.clone());
        if let Some(id) = pick {
            target.entry(id).or_default().insert(tp);
        }
    }
    // Each move shrinks the spread between two members, so this ends; the
    // bound guards against a mistake turning it into a hang.
    for _ in 0..=all.len().saturating_mul(members.len().max(1)) {
        let mut chosen: Option<(String, String, TopicPartition)> = None;
        let mut order: Vec<(&String, &BTreeSet<TopicPartition>)> = target.iter().collect();
        order.sort_by_key(|(id, set)| (std::cmp::Reverse(set.len()), (*id).clone()));
        'search: for (from, set) in &order {
            let owned_by_from = members.get(*from).map(|m| &m.owned);
            let mut candidates: Vec<&TopicPartition> = set.iter().collect();
            candidates.sort_by_key(|tp| owned_by_from.is_some_and(|o| o.contains(*tp)));
            for tp in candidates {
                let to = target
                    .iter()
                    .filter(|(id, other)| *id != *from && eligible(id, tp) && other.len() + 1 < set.len())
                    .min_by_key(|(id, other)| (other.len(), (*id).clone()))
                    .map(|(id, _)| id.clone());
                if let Some(to) = to {
                    chosen = Some(((*from).clone(), to, tp.clone()));
                    break 'search;
                }
            }
        }
        let Some((from, to, tp)) = chosen else { break };
        if let Some(set) = target.get_mut(&from) {
            set.remove(&tp);
        }
        target.entry(to).or_default().insert(tp);
    }
    for (id, set) in target.iter_mut() {
        set.retain(|tp| claimants.get(tp).is_none_or(|owners| owners.iter().all(|o| *o == id)));
    }
    target
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: SessionBounds = SessionBounds { min_ms: 10, max_ms: 100_000 };

    fn parts() -> BTreeMap<String, i32> {
        BTreeMap::from([("in".to_owned(), 4)])
    }

    fn join_req(member_id: &str, owned: &[i32]) -> JoinGroupRequest {
        JoinGroupRequest {
            group_id: "g".into(),
            member_id: member_id.into(),
            group_instance_id: None,
            topics: BTreeSet::from(["in".to_owned()]),
            owned: owned.iter().map(|p| TopicPartition::new("in", *p)).collect(),
            session_timeout_ms: 1_000,
            rebalance_timeout_ms: 5_000,
        }
    }

    fn joined(outcome: JoinOutcome) -> (String, i32) {
        match outcome {
            JoinOutcome::Joined { member_id, generation, .. } => (member_id, generation),
            JoinOutcome::Pending { member_id } => panic!("{member_id} still pending"),
        }
    }

    fn meta(member_id: &str, generation: i32) -> GroupMetadata {
        GroupMetadata { member_id: member_id.into(), group_instance_id: None, generation }
    }

    fn ids(set: &BTreeSet<TopicPartition>) -> Vec<i32> {
        set.iter().map(|tp| tp.partition).collect()
    }

    #[test]
    fn a_single_member_gets_every_partition() {
        let mut gc = GroupCoordinator::default();
        let (a, generation) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        assert_eq!(generation, 1);
        assert_eq!(ids(&gc.sync("g", &meta(&a, 1), 0).unwrap()), vec![0, 1, 2, 3]);
        assert_eq!(gc.group("g").unwrap().state, GroupState::Stable);
    }

    #[test]
    fn a_second_member_gets_partitions_only_after_the_first_revokes_them() {
        let mut gc = GroupCoordinator::default();
        let (a, _) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        gc.sync("g", &meta(&a, 1), 0).unwrap();
        let JoinOutcome::Pending { member_id: b } = gc.join(join_req("", &[]), 1, BOUNDS, &parts()).unwrap() else {
            panic!("b should wait for a");
        };
        assert_eq!(gc.heartbeat("g", &meta(&a, 1), 2), Err(ErrorCode::RebalanceInProgress));
        // a rejoins still owning everything: generation 2 withholds two.
        let (_, g2) = joined(gc.join(join_req(&a, &[0, 1, 2, 3]), 3, BOUNDS, &parts()).unwrap());
        assert_eq!(g2, 2);
        joined(gc.join(join_req(&b, &[]), 3, BOUNDS, &parts()).unwrap());
        let a_assign = gc.sync("g", &meta(&a, 2), 4).unwrap();
        let b_assign = gc.sync("g", &meta(&b, 2), 4).unwrap();
        assert_eq!(a_assign.len(), 2);
        assert!(b_assign.is_empty(), "b must wait until a revoked");
        // a revokes and rejoins with what it kept: generation 3 hands the rest to b.
        let kept: Vec<i32> = ids(&a_assign);
        assert!(matches!(gc.join(join_req(&a, &kept), 5, BOUNDS, &parts()).unwrap(), JoinOutcome::Pending { .. }));
        joined(gc.join(join_req(&b, &[]), 5, BOUNDS, &parts()).unwrap());
        joined(gc.join(join_req(&a, &kept), 5, BOUNDS, &parts()).unwrap());
        assert_eq!(ids(&gc.sync("g", &meta(&a, 3), 6).unwrap()), kept);
        assert_eq!(gc.sync("g", &meta(&b, 3), 6).unwrap().len(), 2);
    }

    #[test]
    fn a_member_whose_session_expires_loses_its_assignment() {
        let mut gc = GroupCoordinator::default();
        let (a, _) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        gc.sync("g", &meta(&a, 1), 0).unwrap();
        gc.advance(2_000, &parts());
        assert_eq!(gc.heartbeat("g", &meta(&a, 1), 2_001), Err(ErrorCode::UnknownMemberId));
        assert_eq!(
            gc.commit_offsets("g", &meta(&a, 1), &[(TopicPartition::new("in", 0), 5)], 2_001),
            Err(ErrorCode::UnknownMemberId)
        );
        assert_eq!(gc.group("g").unwrap().state, GroupState::Empty);
    }

    #[test]
    fn a_static_member_rejoining_fences_its_old_incarnation() {
        let mut gc = GroupCoordinator::default();
        let mut req = join_req("", &[]);
        req.group_instance_id = Some("worker-1".into());
        let (old, generation) = joined(gc.join(req.clone(), 0, BOUNDS, &parts()).unwrap());
        gc.sync(
            "g",
            &GroupMetadata { member_id: old.clone(), group_instance_id: Some("worker-1".into()), generation },
            0,
        )
        .unwrap();
        let (new, same_generation) = joined(gc.join(req, 10, BOUNDS, &parts()).unwrap());
        assert_ne!(old, new);
        assert_eq!(same_generation, generation, "no rebalance for a static restart");
        let stale = GroupMetadata { member_id: old, group_instance_id: Some("worker-1".into()), generation };
        assert_eq!(gc.heartbeat("g", &stale, 11), Err(ErrorCode::FencedInstanceId));
        let fresh = GroupMetadata { member_id: new, group_instance_id: Some("worker-1".into()), generation };
        assert_eq!(gc.sync("g", &fresh, 11).unwrap().len(), 4);
    }

    /// The cooperative hand-over of generation 2: `a` (static) is told to
    /// give partitions up for `b`; they are withheld from both. Returns the
    /// coordinator, `a`'s join request and `b`'s member id.
    fn static_member_in_the_middle_of_a_hand_over(
        rejoin: StaticRejoin,
    ) -> (GroupCoordinator, JoinGroupRequest, String) {
        let mut gc = GroupCoordinator { static_rejoin: rejoin, ..GroupCoordinator::default() };
        let static_meta = |id: &str, generation| GroupMetadata {
            member_id: id.into(),
            group_instance_id: Some("worker-a".into()),
            generation,
        };
        let mut a_req = join_req("", &[]);
        a_req.group_instance_id = Some("worker-a".into());
        let (a, _) = joined(gc.join(a_req.clone(), 0, BOUNDS, &parts()).unwrap());
        gc.sync("g", &static_meta(&a, 1), 0).unwrap();
        let JoinOutcome::Pending { member_id: b } = gc.join(join_req("", &[]), 1, BOUNDS, &parts()).unwrap() else {
            panic!("b should wait for a");
        };
        let mut a_rejoin = join_req(&a, &[0, 1, 2, 3]);
        a_rejoin.group_instance_id = Some("worker-a".into());
        joined(gc.join(a_rejoin, 2, BOUNDS, &parts()).unwrap());
        joined(gc.join(join_req(&b, &[]), 2, BOUNDS, &parts()).unwrap());
        assert_eq!(gc.sync("g", &static_meta(&a, 2), 3).unwrap().len(), 2);
        assert!(gc.sync("g", &meta(&b, 2), 3).unwrap().is_empty());
        assert_eq!(gc.group("g").unwrap().state, GroupState::Stable);
        (gc, a_req, b)
    }

    #[test]
    fn a_static_member_replaced_mid_hand_over_leaves_partitions_unowned_in_kafka_but_not_in_the_model() {
        // Kafka: `a` is killed before its second round; its new incarnation
        // gets the old assignment quietly and nobody is ever assigned the
        // two withheld partitions (the runbook's "partition nobody owns").
        let (mut gc, a_req, b) = static_member_in_the_middle_of_a_hand_over(StaticRejoin::Kafka);
        let (a2, generation) = joined(gc.join(a_req.clone(), 10, BOUNDS, &parts()).unwrap());
        assert_eq!(generation, 2, "no rebalance");
        let a2_meta = GroupMetadata { member_id: a2, group_instance_id: Some("worker-a".into()), generation };
        assert_eq!(gc.sync("g", &a2_meta, 11).unwrap().len(), 2);
        assert_eq!(gc.heartbeat("g", &meta(&b, 2), 12), Ok(()), "b is never asked to rejoin");
        let owners = gc.group("g").unwrap().synced_owners();
        assert_eq!(owners.len(), 2, "two partitions assigned to no one, for good: {owners:?}");

        // The model's default: the replacement starts a rebalance, and the
        // next generation assigns every partition.
        let (mut gc, a_req, b) = static_member_in_the_middle_of_a_hand_over(StaticRejoin::RebalanceUnlessSettled);
        let JoinOutcome::Pending { member_id: a2 } = gc.join(a_req, 10, BOUNDS, &parts()).unwrap() else {
            panic!("the replacement must rebalance");
        };
        assert_eq!(gc.heartbeat("g", &meta(&b, 2), 11), Err(ErrorCode::RebalanceInProgress));
        let (_, generation) = joined(gc.join(join_req(&b, &[]), 12, BOUNDS, &parts()).unwrap());
        assert_eq!(generation, 3);
        let a2_meta = GroupMetadata { member_id: a2, group_instance_id: Some("worker-a".into()), generation };
        let total = gc.sync("g", &a2_meta, 13).unwrap().len() + gc.sync("g", &meta(&b, 3), 13).unwrap().len();
        assert_eq!(total, 4);
    }

    #[test]
    fn offset_commits_check_the_generation() {
        let mut gc = GroupCoordinator::default();
        let tp = TopicPartition::new("in", 0);
        let (a, _) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        assert_eq!(gc.commit_offsets("g", &meta(&a, 1), &[(tp.clone(), 1)], 0), Err(ErrorCode::RebalanceInProgress));
        gc.sync("g", &meta(&a, 1), 0).unwrap();
        assert_eq!(gc.commit_offsets("g", &meta(&a, 0), &[(tp.clone(), 1)], 0), Err(ErrorCode::IllegalGeneration));
        gc.commit_offsets("g", &meta(&a, 1), &[(tp.clone(), 7)], 0).unwrap();
        assert_eq!(gc.fetch_offsets("g", std::slice::from_ref(&tp), true), vec![(tp, Ok(Some(7)))]);
    }

    #[test]
    fn transactional_offsets_appear_only_on_commit_and_block_stable_fetches_meanwhile() {
        let mut gc = GroupCoordinator::default();
        let tp = TopicPartition::new("in", 0);
        gc.txn_commit_offsets("g", 9, &GroupMetadata::simple(), &[(tp.clone(), 3)]).unwrap();
        assert_eq!(gc.fetch_offsets("g", std::slice::from_ref(&tp), false), vec![(tp.clone(), Ok(None))]);
        assert_eq!(
            gc.fetch_offsets("g", std::slice::from_ref(&tp), true),
            vec![(tp.clone(), Err(ErrorCode::UnstableOffsetCommit))]
        );
        gc.complete_txn("g", 9, false);
        assert_eq!(gc.fetch_offsets("g", std::slice::from_ref(&tp), true), vec![(tp.clone(), Ok(None))]);
        gc.txn_commit_offsets("g", 9, &GroupMetadata::simple(), &[(tp.clone(), 4)]).unwrap();
        gc.complete_txn("g", 9, true);
        assert_eq!(gc.fetch_offsets("g", std::slice::from_ref(&tp), true), vec![(tp, Ok(Some(4)))]);
    }

    #[test]
    fn a_plain_commit_written_after_a_txn_offset_commit_wins_over_it() {
        let mut gc = GroupCoordinator::default();
        let tp = TopicPartition::new("in", 0);
        gc.txn_commit_offsets("g", 9, &GroupMetadata::simple(), &[(tp.clone(), 3)]).unwrap();
        gc.commit_offsets("g", &GroupMetadata::simple(), &[(tp.clone(), 10)], 0).unwrap();
        gc.complete_txn("g", 9, true);
        assert_eq!(gc.fetch_offsets("g", std::slice::from_ref(&tp), false), vec![(tp, Ok(Some(10)))]);
    }

    #[test]
    fn a_member_that_does_not_rejoin_before_the_rebalance_timeout_is_removed() {
        let mut gc = GroupCoordinator::default();
        let (a, _) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        gc.sync("g", &meta(&a, 1), 0).unwrap();
        let JoinOutcome::Pending { member_id: b } = gc.join(join_req("", &[]), 1, BOUNDS, &parts()).unwrap() else {
            panic!("b should wait for a");
        };
        // a keeps heartbeating (REBALANCE_IN_PROGRESS) but never rejoins.
        for t in (100..5_000).step_by(100) {
            let _ = gc.heartbeat("g", &meta(&a, 1), t);
            let _ = gc.join(join_req(&b, &[]), t, BOUNDS, &parts());
            gc.advance(t, &parts());
        }
        gc.advance(5_001, &parts());
        assert_eq!(gc.heartbeat("g", &meta(&a, 1), 5_002), Err(ErrorCode::UnknownMemberId));
        let (_, generation) = joined(gc.join(join_req(&b, &[]), 5_002, BOUNDS, &parts()).unwrap());
        assert_eq!(gc.sync("g", &meta(&b, generation), 5_003).unwrap().len(), 4);
    }

    #[test]
    fn leaving_the_group_starts_a_rebalance_for_the_others() {
        let mut gc = GroupCoordinator::default();
        let (a, _) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        gc.sync("g", &meta(&a, 1), 0).unwrap();
        let b = match gc.join(join_req("", &[]), 1, BOUNDS, &parts()).unwrap() {
            JoinOutcome::Pending { member_id } => member_id,
            JoinOutcome::Joined { .. } => panic!("b should wait for a"),
        };
        joined(gc.join(join_req(&a, &[0, 1, 2, 3]), 2, BOUNDS, &parts()).unwrap());
        joined(gc.join(join_req(&b, &[]), 2, BOUNDS, &parts()).unwrap());
        gc.sync("g", &meta(&a, 2), 3).unwrap();
        gc.sync("g", &meta(&b, 2), 3).unwrap();
        gc.leave("g", &meta(&a, 2), 4, &parts()).unwrap();
        assert_eq!(gc.heartbeat("g", &meta(&b, 2), 5), Err(ErrorCode::RebalanceInProgress));
        let (_, generation) = joined(gc.join(join_req(&b, &[]), 6, BOUNDS, &parts()).unwrap());
        assert_eq!(generation, 3);
        assert_eq!(gc.sync("g", &meta(&b, 3), 7).unwrap().len(), 4);
    }

    #[test]
    fn a_session_timeout_outside_the_bounds_is_rejected() {
        let mut gc = GroupCoordinator::default();
        let mut req = join_req("", &[]);
        req.session_timeout_ms = 1;
        assert_eq!(gc.join(req, 0, BOUNDS, &parts()), Err(ErrorCode::InvalidSessionTimeout));
    }

    #[test]
    fn the_assignor_keeps_owned_partitions_and_balances_the_rest() {
        let member = |id: &str, owned: &[i32]| Member {
            member_id: id.into(),
            instance_id: None,
            topics: BTreeSet::from(["in".to_owned()]),
            owned: owned.iter().map(|p| TopicPartition::new("in", *p)).collect(),
            session_timeout_ms: 1,
            rebalance_timeout_ms: 1,
            last_seen_ms: 0,
            joined: true,
            in_generation: false,
            assignment: BTreeSet::new(),
            synced: false,
        };
        let members = BTreeMap::from([
            ("a".to_owned(), member("a", &[0, 1, 2])),
            ("b".to_owned(), member("b", &[3])),
            ("c".to_owned(), member("c", &[])),
        ]);
        let target = compute_assignment(&members, &BTreeMap::from([("in".to_owned(), 6)]));
        // b keeps 3; a keeps two of its three; 4 and 5 are free. a's third
        // is withheld from c while a still owns it.
        assert!(target["b"].contains(&TopicPartition::new("in", 3)));
        assert_eq!(target["a"].len(), 2);
        let total: usize = target.values().map(BTreeSet::len).sum();
        assert_eq!(total, 5, "one partition withheld for the cooperative revoke");
    }

    #[test]
    fn a_txn_offset_commit_with_a_stale_generation_is_rejected() {
        let mut gc = GroupCoordinator::default();
        let tp = TopicPartition::new("in", 0);
        let (a, _) = joined(gc.join(join_req("", &[]), 0, BOUNDS, &parts()).unwrap());
        gc.sync("g", &meta(&a, 1), 0).unwrap();
        assert_eq!(gc.txn_commit_offsets("g", 9, &meta(&a, 0), &[(tp, 3)]), Err(ErrorCode::IllegalGeneration));
    }
}
