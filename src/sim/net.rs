//! A simulated network between clients and the model broker.
//!
//! A driver calls [`Network::send`] with a request and later
//! [`Network::poll`] with the current simulated time; `poll` applies the
//! requests that reached the broker by then, in time order, and returns
//! what reached the clients. Per request, the seeded generator picks:
//!
//! ```text
//! send ──latency──> broker applies ──latency──> client gets the response
//!   │                      │
//!   └ dropped: never       └ response lost: applied, but the client
//!     applied; client        times out all the same
//!     times out
//! ```
//!
//! A client that sees [`Outcome::TimedOut`] cannot tell the two apart,
//! exactly like a Kafka client after `request.timeout.ms`: the request may
//! or may not have been applied (and it may still be applied after the
//! client gave up, when latency exceeds the timeout). [`Delivery::applied`]
//! records the truth for invariant checkers only.
//!
//! Outages are windows of simulated time: while the broker is down requests
//! reaching it are lost; while a coordinator moves, coordinator requests are
//! answered NOT_COORDINATOR without being applied.

use std::collections::BTreeMap;

use crate::sim::broker::api::{Request, Response};
use crate::sim::broker::Broker;
use crate::sim::error::ErrorCode;
use crate::sim::rng::SimRng;

/// Identifies a simulated client (a producer, a consumer, an admin).
pub type ClientId = u32;
/// Identifies one request; unique per [`Network`].
pub type RequestId = u64;

/// Fault and latency settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// One-way latency, drawn uniformly per message.
    pub min_latency_ms: i64,
    pub max_latency_ms: i64,
    /// `request.timeout.ms`: a client gives up on a request after this long.
    pub request_timeout_ms: i64,
    /// Probability, in millionths, that a request is lost on the way in.
    pub drop_request_per_million: u32,
    /// Probability, in millionths, that a response is lost on the way back.
    pub drop_response_per_million: u32,
}

impl Default for NetConfig {
    fn default() -> Self {
        NetConfig {
            min_latency_ms: 1,
            max_latency_ms: 5,
            request_timeout_ms: 30_000,
            drop_request_per_million: 0,
            drop_response_per_million: 0,
        }
    }
}

/// What goes wrong during an [`Outage`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutageKind {
    /// Requests reaching the broker are lost (not applied).
    BrokerDown,
    /// Transaction and group coordinator requests get NOT_COORDINATOR.
    CoordinatorMoving,
}

/// A window `[from_ms, until_ms)` of simulated time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Outage {
    pub from_ms: i64,
    pub until_ms: i64,
    pub kind: OutageKind,
}

/// How a request ended for the client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Answered(Response),
    /// REQUEST_TIMED_OUT: the client does not know whether it was applied.
    TimedOut,
}

/// A request's end, as the client observes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub at_ms: i64,
    pub client: ClientId,
    pub request_id: RequestId,
    pub outcome: Outcome,
    /// Ground truth for checkers: did the broker apply the request (by the
    /// time of this delivery)? A client model must not read it.
    pub applied: bool,
}

#[derive(Debug, Clone)]
enum Event {
    Arrive { request: Request },
    Respond { response: Response },
    Timeout,
}

#[derive(Debug, Clone)]
struct InFlight {
    client: ClientId,
    applied: bool,
    done: bool,
    /// Events of this request still in the queue; at zero, once done, the
    /// request is forgotten.
    scheduled: u32,
}

/// The broker behind a faulty network. See the module documentation.
#[derive(Debug, Clone)]
pub struct Network {
    broker: Broker,
    rng: SimRng,
    config: NetConfig,
    outages: Vec<Outage>,
    /// Events by (time, insertion order): the order is total, so a seed
    /// replays exactly.
    queue: BTreeMap<(i64, u64), (RequestId, Event)>,
    next_seq: u64,
    next_request: RequestId,
    in_flight: BTreeMap<RequestId, InFlight>,
    /// Per client, the latest arrival and response times drawn so far: a
    /// Kafka connection delivers in order (the broker handles one
    /// connection's requests in the order sent), so latency never reorders
    /// one client's requests or responses.
    last_arrival: BTreeMap<ClientId, i64>,
    last_response: BTreeMap<ClientId, i64>,
}

impl Network {
    pub fn new(broker: Broker, config: NetConfig, seed: u64) -> Self {
        Network {
            broker,
            rng: SimRng::new(seed),
            config,
            outages: Vec::new(),
            queue: BTreeMap::new(),
            next_seq: 0,
            next_request: 0,
            in_flight: BTreeMap::new(),
            last_arrival: BTreeMap::new(),
            last_response: BTreeMap::new(),
        }
    }

    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// For setup (topics) and out-of-band observation; requests from
    /// simulated clients should go through [`Network::send`].
    pub fn broker_mut(&mut self) -> &mut Broker {
        &mut self.broker
    }

