//! What one subscription holds in the scheduler: the messages it has
//! received and not yet dispatched, and, for key ordering, which keys are
//! in flight.
//!
//! Unordered and subscription-ordered subscriptions hold one message (the
//! slot). A key-ordered subscription holds up to its buffer size: messages
//! whose key is free, in the order they were received, and messages parked
//! until a message with the same key, dispatched earlier, is released. Keys
//! arrive hashed to a `u64`; a message without a key waits for no one.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use crate::hash::BuildIdentity;

/// A message waiting in the scheduler.
pub(super) struct Waiting<M> {
    pub(super) message: M,
    /// Its ordering key, hashed (key ordering only).
    pub(super) key: Option<u64>,
    /// When it was inserted (the aging policy only).
    pub(super) since: Option<Instant>,
}

pub(super) enum Held<M> {
    /// The one-message slot.
    Slot(Option<Waiting<M>>),
    Keyed(Keyed<M>),
}

pub(super) struct Keyed<M> {
    /// Messages whose keys are free, in receive order.
    free: VecDeque<Waiting<M>>,
    /// Messages whose key is in flight or claimed by an earlier message, in
    /// receive order.
    parked: VecDeque<Waiting<M>>,
    /// Keys of dispatched messages not released yet.
    in_flight: HashSet<u64, BuildIdentity>,
    capacity: usize,
}

impl<M> Held<M> {
    /// A slot, or a key-ordered buffer of `capacity` messages whose keys may
    /// be in flight `concurrent` at a time.
    pub(super) fn new(keyed: bool, capacity: usize, concurrent: usize) -> Self {
        if !keyed {
            return Held::Slot(None);
        }
        let mut in_flight = HashSet::default();
        // Room for every key that can be in flight, so that steady traffic
        // allocates nothing.
        in_flight.reserve(concurrent);
        Held::Keyed(Keyed {
            free: VecDeque::with_capacity(capacity),
            parked: VecDeque::with_capacity(capacity),
            in_flight,
            capacity,
        })
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
            Held::Slot(slot) => slot.as_ref().and_then(|waiting| waiting.since),
            Held::Keyed(keyed) => keyed.free.front().and_then(|waiting| waiting.since),
        }
    }

    /// Stores a message; the caller has checked for room.
    pub(super) fn insert(&mut self, waiting: Waiting<M>) {
        match self {
            Held::Slot(slot) => *slot = Some(waiting),
            Held::Keyed(keyed) => keyed.insert(waiting),
        }
    }

    /// Takes the next message to dispatch; its key (if any) is then in
    /// flight until released.
    pub(super) fn take_next(&mut self) -> Option<Waiting<M>> {
        match self {
            Held::Slot(slot) => slot.take(),
            Held::Keyed(keyed) => {
                let waiting = keyed.free.pop_front()?;
                if let Some(key) = waiting.key {
                    keyed.in_flight.insert(key);
                }
                Some(waiting)
            }
        }
    }

    /// Takes any held message, dispatchable or not (to give it back).
    pub(super) fn take_any(&mut self) -> Option<Waiting<M>> {
        match self {
            Held::Slot(slot) => slot.take(),
            Held::Keyed(keyed) => keyed.free.pop_front().or_else(|| keyed.parked.pop_front()),
        }
    }

    /// A dispatched message with `key` was released: the earliest message
    /// parked behind it becomes free.
    pub(super) fn release(&mut self, key: Option<u64>) {
        let (Held::Keyed(keyed), Some(key)) = (self, key) else {
            return;
        };
        keyed.in_flight.remove(&key);
        if let Some(at) = keyed.parked.iter().position(|w| w.key == Some(key)) {
            let unparked = keyed.parked.remove(at).expect("a parked message");
            keyed.free.push_back(unparked);
        }
    }
}

impl<M> Keyed<M> {
    fn insert(&mut self, waiting: Waiting<M>) {
        let claimed = waiting.key.is_some_and(|key| {
            self.in_flight.contains(&key)
                || self.free.iter().any(|w| w.key == Some(key))
                || self.parked.iter().any(|w| w.key == Some(key))
        });
        if claimed {
            self.parked.push_back(waiting);
        } else {
            self.free.push_back(waiting);
        }
    }
}
