//! The message a handler receives, and its identifier.
//!
//! [`Message`] is what a transport produces and a handler reads: payload,
//! properties, keys, times, topic, message id and redelivery count. It is
//! plain owned data so that the scheduler can hold it in a slot and the
//! failure router can republish it after the handler has returned.

use std::fmt;
use std::rc::Rc;

use pulsar::proto::MessageIdData;

/// Identifies a message on its topic, as the broker assigned it.
///
/// Its [`Display`](fmt::Display) form is the one Pulsar's Java client uses
/// (`ledger:entry:partition`, plus `:batch_index` inside a batch), so it can
/// be compared with ids logged or stamped by other clients.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MessageId(pub(crate) MessageIdData);

impl MessageId {
    /// An id from its parts, as another client would print them. Useful to
    /// build messages for the in-memory transport.
    pub fn new(ledger_id: u64, entry_id: u64, partition: i32, batch_index: Option<i32>) -> Self {
        MessageId(MessageIdData {
            ledger_id,
            entry_id,
            partition: Some(partition),
            batch_index,
            ..Default::default()
        })
    }

    /// The ledger the message is stored in.
    pub fn ledger_id(&self) -> u64 {
        self.0.ledger_id
    }

    /// The entry within the ledger.
    pub fn entry_id(&self) -> u64 {
        self.0.entry_id
    }

    /// The partition index, or -1 for a topic that is not partitioned.
    pub fn partition(&self) -> i32 {
        self.0.partition.unwrap_or(-1)
    }

    /// The index within a batch, for a message that was sent in one.
    pub fn batch_index(&self) -> Option<i32> {
        self.0.batch_index
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
#[derive(Clone, Debug)]
pub struct Message {
    pub(crate) topic: Rc<str>,
    pub(crate) id: MessageId,
    pub(crate) payload: Vec<u8>,
    pub(crate) properties: Vec<(String, String)>,
    pub(crate) partition_key: Option<String>,
    pub(crate) ordering_key: Option<Vec<u8>>,
    pub(crate) event_time: Option<u64>,
    pub(crate) publish_time: u64,
    pub(crate) redelivery_count: Option<u32>,
}

impl Message {
    /// A message as a transport would deliver it; the other fields start
    /// empty and are set with the `with_*` methods.
    pub fn new(topic: impl Into<Rc<str>>, id: MessageId, payload: Vec<u8>) -> Self {
        Message {
            topic: topic.into(),
            id,
            payload,
            properties: Vec::new(),
            partition_key: None,
            ordering_key: None,
            event_time: None,
            publish_time: 0,
            redelivery_count: None,
        }
    }

    /// Adds a property.
    pub fn with_property(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.properties.push((key.into(), value.into()));
        self
    }

    /// Sets the partition key.
    pub fn with_partition_key(mut self, key: impl Into<String>) -> Self {
        self.partition_key = Some(key.into());
        self
    }

    /// Sets the ordering key.
    pub fn with_ordering_key(mut self, key: impl Into<Vec<u8>>) -> Self {
        self.ordering_key = Some(key.into());
        self
    }

    /// Sets the event time (milliseconds since the Unix epoch).
    pub fn with_event_time(mut self, millis: u64) -> Self {
        self.event_time = Some(millis);
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
        self.properties
            .iter()
            .map(|(key, value)| (key.as_str(), value.as_str()))
    }

    /// The value of one property.
    pub fn property(&self, key: &str) -> Option<&str> {
        find_property(&self.properties, key)
    }

    /// The partition key (Pulsar's message key).
    pub fn partition_key(&self) -> Option<&str> {
        self.partition_key.as_deref()
    }

    /// The ordering key, used by Key_Shared subscriptions.
    pub fn ordering_key(&self) -> Option<&[u8]> {
        self.ordering_key.as_deref()
    }

    /// The producer-set event time in milliseconds since the Unix epoch.
    pub fn event_time(&self) -> Option<u64> {
        self.event_time
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
}
