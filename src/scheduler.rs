//! The pure scheduler: priority buckets, one-message slots and the permit count.
//!
//! This module owns the decision of *which* waiting message runs next and
//! *whether* anything may run at all. It knows nothing of Pulsar, tasks or
//! I/O: it is generic over the message type and is driven through plain
//! method calls plus wakers, so it can be tested exhaustively and benchmarked
//! alone.
//!
//! Invariants:
//! - every subscription has a slot that holds at most one message;
//! - a subscription is in its bucket's ready queue exactly when its slot is
//!   full, so a ready queue never holds more entries than the bucket has
//!   members and never reallocates after the last subscription is added;
//! - `ready_buckets` has bit `b` set exactly when bucket `b`'s ready queue is
//!   non-empty, so picking the best message costs one bit scan and one pop;
//! - `available + in_flight == concurrency` at all times.

use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::task::{Context, Poll, Waker};

use slab::Slab;

/// Identifies one subscription inside a [`Scheduler`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SubscriptionKey(usize);

/// Why a message could not be put into its subscription's slot. The message
/// is handed back so that the caller can settle it.
#[derive(Debug, PartialEq, Eq)]
pub enum Rejected<M> {
    /// The slot already holds a message.
    Full(M),
    /// The scheduler has been closed to new insertions.
    Closed(M),
}

struct Subscription<M> {
    bucket: usize,
    slot: Option<M>,
    /// The reader waiting for this slot to empty.
    vacancy_waker: Option<Waker>,
}

struct Bucket {
    priority: i64,
    members: usize,
    /// Subscriptions with a full slot, in the order their slots filled.
    /// Popping the front and pushing refilled slots to the back is what makes
    /// equal priorities round-robin.
    ready: VecDeque<SubscriptionKey>,
}

/// Strict-priority, round-robin-within-priority selection of single-slot
/// queues under a global concurrency limit.
pub struct Scheduler<M> {
    subscriptions: Slab<Subscription<M>>,
    /// Sorted by ascending priority value: index 0 is served first.
    buckets: Vec<Bucket>,
    /// Bit `b` of word `b / 64` is set when bucket `b` has a ready slot.
    ready_buckets: Vec<u64>,
    concurrency: usize,
    available: usize,
    closed: bool,
    /// The dispatch loop, waiting for a permit, a message, or idleness.
    dispatch_waker: Option<Waker>,
}

impl<M> Scheduler<M> {
    /// A scheduler that lets at most `concurrency` messages be in flight.
    pub fn new(concurrency: NonZeroUsize) -> Self {
        Scheduler {
            subscriptions: Slab::new(),
            buckets: Vec::new(),
            ready_buckets: Vec::new(),
            concurrency: concurrency.get(),
            available: concurrency.get(),
            closed: false,
            dispatch_waker: None,
        }
    }

    /// Registers a subscription at `priority` (lower values are served first).
    pub fn add_subscription(&mut self, priority: i64) -> SubscriptionKey {
        let bucket = match self.buckets.binary_search_by_key(&priority, |b| b.priority) {
            Ok(found) => found,
            Err(insert_at) => {
                self.insert_bucket(insert_at, priority);
                insert_at
            }
        };
        self.buckets[bucket].members += 1;
        self.buckets[bucket].ready.reserve(1);
        SubscriptionKey(self.subscriptions.insert(Subscription {
            bucket,
            slot: None,
            vacancy_waker: None,
        }))
    }

    fn insert_bucket(&mut self, at: usize, priority: i64) {
        self.buckets.insert(
            at,
            Bucket {
                priority,
                members: 0,
                ready: VecDeque::new(),
            },
        );
        for (_, subscription) in self.subscriptions.iter_mut() {
            if subscription.bucket >= at {
                subscription.bucket += 1;
            }
        }
        self.rebuild_ready_bits();
    }

    /// Recomputes `ready_buckets` after bucket indices shifted.
    fn rebuild_ready_bits(&mut self) {
        self.ready_buckets = vec![0; self.buckets.len().div_ceil(64)];
        for (index, bucket) in self.buckets.iter().enumerate() {
            if !bucket.ready.is_empty() {
                self.ready_buckets[index / 64] |= 1 << (index % 64);
            }
        }
    }

    /// Whether the subscription's slot is empty.
    pub fn has_vacancy(&self, key: SubscriptionKey) -> bool {
        self.subscriptions[key.0].slot.is_none()
    }

    /// Resolves when the subscription's slot is empty (or at once when the
    /// scheduler is closed, since nothing will empty it for a reader then
    /// except dispatching, which the reader must not wait for).
    pub fn poll_vacancy(&mut self, key: SubscriptionKey, cx: &mut Context<'_>) -> Poll<()> {
        let subscription = &mut self.subscriptions[key.0];
        if subscription.slot.is_none() || self.closed {
            return Poll::Ready(());
        }
        store_waker(&mut subscription.vacancy_waker, cx);
        Poll::Pending
    }

