//! Priority dispatch of Apache Pulsar messages to async handlers, on one
//! thread.
//!
//! placeholder crate docs
#![warn(missing_docs)]

mod dispatcher;
mod error;
mod message;
mod process;
mod reader;
pub mod scheduler;
mod subscription;
mod sync;
mod topic;
pub mod transport;

pub use dispatcher::{CloseHandle, Dispatcher, DispatcherBuilder, DEFAULT_CONCURRENCY};
pub use error::Error;
pub use message::{Message, MessageId};
pub use process::{HandlerError, IntoReply};
pub use pulsar::SubType;
pub use subscription::{SubscribeOptions, DEFAULT_NEGATIVE_ACK_REDELIVERY_DELAY, DEFAULT_PRIORITY};
pub use topic::full_topic_name;

#[cfg(test)]
mod tests;
