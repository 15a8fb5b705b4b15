//! What one subscription holds in the scheduler: the messages it has
//! received and not yet dispatched, and, for key ordering, how many
//! messages held or in flight claim each key.
//!
//! Unordered and subscription-ordered subscriptions hold one message (the
//! slot). A key-ordered subscription holds up to its buffer size: messages
//! whose key is free, in the order they became free, and messages parked
//! until a message with the same key, dispatched earlier, is released; the
//! messages of one key stay in the order they were received. Keys
//! arrive hashed to a `u64`; a message without a key waits for no one.

use std::collections::VecDeque;
use std::time::Instant;

use super::claims::Claims;

/// A message waiting in the scheduler.
pub(super) struct Waiting<M> {
    pub(super) message: M,
    /// Its ordering key, hashed (key ordering only).
    pub(super) key: Option<u64>,
    /// When it was inserted (the aging policy only).
    pub(super) since: Option<Instant>,
}

/// Small, so that a subscription's place in the scheduler fits in one
/// cache line (see `Subscription`): a slot keeps no key (one message waits
/// for no other, so its key would be released unread), and the key-ordered
/// buffer, rarer, is boxed.
pub(super) enum Held<M> {
    /// The one-message slot.
    Slot(Option<Slotted<M>>),
    Keyed(Box<Keyed<M>>),
}

/// The message in a slot, and when it was inserted (the aging policy only).
pub(super) struct Slotted<M> {
    pub(super) message: M,
    pub(super) since: Option<Instant>,
}

impl<M> Slotted<M> {
    fn into_waiting(self) -> Waiting<M> {
        Waiting {
            message: self.message,
            key: None,
            since: self.since,
        }
    }
}

pub(super) struct Keyed<M> {
    /// Messages whose key no earlier message claims, in the order they
    /// became free: receive order, but that a message unparked by a
    /// release goes to the back.
    free: VecDeque<Waiting<M>>,
    /// Messages whose key an earlier message, held or in flight, claims, in
    /// receive order.
    parked: VecDeque<Waiting<M>>,
    /// For each key, how many of its messages are held or in flight.
    ///
    /// Invariant: a key with a claim has at most one message free or in
    /// flight (the earliest); the rest are parked behind it.
    claims: Claims,
    capacity: usize,
}

impl<M> Held<M> {
    /// A slot, or a key-ordered buffer of `capacity` messages whose keys may
    /// be in flight `concurrent` at a time.
    pub(super) fn new(keyed: bool, capacity: usize, concurrent: usize) -> Self {
        if !keyed {
            return Held::Slot(None);
        }
        Held::Keyed(Box::new(Keyed {
            free: VecDeque::with_capacity(capacity),
            parked: VecDeque::with_capacity(capacity),
            // Room for every key that can be held or in flight at once.
            claims: Claims::with_room(capacity.saturating_add(concurrent)),
            capacity,
        }))
    }

    /// How many messages it holds.
    pub(super) fn len(&self) -> usize {
        match self {
            Held::Slot(slot) => usize::from(slot.is_some()),
            Held::Keyed(keyed) => keyed.free.len() + keyed.parked.len(),
        }
    }

    pub(super) fn has_room(&self) -> bool {
        match self {
            Held::Slot(slot) => slot.is_none(),
            Held::Keyed(keyed) => keyed.free.len() + keyed.parked.len() < keyed.capacity,
        }
    }

    /// Whether a message could be dispatched now (limits aside).
    pub(super) fn has_dispatchable(&self) -> bool {
        match self {
            Held::Slot(slot) => slot.is_some(),
            Held::Keyed(keyed) => !keyed.free.is_empty(),
        }
    }

    /// When the next message to dispatch was inserted (aging).
    pub(super) fn next_since(&self) -> Option<Instant> {
        match self {
            Held::Slot(slot) => slot.as_ref().and_then(|slotted| slotted.since),
            Held::Keyed(keyed) => keyed.free.front().and_then(|waiting| waiting.since),
        }
    }

    /// Stores a message; the caller has checked for room.
    pub(super) fn insert(&mut self, waiting: Waiting<M>) {
        match self {
            Held::Slot(slot) => {
                *slot = Some(Slotted {
                    message: waiting.message,
                    since: waiting.since,
                })
            }
            Held::Keyed(keyed) => keyed.insert(waiting),
        }
    }