    /// Puts `message` into the subscription's slot.
    pub fn try_insert(&mut self, key: SubscriptionKey, message: M) -> Result<(), Rejected<M>> {
        if self.closed {
            return Err(Rejected::Closed(message));
        }
        let subscription = &mut self.subscriptions[key.0];
        if subscription.slot.is_some() {
            return Err(Rejected::Full(message));
        }
        subscription.slot = Some(message);
        let bucket = subscription.bucket;
        self.buckets[bucket].ready.push_back(key);
        self.ready_buckets[bucket / 64] |= 1 << (bucket % 64);
        if self.available > 0 {
            wake(&mut self.dispatch_waker);
        }
        Ok(())
    }

    /// Takes a permit and then the best waiting message.
    ///
    /// Returns `Ready(None)` once the scheduler is closed and every slot has
    /// been emptied. The permit comes first: while none is free, messages stay
    /// in their slots, so the choice is made when capacity frees up.
    pub fn poll_dispatch(&mut self, cx: &mut Context<'_>) -> Poll<Option<(SubscriptionKey, M)>> {
        if self.available == 0 {
            store_waker(&mut self.dispatch_waker, cx);
            return Poll::Pending;
        }
        match self.pick() {
            Some(picked) => {
                self.available -= 1;
                Poll::Ready(Some(picked))
            }
            None if self.closed => Poll::Ready(None),
            None => {
                store_waker(&mut self.dispatch_waker, cx);
                Poll::Pending
            }
        }
    }

    fn pick(&mut self) -> Option<(SubscriptionKey, M)> {
        let bucket = first_set_bit(&self.ready_buckets)?;
        let ready = &mut self.buckets[bucket].ready;
        let key = ready
            .pop_front()
            .expect("ready bit set for an empty bucket");
        if ready.is_empty() {
            self.ready_buckets[bucket / 64] &= !(1 << (bucket % 64));
        }
        let subscription = &mut self.subscriptions[key.0];
        let message = subscription
            .slot
            .take()
            .expect("ready queue names an empty slot");
        wake(&mut subscription.vacancy_waker);
        Some((key, message))
    }

    /// Returns the permit of a message whose processing has finished.
    pub fn release_permit(&mut self) {
        assert!(self.available < self.concurrency, "permit released twice");
        self.available += 1;
        wake(&mut self.dispatch_waker);
    }

    /// Number of dispatched messages whose permit has not come back yet.
    pub fn in_flight(&self) -> usize {
        self.concurrency - self.available
    }

    /// Resolves once no permit is taken.
    pub fn poll_idle(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.in_flight() == 0 {
            return Poll::Ready(());
        }
        store_waker(&mut self.dispatch_waker, cx);
        Poll::Pending
    }

    /// Refuses further insertions; messages already in slots stay there to
    /// be dispatched. Wakes the dispatch loop and every waiting reader.
    pub fn close(&mut self) {
        self.closed = true;
        wake(&mut self.dispatch_waker);
        for (_, subscription) in self.subscriptions.iter_mut() {
            wake(&mut subscription.vacancy_waker);
        }
    }
}

fn first_set_bit(words: &[u64]) -> Option<usize> {
    words
        .iter()
        .position(|&word| word != 0)
        .map(|index| index * 64 + words[index].trailing_zeros() as usize)
}

fn store_waker(slot: &mut Option<Waker>, cx: &mut Context<'_>) {
    match slot {
        Some(waker) if waker.will_wake(cx.waker()) => {}
        _ => *slot = Some(cx.waker().clone()),
    }
}

