//! The dispatcher's error type.

use crate::routing::RetryTopicProblem;
use crate::transport::TransportError;

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
