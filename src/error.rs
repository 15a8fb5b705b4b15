//! The crate's error types: [`Error`] for everything the dispatcher reports,
//! [`TransportError`] for what a broker connection reports, and
//! [`RetryTopicProblem`] for retry topics that would not work.
//!
//! They sit at the bottom of the crate: every other module may use them,
//! and they use nothing of the crate but each other.

use std::time::Duration;

use pulsar::SubType;

/// The longest any duration option may be (a year): longer ones are
/// refused with [`Error::InvalidOption`] rather than left to overflow a
/// clock.
pub const MAX_DURATION: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// The largest concurrency limit (2^20 handlers at once on one thread):
/// a larger one is refused with [`Error::InvalidOption`] rather than left
/// to exhaust memory where the scheduler sizes its tables by it.
pub const MAX_CONCURRENCY: usize = 1 << 20;

/// The largest `key_buffer` (2^16 messages held by one subscription),
/// refused beyond that for the same reason.
pub const MAX_KEY_BUFFER: usize = 1 << 16;

/// `duration`, if it is within [`MAX_DURATION`] (and not zero, unless
/// `zero_allowed`); an error naming `option` otherwise.
pub(crate) fn checked_duration(
    option: &'static str,
    duration: Duration,
    zero_allowed: bool,
) -> Result<Duration, Error> {
    let invalid = |reason: String| Error::InvalidOption { option, reason };
    if duration.is_zero() && !zero_allowed {
        return Err(invalid("must be longer than zero".into()));
    }
    if duration > MAX_DURATION {
        return Err(invalid(format!(
            "{duration:?} is longer than the {MAX_DURATION:?} allowed"
        )));
    }
    Ok(duration)
}

/// A failure reported by a transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The `pulsar` crate reported an error.
    #[error(transparent)]
    Pulsar(#[from] pulsar::Error),
    /// A message arrived encrypted, which the `pulsar` crate cannot
    /// decrypt: it is not handed out, and stays unacked with the consumer
    /// (as a Java consumer's `ConsumerCryptoFailureAction::FAIL` leaves
    /// it), for a consumer that holds the key once this one closes.
    #[error("message {message_id} of {topic} is encrypted, which the `pulsar` crate cannot decrypt; left unacknowledged")]
    Encrypted {
        /// The topic (or partition) it came from.
        topic: String,
        /// Its id on the broker. (A `Box<str>`, not a `String`, so that a
        /// `TransportError` stays the size of the crate's error: see the
        /// test below.)
        message_id: Box<str>,
    },
    /// A consumer's stream ended (the `pulsar` crate gave up on its
    /// connection); the consumer is being subscribed again.
    #[error("the consumer of {topic} ended; subscribing it again")]
    Resubscribing {
        /// The topic (or partition) of the consumer.
        topic: String,
    },
    /// A reply, retry or dead letter larger than the broker takes was not
    /// sent. (A broker drops the connection a frame that large arrives on,
    /// with every consumer and producer on it, and the `pulsar` crate sends
    /// it again on each reconnection until its operation timeout; a bookie
    /// can refuse an entry a little smaller, and the broker then retries
    /// the write without end.)
    #[error("a message of about {size} bytes for {topic} is larger than the broker's maximum message size ({limit} bytes); not sent")]
    MessageTooLarge {
        /// The topic it was for.
        topic: String,
        /// About what it would take on the broker, in bytes: its payload,
        /// properties and keys, and 1 KiB for headers.
        size: usize,
        /// The maximum message size the transport was given.
        limit: usize,
    },
    /// The transport, or the consumer, has been closed.
    #[error("the transport is closed")]
    Closed,
    /// A failure injected into the in-memory transport by a test.
    #[error("injected failure: {0}")]
    Injected(String),
}

impl TransportError {
    /// Whether the error is about one message the consumer could not read
    /// (encrypted, compressed in a way the `pulsar` crate cannot undo, a
    /// batch it cannot decode, or without a payload), not about the
    /// consumer: it goes on receiving the messages after it, and the
    /// message stays unacknowledged.
    pub fn is_unreadable_message(&self) -> bool {
        use pulsar::error::{ConnectionError, ConsumerError};
        matches!(
            self,
            TransportError::Encrypted { .. }
                | TransportError::Pulsar(
                    pulsar::Error::Consumer(
                        ConsumerError::Io(_) | ConsumerError::MissingPayload(_)
                    ) | pulsar::Error::Connection(ConnectionError::Decoding(_))
                )
        )
    }
}

impl From<pulsar::error::ConsumerError> for TransportError {
    fn from(error: pulsar::error::ConsumerError) -> Self {
        TransportError::Pulsar(error.into())
    }
}