    pub fn rng_mut(&mut self) -> &mut SimRng {
        &mut self.rng
    }

    pub fn add_outage(&mut self, outage: Outage) {
        self.outages.push(outage);
    }

    fn in_outage(&self, at_ms: i64, kind: OutageKind) -> bool {
        self.outages.iter().any(|o| o.kind == kind && o.from_ms <= at_ms && at_ms < o.until_ms)
    }

    fn schedule(&mut self, at_ms: i64, id: RequestId, event: Event) {
        if let Some(flight) = self.in_flight.get_mut(&id) {
            flight.scheduled += 1;
        }
        self.next_seq += 1;
        self.queue.insert((at_ms, self.next_seq), (id, event));
    }

    fn latency(&mut self) -> i64 {
        self.rng.range_i64(self.config.min_latency_ms, self.config.max_latency_ms)
    }

    /// Sends a request at `now_ms`; its fate is drawn now.
    pub fn send(&mut self, now_ms: i64, client: ClientId, request: Request) -> RequestId {
        self.next_request += 1;
        let id = self.next_request;
        self.in_flight.insert(id, InFlight { client, applied: false, done: false, scheduled: 0 });
        self.schedule(now_ms.saturating_add(self.config.request_timeout_ms), id, Event::Timeout);
        if !self.rng.chance_per_million(self.config.drop_request_per_million) {
            let drawn = now_ms.saturating_add(self.latency());
            let arrive = drawn.max(self.last_arrival.get(&client).copied().unwrap_or(i64::MIN));
            self.last_arrival.insert(client, arrive);
            self.schedule(arrive, id, Event::Arrive { request });
        }
        id
    }

    /// The time of the next scheduled event, for a driver that jumps time.
    pub fn next_event_ms(&self) -> Option<i64> {
        self.queue.keys().next().map(|(at, _)| *at)
    }

    /// Requests still waiting for an outcome.
    pub fn pending_requests(&self) -> usize {
        self.in_flight.values().filter(|f| !f.done).count()
    }

    /// Runs every event due at or before `now_ms` and advances the broker's
    /// clock to `now_ms`; returns the outcomes clients observe, in order.
    pub fn poll(&mut self, now_ms: i64) -> Vec<Delivery> {
        let mut out = Vec::new();
        while let Some(entry) = self.queue.first_entry() {
            let (at_ms, _) = *entry.key();
            if at_ms > now_ms {
                break;
            }
            let (id, event) = entry.remove();
            if let Some(flight) = self.in_flight.get_mut(&id) {
                flight.scheduled = flight.scheduled.saturating_sub(1);
            }
            let outcome = match event {
                Event::Arrive { request } => {
                    self.arrive(at_ms, id, request);
                    None
                }
                Event::Respond { response } => Some(Outcome::Answered(response)),
                Event::Timeout => Some(Outcome::TimedOut),
            };
            // The first of the answer and the timeout is what the client sees.
            if let Some(outcome) = outcome {
                if let Some(flight) = self.in_flight.get_mut(&id).filter(|f| !f.done) {
                    flight.done = true;
                    out.push(Delivery {
                        at_ms,
                        client: flight.client,
                        request_id: id,
                        outcome,
                        applied: flight.applied,
                    });
                }
            }
            // Forget a request once nothing about it can happen any more.
            let settled =
                self.in_flight.get(&id).is_some_and(|f| f.done) && !self.queue.values().any(|(other, _)| *other == id);
            if settled {
                self.in_flight.remove(&id);
            }
        }
        self.broker.advance(now_ms);
        out
    }

