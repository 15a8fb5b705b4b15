//! The small types that routing, the engine and the public API share: what a
//! handler may return, how it ended, what the broker is told, and what is
//! known about a subscription.
//!
//! They sit at the bottom of the crate, next to the errors, so that every
//! layer can name them without importing from a layer above it.

use pulsar::SubType;

/// The error type handlers' errors are converted to. Any `std::error::Error`
/// converts, as do `String`, `&str` and `anyhow::Error`. A
/// `Box<dyn Error + Send + Sync>` (tower's `BoxError`) does not convert by
/// itself (the standard library has no such `From`): coerce it with
/// `.map_err(|e| e as HandlerError)`.
pub type HandlerError = Box<dyn std::error::Error + 'static>;

/// What a handler may return on success: nothing, or reply bytes.
pub trait IntoReply {
    /// The reply payload, if any.
    fn into_reply(self) -> Option<Vec<u8>>;
}

impl IntoReply for () {
    fn into_reply(self) -> Option<Vec<u8>> {
        None
    }
}

impl IntoReply for Vec<u8> {
    fn into_reply(self) -> Option<Vec<u8>> {
        Some(self)
    }
}

impl IntoReply for String {
    fn into_reply(self) -> Option<Vec<u8>> {
        Some(self.into_bytes())
    }
}

impl IntoReply for Option<Vec<u8>> {
    fn into_reply(self) -> Option<Vec<u8>> {
        self
    }
}

/// How a handler ended.
pub(crate) enum Outcome {
    Succeeded(Option<Vec<u8>>),
    Failed(HandlerError),
    Panicked(String),
    /// Still running at its subscription's processing deadline, and
    /// dropped.
    TimedOut(Deadline),
}

/// A processing deadline that passed, as logged.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Deadline(pub(crate) std::time::Duration);

impl std::fmt::Display for Deadline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "still running after its processing deadline of {:?}",
            self.0
        )
    }
}

impl Outcome {
    /// The outcome of a handler's result.
    pub(crate) fn of<R: IntoReply, E: Into<HandlerError>>(result: Result<R, E>) -> Self {
        match result {
            Ok(reply) => Outcome::Succeeded(reply.into_reply()),
            Err(error) => Outcome::Failed(error.into()),
        }
    }

    /// The outcome of a handler that panicked with `payload`.
    pub(crate) fn panicked(payload: &(dyn std::any::Any + Send)) -> Self {
        Outcome::Panicked(panic_text(payload))
    }
}

/// The message of a panic, when it has one.
pub(crate) fn panic_text(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// What the broker is told about a handled message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    Ack,
    Nack,
}

/// What a dispatcher knows about one of its subscriptions.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SubscriptionInfo {
    /// The full topic name.
    pub topic: String,
    /// The subscription name, if one was given.
    pub subscription: Option<String>,
    /// The subscription type.
    pub subscription_type: SubType,
    /// The scheduling priority.
    pub priority: i64,
    /// The full name of the retry topic, if failures may be retried.
    pub retry_topic: Option<String>,
}
