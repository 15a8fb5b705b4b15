//! The per-message task: run the handler, route and settle the message,
//! return the permit.
//!
//! Each dispatched message gets one `spawn_local` task, monomorphised for its
//! subscription's handler so that the task is the only allocation. The task
//! owns an [`InFlight`] guard whose `Drop` returns the permit and nacks the
//! message if nothing settled it, so the permit and the message are released
//! however the task ends: the handler returns, fails, panics, or the task is
//! dropped with the runtime.

use std::any::Any;
use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;

use futures::FutureExt;

use crate::dispatcher::Core;
use crate::message::{Message, MessageId};
use crate::reader::{SubscriptionContext, Verdict};
use crate::routing::Action;
use crate::transport::Transport;

/// The error type handlers' errors are converted to. Any `std::error::Error`
/// converts, as do `String`, `&str` and `anyhow::Error`.
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
}

/// A subscription's handler with its concrete type erased behind the one
/// operation the dispatch loop needs.
pub(crate) trait Spawn<T: Transport> {
    fn spawn(&self, in_flight: InFlight<T>);
}

/// A handler and the task that runs it; one instance may serve several
/// subscriptions (a topic family).
pub(crate) struct HandlerTask<F, R, E> {
    handler: Rc<F>,
    output: PhantomData<fn() -> (R, E)>,
}

impl<F, R, E> HandlerTask<F, R, E> {
    pub(crate) fn new(handler: F) -> Self {
        HandlerTask {
            handler: Rc::new(handler),
            output: PhantomData,
        }
    }
}

impl<T, F, R, E> Spawn<T> for HandlerTask<F, R, E>
where
    T: Transport,
    F: AsyncFn(&Message) -> Result<R, E> + 'static,
    R: IntoReply + 'static,
    E: Into<HandlerError> + 'static,
{
    fn spawn(&self, mut in_flight: InFlight<T>) {
        let handler = self.handler.clone();
        tokio::task::spawn_local(async move {
            let handled = AssertUnwindSafe(handler(&in_flight.message)).catch_unwind();
            let outcome = match handled.await {
                Ok(Ok(reply)) => Outcome::Succeeded(reply.into_reply()),
                Ok(Err(error)) => Outcome::Failed(error.into()),
                Err(panic) => Outcome::Panicked(panic_text(panic.as_ref())),
            };
            in_flight.settle(outcome).await;
        });
    }
}

fn panic_text(panic: &(dyn Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "non-string panic payload".into())
}

/// One dispatched message, with its claim on a permit and on settlement.
pub(crate) struct InFlight<T: Transport> {
    core: Rc<Core<T>>,
    subscription: Rc<SubscriptionContext<T>>,
    message: Message,
    settled: bool,
}

impl<T: Transport> InFlight<T> {
    pub(crate) fn new(
        core: Rc<Core<T>>,
        subscription: Rc<SubscriptionContext<T>>,
        message: Message,
    ) -> Self {
        InFlight {
            core,
            subscription,
            message,
            settled: false,
        }
    }

    /// Routes the handler's outcome (reply, retry, dead letter) and queues
    /// the resulting ack or nack. Works in place and awaits only a boxed
    /// publish, so that the task holding it stays small.
    async fn settle(&mut self, outcome: Outcome) {
        let verdict =
            match self
                .core
                .router()
                .decide(&self.subscription.routing, &self.message, outcome)
            {
                Action::Settle(verdict) => verdict,
                Action::Publish(publish) => self.core.publish(publish, &self.message).await,
            };
        self.finish(verdict);
    }

    fn finish(&mut self, verdict: Verdict) {
        if !std::mem::replace(&mut self.settled, true) {
            // The message is not read after its verdict, so its id moves
            // to the reader instead of being copied.
            let id = std::mem::replace(&mut self.message.id, MessageId::unassigned());
            self.subscription.request(id, verdict);
        }
    }
}

impl<T: Transport> Drop for InFlight<T> {
    fn drop(&mut self) {
        // Reached without a verdict only when the task was dropped mid-way.
        self.finish(Verdict::Nack);
        self.core.release_permit();
    }
}
