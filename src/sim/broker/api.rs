//! The broker's requests and responses as values, so a network model can
//! hold them in flight, drop them, or deliver them late.

use std::collections::BTreeSet;

use crate::sim::broker::group::{GroupMetadata, JoinGroupRequest, JoinOutcome};
use crate::sim::broker::log::{Appended, FetchResult, Isolation, TopicPartition};
use crate::sim::broker::{Broker, OffsetSpec, ProduceBatch, ProducerIdAndEpoch};
use crate::sim::error::ErrorCode;

/// One Kafka request, named after its API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    InitProducerId {
        transactional_id: Option<String>,
        transaction_timeout_ms: i64,
    },
    Produce {
        partition: TopicPartition,
        batch: ProduceBatch,
    },
    Fetch {
        partition: TopicPartition,
        offset: i64,
        max_records: usize,
        isolation: Isolation,
    },
    ListOffsets {
        partition: TopicPartition,
        spec: OffsetSpec,
        isolation: Isolation,
    },
    DeleteRecords {
        partition: TopicPartition,
        before: i64,
    },
    AddPartitionsToTxn {
        transactional_id: String,
        producer: ProducerIdAndEpoch,
        partitions: Vec<TopicPartition>,
    },
    AddOffsetsToTxn {
        transactional_id: String,
        producer: ProducerIdAndEpoch,
        group_id: String,
    },
    TxnOffsetCommit {
        transactional_id: String,
        producer: ProducerIdAndEpoch,
        group_id: String,
        member: GroupMetadata,
        offsets: Vec<(TopicPartition, i64)>,
    },
    EndTxn {
        transactional_id: String,
        producer: ProducerIdAndEpoch,
        commit: bool,
    },
    JoinGroup(JoinGroupRequest),
    SyncGroup {
        group_id: String,
        member: GroupMetadata,
    },
    Heartbeat {
        group_id: String,
        member: GroupMetadata,
    },
    LeaveGroup {
        group_id: String,
        member: GroupMetadata,
    },
    OffsetCommit {
        group_id: String,
        member: GroupMetadata,
        offsets: Vec<(TopicPartition, i64)>,
    },
    OffsetFetch {
        group_id: String,
        partitions: Vec<TopicPartition>,
        require_stable: bool,
    },
}

impl Request {
    /// Whether a transaction or group coordinator answers this request (the
    /// ones a coordinator move turns into NOT_COORDINATOR).
    pub fn is_coordinator_request(&self) -> bool {
        !matches!(
            self,
            Request::Produce { .. }
                | Request::Fetch { .. }
                | Request::ListOffsets { .. }
                | Request::DeleteRecords { .. }
        )
    }
}

/// The answer to a [`Request`], variant for variant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    InitProducerId(Result<ProducerIdAndEpoch, ErrorCode>),
    Produce(Result<Appended, ErrorCode>),
    Fetch(Result<FetchResult, ErrorCode>),
    ListOffsets(Result<Option<i64>, ErrorCode>),
    DeleteRecords(Result<i64, ErrorCode>),
    AddPartitionsToTxn(Result<(), ErrorCode>),
    AddOffsetsToTxn(Result<(), ErrorCode>),
    TxnOffsetCommit(Result<(), ErrorCode>),
    EndTxn(Result<(), ErrorCode>),
    JoinGroup(Result<JoinOutcome, ErrorCode>),
    SyncGroup(Result<BTreeSet<TopicPartition>, ErrorCode>),
    Heartbeat(Result<(), ErrorCode>),
    LeaveGroup(Result<(), ErrorCode>),
    OffsetCommit(Result<(), ErrorCode>),
    OffsetFetch(Vec<(TopicPartition, Result<Option<i64>, ErrorCode>)>),
}

impl Response {
    /// The response a request gets when `error` answers it whole (a network
    /// or coordinator failure rather than the broker's judgement).
    pub fn failed(request: &Request, error: ErrorCode) -> Response {
        match request {
            Request::InitProducerId { .. } => Response::InitProducerId(Err(error)),
            Request::Produce { .. } => Response::Produce(Err(error)),
            Request::Fetch { .. } => Response::Fetch(Err(error)),
            Request::ListOffsets { .. } => Response::ListOffsets(Err(error)),
            Request::DeleteRecords { .. } => Response::DeleteRecords(Err(error)),
            Request::AddPartitionsToTxn { .. } => Response::AddPartitionsToTxn(Err(error)),
            Request::AddOffsetsToTxn { .. } => Response::AddOffsetsToTxn(Err(error)),
            Request::TxnOffsetCommit { .. } => Response::TxnOffsetCommit(Err(error)),
            Request::EndTxn { .. } => Response::EndTxn(Err(error)),
            Request::JoinGroup(_) => Response::JoinGroup(Err(error)),
            Request::SyncGroup { .. } => Response::SyncGroup(Err(error)),
            Request::Heartbeat { .. } => Response::Heartbeat(Err(error)),
            Request::LeaveGroup { .. } => Response::LeaveGroup(Err(error)),
            Request::OffsetCommit { .. } => Response::OffsetCommit(Err(error)),
            Request::OffsetFetch { partitions, .. } => {
                Response::OffsetFetch(partitions.iter().map(|tp| (tp.clone(), Err(error))).collect())
            }
        }
    }

