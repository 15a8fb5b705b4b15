//! The message a handler receives, and its identifier.
//!
//! [`Message`] is what a transport produces and a handler reads: payload,
//! properties, keys, times, topic, message id and redelivery count. It is
//! plain owned data so that the scheduler can hold it in a slot and the
//! failure router can republish it after the handler has returned. What
//! many messages lack (properties, keys, event time) sits behind one shared
//! pointer, so that a message is 112 bytes instead of 216 and costs less to
//! store, copy and clone.

use std::fmt;
use std::rc::Rc;

use pulsar::proto::MessageIdData;

/// Identifies a message on its topic, as the broker assigned it.
///
/// Its [`Display`](fmt::Display) form is the one Pulsar's Java client uses
/// (`ledger:entry:partition`, plus `:batch_index` inside a batch), so it can
/// be compared with ids logged or stamped by other clients.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MessageId {
    ledger_id: u64,
    entry_id: u64,
    partition: Option<i32>,
    batch_index: Option<i32>,
    batch_size: Option<i32>,
    /// The broker's id whole, when it carries more than the fields above
    /// (an ack set, a chunked message's first id, a batch size of its
    /// own), to give back as it came when settling; `None` for nearly every
    /// message, so that an id is 48 bytes and a clone copies them.
    rest: Option<Box<MessageIdData>>,
}

impl MessageId {
    /// An id from its parts, as another client would print them. Useful to
    /// build messages for the in-memory transport.
    pub fn new(ledger_id: u64, entry_id: u64, partition: i32, batch_index: Option<i32>) -> Self {
        MessageId {
            ledger_id,
            entry_id,
            partition: Some(partition),
            batch_index,
            batch_size: None,
            rest: None,
        }
    }

    /// The id the broker gave, as the `pulsar` crate passes it on, of a
    /// message in a batch of `batch_size` (from the batch's metadata) if
    /// the id does not say.
    pub(crate) fn from_broker(id: MessageIdData, batch_size: Option<i32>) -> Self {
        let carries_more = !id.ack_set.is_empty()
            || id.first_chunk_message_id.is_some()
            || id.batch_size.is_some();
        MessageId {
            ledger_id: id.ledger_id,
            entry_id: id.entry_id,
            partition: id.partition,
            batch_index: id.batch_index,
            batch_size: id.batch_size.or(batch_size),
            rest: carries_more.then(|| Box::new(id)),
        }
    }

    /// The id to give back to the broker: the one the crate handed out,
    /// exactly, since the crate's ack timeout forgets an id only when an
    /// ack carries that same id.
    pub(crate) fn to_broker(&self) -> MessageIdData {
        match &self.rest {
            Some(whole) => (**whole).clone(),
            None => MessageIdData {
                ledger_id: self.ledger_id,
                entry_id: self.entry_id,
                partition: self.partition,
                batch_index: self.batch_index,
                ..Default::default()
            },
        }
    }

    /// The ledger the message is stored in.
    pub fn ledger_id(&self) -> u64 {
        self.ledger_id
    }

    /// The entry within the ledger.
    pub fn entry_id(&self) -> u64 {
        self.entry_id
    }

    /// The partition index, or -1 for a topic that is not partitioned.
    pub fn partition(&self) -> i32 {
        self.partition.unwrap_or(-1)
    }

    /// The index within a batch, for a message that was sent in one.
    pub fn batch_index(&self) -> Option<i32> {
        self.batch_index
    }

    /// How many messages the batch holds, for a message sent in one, when
    /// the broker says.
    pub(crate) fn batch_size(&self) -> Option<i32> {
        self.batch_size
    }

    /// The same id, in a batch of `size`.
    #[cfg(test)]
    pub(crate) fn with_batch_size(mut self, size: i32) -> Self {
        self.batch_size = Some(size);
        self
    }
}

impl fmt::Display for MessageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}:{}:{}",
            self.ledger_id(),
            self.entry_id(),
            self.partition()
        )?;
        match self.batch_index() {
            Some(index) => write!(f, ":{index}"),
            None => Ok(()),
        }
    }
}

