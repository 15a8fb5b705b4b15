//! The transport over the `pulsar` crate.
//!
//! One `pulsar::Consumer` per partition of a subscription's topic (one for a
//! topic that is not partitioned; see `partition`), so that every message is
//! settled on the partition it came from and every partition can be drained,
//! closed or subscribed again on its own. The crate's acks and nacks only
//! queue a command for the consumer's engine task, so settling is
//! synchronous here. Producers wrap the crate's
//! `Producer` in an async mutex held only while a message is handed over,
//! not while its receipt is awaited, so concurrent sends to one topic
//! pipeline. The crate runs its connection tasks with `tokio::spawn`, which
//! works on a `current_thread` runtime.
//!
//! Messages that a producer sent in one batch share one broker entry, and
//! the crate acknowledges entries, not batch members: acking one member
//! would acknowledge all of them, including members still being handled.
//! The consumer therefore holds the settlements of batch members until the
//! whole batch is settled, then acks the entry if every member succeeded
//! and nacks it (redelivering the whole batch) otherwise; when the batch
//! comes back, its members that succeeded are settled again on arrival
//! instead of being handled again. With the crate's ack timeout on, which
//! tracks every member's id, the entry is acked once per member, each by
//! the id the crate handed out.
//!
//! A message its producer split into chunks is put back together before it
//! is handed out, and all its chunks are settled with it (see `chunks`).
//!
//! On Exclusive and Failover subscriptions a nack rewinds the whole
//! subscription; `rewind` drops the second copies that delivers of messages
//! still being handled, and asks for one more rewind once idle, since the
//! broker can skip an entry in a rewind.

use std::cell::RefCell;
use std::rc::Rc;
use std::task::{Context, Poll};

use pulsar::producer::Message as PulsarOutgoing;
use pulsar::{Pulsar, PulsarBuilder, SubType, TokioExecutor};
use tokio::time::Instant;

use super::chunks::{is_chunk, Assembled, ChunkId, ChunkedMessages};
use super::partition::{
    close_partitions, subscribe_partitions, AddedPartitions, Partition, Subscriber,
};
use super::rewind::RewindCheck;
use super::settlement::{
    entry_of, entry_of_chunk, BatchSettlements, EntryKey, RecentAcks, Redelivery, SettledBefore,
};
use super::sockets::BrokerSockets;
use super::{
    Consumer, ConsumerSpec, OutgoingMessage, Producer, Repairs, Transport, TransportError,
};
use crate::log_limit::LogLimit;
use crate::message::{Message, MessageId, Metadata};
use crate::topic::{is_non_persistent, partition_name};

/// A connection to a Pulsar cluster through the `pulsar` crate.
pub struct PulsarTransport {
    /// Taken on close, so that the connections go once the consumers and
    /// producers holding them are gone.
    client: RefCell<Option<Pulsar<TokioExecutor>>>,
    brokers: Rc<BrokerSockets>,
    max_message_size: usize,
}

/// The largest message the transport's producers send unless told
/// otherwise: the broker's default `maxMessageSize`, 5 MiB. (The broker
/// tells its clients its own setting when they connect, but the `pulsar`
/// crate does not pass it on.)
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = 5 * 1024 * 1024;

impl std::fmt::Debug for PulsarTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarTransport")
            .field("open", &self.client.borrow().is_some())
            .field("max_message_size", &self.max_message_size)
            .finish()
    }
}

impl PulsarTransport {
    /// Connects with a builder the caller has configured (authentication,
    /// TLS, retry options, ...).
    pub async fn from_builder(
        builder: PulsarBuilder<TokioExecutor>,
    ) -> Result<Self, TransportError> {
        Ok(Self::from_client(builder.build().await?))
    }

    /// Wraps a client the caller has already built.
    pub fn from_client(client: Pulsar<TokioExecutor>) -> Self {
        PulsarTransport {
            client: RefCell::new(Some(client)),
            brokers: Rc::default(),
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
        }
    }