    fn arrive(&mut self, at_ms: i64, id: RequestId, request: Request) {
        if self.in_outage(at_ms, OutageKind::BrokerDown) {
            return;
        }
        let response = if request.is_coordinator_request() && self.in_outage(at_ms, OutageKind::CoordinatorMoving) {
            Response::failed(&request, ErrorCode::NotCoordinator)
        } else {
            if let Some(flight) = self.in_flight.get_mut(&id) {
                flight.applied = true;
            }
            self.broker.handle(at_ms, request)
        };
        if self.rng.chance_per_million(self.config.drop_response_per_million) {
            return;
        }
        let drawn = at_ms.saturating_add(self.latency());
        let client = self.in_flight.get(&id).map_or(0, |f| f.client);
        let back = drawn.max(self.last_response.get(&client).copied().unwrap_or(i64::MIN));
        self.last_response.insert(client, back);
        self.schedule(back, id, Event::Respond { response });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::broker::log::{Isolation, Record, TopicPartition};
    use crate::sim::broker::{BrokerConfig, ProduceBatch};

    fn network(config: NetConfig, seed: u64) -> Network {
        let mut broker = Broker::new(BrokerConfig::default());
        broker.create_topic("t", 1).unwrap();
        Network::new(broker, config, seed)
    }

    fn produce() -> Request {
        Request::Produce {
            partition: TopicPartition::new("t", 0),
            batch: ProduceBatch {
                producer_id: -1,
                producer_epoch: -1,
                base_sequence: -1,
                transactional: false,
                records: vec![Record::default()],
            },
        }
    }

    fn run(net: &mut Network, until: i64) -> Vec<Delivery> {
        let mut all = Vec::new();
        let mut now = 0;
        while now <= until {
            all.extend(net.poll(now));
            now += 1;
        }
        all
    }

    #[test]
    fn a_request_is_answered_after_two_latencies() {
        let mut net = network(NetConfig { min_latency_ms: 3, max_latency_ms: 3, ..NetConfig::default() }, 1);
        let id = net.send(0, 7, produce());
        assert!(net.poll(5).is_empty());
        let got = net.poll(6);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].client, got[0].request_id, got[0].at_ms, got[0].applied), (7, id, 6, true));
        assert!(matches!(got[0].outcome, Outcome::Answered(Response::Produce(Ok(_)))));
        assert_eq!(net.pending_requests(), 0);
    }

    #[test]
    fn a_dropped_request_times_out_without_being_applied() {
        let config = NetConfig { drop_request_per_million: 1_000_000, request_timeout_ms: 100, ..NetConfig::default() };
        let mut net = network(config, 1);
        net.send(0, 1, produce());
        let got = run(&mut net, 100);
        assert_eq!(got.len(), 1);
        assert_eq!((got[0].outcome.clone(), got[0].applied, got[0].at_ms), (Outcome::TimedOut, false, 100));
        assert_eq!(net.broker().partition(&TopicPartition::new("t", 0)).unwrap().high_watermark(), 0);
    }

    #[test]
    fn a_lost_response_times_out_although_the_request_was_applied() {
        let config =
            NetConfig { drop_response_per_million: 1_000_000, request_timeout_ms: 100, ..NetConfig::default() };
        let mut net = network(config, 1);
        net.send(0, 1, produce());
        let got = run(&mut net, 100);
        assert_eq!((got[0].outcome.clone(), got[0].applied), (Outcome::TimedOut, true));
        assert_eq!(net.broker().partition(&TopicPartition::new("t", 0)).unwrap().high_watermark(), 1);
    }

    #[test]
    fn a_request_slower_than_the_timeout_may_be_applied_after_the_client_gave_up() {
        let config =
            NetConfig { min_latency_ms: 50, max_latency_ms: 50, request_timeout_ms: 20, ..NetConfig::default() };
        let mut net = network(config, 1);
        net.send(0, 1, produce());
        let got = run(&mut net, 200);
        assert_eq!((got.len(), got[0].outcome.clone(), got[0].applied), (1, Outcome::TimedOut, false));
        assert_eq!(net.broker().partition(&TopicPartition::new("t", 0)).unwrap().high_watermark(), 1);
    }

    #[test]
    fn requests_during_a_broker_outage_are_lost_and_coordinator_moves_answer_not_coordinator() {
        let config = NetConfig { request_timeout_ms: 100, ..NetConfig::default() };
        let mut net = network(config, 1);
        net.add_outage(Outage { from_ms: 0, until_ms: 50, kind: OutageKind::BrokerDown });
        net.add_outage(Outage { from_ms: 200, until_ms: 300, kind: OutageKind::CoordinatorMoving });
        net.send(0, 1, produce());
        net.send(200, 1, Request::InitProducerId { transactional_id: Some("x".into()), transaction_timeout_ms: 1000 });
        net.send(
            200,
            1,
            Request::Fetch {
                partition: TopicPartition::new("t", 0),
                offset: 0,
                max_records: 1,
                isolation: Isolation::ReadUncommitted,
            },
        );
        let got = run(&mut net, 400);
        assert_eq!(got[0].outcome, Outcome::TimedOut);
        assert!(got
            .iter()
            .any(|d| d.outcome == Outcome::Answered(Response::InitProducerId(Err(ErrorCode::NotCoordinator)))));
        assert!(got.iter().any(|d| matches!(d.outcome, Outcome::Answered(Response::Fetch(Ok(_))))));
        assert!(net.broker().transaction("x").is_none());
    }

    #[test]
    fn the_same_seed_replays_the_same_deliveries() {
        let config = NetConfig {
            min_latency_ms: 1,
            max_latency_ms: 40,
            request_timeout_ms: 30,
            drop_request_per_million: 200_000,
            drop_response_per_million: 200_000,
        };
        let trace = |seed| {
            let mut net = network(config.clone(), seed);
            for i in 0..50 {
                net.send(i, 1, produce());
            }
            run(&mut net, 200)
        };
        assert_eq!(trace(9), trace(9));
        assert_ne!(trace(9), trace(10));
    }
}