/// A received message, as handed to a handler.
#[derive(Clone)]
pub struct Message {
    pub(crate) topic: Rc<str>,
    pub(crate) id: MessageId,
    pub(crate) payload: Vec<u8>,
    /// `None` when the message has none of it.
    metadata: Option<Rc<Metadata>>,
    pub(crate) publish_time: u64,
    pub(crate) redelivery_count: Option<u32>,
}

/// The parts of a message that many messages lack, kept apart: a clone
/// shares them, and a message without any holds only an empty pointer.
#[derive(Clone, Debug, Default)]
pub(crate) struct Metadata {
    pub(crate) properties: Vec<(String, String)>,
    pub(crate) partition_key: Option<String>,
    /// The partition key is the base64 text of a key given as bytes.
    pub(crate) partition_key_b64_encoded: bool,
    pub(crate) ordering_key: Option<Vec<u8>>,
    pub(crate) event_time: Option<u64>,
}

/// What a message without metadata reads.
static NO_METADATA: Metadata = Metadata {
    properties: Vec::new(),
    partition_key: None,
    partition_key_b64_encoded: false,
    ordering_key: None,
    event_time: None,
};

impl Metadata {
    fn is_empty(&self) -> bool {
        self.properties.is_empty()
            && self.partition_key.is_none()
            && !self.partition_key_b64_encoded
            && self.ordering_key.is_none()
            && self.event_time.is_none()
    }
}

impl Message {
    /// A message as a transport would deliver it; the other fields start
    /// empty and are set with the `with_*` methods.
    pub fn new(topic: impl Into<Rc<str>>, id: MessageId, payload: Vec<u8>) -> Self {
        Message {
            topic: topic.into(),
            id,
            payload,
            metadata: None,
            publish_time: 0,
            redelivery_count: None,
        }
    }

    /// Sets the properties, keys and event time at once, allocating only
    /// when there is any.
    pub(crate) fn set_metadata(&mut self, metadata: Metadata) {
        self.metadata = (!metadata.is_empty()).then(|| Rc::new(metadata));
    }

    /// Empties `slot` (a message box being taken back), dropping the
    /// message's parts one by one, inline: the drop of a whole
    /// `Option<Message>` stayed a call of its own, about 10 instructions
    /// per message more.
    #[inline(always)]
    pub(crate) fn clear(slot: &mut Option<Message>) {
        if let Some(message) = slot.take() {
            let Message {
                topic,
                id: MessageId { rest, .. },
                payload,
                metadata,
                ..
            } = message;
            drop(topic);
            drop(rest);
            drop(payload);
            drop(metadata);
        }
    }

    pub(crate) fn metadata(&self) -> &Metadata {
        self.metadata.as_deref().unwrap_or(&NO_METADATA)
    }

    fn metadata_mut(&mut self) -> &mut Metadata {
        Rc::make_mut(self.metadata.get_or_insert_with(Rc::default))
    }

