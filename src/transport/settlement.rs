//! What the Pulsar transport tells the broker about received messages, and
//! when: batch members are settled as one entry, and an entry acked
//! shortly before a connection failed is recognised when the broker
//! delivers it again.
//!
//! Both are bookkeeping above the `pulsar` crate, which acknowledges whole
//! entries and drops acknowledgements sent while its connection is down.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::hash::TrustedHashing;
use crate::message::MessageId;

/// Settlements of batch members, held until their batch is complete.
#[derive(Default)]
pub(super) struct BatchSettlements {
    by_entry: HashMap<EntryKey, BatchProgress, TrustedHashing>,
}

struct BatchProgress {
    /// One flag per member: settled yet?
    settled: Vec<bool>,
    all_succeeded: bool,
}

impl BatchSettlements {
    /// Records one settlement. Returns what to tell the broker about the
    /// message's entry, once there is something to tell: `Some(true)` to ack
    /// it, `Some(false)` to nack it, `None` while batch-mates are pending.
    /// Messages outside a batch are passed straight through.
    ///
    /// A member of an entry `acked` remembers has nothing left to tell: a
    /// rewind delivered it a second time, and its first copies completed
    /// and acked the entry meanwhile. Held, it would wait for batch-mates
    /// that never come again.
    pub(super) fn settle(
        &mut self,
        id: &MessageId,
        succeeded: bool,
        acked: &RecentAcks,
    ) -> Option<bool> {
        let (Some(index), Some(size)) = (id.batch_index(), id.batch_size()) else {
            return Some(succeeded);
        };
        let (Ok(index), Ok(size)) = (usize::try_from(index), usize::try_from(size)) else {
            return Some(succeeded);
        };
        if size <= 1 || index >= size {
            return Some(succeeded);
        }
        let entry = entry_of(id);
        let progress = match self.by_entry.entry(entry) {
            Entry::Occupied(progress) => progress.into_mut(),
            Entry::Vacant(_) if acked.contains(entry) => return None,
            Entry::Vacant(vacant) => vacant.insert(BatchProgress {
                settled: vec![false; size],
                all_succeeded: true,
            }),
        };
        progress.settled[index] = true;
        progress.all_succeeded &= succeeded;
        if progress.settled.iter().all(|&settled| settled) {
            let all_succeeded = progress.all_succeeded;
            self.by_entry.remove(&entry);
            Some(all_succeeded)
        } else {
            None
        }
    }
}

/// An entry on the broker: partition, ledger, entry.
pub(super) type EntryKey = (i32, u64, u64);

/// The entry a message id belongs to.
pub(super) fn entry_of(id: &MessageId) -> EntryKey {
    (id.partition(), id.ledger_id(), id.entry_id())
}

/// Entries acknowledged recently.
///
/// The crate drops an ack sent while its connection is down without telling
/// anyone; after it reconnects, the broker delivers the entry again. An
/// entry delivered again that was acked moments ago is therefore an ack
/// that was lost: it is acked again instead of being handled a second time.
/// The first such redelivery also shows that the connection came back, so
/// every remembered ack is sent again then, before the broker hands those
/// entries to another consumer of the subscription. Bounded by a count (an
/// age would cost a clock read per ack); what falls out can still come back
/// as a duplicate.
pub(super) struct RecentAcks {
    in_order: VecDeque<EntryKey>,
    entries: HashSet<EntryKey, TrustedHashing>,
    capacity: usize,
    last_bulk_resend: Option<Instant>,
    /// Redeliveries of acked entries recognised so far.
    pub(super) recognised: u64,
}

/// After a bulk re-send, another waits this long.
const BULK_RESEND_INTERVAL: Duration = Duration::from_secs(5);

impl RecentAcks {
    pub(super) fn new(capacity: usize) -> Self {
        RecentAcks {
            in_order: VecDeque::new(),
            entries: HashSet::default(),
            capacity,
            last_bulk_resend: None,
            recognised: 0,
        }
    }

    /// Remembers up to `capacity` entries from now on, if that is more
    /// than before (for a consumer whose topic gained partitions).
    pub(super) fn grow_to(&mut self, capacity: usize) {
        self.capacity = self.capacity.max(capacity);
    }

    /// Remembers that `entry` was acked.
    pub(super) fn record(&mut self, entry: EntryKey) {
        if self.in_order.len() >= self.capacity {
            if let Some(oldest) = self.in_order.pop_front() {
                self.entries.remove(&oldest);
            }
        }
        if self.entries.insert(entry) {
            self.in_order.push_back(entry);
        }
    }

    /// Whether `entry` was acked recently.
    pub(super) fn contains(&self, entry: EntryKey) -> bool {
        self.entries.contains(&entry)
    }