/// A retry topic that will not work as intended.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RetryTopicProblem {
    /// No subscription on this dispatcher consumes the retry topic, so
    /// retried messages would never be processed here.
    #[error("{retry_topic} (the retry topic of {topic}) is not consumed by this dispatcher")]
    NotConsumed {
        /// The full name of the retry topic.
        retry_topic: String,
        /// The subscription's topic that retries there.
        topic: String,
    },
    /// A subscription consumes the retry topic with a type that ignores
    /// delivery delays, so retries would come back at once.
    #[error("{retry_topic} is consumed by a {subscription_type:?} subscription, which ignores retry delays; use Shared or Key_Shared")]
    DelaysIgnored {
        /// The full name of the retry topic.
        retry_topic: String,
        /// The type of the consuming subscription.
        subscription_type: SubType,
    },
}

/// Everything that can go wrong when configuring or running a dispatcher.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An option has a value the dispatcher cannot honour.
    #[error("invalid option `{option}`: {reason}")]
    InvalidOption {
        /// The option's name.
        option: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A topic name is malformed.
    #[error("invalid topic name {topic:?}: {reason}")]
    InvalidTopic {
        /// The name as given.
        topic: String,
        /// What is wrong with it.
        reason: String,
    },
    /// This dispatcher already consumes the topic (or, for a partition, its
    /// partitioned topic; for a partitioned topic, one of its partitions)
    /// with a subscription of that name: a second consumer of it would wait for ever on an
    /// Exclusive or Failover subscription, and on a Shared one take turns
    /// with the first at another priority. Change the existing one's
    /// priority instead, or use another subscription name.
    #[error("{topic} is already subscribed as {subscription:?} on this dispatcher")]
    AlreadySubscribed {
        /// The full topic name.
        topic: String,
        /// The subscription name.
        subscription: String,
    },
    /// `subscribe` was called once the dispatcher had begun to close.
    #[error("cannot subscribe to {topic}: the dispatcher is {state}")]
    SubscribeNotAllowed {
        /// The topic of the refused subscription.
        topic: String,
        /// What the dispatcher was doing.
        state: &'static str,
    },
    /// A [`SubscriptionHandle`](crate::SubscriptionHandle) names a
    /// subscription that is gone (unsubscribed, or its dispatcher dropped),
    /// or one of another dispatcher. A closed dispatcher's subscriptions
    /// are not gone: their handles still answer, with their last state.
    #[error("{topic} is not a subscription of this dispatcher (any more)")]
    UnknownSubscription {
        /// The full topic name of the handle.
        topic: String,
    },
    /// `run` was called a second time, or after `close`.
    #[error("cannot run: the dispatcher is {state}")]
    RunNotAllowed {
        /// What the dispatcher was doing.
        state: &'static str,
    },
    /// Connecting to the broker failed.
    #[error("connecting to the broker failed")]
    Connect(#[source] TransportError),
    /// The broker refused or failed a subscription.
    #[error("subscribing to {topic} failed")]
    Subscribe {
        /// The full topic name.
        topic: String,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
    /// The broker did not create the consumer within the subscription's
    /// `subscribe_timeout`, for example because another consumer holds an
    /// Exclusive subscription (a producer's timeout is
    /// [`Error::ProducerTimeout`]).
    #[error("subscribing to {topic} (subscription {}) took over {waited:?}: the broker did not accept it in time (another consumer holding an Exclusive subscription is a common cause; the `pulsar` crate logs the broker's answer)", subscription.as_deref().unwrap_or("<generated>"))]
    SubscribeTimeout {
        /// The full topic name.
        topic: String,
        /// The subscription name, if one was given.
        subscription: Option<String>,
        /// How long `subscribe` waited.
        waited: std::time::Duration,
    },
    /// The broker did not answer the creation of a producer for a
    /// subscription's retry, dead letter or reply topic within the
    /// subscription's `subscribe_timeout`, for example because another
    /// producer holds the topic with Exclusive access.
    #[error(
        "creating a producer for {topic} (for a subscription to {subscribed}) took over {waited:?}"
    )]
    ProducerTimeout {
        /// The full name of the topic to publish to.
        topic: String,
        /// The full name of the topic being subscribed.
        subscribed: String,
        /// How long `subscribe` waited in all.
        waited: std::time::Duration,
    },
    /// A producer for a subscription's retry, dead letter or reply topic
    /// could not be created.
    #[error("creating a producer for {topic} failed")]
    Producer {
        /// The full name of the topic to publish to.
        topic: String,
        /// The transport's error.
        #[source]
        source: TransportError,
    },
    /// A consumer's stream ended while the dispatcher was running.
    #[error("the consumer of {topic} stopped delivering messages")]
    ConsumerEnded {
        /// The full topic name.
        topic: String,
    },
    /// A consumer kept returning errors for longer than its
    /// `receive_failure_limit`.
    #[error("receiving from {topic} kept failing for {failing_for:?}")]
    ConsumerFailing {
        /// The full topic name.
        topic: String,
        /// How long it had been failing.
        failing_for: std::time::Duration,
        /// The last error the consumer returned (for a partition that could
        /// not be subscribed again, [`TransportError::Resubscribing`]).
        #[source]
        last_error: TransportError,
    },
    /// One of the dispatcher's own tasks failed (a bug): the dispatcher was
    /// shut down.
    #[error("the dispatcher's engine failed: {reason}")]
    EngineFailed {
        /// What happened.
        reason: String,
    },
    /// Shutdown passed its deadline (`shutdown_timeout` or `close_within`)
    /// and cancelled handlers that were still running; their messages were
    /// nacked.
    #[error("shutdown cancelled {cancelled} handler(s) still running at its deadline")]
    HandlersCancelled {
        /// How many handlers were cancelled (messages handed to a worker
        /// and not started yet count too).
        cancelled: usize,
    },
    /// `run()` refused to start because of retry topic problems (see
    /// [`RetryTopicCheck::Refuse`](crate::RetryTopicCheck::Refuse)).
    #[error("retry topic check failed: {}", .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    RetryTopics(Vec<RetryTopicProblem>),
    /// Closing the broker connection failed.
    #[error("closing the broker connection failed")]
    Close(#[source] TransportError),
}

/// An error and its `source()` chain for logs: `outer: inner: root`. The
/// usual error types (thiserror's `#[source]`, anyhow's context) leave the
/// cause out of their own `Display`, and a log line without it says what
/// failed but not why. A cause whose text repeats the error before it (a
/// wrapper that shows what it wraps, such as a handler's `anyhow::Error`)
/// is shown once.
pub(crate) struct ErrorChain<'a>(pub(crate) &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for ErrorChain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut shown = self.0.to_string();
        f.write_str(&shown)?;
        let mut source = self.0.source();
        while let Some(cause) = source {
            let text = cause.to_string();
            if text != shown {
                write!(f, ": {text}")?;
            }
            shown = text;
            source = cause.source();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("warehouse busy")]
    struct Busy(#[source] std::io::Error);

    #[test]
    fn a_chain_shows_every_cause() {
        let busy = Busy(std::io::Error::other("connection refused by wms-3"));
        assert_eq!(
            ErrorChain(&busy).to_string(),
            "warehouse busy: connection refused by wms-3"
        );
        let refused = TransportError::Closed;
        assert_eq!(ErrorChain(&refused).to_string(), "the transport is closed");
    }

    #[derive(Debug, thiserror::Error)]
    #[error("{0}")]
    struct ShowsWhatItWraps(#[source] Busy);

    #[test]
    fn a_cause_that_repeats_the_error_before_it_is_shown_once() {
        let busy = Busy(std::io::Error::other("warehouse busy"));
        assert_eq!(ErrorChain(&busy).to_string(), "warehouse busy");
        let wrapped = ShowsWhatItWraps(Busy(std::io::Error::other("refused")));
        assert_eq!(ErrorChain(&wrapped).to_string(), "warehouse busy: refused");
    }

    #[test]
    fn errors_about_one_message_are_told_from_errors_about_the_consumer() {
        use pulsar::error::ConsumerError;
        let decompression = ConsumerError::Io(std::io::Error::other("snappy"));
        let unreadable = [
            TransportError::Encrypted {
                topic: "t".into(),
                message_id: "1:2:-1".into(),
            },
            TransportError::from(decompression),
            TransportError::from(ConsumerError::MissingPayload("none".into())),
        ];
        assert!(unreadable.iter().all(TransportError::is_unreadable_message));
        let failures = [
            TransportError::Resubscribing { topic: "t".into() },
            TransportError::Closed,
            TransportError::from(ConsumerError::Closed),
            TransportError::Pulsar(pulsar::Error::Custom("lookup failed".into())),
        ];
        assert!(!failures.iter().any(TransportError::is_unreadable_message));
    }

    #[test]
    fn a_duration_of_a_year_is_accepted_and_a_longer_one_refused() {
        let year = Duration::from_secs(365 * 24 * 60 * 60);
        assert_eq!(checked_duration("nack_delay", year, false).ok(), Some(year));
        let longer = year + Duration::from_nanos(1);
        match checked_duration("nack_delay", longer, false) {
            Err(Error::InvalidOption { option, reason }) => {
                assert_eq!(option, "nack_delay");
                assert!(reason.contains("longer than"), "{reason}");
            }
            other => panic!("a year and a nanosecond was not refused: {other:?}"),
        }
        assert!(checked_duration("nack_delay", Duration::ZERO, true).is_ok());
        assert!(checked_duration("nack_delay", Duration::ZERO, false).is_err());
    }

    #[test]
    fn a_transport_error_is_no_larger_than_the_crates() {
        // Receives return it by value on the per-message path, inside the
        // engine's `Error` too: a variant larger than `pulsar::Error` grows
        // both (the encrypted message's two `String`s did, by 8 bytes).
        assert!(std::mem::size_of::<TransportError>() <= std::mem::size_of::<pulsar::Error>());
    }
}