    /// The largest message its producers send (replies, retries, dead
    /// letters), counting its payload, properties and keys and 1 KiB for
    /// headers: set it to the broker's `maxMessageSize` where that is not
    /// the default [`DEFAULT_MAX_MESSAGE_SIZE`]. A larger message fails with
    /// [`TransportError::MessageTooLarge`] without being sent, and its
    /// original is nacked, as after any failed publish.
    #[must_use]
    pub fn with_max_message_size(mut self, bytes: usize) -> Self {
        self.max_message_size = bytes;
        self
    }

    /// The underlying client, until the transport is closed.
    pub fn client(&self) -> Option<Pulsar<TokioExecutor>> {
        self.client.borrow().clone()
    }

    fn open_client(&self) -> Result<Pulsar<TokioExecutor>, TransportError> {
        self.client().ok_or(TransportError::Closed)
    }
}

impl Transport for PulsarTransport {
    type Consumer = PulsarConsumer;
    type Producer = PulsarProducer;

    async fn subscribe(&self, spec: &ConsumerSpec) -> Result<PulsarConsumer, TransportError> {
        let topic = spec.topic.as_str();
        let client = self.open_client()?;
        // A partitioned topic gets one consumer per partition, so that each
        // message is settled on the partition it came from and each
        // partition can be drained and closed on its own.
        let partition_count = client.lookup_partitioned_topic_number(topic).await?;
        let names: Vec<String> = match partition_count {
            0 => vec![topic.to_owned()],
            n => (0..n).map(|index| partition_name(topic, index)).collect(),
        };
        let mut spec = spec.clone();
        // The crate makes up a new name at every build: without one made up
        // here, each partition, and each partition subscribed again, would
        // open a subscription of its own and leave the others' messages.
        spec.subscription
            .get_or_insert_with(made_up_subscription_name);
        let subscriber = Rc::new(Subscriber {
            client,
            spec,
            brokers: self.brokers.clone(),
        });
        let partitions = subscribe_partitions(&subscriber, &names).await?;
        self.brokers.look();
        let spec = &subscriber.spec;
        let remembered = remembered_acks(spec.receiver_queue_size, partitions.len());
        let persistent = !is_non_persistent(&spec.topic);
        let rewinding = matches!(
            spec.subscription_type,
            SubType::Exclusive | SubType::Failover
        );
        let rewinds = persistent.then(|| RewindCheck::new(rewinding));
        let acks_each_member = spec.unacked_message_resend_delay.is_some();
        Ok(PulsarConsumer {
            added: (partition_count > 0).then(|| AddedPartitions::new(subscriber)),
            partitions,
            next_partition: 0,
            batches: BatchSettlements::default(),
            chunks: ChunkedMessages::default(),
            recent_acks: RecentAcks::new(remembered),
            rewinds,
            acks_each_member,
            persistent,
            brokers: self.brokers.clone(),
            replays_log: LogLimit::default(),
        })
    }

    async fn create_producer(&self, topic: &str) -> Result<PulsarProducer, TransportError> {
        let client = self.open_client()?;
        // The crate queues at most `outbound_channel_size` (100) sends per
        // connection and by default fails the next one at once; every
        // handler of a burst may publish in the same turn of the thread, so
        // a send waits for room instead of failing (and nacking) its message.
        let options = pulsar::ProducerOptions {
            block_queue_if_full: true,
            ..Default::default()
        };
        let producer = Box::pin(
            client
                .producer()
                .with_topic(topic)
                .with_options(options)
                .build(),
        )
        .await?;
        if let Ok(broker) = client.lookup_topic(topic).await {
            self.brokers
                .add(broker.url.host_str(), broker.url.port())
                .await;
            self.brokers.look();
        }
        Ok(PulsarProducer {
            producer: tokio::sync::Mutex::new(producer),
            topic: topic.into(),
            max_message_size: self.max_message_size,
        })
    }

    async fn close(&self) -> Result<(), TransportError> {
        self.client.borrow_mut().take();
        Ok(())
    }
}