    /// Whether `entry` was acked recently; if so, counts a redelivery and
    /// returns the entries whose acks to send again: all remembered ones
    /// the first time after a while, otherwise just this one.
    pub(super) fn redelivered(&mut self, entry: EntryKey, now: Instant) -> Option<Vec<EntryKey>> {
        if !self.entries.contains(&entry) {
            return None;
        }
        self.recognised += 1;
        let bulk_due = self
            .last_bulk_resend
            .is_none_or(|last| now.duration_since(last) >= BULK_RESEND_INTERVAL);
        if !bulk_due {
            return Some(vec![entry]);
        }
        self.last_bulk_resend = Some(now);
        Some(self.in_order.iter().copied().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(entry: u64, index: i32, size: i32) -> MessageId {
        MessageId::new(1, entry, -1, Some(index)).with_batch_size(size)
    }

    #[test]
    fn unbatched_messages_settle_at_once() {
        let mut batches = BatchSettlements::default();
        let none = RecentAcks::new(0);
        assert_eq!(
            batches.settle(&MessageId::new(1, 2, -1, None), true, &none),
            Some(true)
        );
        assert_eq!(
            batches.settle(&MessageId::new(1, 3, -1, None), false, &none),
            Some(false)
        );
        assert_eq!(batches.settle(&member(4, 0, 1), true, &none), Some(true));
    }

    #[test]
    fn a_batch_is_acked_when_its_last_member_succeeds() {
        let mut batches = BatchSettlements::default();
        let none = RecentAcks::new(0);
        assert_eq!(batches.settle(&member(7, 2, 3), true, &none), None);
        assert_eq!(
            batches.settle(&member(8, 0, 2), true, &none),
            None,
            "another entry"
        );
        assert_eq!(batches.settle(&member(7, 0, 3), true, &none), None);
        assert_eq!(
            batches.settle(&member(7, 0, 3), true, &none),
            None,
            "a repeat changes nothing"
        );
        assert_eq!(batches.settle(&member(7, 1, 3), true, &none), Some(true));
        assert!(batches.by_entry.contains_key(&(-1, 1, 8)));
        assert!(!batches.by_entry.contains_key(&(-1, 1, 7)));
    }

    #[test]
    fn a_batch_with_a_failed_member_is_nacked_once_all_are_settled() {
        let mut batches = BatchSettlements::default();
        let none = RecentAcks::new(0);
        assert_eq!(batches.settle(&member(7, 0, 3), true, &none), None);
        assert_eq!(batches.settle(&member(7, 1, 3), false, &none), None);
        assert_eq!(batches.settle(&member(7, 2, 3), true, &none), Some(false));
        assert!(batches.by_entry.is_empty());
    }

    #[test]
    fn a_second_copy_of_a_member_settled_after_its_entry_was_acked_is_not_held() {
        // On an Exclusive subscription a nack rewinds: member 0 of entry 7,
        // already settled, is delivered again while member 1 is still
        // being handled. Member 1 then completes the entry, which is acked.
        let mut batches = BatchSettlements::default();
        let mut acked = RecentAcks::new(16);
        assert_eq!(batches.settle(&member(7, 0, 2), true, &acked), None);
        assert_eq!(batches.settle(&member(7, 1, 2), true, &acked), Some(true));
        acked.record((-1, 1, 7));
        // The second copy of member 0 settles last: nothing to tell, and
        // nothing held for an entry that is gone.
        assert_eq!(batches.settle(&member(7, 0, 2), true, &acked), None);
        assert_eq!(batches.settle(&member(7, 0, 2), false, &acked), None);
        assert!(batches.by_entry.is_empty());
        // Another entry is held as before.
        assert_eq!(batches.settle(&member(8, 0, 2), true, &acked), None);
        assert!(batches.by_entry.contains_key(&(-1, 1, 8)));
    }

    #[test]
    fn a_redelivered_acked_entry_is_recognised_and_the_first_one_resends_all() {
        let now = Instant::now();
        let mut acks = RecentAcks::new(3);
        for entry in 1..=4 {
            acks.record((0, 9, entry));
        }
        assert_eq!(
            acks.redelivered((0, 9, 1), now),
            None,
            "evicted at capacity"
        );
        assert_eq!(acks.redelivered((1, 9, 4), now), None, "another partition");
        assert_eq!(
            acks.redelivered((0, 9, 3), now),
            Some(vec![(0, 9, 2), (0, 9, 3), (0, 9, 4)])
        );
        assert_eq!(acks.redelivered((0, 9, 4), now), Some(vec![(0, 9, 4)]));
        assert_eq!(
            acks.redelivered((0, 9, 2), now + BULK_RESEND_INTERVAL)
                .map(|all| all.len()),
            Some(3),
            "a later reconnection resends all again"
        );
        assert_eq!(acks.recognised, 3);
    }

    #[test]
    fn a_grown_capacity_remembers_more_acks() {
        let now = Instant::now();
        let mut acks = RecentAcks::new(2);
        acks.record((0, 9, 1));
        acks.record((0, 9, 2));
        acks.grow_to(4);
        acks.grow_to(3);
        for entry in 3..=4 {
            acks.record((1, 9, entry));
        }
        assert_eq!(
            acks.redelivered((0, 9, 1), now).map(|all| all.len()),
            Some(4),
            "nothing evicted below the new capacity"
        );
        acks.record((1, 9, 5));
        assert_eq!(acks.redelivered((0, 9, 1), now), None, "the oldest goes");
    }
}