    /// The error of a whole-request failure, if any (per-partition errors of
    /// OffsetFetch count when every partition failed alike).
    pub fn error(&self) -> Option<ErrorCode> {
        fn err<T>(r: &Result<T, ErrorCode>) -> Option<ErrorCode> {
            r.as_ref().err().copied()
        }
        match self {
            Response::InitProducerId(r) => err(r),
            Response::Produce(r) => err(r),
            Response::Fetch(r) => err(r),
            Response::ListOffsets(r) => err(r),
            Response::DeleteRecords(r) => err(r),
            Response::AddPartitionsToTxn(r)
            | Response::AddOffsetsToTxn(r)
            | Response::TxnOffsetCommit(r)
            | Response::EndTxn(r)
            | Response::Heartbeat(r)
            | Response::LeaveGroup(r)
            | Response::OffsetCommit(r) => err(r),
            Response::JoinGroup(r) => err(r),
            Response::SyncGroup(r) => err(r),
            Response::OffsetFetch(parts) => {
                let first = parts.first().and_then(|(_, r)| err(r))?;
                parts.iter().all(|(_, r)| err(r) == Some(first)).then_some(first)
            }
        }
    }
}

impl Broker {
    /// Applies one request at `now_ms` and answers it.
    pub fn handle(&mut self, now_ms: i64, request: Request) -> Response {
        match request {
            Request::InitProducerId { transactional_id, transaction_timeout_ms } => Response::InitProducerId(
                self.init_producer_id(now_ms, transactional_id.as_deref(), transaction_timeout_ms),
            ),
            Request::Produce { partition, batch } => Response::Produce(self.produce(now_ms, &partition, batch)),
            Request::Fetch { partition, offset, max_records, isolation } => {
                Response::Fetch(self.fetch(now_ms, &partition, offset, max_records, isolation))
            }
            Request::ListOffsets { partition, spec, isolation } => {
                Response::ListOffsets(self.list_offsets(now_ms, &partition, spec, isolation))
            }
            Request::DeleteRecords { partition, before } => {
                Response::DeleteRecords(self.delete_records(now_ms, &partition, before))
            }
            Request::AddPartitionsToTxn { transactional_id, producer, partitions } => Response::AddPartitionsToTxn(
                self.add_partitions_to_txn(now_ms, &transactional_id, producer, &partitions),
            ),
            Request::AddOffsetsToTxn { transactional_id, producer, group_id } => {
                Response::AddOffsetsToTxn(self.add_offsets_to_txn(now_ms, &transactional_id, producer, &group_id))
            }
            Request::TxnOffsetCommit { transactional_id, producer, group_id, member, offsets } => {
                Response::TxnOffsetCommit(self.txn_offset_commit(
                    now_ms,
                    &transactional_id,
                    producer,
                    &group_id,
                    &member,
                    &offsets,
                ))
            }
            Request::EndTxn { transactional_id, producer, commit } => {
                Response::EndTxn(self.end_txn(now_ms, &transactional_id, producer, commit))
            }
            Request::JoinGroup(req) => Response::JoinGroup(self.join_group(now_ms, req)),
            Request::SyncGroup { group_id, member } => Response::SyncGroup(self.sync_group(now_ms, &group_id, &member)),
            Request::Heartbeat { group_id, member } => Response::Heartbeat(self.heartbeat(now_ms, &group_id, &member)),
            Request::LeaveGroup { group_id, member } => {
                Response::LeaveGroup(self.leave_group(now_ms, &group_id, &member))
            }
            Request::OffsetCommit { group_id, member, offsets } => {
                Response::OffsetCommit(self.offset_commit(now_ms, &group_id, &member, &offsets))
            }
            Request::OffsetFetch { group_id, partitions, require_stable } => {
                Response::OffsetFetch(self.offset_fetch(now_ms, &group_id, &partitions, require_stable))
            }
        }
    }
}
