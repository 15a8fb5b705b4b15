//! What the Pulsar transport tells the broker about received messages, and
//! when: batch members are settled as one entry, an entry acked shortly
//! before a connection failed is recognised when the broker delivers it
//! again, and on subscriptions with one position on the broker (Exclusive,
//! Failover) the acks of a run of entries go out as one cumulative ack.
//!
//! All three are bookkeeping above the `pulsar` crate, which acknowledges
//! whole entries, drops acknowledgements sent while its connection is down,
//! and sends each acknowledgement in a frame and a system call of its own.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use crate::message::MessageId;

/// Settlements of batch members, held until their batch is complete.
#[derive(Default)]
pub(super) struct BatchSettlements {
    by_entry: HashMap<(u64, u64, i32), BatchProgress>,
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
    pub(super) fn settle(&mut self, id: &MessageId, succeeded: bool) -> Option<bool> {
        let (Some(index), Some(size)) = (id.batch_index(), id.batch_size()) else {
            return Some(succeeded);
        };
        let (Ok(index), Ok(size)) = (usize::try_from(index), usize::try_from(size)) else {
            return Some(succeeded);
        };
        if size <= 1 || index >= size {
            return Some(succeeded);
        }
        let entry = (id.ledger_id(), id.entry_id(), id.partition());
        let progress = self.by_entry.entry(entry).or_insert_with(|| BatchProgress {
            settled: vec![false; size],
            all_succeeded: true,
        });
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
    entries: HashSet<EntryKey>,
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
            entries: HashSet::new(),
            capacity,
            last_bulk_resend: None,
            recognised: 0,
        }
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

/// How many acks are held back at most before they go out.
const GROUP_SIZE: usize = 1000;

/// Acks held back to go to the broker as cumulative ones, for a
/// subscription whose position on the broker is one line (Exclusive,
/// Failover): acknowledging entry `e` cumulatively acknowledges every entry
/// of its partition up to `e`.
///
/// Invariant: a cumulative ack never covers an entry received and not
/// acked (in flight, or nacked and waiting to come back). So, per
/// partition, the held acks below the first such entry go out as one
/// cumulative ack of the highest, and those above it one by one. Acks are
/// held for at most the group time, or until [`GROUP_SIZE`] are held.
pub(super) struct GroupedAcks {
    /// Entries received and not acked.
    unsettled: BTreeSet<EntryKey>,
    /// Entries acked and not yet told to the broker.
    held: BTreeSet<EntryKey>,
    /// When the first of `held` must go out.
    due: Option<Instant>,
    group_time: Duration,
}

/// An ack to send.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Ack {
    /// This entry and every earlier one of its partition.
    Cumulative(EntryKey),
    /// This entry alone.
    Single(EntryKey),
}

impl GroupedAcks {
    pub(super) fn new(group_time: Duration) -> Self {
        GroupedAcks {
            unsettled: BTreeSet::new(),
            held: BTreeSet::new(),
            due: None,
            group_time,
        }
    }

    /// An entry the consumer handed over (again, if it was nacked).
    pub(super) fn received(&mut self, entry: EntryKey) {
        self.unsettled.insert(entry);
    }

    /// Holds the ack of `entry`; returns whether the held acks should go
    /// out now.
    pub(super) fn acked(&mut self, entry: EntryKey, now: Instant) -> bool {
        self.unsettled.remove(&entry);
        self.held.insert(entry);
        let due = *self.due.get_or_insert(now + self.group_time);
        self.held.len() >= GROUP_SIZE || due <= now
    }

    /// When the held acks must go out; `None` while none are held.
    pub(super) fn due(&self) -> Option<Instant> {
        self.due
    }

    /// Takes every held ack as what to send: per partition, a cumulative
    /// ack of the highest held entry below the partition's first unsettled
    /// one, and single acks of the held entries above it.
    pub(super) fn take(&mut self) -> Vec<Ack> {
        self.due = None;
        let mut acks = Vec::new();
        // The partition at hand and its first unsettled entry.
        let mut partition: Option<(i32, EntryKey)> = None;
        let mut cumulative = None;
        // In order: by partition, then ledger, then entry.
        for entry in std::mem::take(&mut self.held) {
            let first_unsettled = match partition {
                Some((index, first)) if index == entry.0 => first,
                _ => {
                    acks.extend(cumulative.take().map(Ack::Cumulative));
                    let first = self.first_unsettled(entry.0);
                    partition = Some((entry.0, first));
                    first
                }
            };
            if entry < first_unsettled {
                cumulative = Some(entry);
            } else {
                acks.push(Ack::Single(entry));
            }
        }
        acks.extend(cumulative.map(Ack::Cumulative));
        acks
    }

    /// The partition's first entry received and not acked, or a key above
    /// all of its entries.
    fn first_unsettled(&self, partition: i32) -> EntryKey {
        self.unsettled
            .range((partition, 0, 0)..)
            .next()
            .copied()
            .filter(|first| first.0 == partition)
            .unwrap_or((partition, u64::MAX, u64::MAX))
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
        assert_eq!(
            batches.settle(&MessageId::new(1, 2, -1, None), true),
            Some(true)
        );
        assert_eq!(
            batches.settle(&MessageId::new(1, 3, -1, None), false),
            Some(false)
        );
        assert_eq!(batches.settle(&member(4, 0, 1), true), Some(true));
    }

