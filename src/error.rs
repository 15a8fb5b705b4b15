//! The crate's error types: [`Error`] for everything the dispatcher reports,
//! [`TransportError`] for what a broker connection reports, and
//! [`RetryTopicProblem`] for retry topics that would not work.
//!
//! They sit at the bottom of the crate: every other module may use them,
//! and they use nothing of the crate but each other.

use pulsar::SubType;

/// A failure reported by a transport.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The `pulsar` crate reported an error.
    #[error(transparent)]
    Pulsar(#[from] pulsar::Error),
    /// The transport, or the consumer, has been closed.
    #[error("the transport is closed")]
    Closed,
    /// A failure injected into the in-memory transport by a test.
    #[error("injected failure: {0}")]
    Injected(String),
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
    /// The concurrency limit was zero.
    #[error("concurrency must be at least 1")]
    ZeroConcurrency,
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
    /// `subscribe` was called after `run` started or after `close`.
    #[error("cannot subscribe to {topic}: the dispatcher is {state}")]
    SubscribeNotAllowed {
        /// The topic of the refused subscription.
        topic: String,
        /// What the dispatcher was doing.
        state: &'static str,
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
    /// A consumer's stream ended while the dispatcher was running.
    #[error("the consumer of {topic} stopped delivering messages")]
    ConsumerEnded {
        /// The full topic name.
        topic: String,
    },
    /// A reader task ended abnormally (it panicked or was cancelled).
    #[error("the reader of {topic} failed: {reason}")]
    ReaderFailed {
        /// The full topic name.
        topic: String,
        /// What happened.
        reason: String,
    },
    /// `run()` refused to start because of retry topic problems (see
    /// [`RetryTopicCheck::Refuse`](crate::RetryTopicCheck::Refuse)).
    #[error("retry topic check failed: {}", .0.iter().map(|p| p.to_string()).collect::<Vec<_>>().join("; "))]
    RetryTopics(Vec<RetryTopicProblem>),
    /// Closing the broker connection failed.
    #[error("closing the broker connection failed")]
    Close(#[source] TransportError),
}
