//! The pure scheduler: priority buckets, one-message slots and the permit count.
//!
//! This module owns the decision of *which* waiting message runs next and
//! *whether* anything may run at all. It knows nothing of Pulsar, tasks,
//! wakers or I/O: it is generic over the message type and driven through
//! plain method calls, so it can be tested exhaustively and benchmarked
//! alone. Whoever inserts a message or returns a permit asks it for work
//! right away; nothing in it waits.
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
    /// Full slots, across all buckets.
    waiting: usize,
    closed: bool,
}

impl<M> std::fmt::Debug for Scheduler<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("subscriptions", &self.subscriptions.len())
            .field("priorities", &self.buckets.len())
            .field("waiting", &self.waiting)
            .field("in_flight", &self.in_flight())
            .field("concurrency", &self.concurrency)
            .field("closed", &self.closed)
            .finish()
    }
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
            waiting: 0,
            closed: false,
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
        let bucket_state = &mut self.buckets[bucket];
        bucket_state.members += 1;
        // Room for every member at once, so that the queue never grows
        // while messages are dispatched.
        let room = bucket_state.members - bucket_state.ready.len();
        bucket_state.ready.reserve(room);
        SubscriptionKey(
            self.subscriptions
                .insert(Subscription { bucket, slot: None }),
        )
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
        self.waiting += 1;
        Ok(())
    }

    /// Takes a permit and then the best waiting message, if there is both.
    ///
    /// The permit comes first: while none is free, messages stay in their
    /// slots, so the choice is made when capacity frees up.
    pub fn try_dispatch(&mut self) -> Option<(SubscriptionKey, M)> {
        if self.available == 0 {
            return None;
        }
        let picked = self.pick()?;
        self.available -= 1;
        Some(picked)
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
        let message = self.subscriptions[key.0]
            .slot
            .take()
            .expect("ready queue names an empty slot");
        self.waiting -= 1;
        Some((key, message))
    }

    /// Takes the best waiting message without a permit (to give it back
    /// when the dispatcher gives up on it).
    pub fn take_waiting(&mut self) -> Option<(SubscriptionKey, M)> {
        self.pick()
    }

    /// Returns the permit of a message whose processing has finished.
    pub fn release_permit(&mut self) {
        assert!(self.available < self.concurrency, "permit released twice");
        self.available += 1;
    }

    /// Number of dispatched messages whose permit has not come back yet.
    pub fn in_flight(&self) -> usize {
        self.concurrency - self.available
    }

    /// Number of permits free.
    pub fn available(&self) -> usize {
        self.available
    }

    /// Number of messages waiting in slots.
    pub fn waiting(&self) -> usize {
        self.waiting
    }

    /// Whether nothing waits and nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.waiting == 0 && self.in_flight() == 0
    }

    /// Refuses further insertions; messages already in slots stay there to
    /// be dispatched.
    pub fn close(&mut self) {
        self.closed = true;
    }
}

fn first_set_bit(words: &[u64]) -> Option<usize> {
    words
        .iter()
        .position(|&word| word != 0)
        .map(|index| index * 64 + words[index].trailing_zeros() as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scheduler(concurrency: usize) -> Scheduler<&'static str> {
        Scheduler::new(NonZeroUsize::new(concurrency).unwrap())
    }

    fn dispatch(s: &mut Scheduler<&'static str>) -> Option<&'static str> {
        s.try_dispatch().map(|(_, message)| message)
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
        let mut order = Vec::new();
        for _ in 0..6 {
            let (key, name) = s.try_dispatch().expect("a message is waiting");
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
        assert_eq!(s.waiting(), 1);
        assert_eq!(dispatch(&mut s), Some("a"));
        assert_eq!(dispatch(&mut s), None);
        assert!(!s.is_idle(), "one message is in flight");
        s.release_permit();
        assert!(s.is_idle());
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
    fn ready_queues_hold_their_whole_bucket_without_growing() {
        let mut s = scheduler(1);
        let keys: Vec<_> = (0..10).map(|_| s.add_subscription(7)).collect();
        let capacity = s.buckets[0].ready.capacity();
        assert!(capacity >= 10, "capacity {capacity} for 10 members");
        for key in keys {
            s.try_insert(key, "m").unwrap();
        }
        assert_eq!(s.buckets[0].ready.capacity(), capacity);
        assert_eq!(s.waiting(), 10);
    }
}
