//! Single-threaded signalling: a one-waiter notification built on `Cell`.
//!
//! The dispatcher's tasks all run on one thread, so a flag and a stored
//! waker are all a notification needs; no atomics, no locks, no allocation.

use std::cell::Cell;
use std::future::poll_fn;
use std::task::{Poll, Waker};

/// Wakes one waiting task. A notification sent while nobody waits is kept
/// (like a permit) and consumed by the next wait.
#[derive(Default)]
pub(crate) struct LocalNotify {
    notified: Cell<bool>,
    waker: Cell<Option<Waker>>,
}

impl LocalNotify {
    pub(crate) fn notify(&self) {
        self.notified.set(true);
        if let Some(waker) = self.waker.take() {
            waker.wake();
        }
    }

    /// Waits for a notification. Cancel-safe: a dropped wait consumes none.
    pub(crate) async fn notified(&self) {
        poll_fn(|cx| {
            if self.notified.replace(false) {
                return Poll::Ready(());
            }
            let waker = match self.waker.take() {
                Some(waker) if waker.will_wake(cx.waker()) => waker,
                _ => cx.waker().clone(),
            };
            self.waker.set(Some(waker));
            Poll::Pending
        })
        .await
    }
}