/// A consumer of the Pulsar transport: one `pulsar` crate consumer per
/// partition of a partitioned topic, or one for a topic that is not.
pub struct PulsarConsumer {
    /// Indexed by partition number.
    partitions: Vec<Partition>,
    /// On a partitioned topic (and only there), the partitions added after
    /// it was subscribed.
    added: Option<AddedPartitions>,
    /// Where the next receive starts looking, so that partitions take turns.
    next_partition: usize,
    batches: BatchSettlements,
    chunks: ChunkedMessages,
    recent_acks: RecentAcks,
    /// On a persistent topic, the messages handed out and not settled,
    /// whose second copies are dropped, and on Exclusive and Failover
    /// subscriptions, where a nack rewinds the subscription, when to ask
    /// for a rewind once more (see `rewind`).
    rewinds: Option<RewindCheck>,
    /// With the crate's ack timeout on, a batch is acked member by member
    /// (see `ack_each_member`).
    acks_each_member: bool,
    /// False on a non-persistent topic, where the broker delivers nothing
    /// again and every message of a partition has the id `0:0`: ids name
    /// no entries there, so nothing is held, remembered or dropped by id.
    persistent: bool,
    brokers: Rc<BrokerSockets>,
    /// Replays are logged at most one an interval: a reset cursor can
    /// replay a whole backlog.
    replays_log: LogLimit,
}

/// A message received whole, and the other chunks it was put together
/// from (none unless its producer chunked it).
type WholeMessage = (Message, Vec<ChunkId>);

/// A subscription name for a consumer whose spec names none: random, so
/// that two such consumers never share a subscription.
fn made_up_subscription_name() -> String {
    use std::hash::{BuildHasher, Hasher};
    // Every `RandomState` has keys of its own (random per thread, then
    // counted on), so hashing nothing gives a new number each time.
    let random = std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish();
    format!("pulsar-dispatcher-{random:016x}")
}

/// How many acknowledged entries a consumer remembers, besides twice its
/// receiver queues: enough for the messages in flight and prefetched when a
/// connection fails (see `settlement::RecentAcks`).
const RECENT_ACKS: usize = 2048;

/// How many acknowledged entries a consumer of `partitions` partitions, each
/// prefetching up to `receiver_queue_size` messages, remembers.
fn remembered_acks(receiver_queue_size: u32, partitions: usize) -> usize {
    RECENT_ACKS + 2 * receiver_queue_size as usize * partitions
}

/// How many received messages one receive may pass over without handing
/// one out (chunks held, acked entries delivered again, second copies,
/// batch members settled before) before it lets other tasks run.
const SKIPS_PER_RECEIVE: usize = 256;

impl std::fmt::Debug for PulsarConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let topics: Vec<&str> = self.partitions.iter().map(|p| &*p.topic).collect();
        f.debug_struct("PulsarConsumer")
            .field("topics", &topics)
            .finish()
    }
}

impl PulsarConsumer {
    fn is_partitioned(&self) -> bool {
        self.added.is_some()
    }