    /// Adds a property.
    pub fn with_property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        let property = (key.into(), value.into());
        self.metadata_mut().properties.push(property);
        self
    }

    /// Sets the partition key.
    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.metadata_mut().partition_key = Some(key.into());
        self
    }

    /// Sets the ordering key.
    pub fn with_ordering_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.metadata_mut().ordering_key = Some(key.into());
        self
    }

    /// Sets the event time (milliseconds since the Unix epoch).
    pub fn with_event_time(mut self, millis: u64) -> Self {
        self.metadata_mut().event_time = Some(millis);
        self
    }

    /// Sets the publish time (milliseconds since the Unix epoch).
    pub fn with_publish_time(mut self, millis: u64) -> Self {
        self.publish_time = millis;
        self
    }

    /// Sets how many times the broker has redelivered the message.
    pub fn with_redelivery_count(mut self, count: u32) -> Self {
        self.redelivery_count = Some(count);
        self
    }

    /// The full topic name the message was consumed from.
    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// The broker-assigned id.
    pub fn id(&self) -> &MessageId {
        &self.id
    }

    /// The message body.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Every property, in the order the producer set them.
    pub fn properties(&self) -> impl Iterator<Item = (&str, &str)> {
        self.metadata()
            .properties
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
    }

    /// The value of one property.
    pub fn property(&self, key: &str) -> Option<&str> {
        find_property(&self.metadata().properties, key)
    }

    /// The partition key (Pulsar's message key).
    pub fn partition_key(&self) -> Option<&str> {
        self.metadata().partition_key.as_deref()
    }

    /// Whether the [partition key](Self::partition_key) is the base64 text
    /// of a key its producer gave as bytes (Pulsar's
    /// `partition_key_b64_encoded`).
    pub fn partition_key_is_base64(&self) -> bool {
        self.metadata().partition_key_b64_encoded
    }

    /// The ordering key, used by Key_Shared subscriptions.
    pub fn ordering_key(&self) -> Option<&[u8]> {
        self.metadata().ordering_key.as_deref()
    }

    /// The producer-set event time in milliseconds since the Unix epoch.
    pub fn event_time(&self) -> Option<u64> {
        self.metadata().event_time
    }

    /// The broker's publish time in milliseconds since the Unix epoch.
    pub fn publish_time(&self) -> u64 {
        self.publish_time
    }

    /// How many times the broker has redelivered this message, where the
    /// transport knows it.
    ///
    /// The `pulsar` crate (6.9) does not pass the broker's redelivery count
    /// on to its consumers, so messages from the Pulsar transport report
    /// `None`; the in-memory transport counts its own redeliveries.
    pub fn redelivery_count(&self) -> Option<u32> {
        self.redelivery_count
    }
}

impl fmt::Debug for Message {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let metadata = self.metadata();
        f.debug_struct("Message")
            .field("topic", &self.topic)
            .field("id", &self.id)
            .field("payload", &self.payload)
            .field("properties", &metadata.properties)
            .field("partition_key", &metadata.partition_key)
            .field(
                "partition_key_b64_encoded",
                &metadata.partition_key_b64_encoded,
            )
            .field("ordering_key", &metadata.ordering_key)
            .field("event_time", &metadata.event_time)
            .field("publish_time", &self.publish_time)
            .field("redelivery_count", &self.redelivery_count)
            .finish()
    }
}

