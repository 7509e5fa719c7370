#!/bin/bash
# Creates dedupd's four topics (and the router's raw topic, the ledger's rollups and periods topics) on the compose broker, or checks them when they
# exist. Run by the kafka-init service (docker-compose.yml); idempotent.
#
# Input and output must have the same partition count: input partition p
# publishes to output partition p, whose records are p's state changelog
# (DESIGN §6). dedupd refuses to start otherwise; failing here says why
# earlier. Conflicts and rejected get the same count for symmetry only.
set -euo pipefail

bootstrap="${BOOTSTRAP:-kafka:9092}"
partitions="${PARTITIONS:-3}"
output_retention_ms="${OUTPUT_RETENTION_MS:-3456000000}"
input_topic="${INPUT_TOPIC:-usage-events}"
output_topic="${OUTPUT_TOPIC:-usage-events-deduped}"
conflicts_topic="${CONFLICTS_TOPIC:-usage-events-conflicts}"
rejected_topic="${REJECTED_TOPIC:-usage-events-rejected}"
# Where producers write when `dedupd route` places records by identity (the
# `router` profile); any partition count works, it only bounds the router's
# parallelism.
raw_topic="${RAW_TOPIC:-usage-events-raw}"
# The usage ledger's hourly rollups (each key's latest value is its total)
# and the billing periods closed with `dedupd period close`: both compacted.
rollups_topic="${ROLLUPS_TOPIC:-usage-rollups}"
periods_topic="${PERIODS_TOPIC:-usage-periods}"
# Overridable so scripts/check-deploy can run this script against a fake.
topics="${KAFKA_TOPICS_SH:-/opt/kafka/bin/kafka-topics.sh}"

partition_count() {
    "$topics" --bootstrap-server "$bootstrap" --describe --topic "$1" \
        | sed -n 's/.*PartitionCount: *\([0-9][0-9]*\).*/\1/p' | head -n 1
}

create() {
    local topic="$1"
    shift
    "$topics" --bootstrap-server "$bootstrap" --create --if-not-exists \
        --topic "$topic" --partitions "$partitions" --replication-factor 1 "$@"
}

create "$input_topic"
# The output topic is the source of truth for repair: time-based retention
# must outlive the dedupe horizon, and dedupd stamps records with ingest time
# (CreateTime) so back-dated events are not deleted early.
create "$output_topic" --config "retention.ms=${output_retention_ms}" \
    --config cleanup.policy=delete --config message.timestamp.type=CreateTime
create "$conflicts_topic" --config retention.ms=2592000000
create "$rejected_topic" --config retention.ms=2592000000
create "$raw_topic" --config retention.ms=604800000
create "$rollups_topic" --config cleanup.policy=compact
"$topics" --bootstrap-server "$bootstrap" --create --if-not-exists \
    --topic "$periods_topic" --partitions 1 --replication-factor 1 --config cleanup.policy=compact

input_count="$(partition_count "$input_topic")"
output_count="$(partition_count "$output_topic")"
echo "partitions: ${input_topic}=${input_count} ${output_topic}=${output_count}"
if [ "$input_count" != "$output_count" ]; then
    echo "error: ${input_topic} has ${input_count} partitions but ${output_topic} has ${output_count};" \
        "they must match (see docs/runbook.md#adding-partitions)" >&2
    exit 1
fi
if [ "$input_count" != "$partitions" ]; then
    echo "warning: topics already exist with ${input_count} partitions, not PARTITIONS=${partitions};" \
        "kept as they are (see docs/runbook.md#adding-partitions)" >&2
fi