    /// The next message of any partition, trying each in turn from where the
    /// last receive stopped.
    fn poll_partitions(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Message, TransportError>>> {
        if let Some(added) = &mut self.added {
            // Until pending, so that the next count's timer holds the waker.
            while let Poll::Ready(new) = added.poll(cx, self.partitions.len()) {
                self.partitions.extend(new);
                // The added partitions prefetch too.
                let receiver_queue_size = added.receiver_queue_size();
                let capacity = remembered_acks(receiver_queue_size, self.partitions.len());
                self.recent_acks.grow_to(capacity);
            }
        }
        for _ in 0..SKIPS_PER_RECEIVE {
            match self.poll_next_partition(cx) {
                // A chunk, held until its message is whole.
                Poll::Ready(Some(Ok(None))) => continue,
                Poll::Ready(Some(Ok(Some((message, chunks))))) => {
                    let id = message.id();
                    if self.was_acked(id) {
                        self.settle_chunks(chunks, true);
                        continue;
                    }
                    if self.settled_before(id) || self.is_being_handled(id) {
                        continue;
                    }
                    self.chunks.hand_out(entry_of(id), chunks);
                    return Poll::Ready(Some(Ok(message)));
                }
                Poll::Ready(Some(Err(error))) => return Poll::Ready(Some(Err(error))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => {
                    self.rewind_again_if_due(cx);
                    return Poll::Pending;
                }
            }
        }
        cx.waker().wake_by_ref();
        Poll::Pending
    }

    /// Whether the message is a second copy of one still being handled,
    /// which a reconnection (any subscription type) or a nack's rewind
    /// delivered again (see `rewind`); otherwise it is handed out from here
    /// on.
    fn is_being_handled(&mut self, id: &MessageId) -> bool {
        let Some(rewinds) = &mut self.rewinds else {
            return false;
        };
        let handed_out = rewinds.received(id);
        if !handed_out {
            tracing::debug!(message_id = %id, "the broker delivered again a message still being handled; dropped");
        }
        !handed_out
    }

    /// Whether the message is a batch member settled before (see
    /// `BatchSettlements::settled_before`): a second copy while its batch
    /// is pending is dropped, as copies of messages being handled are; a
    /// member that succeeded in a nacked earlier delivery is settled as
    /// succeeded again instead of being handled again.
    fn settled_before(&mut self, id: &MessageId) -> bool {
        let Some(settled) = self.batches.settled_before(id) else {
            return false;
        };
        match settled {
            SettledBefore::InThisDelivery => {
                tracing::debug!(message_id = %id, "a second copy of a batch member settled while its batch is pending; dropped");
                if let Some(rewinds) = &mut self.rewinds {
                    rewinds.dropped_in_flight += 1;
                }
            }
            SettledBefore::SucceededInAnEarlierDelivery => {
                self.batches.redelivered_after_success += 1;
                tracing::debug!(message_id = %id, "a nacked batch came back: this member succeeded before and is not handled again");
                if let Err(error) = self.settle(id, true) {
                    tracing::warn!(message_id = %id, %error, "settling a batch member that succeeded before failed");
                }
            }
        }
        true
    }

    /// Asks the partitions that nacked to rewind once more, once the
    /// consumer has been idle long enough after the nack (see `rewind`).
    fn rewind_again_if_due(&mut self, cx: &mut Context<'_>) {
        let Some(Poll::Ready(due)) = self.rewinds.as_mut().map(|rewinds| rewinds.poll_due(cx))
        else {
            return;
        };
        for (index, id) in due {
            let partition = &mut self.partitions[index];
            tracing::debug!(topic = %partition.topic, "idle after a nack: asking the broker to rewind once more");
            if let Err(error) = partition.settle(id, false) {
                tracing::warn!(topic = %partition.topic, %error, "asking for a rewind failed");
            }
        }
    }

    /// Whether the message is one the broker delivered again although it was
    /// acked (the ack was lost with a connection); if so, acks it again.
    fn was_acked(&mut self, id: &MessageId) -> bool {
        if !self.persistent {
            return false;
        }
        let (partitions, brokers) = (&self.partitions, &self.brokers);
        // A plain topic's entries name no partition: all are its one's.
        let outage = |(partition, ..): EntryKey| {
            let index = usize::try_from(partition).unwrap_or(0);
            partitions.get(index).and_then(Partition::outage)
        };
        let (entry, now) = (entry_of(id), Instant::now());
        let resend = match self
            .recent_acks
            .redelivered(entry, now, outage, || brokers.losses())
        {
            Redelivery::NotAcked => return false,
            Redelivery::Replay => {
                if let Some(held_back) = self.replays_log.admit(now) {
                    // What the decision went by, should it be wrong, in
                    // times before now: the partition's outage (ended,
                    // reopened) and the broker connections lost lately (last
                    // seen open, new one seen).
                    let ago = |at: Instant| now.saturating_duration_since(at);
                    let outage = outage(entry).map(|o| (ago(o.ended), o.reopened.map(ago)));
                    let connection_losses: Vec<_> = brokers
                        .losses()
                        .iter()
                        .map(|loss| (ago(loss.last_seen_open), loss.reconnected.map(ago)))
                        .collect();
                    tracing::info!(message_id = %id, ?outage, ?connection_losses, held_back, "the broker delivered again a message acked well before any connection was lost (a reset or seek of the subscription): handling it again");
                }
                return false;
            }
            Redelivery::AckLost(resend) => resend,
        };
        tracing::info!(message_id = %id, resending = resend.len(), "the broker delivered an acked message again (its ack was lost with a connection); acking again");
        for entry in resend {
            self.ack_entry(entry);
        }
        true
    }

    /// Sends the ack of a whole entry again, as the crate acks entries.
    fn ack_entry(&mut self, (partition, ledger_id, entry_id): EntryKey) {
        let id = MessageId::new(ledger_id, entry_id, partition, None);
        if let Err(error) = self.send_settlement(&id, true) {
            tracing::warn!(message_id = %id, %error, "acking again failed");
        }
    }

    /// The next message of any partition with the other chunks it was put
    /// together from, if it was chunked; `None` for a chunk held, or a
    /// chunk of an acked message, acked again.
    fn poll_next_partition(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Option<WholeMessage>, TransportError>>> {
        let count = self.partitions.len();
        // A plain topic's ids name no partition: its unsettled messages
        // are all the one partition's.
        let partitioned = self.is_partitioned();
        for step in 0..count {
            let index = (self.next_partition + step) % count;
            let rewinds = &self.rewinds;
            let holds_unsettled = || {
                let partition = partitioned.then_some(index as i32);
                rewinds
                    .as_ref()
                    .is_some_and(|rewinds| rewinds.holds_unsettled(partition))
            };
            let received = match self.partitions[index].poll_next(cx, holds_unsettled) {
                Poll::Pending => continue,
                Poll::Ready(Err(error)) => Err(error),
                Poll::Ready(Ok(received)) => self.convert(index, received),
            };
            self.next_partition = (index + 1) % count;
            if let Err(error) = &received {
                self.partitions[index].receive_failed(error);
            }
            return Poll::Ready(Some(received));
        }
        Poll::Pending
    }

    /// The message received, whole: with the other chunks it was put
    /// together from, or `None` while its chunks are arriving (or for a
    /// chunk of an acked message, acked again); an error
    /// for a message that cannot be read (encrypted), left unsettled.
    fn convert(
        &mut self,
        partition: usize,
        received: pulsar::consumer::Message<Vec<u8>>,
    ) -> Result<Option<WholeMessage>, TransportError> {
        let pulsar::Payload { metadata, data } = received.payload;
        let mut id = received.message_id.id;
        if self.is_partitioned() {
            // The partition is also what settlement goes by.
            id.partition = Some(partition as i32);
        }
        if !metadata.encryption_keys.is_empty() {
            return Err(TransportError::Encrypted {
                topic: self.partitions[partition].topic.to_string(),
                message_id: MessageId::from_broker(id, None).to_string().into(),
            });
        }
        // A chunk of a message acked shortly before, delivered again on its
        // own because the last of the message's acks were lost with a
        // connection: acked again. Given up, it would be nacked and come
        // back for ever, its first chunk acked for good.
        if is_chunk(&metadata) && self.was_acked(&MessageId::from_broker(id.clone(), None)) {
            return Ok(None);
        }
        let mut given_up = Vec::new();
        let assembled = self
            .chunks
            .accept(partition, &id, &metadata, data, &mut given_up);
        if !given_up.is_empty() {
            tracing::warn!(topic = %self.partitions[partition].topic, chunks = given_up.len(), "chunks of a message that cannot be put together here (its first chunk never came, or too many chunked messages arrive at once); nacked");
            self.settle_chunks(given_up, false);
        }
        let (data, chunks) = match assembled {
            Assembled::Whole(data) => (data, Vec::new()),
            Assembled::Complete(data, chunks) => (data, chunks),
            Assembled::Held => return Ok(None),
        };
        let topic = self.partitions[partition].topic.clone();
        let id = MessageId::from_broker(id, received.message_id.batch_size);
        let mut message = Message::new(topic, id, data);
        message.set_metadata(Metadata {
            properties: metadata
                .properties
                .into_iter()
                .map(|pair| (pair.key, pair.value))
                .collect(),
            partition_key: metadata.partition_key,
            partition_key_b64_encoded: metadata.partition_key_b64_encoded.unwrap_or(false),
            ordering_key: metadata.ordering_key,
            event_time: metadata.event_time,
        });
        message.publish_time = metadata.publish_time;
        Ok(Some((message, chunks)))
    }

    /// Settles chunks: those of a message settled, besides its last, or
    /// those given up (nacked).
    fn settle_chunks(&mut self, chunks: Vec<ChunkId>, succeeded: bool) {
        for (index, id) in chunks {
            let partition = &mut self.partitions[index];
            if let Err(error) = partition.settle(id, succeeded) {
                tracing::warn!(topic = %partition.topic, %error, "settling a chunk failed");
            }
        }
    }

    /// The index of the partition a message id belongs to.
    fn partition_of(&self, id: &MessageId) -> Result<usize, TransportError> {
        let index = if self.is_partitioned() {
            usize::try_from(id.partition()).ok()
        } else {
            Some(0)
        };
        let count = self.partitions.len();
        index.filter(|&index| index < count).ok_or_else(|| {
            TransportError::Pulsar(pulsar::Error::Custom(format!(
                "message {id} names partition {} of a topic with {count}",
                id.partition()
            )))
        })
    }

    fn settle(&mut self, id: &MessageId, succeeded: bool) -> Result<(), TransportError> {
        if !self.persistent {
            return self.send_settlement(id, succeeded).map(drop);
        }
        if let Some(rewinds) = &mut self.rewinds {
            rewinds.settled(id);
        }
        if let Some(chunks) = self.chunks.settled(entry_of(id)) {
            if succeeded {
                // Each chunk is an entry the broker may deliver again alone.
                let now = Instant::now();
                for (_, chunk) in &chunks {
                    self.recent_acks.record(entry_of_chunk(chunk), now);
                }
            }
            self.settle_chunks(chunks, succeeded);
        }
        let Some(succeeded) = self.batches.settle(id, succeeded, &self.recent_acks) else {
            return Ok(());
        };
        let partition = match id.batch_size() {
            Some(size) if succeeded && size > 1 && self.acks_each_member => {
                self.ack_each_member(id, size)?
            }
            _ => self.send_settlement(id, succeeded)?,
        };
        if succeeded {
            self.recent_acks.record(entry_of(id), Instant::now());
        } else if let Some(rewinds) = &mut self.rewinds {
            rewinds.nacked(partition, id.to_broker());
        }
        Ok(())
    }

    /// Acks a whole batch by the id of each of its `size` members, as the
    /// crate handed them out: its ack timeout tracks every member's id and
    /// forgets one only when an ack carries it, and once the delay passes
    /// asks the broker to deliver again whatever it still tracks (which on
    /// an Exclusive or Failover subscription rewinds the subscription).
    /// The first ack already acks the entry on the broker. Returns the
    /// partition's index.
    fn ack_each_member(&mut self, id: &MessageId, size: i32) -> Result<usize, TransportError> {
        let index = self.partition_of(id)?;
        let mut member = id.to_broker();
        for batch_index in 0..size {
            member.batch_index = Some(batch_index);
            self.partitions[index].settle(member.clone(), true)?;
        }
        Ok(index)
    }

    /// Sends the settlement to the message's partition; returns its index.
    fn send_settlement(
        &mut self,
        id: &MessageId,
        succeeded: bool,
    ) -> Result<usize, TransportError> {
        let index = self.partition_of(id)?;
        self.partitions[index].settle(id.to_broker(), succeeded)?;
        Ok(index)
    }
}

impl Consumer for PulsarConsumer {
    fn poll_receive(
        &mut self,
        cx: &mut Context<'_>,
        slot: &mut Option<Message>,
    ) -> Poll<Option<Result<(), TransportError>>> {
        let received = self.poll_partitions(cx);
        if received.is_ready() {
            self.brokers.recheck_if_due();
        }
        received.map(|polled| polled.map(|result| result.map(|message| *slot = Some(message))))
    }

    fn ack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.settle(id, true)
    }

    fn nack(&mut self, id: &MessageId) -> Result<(), TransportError> {
        self.settle(id, false)
    }

    async fn close(&mut self) -> Result<(), TransportError> {
        close_partitions(&mut self.partitions).await
    }

    fn failing_since(&self) -> Option<tokio::time::Instant> {
        self.partitions
            .iter()
            .filter_map(Partition::resubscribing_since)
            .min()
    }

    fn repairs(&self) -> Repairs {
        let (rewinds_repeated, dropped_in_flight) =
            self.rewinds.as_ref().map_or((0, 0), |rewinds| {
                (rewinds.repeated, rewinds.dropped_in_flight)
            });
        Repairs {
            redelivered_after_ack: self.recent_acks.recognised,
            rewinds_repeated,
            stalls_rewound: self.partitions.iter().map(Partition::stalls_rewound).sum(),
            dropped_in_flight,
            redelivered_after_success: self.batches.redelivered_after_success,
        }
    }
}

/// What the headers around a message's payload and metadata take, with
/// room to spare: the broker's frame and its entry on a bookie (about 110
/// bytes measured).
const HEADER_ALLOWANCE: usize = 1024;

/// About what a message takes on the broker and its bookies: its payload,
/// properties and keys, and [`HEADER_ALLOWANCE`]. Above the broker's
/// maximum message size a broker drops the connection; a little below it,
/// a bookie whose frame limit is that size (a standalone broker's is)
/// refuses the entry, and the broker retries the write without end.
fn stored_size(message: &OutgoingMessage) -> usize {
    let properties: usize = message
        .properties
        .iter()
        .map(|(key, value)| key.len() + value.len())
        .sum();
    let keys = message.partition_key.as_ref().map_or(0, String::len)
        + message.ordering_key.as_ref().map_or(0, Vec::len);
    message.payload.len() + properties + keys + HEADER_ALLOWANCE
}

/// A producer of the Pulsar transport.
pub struct PulsarProducer {
    producer: tokio::sync::Mutex<pulsar::Producer<TokioExecutor>>,
    topic: Box<str>,
    max_message_size: usize,
}

impl std::fmt::Debug for PulsarProducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PulsarProducer")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl Producer for PulsarProducer {
    async fn send(&self, message: OutgoingMessage) -> Result<(), TransportError> {
        let size = stored_size(&message);
        if size > self.max_message_size {
            return Err(TransportError::MessageTooLarge {
                topic: self.topic.to_string(),
                size,
                limit: self.max_message_size,
            });
        }
        let outgoing = PulsarOutgoing {
            payload: message.payload,
            properties: message.properties.into_iter().collect(),
            partition_key: message.partition_key,
            partition_key_b64_encoded: message.partition_key_b64_encoded.then_some(true),
            ordering_key: message.ordering_key,
            event_time: message.event_time,
            deliver_at_time: message.deliver_at_time,
            ..Default::default()
        };
        let receipt = {
            let mut producer = self.producer.lock().await;
            producer.send_non_blocking(outgoing).await?
        };
        receipt.await?;
        Ok(())
    }

    async fn close(&self) -> Result<(), TransportError> {
        Ok(self.producer.lock().await.close().await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_messages_stored_size_counts_its_metadata_and_the_headers() {
        let mut message = OutgoingMessage::new(vec![0; 1000]);
        assert_eq!(stored_size(&message), 1000 + HEADER_ALLOWANCE);
        message
            .properties
            .push(("RECONSUMETIMES".into(), "1".into()));
        message.partition_key = Some("key".into());
        message.ordering_key = Some(b"order".to_vec());
        assert_eq!(stored_size(&message), 1000 + 15 + 3 + 5 + HEADER_ALLOWANCE);
        // The standalone broker's bookie got a frame 109 bytes longer than
        // the payload and refuses frames over 5 MiB: a payload 100 bytes
        // short of the limit is refused.
        let near_the_limit = OutgoingMessage::new(vec![0; DEFAULT_MAX_MESSAGE_SIZE - 100]);
        assert!(stored_size(&near_the_limit) > DEFAULT_MAX_MESSAGE_SIZE);
    }
}
