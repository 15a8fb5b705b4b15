//! The small types that routing, the engine and the public API share: what a
//! handler may return, how it ended, what the broker is told, and what is
//! known about a subscription.
//!
//! They sit at the bottom of the crate, next to the errors, so that every
//! layer can name them without importing from a layer above it.

use pulsar::SubType;

use crate::error::Error;

/// The error type handlers' errors are converted to. Any `std::error::Error`
/// converts, as do `String`, `&str` and `anyhow::Error` (with the `anyhow`
/// feature, on by default, [`ErrorClass`](crate::ErrorClass) sees the
/// error it was made from and that error's sources, under any context; a
/// context shows in the logs and is not classed, even one of an error
/// type). A
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
    pub(crate) fn of<R: IntoReply, E: Into<HandlerError> + 'static>(result: Result<R, E>) -> Self {
        match result {
            Ok(reply) => Outcome::Succeeded(reply.into_reply()),
            Err(error) => Outcome::Failed(handler_error(error)),
        }
    }

    /// The outcome of a handler that panicked with `payload`.
    pub(crate) fn panicked(payload: &(dyn std::any::Any + Send)) -> Self {
        Outcome::Panicked(panic_text(payload))
    }
}

/// A handler's error as a [`HandlerError`]. An `anyhow::Error` is kept
/// whole in an [`AnyhowError`] rather than converted by anyhow's own
/// `From`, whose box forwards `source()` to the wrapped error's source and
/// so hides the wrapped error itself: `ErrorClass::of` could never match a
/// handler's `Err(Busy.into())`, and the message would be nacked where the
/// user asked for a retry or a dead letter.
fn handler_error<E: Into<HandlerError> + 'static>(error: E) -> HandlerError {
    #[cfg(feature = "anyhow")]
    {
        let mut error = Some(error);
        let anyhow = (&mut error as &mut dyn std::any::Any)
            .downcast_mut::<Option<anyhow::Error>>()
            .and_then(Option::take);
        if let Some(anyhow) = anyhow {
            return Box::new(AnyhowError(anyhow));
        }
        error
            .expect("taken only when it is an anyhow::Error")
            .into()
    }
    #[cfg(not(feature = "anyhow"))]
    error.into()
}

/// An `anyhow::Error` a handler returned. Its text is the error's own, and
/// its `source()` is the object anyhow wraps: the error it was made from,
/// or, under a context, anyhow's pair of the two, whose own `source()` is
/// that error. So the chain holds the error and its sources.
/// Logs leave its text out once, as a repeat of its source's.
#[cfg(feature = "anyhow")]
#[derive(Debug)]
struct AnyhowError(anyhow::Error);

#[cfg(feature = "anyhow")]
impl std::fmt::Display for AnyhowError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&*self.0, f)
    }
}

#[cfg(feature = "anyhow")]
impl std::error::Error for AnyhowError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&*self.0)
    }
}

/// The failure of a dispatcher one of whose own steps (or its transport's,
/// called from one) panicked: a bug, which stops it.
pub(crate) fn panicked(
    what: impl std::fmt::Display,
    payload: &(dyn std::any::Any + Send),
) -> Error {
    Error::EngineFailed {
        reason: format!("{what} panicked: {}", panic_text(payload)),
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

#[cfg(all(test, feature = "anyhow"))]
mod tests {
    use anyhow::Context;

    use super::*;
    use crate::error::ErrorChain;
    use crate::ErrorClass;

    #[derive(Debug, thiserror::Error)]
    #[error("warehouse busy")]
    struct Busy;

    #[derive(Debug, thiserror::Error)]
    #[error("invalid order")]
    struct Invalid;

    fn failed(result: anyhow::Result<()>) -> HandlerError {
        match Outcome::of(result) {
            Outcome::Failed(error) => error,
            _ => panic!("an Err is a failure"),
        }
    }

    /// What a handler returns is its reply's bytes, or no reply for `()`
    /// and `None` (nothing is published, not an empty reply).
    #[test]
    fn each_return_type_gives_its_bytes_or_no_reply() {
        assert_eq!(().into_reply(), None);
        assert_eq!(None::<Vec<u8>>.into_reply(), None);
        assert_eq!(b"thumb".to_vec().into_reply(), Some(b"thumb".to_vec()));
        assert_eq!(
            Some(b"thumb".to_vec()).into_reply(),
            Some(b"thumb".to_vec())
        );
        assert_eq!("thumb".to_owned().into_reply(), Some(b"thumb".to_vec()));
    }

    #[test]
    fn an_anyhow_error_is_classed_by_what_it_was_made_from() {
        let busy = ErrorClass::of::<Busy>();
        let made_from = failed(Err(Busy.into()));
        assert!(busy.matches(made_from.as_ref()));
        assert!(!ErrorClass::of::<Invalid>().matches(made_from.as_ref()));
        let with_context = failed(Err(Busy).context("reserving stock"));
        assert!(busy.matches(with_context.as_ref()));
        // anyhow's own conversion hides it: why the dispatcher converts.
        let anyhows_own: HandlerError = anyhow::Error::from(Busy).into();
        assert!(!busy.matches(anyhows_own.as_ref()));
    }

    #[test]
    fn an_anyhow_error_is_logged_with_its_context_once() {
        let made_from = failed(Err(Busy.into()));
        assert_eq!(ErrorChain(made_from.as_ref()).to_string(), "warehouse busy");
        let with_context = failed(Err(Busy).context("reserving stock"));
        assert_eq!(
            ErrorChain(with_context.as_ref()).to_string(),
            "reserving stock: warehouse busy"
        );
        let message = failed(Err(anyhow::anyhow!("no such customer")));
        assert_eq!(ErrorChain(message.as_ref()).to_string(), "no such customer");
    }
}