    #[test]
    fn a_batch_is_acked_when_its_last_member_succeeds() {
        let mut batches = BatchSettlements::default();
        assert_eq!(batches.settle(&member(7, 2, 3), true), None);
        assert_eq!(
            batches.settle(&member(8, 0, 2), true),
            None,
            "another entry"
        );
        assert_eq!(batches.settle(&member(7, 0, 3), true), None);
        assert_eq!(
            batches.settle(&member(7, 0, 3), true),
            None,
            "a repeat changes nothing"
        );
        assert_eq!(batches.settle(&member(7, 1, 3), true), Some(true));
        assert!(batches.by_entry.contains_key(&(1, 8, -1)));
        assert!(!batches.by_entry.contains_key(&(1, 7, -1)));
    }

    #[test]
    fn a_batch_with_a_failed_member_is_nacked_once_all_are_settled() {
        let mut batches = BatchSettlements::default();
        assert_eq!(batches.settle(&member(7, 0, 3), true), None);
        assert_eq!(batches.settle(&member(7, 1, 3), false), None);
        assert_eq!(batches.settle(&member(7, 2, 3), true), Some(false));
        assert!(batches.by_entry.is_empty());
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

    const GROUP_TIME: Duration = Duration::from_millis(100);

    #[test]
    fn acks_in_receive_order_go_out_as_one_cumulative_ack() {
        let now = Instant::now();
        let mut grouped = GroupedAcks::new(GROUP_TIME);
        for entry in 1..=5 {
            grouped.received((0, 7, entry));
        }
        for entry in [2, 1, 4, 3] {
            assert!(!grouped.acked((0, 7, entry), now), "held");
        }
        assert_eq!(grouped.due(), Some(now + GROUP_TIME));
        assert_eq!(grouped.take(), [Ack::Cumulative((0, 7, 4))]);
        assert_eq!(grouped.due(), None);
        assert!(grouped.held.is_empty());
        grouped.acked((0, 7, 5), now);
        assert_eq!(grouped.take(), [Ack::Cumulative((0, 7, 5))]);
    }

    #[test]
    fn no_cumulative_ack_covers_an_entry_in_flight_or_nacked() {
        let now = Instant::now();
        let mut grouped = GroupedAcks::new(GROUP_TIME);
        // Partition 0: entry 3 in flight. Partition 1: entry 10 nacked (it
        // stays unsettled until it comes back and is acked).
        for entry in 1..=5 {
            grouped.received((0, 7, entry));
        }
        for entry in 9..=12 {
            grouped.received((1, 2, entry));
        }
        for entry in [1, 2, 4, 5] {
            grouped.acked((0, 7, entry), now);
        }
        for entry in [9, 11, 12] {
            grouped.acked((1, 2, entry), now);
        }
        assert_eq!(
            grouped.take(),
            [
                Ack::Single((0, 7, 4)),
                Ack::Single((0, 7, 5)),
                Ack::Cumulative((0, 7, 2)),
                Ack::Single((1, 2, 11)),
                Ack::Single((1, 2, 12)),
                Ack::Cumulative((1, 2, 9)),
            ]
        );
        grouped.received((1, 2, 10));
        grouped.acked((0, 7, 3), now);
        grouped.acked((1, 2, 10), now);
        assert_eq!(
            grouped.take(),
            [Ack::Cumulative((0, 7, 3)), Ack::Cumulative((1, 2, 10))]
        );
    }

    #[test]
    fn a_later_ledger_sorts_after_an_earlier_one() {
        let now = Instant::now();
        let mut grouped = GroupedAcks::new(GROUP_TIME);
        grouped.received((0, 7, 900));
        grouped.received((0, 8, 0));
        grouped.acked((0, 8, 0), now);
        assert_eq!(grouped.take(), [Ack::Single((0, 8, 0))]);
        grouped.acked((0, 7, 900), now);
        assert_eq!(grouped.take(), [Ack::Cumulative((0, 7, 900))]);
    }

    #[test]
    fn acks_go_out_when_due_or_when_many() {
        let now = Instant::now();
        let mut grouped = GroupedAcks::new(GROUP_TIME);
        grouped.received((0, 1, 1));
        grouped.received((0, 1, 2));
        assert!(!grouped.acked((0, 1, 1), now));
        assert!(grouped.acked((0, 1, 2), now + GROUP_TIME), "due");
        grouped.take();
        for entry in 0..GROUP_SIZE as u64 {
            grouped.received((0, 2, entry));
        }
        for entry in 0..GROUP_SIZE as u64 - 1 {
            assert!(!grouped.acked((0, 2, entry), now));
        }
        assert!(grouped.acked((0, 2, GROUP_SIZE as u64 - 1), now), "many");
        assert_eq!(
            grouped.take(),
            [Ack::Cumulative((0, 2, GROUP_SIZE as u64 - 1))]
        );
    }
}
