//! Priority dispatch of Apache Pulsar messages to async handlers, on one
//! thread.
//!
//! A [`Dispatcher`] consumes any number of Pulsar topics, each with its own
//! async handler and an integer priority, and runs the handlers on the
//! current thread:
//!
//! - **Priority**: when a handler may start, the waiting message with the
//!   lowest priority value goes first; subscriptions of equal priority take
//!   turns (by default; see [`SchedulingPolicy`] and
//!   [`DispatcherBuilder::reserve`]). Priority is decided when capacity
//!   frees up, and a running handler is never preempted.
//! - **Backpressure per subscription**: each subscription holds at most one
//!   message waiting for dispatch (a key-ordered one, up to its
//!   [`key_buffer`](SubscribeOptions::key_buffer) while their keys are
//!   busy), and its consumer asks the broker for the next one only when
//!   that slot is empty. With the default receiver queue
//!   of 1, a slow subscription's backlog stays on the broker.
//! - **One concurrency limit** across all subscriptions (20 by default).
//! - **Automatic settlement**: a handler that returns `Ok` has its message
//!   acknowledged; one that returns `Err` or panics has it negatively
//!   acknowledged, after the subscription's negative-ack delay (60 s by
//!   default, as in Pulsar's other clients).
//! - **Graceful shutdown**: [`Dispatcher::close`] stops receiving, still
//!   dispatches what was queued, waits for running handlers, and closes the
//!   connection.
//!
//! The dispatcher is `!Send` by design: it keeps its state in `Rc` and
//! `Cell`, runs handlers in reused `spawn_local` worker tasks, and must
//! live in a [`tokio::task::LocalSet`] on a runtime with time enabled. To
//! use several cores, run one dispatcher per core.
//!
//! # Quick start
//!
//! ```no_run
//! use std::convert::Infallible;
//! use pulsar_dispatcher::{Dispatcher, Message, SubType, SubscribeOptions};
//!
//! async fn process_order(message: &Message) -> Result<(), Infallible> {
//!     println!("order {}", String::from_utf8_lossy(message.payload()));
//!     Ok(())
//! }
//!
//! #[tokio::main(flavor = "current_thread")]
//! async fn main() -> Result<(), pulsar_dispatcher::Error> {
//!     tokio::task::LocalSet::new()
//!         .run_until(async {
//!             let dispatcher = Dispatcher::builder()
//!                 .concurrency(20)
//!                 .connect("pulsar://127.0.0.1:6650")
//!                 .await?;
//!             dispatcher
//!                 .subscribe(
//!                     "orders",
//!                     process_order,
//!                     SubscribeOptions::new()
//!                         .priority(5)
//!                         .subscription("orders-sub")
//!                         .subscription_type(SubType::Shared),
//!                 )
//!                 .await?;
//!             dispatcher
//!                 .subscribe(
//!                     "payments",
//!                     async |message: &Message| {
//!                         if message.payload().is_empty() {
//!                             return Err("empty payment");
//!                         }
//!                         Ok(())
//!                     },
//!                     SubscribeOptions::new().priority(10).subscription("payments-sub"),
//!                 )
//!                 .await?;
//!             let closer = dispatcher.close_handle();
//!             tokio::task::spawn_local(async move {
//!                 tokio::signal::ctrl_c().await.ok();
//!                 closer.close().await;
//!             });
//!             dispatcher.run().await
//!         })
//!         .await
//! }
//! ```
//!
//! # Cargo features
//!
//! - `compression` (default): the `pulsar` crate's LZ4, zlib, zstd and
//!   Snappy codecs, so that messages other clients' producers compressed
//!   are read (Snappy written by Pulsar's other clients excepted: the crate
//!   reads only its framed format; the README's "Schemas, compressed,
//!   chunked and encrypted messages" says what happens to such a message).
//! - `anyhow` (default): handlers may return `anyhow::Error` and still be
//!   routed by [`ErrorClass::of`]: the error an `anyhow::Error` was made
//!   from and its sources are in the chain a class looks at, under any
//!   context (anyhow's own conversion to `Box<dyn Error>` hides that
//!   error; a context is logged, not classed). Without the feature an
//!   `anyhow::Error` still converts, and is classed by its sources alone.
//!
//! # Layout
//!
//! - `scheduler` (internal, hidden from these docs; its policy types are
//!   re-exported): the pure scheduler (priority buckets, slots, permits).
//! - [`transport`]: the seam to the broker, with the Pulsar and in-memory
//!   implementations.
//! - [`routing`]: what happens after a handler returns: replies, delayed
//!   retries, dead letters, and the properties they carry.
//! - The engine (private): refills slots from consumers, dispatches to
//!   workers that run handlers in place, settles, and shuts down.
//! - [`Dispatcher`], [`SubscribeOptions`], [`TopicFamily`] and
//!   [`ErrorClass`]: the public API.
//! - [`per_core`]: one dispatcher per core, with one shutdown and one monitor for all.
//!
//! `docs/architecture.md` in the repository walks through the data path and
//! its invariants.
#![warn(missing_docs, missing_debug_implementations)]

mod backoff;
mod classify;
mod dispatcher;
mod engine;
mod error;
mod family;
mod handle;
mod hash;
mod log_limit;
mod message;
mod options;
mod outcome;
pub mod per_core;
pub mod routing;
// Public for the benchmarks, which drive the scheduler alone; not part of
// the API (its policy types are re-exported below).
#[doc(hidden)]
pub mod scheduler;
mod topic;
pub mod transport;

pub use backoff::{default_backoff, exponential_backoff};
pub use classify::ErrorClass;
pub use dispatcher::{
    Dispatcher, DispatcherBuilder, CONNECT_OPERATION_RETRIES, DEFAULT_CONCURRENCY,
    DEFAULT_METRICS_INTERVAL,
};
pub use engine::{
    DispatcherStats, Health, HealthPhase, Latency, SubscriptionHealth, SubscriptionStats,
    PUBLISH_GRACE,
};
pub use error::{
    Error, RetryTopicProblem, TransportError, MAX_CONCURRENCY, MAX_DURATION, MAX_KEY_BUFFER,
};
pub use family::{FamilyTopic, NoSublevels, PriorityLevel, TopicFamily};
pub use handle::{CloseHandle, FamilyHandle, SubscriptionHandle};
pub use message::{Message, MessageId};
pub use options::{
    SubscribeOptions, DEFAULT_KEY_BUFFER, DEFAULT_NEGATIVE_ACK_REDELIVERY_DELAY,
    DEFAULT_PARTITION_REFRESH_INTERVAL, DEFAULT_PRIORITY, DEFAULT_RECEIVE_FAILURE_LIMIT,
    DEFAULT_STALL_CHECK, DEFAULT_SUBSCRIBE_TIMEOUT,
};
pub use outcome::{HandlerError, IntoReply, SubscriptionInfo};
/// The `pulsar` crate at the version this crate uses, so that its types
/// (client builder, consumer options, dead letter policy) can be named
/// without a second dependency that must be kept in step.
pub use pulsar;
pub use pulsar::consumer::DeadLetterPolicy;
pub use pulsar::SubType;
pub use routing::{DeadLetterTargets, RetryTopicCheck};
pub use scheduler::{Aging, Ordering, SchedulingPolicy, Weights};
pub use topic::full_topic_name;

#[cfg(test)]
mod tests;

/// The README's Rust examples, compiled as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeExamples;