fn wake(slot: &mut Option<Waker>) {
    if let Some(waker) = slot.take() {
        waker.wake();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::task::noop_waker_ref;

    fn scheduler(concurrency: usize) -> Scheduler<&'static str> {
        Scheduler::new(NonZeroUsize::new(concurrency).unwrap())
    }

    fn dispatch(s: &mut Scheduler<&'static str>) -> Option<&'static str> {
        let mut cx = Context::from_waker(noop_waker_ref());
        match s.poll_dispatch(&mut cx) {
            Poll::Ready(Some((_, m))) => Some(m),
            _ => None,
        }
    }

    #[test]
    fn lower_priority_value_is_served_first_whatever_the_insertion_order() {
        let mut s = scheduler(10);
        let low = s.add_subscription(20);
        let high = s.add_subscription(5);
        let mid = s.add_subscription(10);
        s.try_insert(low, "low").unwrap();
        s.try_insert(mid, "mid").unwrap();
        s.try_insert(high, "high").unwrap();
        assert_eq!(dispatch(&mut s), Some("high"));
        assert_eq!(dispatch(&mut s), Some("mid"));
        assert_eq!(dispatch(&mut s), Some("low"));
        assert_eq!(dispatch(&mut s), None);
        assert_eq!(s.in_flight(), 3);
    }

    #[test]
    fn negative_and_sparse_priorities_are_ordered() {
        let mut s = scheduler(10);
        for (priority, name) in [
            (1000, "1000"),
            (-5, "-5"),
            (0, "0"),
            (i64::MIN, "min"),
            (7, "7"),
        ] {
            let key = s.add_subscription(priority);
            s.try_insert(key, name).unwrap();
        }
        let order: Vec<_> = std::iter::from_fn(|| dispatch(&mut s)).collect();
        assert_eq!(order, ["min", "-5", "0", "7", "1000"]);
    }

    #[test]
    fn equal_priorities_take_turns_while_all_stay_busy() {
        let mut s = scheduler(100);
        let names = ["a", "b", "c"];
        let keys: Vec<_> = names.iter().map(|_| s.add_subscription(10)).collect();
        for (key, name) in keys.iter().zip(names) {
            s.try_insert(*key, name).unwrap();
        }
        let mut cx = Context::from_waker(noop_waker_ref());
        let mut order = Vec::new();
        for _ in 0..6 {
            let Poll::Ready(Some((key, name))) = s.poll_dispatch(&mut cx) else {
                panic!("a message is waiting");
            };
            order.push(name);
            // The served subscription refills at once and so joins the back
            // of the line.
            s.try_insert(key, name).unwrap();
        }
        assert_eq!(order, ["a", "b", "c", "a", "b", "c"]);
    }

    #[test]
    fn a_full_slot_rejects_and_returns_the_message() {
        let mut s = scheduler(1);
        let a = s.add_subscription(1);
        s.try_insert(a, "first").unwrap();
        assert!(!s.has_vacancy(a));
        assert_eq!(s.try_insert(a, "second"), Err(Rejected::Full("second")));
    }

    #[test]
    fn no_message_is_picked_without_a_permit() {
        let mut s = scheduler(1);
        let low = s.add_subscription(20);
        let high = s.add_subscription(10);
        s.try_insert(low, "low-1").unwrap();
        assert_eq!(dispatch(&mut s), Some("low-1"));
        s.try_insert(low, "low-2").unwrap();
        assert_eq!(dispatch(&mut s), None, "the only permit is taken");
        // A high-priority message arriving while capacity is exhausted wins
        // once the permit comes back.
        s.try_insert(high, "high").unwrap();
        s.release_permit();
        assert_eq!(dispatch(&mut s), Some("high"));
        s.release_permit();
        assert_eq!(dispatch(&mut s), Some("low-2"));
    }

    #[test]
    fn closing_rejects_insertions_but_drains_slots() {
        let mut s = scheduler(5);
        let a = s.add_subscription(1);
        let b = s.add_subscription(2);
        s.try_insert(a, "a").unwrap();
        s.close();
        assert_eq!(s.try_insert(b, "b"), Err(Rejected::Closed("b")));
        assert_eq!(dispatch(&mut s), Some("a"));
        let mut cx = Context::from_waker(noop_waker_ref());
        assert!(matches!(s.poll_dispatch(&mut cx), Poll::Ready(None)));
        assert!(s.poll_idle(&mut cx).is_pending());
        s.release_permit();
        assert!(s.poll_idle(&mut cx).is_ready());
    }

    #[test]
    fn more_than_64_priority_levels_are_ordered() {
        let mut s = scheduler(200);
        let keys: Vec<_> = (0..150).rev().map(|p| (p, s.add_subscription(p))).collect();
        let names: Vec<&'static str> = (0..150)
            .map(|p| &*Box::leak(p.to_string().into_boxed_str()))
            .collect();
        for (p, key) in &keys {
            s.try_insert(*key, names[*p as usize]).unwrap();
        }
        let order: Vec<_> = std::iter::from_fn(|| dispatch(&mut s)).collect();
        assert_eq!(order, names);
    }

    #[test]
    fn dispatch_and_vacancy_wake_their_waiters() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        use std::sync::Arc;
        struct Counter(AtomicUsize);
        impl futures::task::ArcWake for Counter {
            fn wake_by_ref(arc_self: &Arc<Self>) {
                arc_self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let dispatch_wakes = Arc::new(Counter(AtomicUsize::new(0)));
        let reader_wakes = Arc::new(Counter(AtomicUsize::new(0)));
        let dispatch_waker = futures::task::waker(dispatch_wakes.clone());
        let reader_waker = futures::task::waker(reader_wakes.clone());
        let mut s = scheduler(1);
        let a = s.add_subscription(1);
        assert!(s
            .poll_dispatch(&mut Context::from_waker(&dispatch_waker))
            .is_pending());
        s.try_insert(a, "a").unwrap();
        assert_eq!(dispatch_wakes.0.load(Ordering::SeqCst), 1);
        assert!(s
            .poll_vacancy(a, &mut Context::from_waker(&reader_waker))
            .is_pending());
        assert!(s
            .poll_dispatch(&mut Context::from_waker(&dispatch_waker))
            .is_ready());
        assert_eq!(reader_wakes.0.load(Ordering::SeqCst), 1);
    }
}