    /// Takes the next message to dispatch; its key (if any) is then in
    /// flight until released.
    pub(super) fn take_next(&mut self) -> Option<Waiting<M>> {
        match self {
            Held::Slot(slot) => slot.take().map(Slotted::into_waiting),
            Held::Keyed(keyed) => keyed.free.pop_front(),
        }
    }

    /// Takes any held message, dispatchable or not (to give it back).
    pub(super) fn take_any(&mut self) -> Option<Waiting<M>> {
        match self {
            Held::Slot(slot) => slot.take().map(Slotted::into_waiting),
            Held::Keyed(keyed) => keyed.take_any(),
        }
    }

    /// A dispatched message with `key` was released: the earliest message
    /// parked behind it becomes free.
    pub(super) fn release(&mut self, key: Option<u64>) {
        let (Held::Keyed(keyed), Some(key)) = (self, key) else {
            return;
        };
        keyed.release(key);
    }
}

impl<M> Keyed<M> {
    /// Stores a message refilled within a pick (the pick left room);
    /// returns whether the refill is done: a message held may run, or the
    /// buffer is full.
    #[inline(always)]
    pub(super) fn store_refilled(&mut self, waiting: Waiting<M>) -> bool {
        self.insert(waiting);
        !self.waits_for_busy_keys()
    }

    #[inline(always)]
    fn insert(&mut self, waiting: Waiting<M>) {
        let Some(key) = waiting.key else {
            return self.free.push_back(waiting);
        };
        if self.claims.claim(key) == 1 {
            self.free.push_back(waiting);
        } else {
            self.parked.push_back(waiting);
        }
    }

    /// Whether everything it holds waits for a busy key and it has room:
    /// a refill takes more then.
    pub(super) fn waits_for_busy_keys(&self) -> bool {
        self.free.is_empty() && self.parked.len() < self.capacity
    }

    /// A re-dispatch ([`Redispatch::exchange`]): releases the ended
    /// message's key, then hands out the earliest free message through
    /// `exchange`, which puts the subscription's next message in its place,
    /// and stores that one as received, its key told by `key_of`. The
    /// buffer has a free message (the re-dispatch is offered for it), and
    /// the release frees any message behind it. Returns the key of the
    /// message handed out, in flight now.
    ///
    /// [`Redispatch::exchange`]: super::Redispatch::exchange
    pub(super) fn exchange(
        &mut self,
        ended: Option<u64>,
        exchange: impl FnOnce(&mut M),
        key_of: impl FnOnce(&M) -> Option<u64>,
    ) -> Option<u64> {
        if let Some(key) = ended {
            self.release(key);
        }
        let mut waiting = self
            .free
            .pop_front()
            .expect("a re-dispatch is offered for a free message");
        let handed_out = waiting.key;
        exchange(&mut waiting.message);
        // Under the strict policy, the only one that re-dispatches, no
        // message keeps the time it was inserted.
        debug_assert!(waiting.since.is_none());
        waiting.key = key_of(&waiting.message);
        self.insert(waiting);
        handed_out
    }

    /// Free messages go first, then parked ones, each in their queue's
    /// order.
    fn take_any(&mut self) -> Option<Waiting<M>> {
        if let Some(waiting) = self.free.pop_front() {
            // Nothing of its key is in flight, so it was the key's holder.
            if let Some(key) = waiting.key {
                self.release(key);
            }
            return Some(waiting);
        }
        // With nothing free, the key of a parked message is in flight.
        let waiting = self.parked.pop_front()?;
        if let Some(key) = waiting.key {
            self.claims.unclaim(key);
        }
        Some(waiting)
    }

    /// The key's holder (free or in flight) is gone: the earliest message
    /// parked behind it becomes free. Out of line, as every caller of
    /// `Scheduler::release` would otherwise carry it (the unordered path
    /// took 10 instructions per message more with it inlined); the rarer
    /// case of a key whose messages overlap is a call of its own.
    #[inline(never)]
    fn release(&mut self, key: u64) {
        if self.claims.unclaim(key) > 0 {
            self.unpark(key);
        }
    }

    /// Frees the earliest message parked behind `key`.
    #[inline(never)]
    fn unpark(&mut self, key: u64) {
        let at = self.parked.iter().position(|w| w.key == Some(key));
        let unparked = self
            .parked
            .remove(at.expect("a claimed key has a parked message"));
        self.free.push_back(unparked.expect("a parked message"));
    }
}
