//! Kafka error codes the model broker answers with.

/// An error a request can end in, named after the Kafka protocol error it
/// mirrors; [`ErrorCode::code`] gives the wire number from Kafka's `Errors`
/// table so a driver can compare with what a real client would have seen.
///
/// `DUPLICATE_SEQUENCE_NUMBER` is deliberately absent: since Kafka 0.11 the
/// partition leader answers a retry of one of a producer's last five batches
/// with the batch's original offsets and no error, which is what the model
/// does (see [`crate::sim::broker::log::Appended::duplicate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, thiserror::Error)]
pub enum ErrorCode {
    #[error("OFFSET_OUT_OF_RANGE: the offset is below the log start or above the end")]
    OffsetOutOfRange,
    #[error("UNKNOWN_TOPIC_OR_PARTITION")]
    UnknownTopicOrPartition,
    #[error("REQUEST_TIMED_OUT: the outcome of the request is unknown")]
    RequestTimedOut,
    #[error("NETWORK_EXCEPTION: the broker could not be reached; the request was not applied")]
    NetworkException,
    #[error("NOT_COORDINATOR: the coordinator is moving; the request was not applied")]
    NotCoordinator,
    #[error("ILLEGAL_GENERATION: the generation is not the group's current one")]
    IllegalGeneration,
    #[error("UNKNOWN_MEMBER_ID: the group does not know this member (it left or its session expired)")]
    UnknownMemberId,
    #[error("INVALID_SESSION_TIMEOUT")]
    InvalidSessionTimeout,
    #[error("REBALANCE_IN_PROGRESS: the member must rejoin the group")]
    RebalanceInProgress,
    #[error("INVALID_REQUEST")]
    InvalidRequest,
    #[error("OUT_OF_ORDER_SEQUENCE_NUMBER: the batch does not follow the producer's last sequence")]
    OutOfOrderSequence,
    #[error("INVALID_PRODUCER_EPOCH: a newer epoch of this producer id has written to the partition")]
    InvalidProducerEpoch,
    #[error("INVALID_TXN_STATE: the request does not fit the transaction's state")]
    InvalidTxnState,
    #[error("INVALID_PRODUCER_ID_MAPPING: the producer id does not belong to the transactional id")]
    InvalidProducerIdMapping,
    #[error("INVALID_TRANSACTION_TIMEOUT: above transaction.max.timeout.ms")]
    InvalidTransactionTimeout,
    #[error("CONCURRENT_TRANSACTIONS: the previous transaction is still completing; retry")]
    ConcurrentTransactions,
    #[error("UNKNOWN_PRODUCER_ID: this broker never handed out the producer id")]
    UnknownProducerId,
    #[error("GROUP_ID_NOT_FOUND")]
    GroupIdNotFound,
    #[error("FENCED_INSTANCE_ID: another member joined with the same group.instance.id")]
    FencedInstanceId,
    #[error("UNSTABLE_OFFSET_COMMIT: a transaction holding offsets for the partition is still open")]
    UnstableOffsetCommit,
    #[error("PRODUCER_FENCED: a newer epoch of this transactional id exists")]
    ProducerFenced,
}

impl ErrorCode {
    /// The number Kafka puts on the wire for this error.
    pub fn code(self) -> i16 {
        match self {
            ErrorCode::OffsetOutOfRange => 1,
            ErrorCode::UnknownTopicOrPartition => 3,
            ErrorCode::RequestTimedOut => 7,
            ErrorCode::NetworkException => 13,
            ErrorCode::NotCoordinator => 16,
            ErrorCode::IllegalGeneration => 22,
            ErrorCode::UnknownMemberId => 25,
            ErrorCode::InvalidSessionTimeout => 26,
            ErrorCode::RebalanceInProgress => 27,
            ErrorCode::InvalidRequest => 42,
            ErrorCode::OutOfOrderSequence => 45,
            ErrorCode::InvalidProducerEpoch => 47,
            ErrorCode::InvalidTxnState => 48,
            ErrorCode::InvalidProducerIdMapping => 49,
            ErrorCode::InvalidTransactionTimeout => 50,
            ErrorCode::ConcurrentTransactions => 51,
            ErrorCode::UnknownProducerId => 59,
            ErrorCode::GroupIdNotFound => 69,
            ErrorCode::FencedInstanceId => 82,
            ErrorCode::UnstableOffsetCommit => 88,
            ErrorCode::ProducerFenced => 90,
        }
    }

    /// Whether a Kafka client retries this error on its own (Kafka's
    /// `RetriableException` subclasses), as opposed to surfacing it.
    pub fn is_retriable(self) -> bool {
        matches!(
            self,
            ErrorCode::RequestTimedOut
                | ErrorCode::NetworkException
                | ErrorCode::NotCoordinator
                | ErrorCode::ConcurrentTransactions
                | ErrorCode::UnstableOffsetCommit
        )
    }
}