/// The value of `key` in a property list.
pub(crate) fn find_property<'a>(properties: &'a [(String, String)], key: &str) -> Option<&'a str> {
    properties
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, value)| value.as_str())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_print_like_the_java_client() {
        assert_eq!(MessageId::new(12, 3, -1, None).to_string(), "12:3:-1");
        assert_eq!(MessageId::new(12, 3, 2, Some(4)).to_string(), "12:3:2:4");
    }

    #[test]
    fn properties_are_found_by_key() {
        let message = Message::new("t", MessageId::new(1, 1, -1, None), b"x".to_vec())
            .with_property("a", "1")
            .with_property("b", "2");
        assert_eq!(message.property("b"), Some("2"));
        assert_eq!(message.property("c"), None);
        assert_eq!(message.properties().count(), 2);
    }

    #[test]
    fn a_clone_shares_metadata_until_one_side_changes_it() {
        let original = Message::new("t", MessageId::new(1, 1, -1, None), Vec::new())
            .with_property("a", "1")
            .with_partition_key("k");
        let same = |a: &Message, b: &Message| match (&a.metadata, &b.metadata) {
            (Some(a), Some(b)) => Rc::ptr_eq(a, b),
            _ => false,
        };
        let clone = original.clone();
        assert!(same(&clone, &original), "a clone shares the metadata");
        let changed = clone.with_property("b", "2").with_event_time(7);
        assert!(!same(&changed, &original), "a change copies it first");
        assert_eq!(original.properties().count(), 1);
        assert_eq!(original.event_time(), None);
        assert_eq!(changed.property("a"), Some("1"));
        assert_eq!(changed.property("b"), Some("2"));
        assert_eq!(changed.partition_key(), Some("k"));
        assert_eq!(changed.event_time(), Some(7));

        let bare = Message::new("t", MessageId::new(1, 2, -1, None), Vec::new());
        assert_eq!(bare.properties().count(), 0);
        assert_eq!((bare.partition_key(), bare.ordering_key()), (None, None));
        // What keeps a message cheap to store and copy.
        assert!(std::mem::size_of::<Message>() <= 112);
    }

    #[test]
    fn a_message_reads_and_prints_what_it_was_built_with() {
        let message = Message::new("orders", MessageId::new(3, 4, 1, Some(0)), b"hi".to_vec())
            .with_property("tenant", "acme")
            .with_partition_key("k")
            .with_ordering_key(*b"o")
            .with_event_time(7)
            .with_publish_time(1_700_000_000_000)
            .with_redelivery_count(2);
        assert_eq!(message.publish_time(), 1_700_000_000_000);
        assert_eq!(message.redelivery_count(), Some(2));
        let shown = format!("{message:?}");
        for part in [
            "topic: \"orders\"",
            "ledger_id: 3, entry_id: 4",
            "payload: [104, 105]",
            "(\"tenant\", \"acme\")",
            "partition_key: Some(\"k\")",
            "ordering_key: Some([111])",
            "event_time: Some(7)",
            "publish_time: 1700000000000",
            "redelivery_count: Some(2)",
        ] {
            assert!(shown.contains(part), "{part} not in {shown}");
        }
    }

    #[test]
    fn metadata_is_kept_only_when_there_is_some() {
        let mut message = Message::new("t", MessageId::new(1, 1, -1, None), Vec::new());
        // Most messages carry none: they must not allocate for it.
        message.set_metadata(Metadata::default());
        assert!(message.metadata.is_none());
        let each_part = [
            Metadata {
                properties: vec![("a".into(), "1".into())],
                ..Metadata::default()
            },
            Metadata {
                partition_key: Some("k".into()),
                ..Metadata::default()
            },
            Metadata {
                partition_key_b64_encoded: true,
                ..Metadata::default()
            },
            Metadata {
                ordering_key: Some(b"o".to_vec()),
                ..Metadata::default()
            },
            Metadata {
                event_time: Some(7),
                ..Metadata::default()
            },
        ];
        for metadata in each_part {
            message.set_metadata(metadata.clone());
            assert!(message.metadata.is_some(), "{metadata:?} was dropped");
            assert_eq!(
                message.partition_key_is_base64(),
                metadata.partition_key_b64_encoded
            );
        }
    }

    #[test]
    fn an_id_goes_back_to_the_broker_as_it_came() {
        let plain = MessageIdData {
            ledger_id: 5,
            entry_id: 9,
            partition: Some(2),
            batch_index: Some(1),
            ..Default::default()
        };
        // The batch size comes from the batch's metadata, not the id, and
        // does not go back with it.
        let id = MessageId::from_broker(plain.clone(), Some(3));
        assert_eq!(id.to_broker(), plain);
        assert_eq!((id.ledger_id(), id.entry_id(), id.partition()), (5, 9, 2));
        assert_eq!((id.batch_index(), id.batch_size()), (Some(1), Some(3)));
        assert_eq!(id.to_string(), "5:9:2:1");
        let sized = MessageIdData {
            batch_size: Some(3),
            ..plain.clone()
        };
        let id_with_size = MessageId::from_broker(sized.clone(), None);
        assert_eq!(id_with_size.batch_size(), Some(3));
        assert_eq!(id_with_size.to_broker(), sized, "a size in the id stays");

        // Each extra alone is kept: an ack set (a batch the broker
        // redelivered in part) and a chunked message's first chunk.
        let with_ack_set = MessageIdData {
            ack_set: vec![0b101],
            ..plain.clone()
        };
        let with_first_chunk = MessageIdData {
            first_chunk_message_id: Some(Box::new(plain.clone())),
            ..plain.clone()
        };
        let with_both = MessageIdData {
            ack_set: vec![0b101],
            ..with_first_chunk.clone()
        };
        for with_more in [with_ack_set, with_first_chunk, with_both] {
            assert_eq!(
                MessageId::from_broker(with_more.clone(), None).to_broker(),
                with_more
            );
            assert_ne!(
                MessageId::from_broker(with_more, None),
                id,
                "the extras are part of the id"
            );
        }

        let unpartitioned = MessageIdData {
            partition: None,
            ..plain
        };
        let id = MessageId::from_broker(unpartitioned.clone(), None);
        assert_eq!(id.partition(), -1);
        assert_eq!(id.to_broker(), unpartitioned);
    }
}
