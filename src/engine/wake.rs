//! Consumer wake-ups: which subscriptions' consumers may have a message.
//!
//! A consumer that has nothing to give keeps the waker it was polled with
//! and wakes it when a message arrives. Each subscription's waker records
//! the subscription in one shared list and wakes an idle worker that
//! offered to dispatch (the helper), or else the engine task, so that
//! whoever dispatches next (the helper, the engine, or a worker that just
//! finished) polls exactly the consumers that woke, never all of them. A
//! helper dispatches in its own task and runs the message it picks itself,
//! which spares a message that arrives alone the engine task's turn and a
//! hand-over. Consumers may
//! be woken from the `pulsar` crate's own tasks, so this is the one place
//! that uses `Send` types: an `Arc`, an atomic flag per subscription and a
//! mutex that nobody holds for longer than a push or a swap.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Wake, Waker};

use futures::task::AtomicWaker;

/// Subscriptions whose consumers woke since the list was last taken, and
/// the engine task to tell.
#[derive(Default)]
pub(crate) struct WokenList {
    indices: Mutex<Vec<usize>>,
    /// A hint that `indices` is not empty, read without the lock.
    any: AtomicBool,
    engine: AtomicWaker,
    /// An idle worker that dispatches when a consumer wakes, if one offered.
    helper: AtomicWaker,
}

impl WokenList {
    /// Registers the engine task's waker.
    pub(crate) fn register_engine(&self, waker: &Waker) {
        self.engine.register(waker);
    }

    /// Wakes the engine task.
    pub(crate) fn wake_engine(&self) {
        self.engine.wake();
    }

    /// Registers an idle worker as the one to wake, instead of the engine
    /// task, when a consumer wakes.
    pub(crate) fn register_helper(&self, waker: &Waker) {
        self.helper.register(waker);
    }

    /// Withdraws the helper (whichever worker it is): the worker that
    /// offered may be about to get busy. Consumers then wake the engine
    /// task until an idle worker offers again.
    pub(crate) fn clear_helper(&self) {
        drop(self.helper.take());
    }

    /// Whether any subscription woke since the last [`take`](Self::take).
    pub(crate) fn any(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Moves the woken subscriptions into `into` (which should be empty;
    /// swapping buffers keeps this free of allocation).
    pub(crate) fn take(&self, into: &mut Vec<usize>) {
        let mut indices = self
            .indices
            .lock()
            .expect("the woken list is never poisoned");
        std::mem::swap(&mut *indices, into);
        self.any.store(false, Ordering::Release);
    }

    fn push(&self, index: usize) {
        self.indices
            .lock()
            .expect("the woken list is never poisoned")
            .push(index);
        self.any.store(true, Ordering::Release);
        match self.helper.take() {
            Some(helper) => helper.wake(),
            None => self.engine.wake(),
        }
    }
}

/// The waker a subscription's consumer is polled with.
pub(crate) struct SubscriptionWaker {
    index: usize,
    /// Set while the subscription is in the list, so that it is listed once
    /// however often its consumer wakes it.
    listed: AtomicBool,
    list: Arc<WokenList>,
}

impl SubscriptionWaker {
    /// A waker for the subscription at `index` in the engine's table.
    pub(crate) fn new(index: usize, list: Arc<WokenList>) -> Arc<Self> {
        Arc::new(SubscriptionWaker {
            index,
            listed: AtomicBool::new(false),
            list,
        })
    }

    /// Called before the consumer is polled again, so that a wake-up during
    /// or after that poll lists the subscription anew.
    pub(crate) fn unlist(&self) {
        self.listed.store(false, Ordering::Release);
    }
}

impl Wake for SubscriptionWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if !self.listed.swap(true, Ordering::AcqRel) {
            self.list.push(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// A waker that counts its wakes.
    #[derive(Default)]
    struct Counted(AtomicUsize);

    impl Wake for Counted {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The idle worker that offered is woken instead of the engine task,
    /// once per offer; a withdrawn offer leaves the wakes to the engine.
    #[test]
    fn a_wake_goes_to_the_helper_that_offered_once_then_to_the_engine() {
        let list = Arc::new(WokenList::default());
        let (engine, helper) = (Arc::new(Counted::default()), Arc::new(Counted::default()));
        let (engine_waker, helper_waker) =
            (Waker::from(engine.clone()), Waker::from(helper.clone()));
        let wakes = || {
            (
                engine.0.load(Ordering::Relaxed),
                helper.0.load(Ordering::Relaxed),
            )
        };
        list.register_engine(&engine_waker);
        let subscription = SubscriptionWaker::new(0, list.clone());
        let consumer_waker = Waker::from(subscription.clone());
        let wake_again = || {
            subscription.unlist();
            consumer_waker.wake_by_ref();
        };
        list.register_helper(&helper_waker);
        wake_again();
        assert_eq!(wakes(), (0, 1), "the helper, not the engine");
        wake_again();
        assert_eq!(wakes(), (1, 1), "the offer was taken by the first wake");
        // The engine task registers again each time it is polled.
        list.register_engine(&engine_waker);
        list.register_helper(&helper_waker);
        list.clear_helper();
        wake_again();
        assert_eq!(wakes(), (2, 1), "a withdrawn offer leaves it to the engine");
    }

    #[test]
    fn a_subscription_is_listed_once_until_unlisted() {
        let list = Arc::new(WokenList::default());
        let first = Waker::from(SubscriptionWaker::new(3, list.clone()));
        let second_state = SubscriptionWaker::new(7, list.clone());
        let second = Waker::from(second_state.clone());
        assert!(!list.any());
        first.wake_by_ref();
        first.wake_by_ref();
        second.wake_by_ref();
        assert!(list.any());
        let mut taken = Vec::new();
        list.take(&mut taken);
        assert_eq!(taken, [3, 7]);
        assert!(!list.any());
        second.wake_by_ref();
        let mut again = Vec::new();
        list.take(&mut again);
        assert!(again.is_empty(), "listed until unlisted");
        second_state.unlist();
        second.wake_by_ref();
        list.take(&mut again);
        assert_eq!(again, [7]);
    }
}
