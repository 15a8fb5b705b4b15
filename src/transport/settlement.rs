//! What the Pulsar transport tells the broker about received messages, and
//! when: batch members are settled as one entry, and an entry acked
//! shortly before a connection failed is recognised when the broker
//! delivers it again.
//!
//! Both are bookkeeping above the `pulsar` crate, which acknowledges whole
//! entries and drops acknowledgements sent while its connection is down.

use std::cell::LazyCell;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

use pulsar::proto::MessageIdData;
use tokio::time::Instant;

use super::sockets::{ConnectionLoss, ConnectionLosses};
use crate::hash::TrustedHashing;
use crate::message::MessageId;

/// Settlements of batch members, held until their batch is complete, and
/// which members of a nacked batch succeeded.
///
/// A nacked batch comes back whole: the broker redelivers entries, not
/// members. Its members that succeeded the first time (acked, or routed to
/// a retry or dead-letter topic and acked) are not handled again when it
/// comes back to this consumer: they settle as succeeded on arrival, so
/// that only the members that failed run again. The memory is bounded by a
/// count of batches (`NACKED_BATCHES`); a batch that falls out of it, or
/// that the broker hands to another consumer, runs whole again.
#[derive(Default)]
pub(super) struct BatchSettlements {
    by_entry: HashMap<EntryKey, BatchProgress, TrustedHashing>,
    nacked: NackedBatches,
    /// Members that came back after they had succeeded, settled again
    /// without being handed out, so far.
    pub(super) redelivered_after_success: u64,
}

struct BatchProgress {
    /// One per member: `None` while pending, then whether it succeeded.
    members: Vec<Option<bool>>,
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
        let Some((index, size)) = member_of_batch(id) else {
            return Some(succeeded);
        };
        let entry = entry_of(id);
        let progress = match self.by_entry.entry(entry) {
            Entry::Occupied(progress) => progress.into_mut(),
            Entry::Vacant(_) if acked.contains(entry) => return None,
            Entry::Vacant(vacant) => vacant.insert(BatchProgress {
                members: vec![None; size],
            }),
        };
        progress.members[index] = Some(succeeded);
        if progress.members.iter().any(Option::is_none) {
            return None;
        }
        let members = self
            .by_entry
            .remove(&entry)
            .expect("the progress just updated")
            .members;
        let all_succeeded = members.iter().all(|&member| member == Some(true));
        if all_succeeded {
            self.nacked.forget(entry);
        } else {
            self.nacked.remember(entry, members);
        }
        Some(all_succeeded)
    }

    /// Whether a batch member that just arrived was settled before: in
    /// this delivery of its batch (a second copy, which a rewind or a
    /// reconnection delivered while batch-mates are still being handled),
    /// or with success in an earlier delivery that was nacked for another
    /// member. `None` for a member to hand out, and for any other message.
    pub(super) fn settled_before(&self, id: &MessageId) -> Option<SettledBefore> {
        let (index, _) = member_of_batch(id)?;
        let entry = entry_of(id);
        let progress = self.by_entry.get(&entry);
        if progress.is_some_and(|progress| progress.members[index].is_some()) {
            return Some(SettledBefore::InThisDelivery);
        }
        self.nacked
            .succeeded(entry, index)
            .then_some(SettledBefore::SucceededInAnEarlierDelivery)
    }
}

/// When a batch member that arrives again was settled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum SettledBefore {
    /// Its batch is still being settled: its settlement is held with the
    /// batch's, and the copy has nothing to add.
    InThisDelivery,
    /// It succeeded when its batch was delivered before, and the batch was
    /// nacked for another member: it is settled as succeeded again.
    SucceededInAnEarlierDelivery,
}

/// The member's index and its batch's size, for a member of a batch of
/// more than one.
fn member_of_batch(id: &MessageId) -> Option<(usize, usize)> {
    let index = usize::try_from(id.batch_index()?).ok()?;
    let size = usize::try_from(id.batch_size()?).ok()?;
    (size > 1 && index < size).then_some((index, size))
}

/// How many nacked batches a consumer remembers the succeeded members of.
const NACKED_BATCHES: usize = 1024;

/// The members that succeeded in recently nacked batches, oldest first out.
#[derive(Default)]
struct NackedBatches {
    in_order: VecDeque<EntryKey>,
    succeeded: HashMap<EntryKey, Vec<bool>, TrustedHashing>,
}

impl NackedBatches {
    /// Remembers which of an entry's settled members succeeded, on top of
    /// those that succeeded in its earlier deliveries (settled again as
    /// succeeded on arrival, so already among them).
    fn remember(&mut self, entry: EntryKey, members: Vec<Option<bool>>) {
        let succeeded = members.iter().map(|&member| member == Some(true)).collect();
        if self.succeeded.insert(entry, succeeded).is_some() {
            return;
        }
        if self.in_order.len() >= NACKED_BATCHES {
            if let Some(oldest) = self.in_order.pop_front() {
                self.succeeded.remove(&oldest);
            }
        }
        self.in_order.push_back(entry);
    }

    fn forget(&mut self, entry: EntryKey) {
        if self.succeeded.remove(&entry).is_some() {
            self.in_order.retain(|remembered| *remembered != entry);
        }
    }

    fn succeeded(&self, entry: EntryKey, index: usize) -> bool {
        self.succeeded
            .get(&entry)
            .and_then(|members| members.get(index))
            .is_some_and(|&succeeded| succeeded)
    }
}

/// An entry on the broker: partition, ledger, entry.
pub(super) type EntryKey = (i32, u64, u64);

/// The entry a message id belongs to.
pub(super) fn entry_of(id: &MessageId) -> EntryKey {
    (id.partition(), id.ledger_id(), id.entry_id())
}

/// The entry of a chunk (see `chunks`), as [`entry_of`] its message's.
pub(super) fn entry_of_chunk(id: &MessageIdData) -> EntryKey {
    (id.partition.unwrap_or(-1), id.ledger_id, id.entry_id)
}

/// Entries acknowledged recently, and when.
///
/// The crate drops an ack sent while its connection is down without telling
/// anyone, and a broker that crashes loses the acks of its last moments;
/// after the consumer reconnects, the broker delivers those entries again.
/// An entry delivered again whose ack was sent at most [`LOST_ACK_WINDOW`]
/// before the connection was lost is therefore taken for a lost ack: it is
/// acked again instead of being handled a second time. The first such
/// redelivery also shows that the connection came back, so every
/// remembered ack that may have been lost is sent again then, before the
/// broker hands those entries to another consumer of the subscription.
///
/// The connection was lost when the partition's consumer was last found
/// stopped (see [`Outage`]), if that was after the ack. The crate also
/// reconnects by itself, after a topic unload or a broker restart, and
/// tells nobody: a broker connection found gone and made again among the
/// process's sockets (a [`ConnectionLoss`]; the last few are kept, and any
/// of them may cover an ack) covers the acks sent at most the window before
/// the lost connection was last seen open, or after, until the new one was
/// seen, for the redeliveries taken within [`REDELIVERY_TAKEN_WITHIN`]
/// after that. Otherwise the connection is taken to have been lost now, at
/// the redelivery (an unload's reconnection is quick). An ack made while
/// the partition was being subscribed again waited for the new consumer: it
/// counts as sent when that came. An entry acked longer ago than that came
/// back for another reason: someone reset the subscription's cursor, or the
/// consumer sought back, to replay it. It is handled again and forgotten,
/// so that its new settlement counts. Bounded by a count as well; what
/// falls out can still come back as a duplicate.
pub(super) struct RecentAcks {
    /// Entries in the order they were recorded, with the time recorded; an
    /// entry recorded again, or forgotten, leaves a stale element, told
    /// apart by its time.
    in_order: VecDeque<(EntryKey, Instant)>,
    /// The entries remembered, with the time each was last acked.
    entries: HashMap<EntryKey, Instant, TrustedHashing>,
    capacity: usize,
    last_bulk_resend: Option<Instant>,
    /// Redeliveries of acked entries recognised so far.
    pub(super) recognised: u64,
}

/// A partition's last outage: when its consumer was found stopped (the
/// crate gave up on its connection: it refused a settlement, or its stream
/// ended), and when it was subscribed again (`None` while it is still
/// being).
#[derive(Clone, Copy, Debug)]
pub(super) struct Outage {
    pub(super) ended: Instant,
    pub(super) reopened: Option<Instant>,
}

/// How long before its connection was lost an ack can have been lost with
/// it: sent into a connection that was failing, or not yet stored by a
/// broker that crashed (brokers store a cursor's position about once a
/// second). Also how long after an ack a reset of the cursor does not
/// replay its entry (the delivery looks like a quick reconnection's).
pub(super) const LOST_ACK_WINDOW: Duration = Duration::from_secs(10);

/// How long after a reconnection the entries it brought back may still be
/// taken for lost acks: the broker delivers them at once, but a subscription
/// whose priority is not served takes its messages from the consumer's
/// queue later. An entry acked before the outage that comes back later than
/// this is a replay (a reset of the cursor).
const REDELIVERY_TAKEN_WITHIN: Duration = Duration::from_secs(60);

/// After a bulk re-send, another waits this long.
const BULK_RESEND_INTERVAL: Duration = Duration::from_secs(5);

impl RecentAcks {
    pub(super) fn new(capacity: usize) -> Self {
        RecentAcks {
            in_order: VecDeque::new(),
            entries: HashMap::default(),
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

    /// Remembers that `entry` was acked at `now`.
    pub(super) fn record(&mut self, entry: EntryKey, now: Instant) {
        if self.in_order.len() >= self.capacity {
            if let Some((oldest, recorded)) = self.in_order.pop_front() {
                if self.entries.get(&oldest) == Some(&recorded) {
                    self.entries.remove(&oldest);
                }
            }
        }
        if self.capacity > 0 {
            self.entries.insert(entry, now);
            self.in_order.push_back((entry, now));
        }
    }

    /// Whether `entry` was acked recently.
    pub(super) fn contains(&self, entry: EntryKey) -> bool {
        self.entries.contains_key(&entry)
    }

    /// What the delivery of `entry` at `now` is (see [`Redelivery`]).
    /// `outage` tells the last outage of an entry's partition. A lost ack
    /// is counted; a replay is forgotten, so that its new settlement counts.
    /// `connection_losses` tells the broker connections lost lately; it
    /// is asked only when the rest does not show the ack lost.
    pub(super) fn redelivered(
        &mut self,
        entry: EntryKey,
        now: Instant,
        outage: impl Fn(EntryKey) -> Option<Outage>,
        connection_losses: impl FnOnce() -> ConnectionLosses,
    ) -> Redelivery {
        let Some(&acked_at) = self.entries.get(&entry) else {
            return Redelivery::NotAcked;
        };
        let connection_losses = LazyCell::new(connection_losses);
        let lost = |entry: EntryKey, acked_at: Instant| {
            let (lost_at, sent_at) = match outage(entry) {
                // Sent shortly before the stream ended, however long ago.
                Some(Outage { ended, .. }) if ended >= acked_at => (ended, acked_at),
                // Held for the new consumer, and sent when it came.
                Some(Outage { reopened, .. }) if reopened.is_none_or(|at| at >= acked_at) => {
                    (now, reopened.unwrap_or(now))
                }
                _ => (now, acked_at),
            };
            lost_at.saturating_duration_since(sent_at) <= LOST_ACK_WINDOW
                || connection_losses.covers(acked_at, now)
        };
        if !lost(entry, acked_at) {
            self.entries.remove(&entry);
            return Redelivery::Replay;
        }
        self.recognised += 1;
        let bulk_due = self
            .last_bulk_resend
            .is_none_or(|last| now.duration_since(last) >= BULK_RESEND_INTERVAL);
        if !bulk_due {
            return Redelivery::AckLost(vec![entry]);
        }
        self.last_bulk_resend = Some(now);
        let current = |&(entry, recorded): &(EntryKey, Instant)| {
            self.entries.get(&entry) == Some(&recorded) && lost(entry, recorded)
        };
        Redelivery::AckLost(
            self.in_order
                .iter()
                .filter(|element| current(element))
                .map(|&(entry, _)| entry)
                .collect(),
        )
    }
}

impl ConnectionLosses {
    /// Whether any of the losses covers an ack sent at `acked_at`, for an
    /// entry taken from the consumer again at `now` (see
    /// [`ConnectionLoss::covers`]).
    fn covers(&self, acked_at: Instant, now: Instant) -> bool {
        self.iter().any(|loss| loss.covers(acked_at, now))
    }
}

impl ConnectionLoss {
    /// Whether an ack sent at `acked_at` may have been lost with the
    /// connection, for an entry taken from the consumer again at `now`:
    /// sent at most [`LOST_ACK_WINDOW`] before the connection was last seen
    /// open, or after, and not after the new connection was seen; and taken
    /// within [`REDELIVERY_TAKEN_WITHIN`] after that.
    fn covers(&self, acked_at: Instant, now: Instant) -> bool {
        let Some(reconnected) = self.reconnected else {
            return false;
        };
        acked_at + LOST_ACK_WINDOW >= self.last_seen_open
            && acked_at <= reconnected
            && now <= reconnected + REDELIVERY_TAKEN_WITHIN
    }
}

/// What a delivered entry is to [`RecentAcks`].
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Redelivery {
    /// Not acked recently: a first delivery, or one after a nack or a
    /// failed handling.
    NotAcked,
    /// Acked longer than [`LOST_ACK_WINDOW`] before its connection was
    /// lost: the subscription's cursor was reset, or the consumer sought
    /// back, to replay it. It is to be handled again.
    Replay,
    /// Acked, and the ack perhaps lost with a connection: the entries whose
    /// acks to send again, every one that may have been lost the first time
    /// after a while, otherwise just this one.
    AckLost(Vec<EntryKey>),
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
        assert_eq!(batches.settle(&member(5, 0, 1), false, &none), Some(false));
        // A batch of one is one message, which the broker gives back whole:
        // there is no member of it to remember as having succeeded.
        assert!(batches.nacked.in_order.is_empty());
        // An index outside its batch (an id no broker sends) is settled as
        // one message, not taken for a member of a batch it cannot be in.
        assert_eq!(batches.settle(&member(6, 3, 3), true, &none), Some(true));
        assert_eq!(batches.settle(&member(6, 5, 3), false, &none), Some(false));
        assert!(batches.by_entry.is_empty());
    }

    #[test]
    fn a_chunk_is_remembered_by_the_entry_its_redelivery_is_looked_up_by() {
        // A chunk's ack is recorded by `entry_of_chunk`; when the broker
        // delivers the chunk again, it is looked up by `entry_of` its id.
        for partition in [None, Some(0), Some(3)] {
            let chunk = MessageIdData {
                ledger_id: 5,
                entry_id: 9,
                partition,
                ..Default::default()
            };
            let delivered = MessageId::from_broker(chunk.clone(), None);
            assert_eq!(entry_of_chunk(&chunk), entry_of(&delivered));
            assert_eq!(entry_of(&delivered), (partition.unwrap_or(-1), 5, 9));
        }
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
    fn a_nacked_batch_remembers_which_members_succeeded_until_it_is_acked() {
        let mut batches = BatchSettlements::default();
        let none = RecentAcks::new(0);
        batches.settle(&member(7, 0, 3), true, &none);
        batches.settle(&member(7, 1, 3), false, &none);
        assert!(
            batches.settled_before(&member(7, 2, 3)).is_none(),
            "a member not settled yet"
        );
        assert_eq!(
            batches.settled_before(&member(7, 1, 3)),
            Some(SettledBefore::InThisDelivery),
            "a failed member's second copy while its batch is pending"
        );
        assert_eq!(batches.settle(&member(7, 2, 3), false, &none), Some(false));
        let succeeded = |batches: &BatchSettlements| -> Vec<bool> {
            (0..3)
                .map(|index| {
                    batches.settled_before(&member(7, index, 3))
                        == Some(SettledBefore::SucceededInAnEarlierDelivery)
                })
                .collect()
        };
        assert_eq!(succeeded(&batches), [true, false, false]);
        assert_eq!(
            batches.settled_before(&member(8, 0, 3)),
            None,
            "another entry"
        );
        // Delivered again: member 0 settles on arrival, member 1 succeeds
        // this time, member 2 fails again.
        assert_eq!(batches.settle(&member(7, 0, 3), true, &none), None);
        assert_eq!(
            batches.settled_before(&member(7, 0, 3)),
            Some(SettledBefore::InThisDelivery),
            "settled in this delivery now"
        );
        assert_eq!(batches.settle(&member(7, 1, 3), true, &none), None);
        assert_eq!(batches.settle(&member(7, 2, 3), false, &none), Some(false));
        assert_eq!(succeeded(&batches), [true, true, false]);
        // The third time, with member 0 settled on arrival and the batch
        // pending, member 1 is still known to have succeeded before; member
        // 2 succeeds, and the entry is acked and forgotten.
        batches.settle(&member(7, 0, 3), true, &none);
        assert_eq!(
            batches.settled_before(&member(7, 1, 3)),
            Some(SettledBefore::SucceededInAnEarlierDelivery)
        );
        batches.settle(&member(7, 1, 3), true, &none);
        assert_eq!(batches.settle(&member(7, 2, 3), true, &none), Some(true));
        assert_eq!(succeeded(&batches), [false, false, false]);
        assert!(batches.nacked.in_order.is_empty());
    }

    #[test]
    fn the_oldest_nacked_batch_is_forgotten_at_capacity() {
        let mut batches = BatchSettlements::default();
        let none = RecentAcks::new(0);
        for entry in 0..=NACKED_BATCHES as u64 {
            batches.settle(&member(entry, 0, 2), true, &none);
            assert_eq!(
                batches.settle(&member(entry, 1, 2), false, &none),
                Some(false)
            );
        }
        let earlier = Some(SettledBefore::SucceededInAnEarlierDelivery);
        assert_eq!(
            batches.settled_before(&member(0, 0, 2)),
            None,
            "the oldest goes"
        );
        assert_eq!(batches.settled_before(&member(1, 0, 2)), earlier);
        assert_eq!(
            batches.settled_before(&member(NACKED_BATCHES as u64, 0, 2)),
            earlier
        );
        assert_eq!(batches.settled_before(&member(1, 1, 2)), None, "failed");
        assert_eq!(batches.nacked.in_order.len(), NACKED_BATCHES);
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
        acked.record((-1, 1, 7), Instant::now());
        // The second copy of member 0 settles last: nothing to tell, and
        // nothing held for an entry that is gone.
        assert_eq!(batches.settle(&member(7, 0, 2), true, &acked), None);
        assert_eq!(batches.settle(&member(7, 0, 2), false, &acked), None);
        assert!(batches.by_entry.is_empty());
        // Another entry is held as before.
        assert_eq!(batches.settle(&member(8, 0, 2), true, &acked), None);
        assert!(batches.by_entry.contains_key(&(-1, 1, 8)));
    }

    /// No stream ended: the connection is taken to be lost at the
    /// redelivery.
    fn no_stream_end(_: EntryKey) -> Option<Outage> {
        None
    }

    /// No broker connection seen lost.
    fn no_loss() -> ConnectionLosses {
        ConnectionLosses::default()
    }

    #[test]
    fn a_redelivered_acked_entry_is_recognised_and_the_first_one_resends_all() {
        let now = Instant::now();
        let mut acks = RecentAcks::new(3);
        for entry in 1..=4 {
            acks.record((0, 9, entry), now);
        }
        let mut redelivered = |entry, at| acks.redelivered(entry, at, no_stream_end, no_loss);
        assert_eq!(
            redelivered((0, 9, 1), now),
            Redelivery::NotAcked,
            "evicted at capacity"
        );
        assert_eq!(
            redelivered((1, 9, 4), now),
            Redelivery::NotAcked,
            "another partition"
        );
        assert_eq!(
            redelivered((0, 9, 3), now),
            Redelivery::AckLost(vec![(0, 9, 2), (0, 9, 3), (0, 9, 4)])
        );
        assert_eq!(
            redelivered((0, 9, 4), now),
            Redelivery::AckLost(vec![(0, 9, 4)])
        );
        assert_eq!(
            redelivered((0, 9, 2), now + BULK_RESEND_INTERVAL),
            Redelivery::AckLost(vec![(0, 9, 2), (0, 9, 3), (0, 9, 4)]),
            "a later reconnection resends all again"
        );
        assert_eq!(acks.recognised, 3);
    }

    #[test]
    fn a_grown_capacity_remembers_more_acks() {
        let now = Instant::now();
        let mut none = RecentAcks::new(0);
        none.record((0, 9, 1), now);
        assert!(!none.contains((0, 9, 1)), "no capacity, nothing remembered");
        let mut acks = RecentAcks::new(2);
        acks.record((0, 9, 1), now);
        acks.record((0, 9, 2), now);
        acks.grow_to(4);
        acks.grow_to(3);
        for entry in 3..=4 {
            acks.record((1, 9, entry), now);
        }
        assert_eq!(
            acks.redelivered((0, 9, 1), now, no_stream_end, no_loss),
            Redelivery::AckLost(vec![(0, 9, 1), (0, 9, 2), (1, 9, 3), (1, 9, 4)]),
            "nothing evicted below the new capacity"
        );
        acks.record((1, 9, 5), now);
        assert_eq!(
            acks.redelivered((0, 9, 1), now, no_stream_end, no_loss),
            Redelivery::NotAcked,
            "the oldest goes"
        );
    }

    #[test]
    fn an_entry_acked_longer_ago_than_the_window_is_a_replay_and_is_forgotten() {
        let begun = Instant::now();
        let mut acks = RecentAcks::new(16);
        acks.record((0, 9, 1), begun);
        acks.record((0, 9, 2), begun + Duration::from_secs(5));
        let reset = begun + LOST_ACK_WINDOW + Duration::from_secs(1);
        assert_eq!(
            acks.redelivered((0, 9, 1), reset, no_stream_end, no_loss),
            Redelivery::Replay,
            "acked 11 s before it came back"
        );
        assert!(!acks.contains((0, 9, 1)), "forgotten: its new ack counts");
        assert_eq!(
            acks.redelivered((0, 9, 1), reset, no_stream_end, no_loss),
            Redelivery::NotAcked,
            "a second copy of the replay is handled as well"
        );
        assert_eq!(
            acks.redelivered((0, 9, 2), reset, no_stream_end, no_loss),
            Redelivery::AckLost(vec![(0, 9, 2)]),
            "acked 6 s before: perhaps lost, and the only one resent"
        );
        assert_eq!(acks.recognised, 1);
        // Handled again and acked again, it is remembered anew.
        acks.record((0, 9, 1), reset);
        assert_eq!(
            acks.redelivered((0, 9, 1), reset, no_stream_end, no_loss),
            Redelivery::AckLost(vec![(0, 9, 1)])
        );
    }

    #[test]
    fn an_ack_shortly_before_the_stream_ended_is_lost_however_long_the_outage() {
        let begun = Instant::now();
        let mut acks = RecentAcks::new(16);
        acks.record((0, 9, 1), begun);
        acks.record((1, 9, 1), begun);
        let ended = begun + Duration::from_secs(2);
        let back = ended + Duration::from_secs(120);
        let outage = Outage {
            ended,
            reopened: Some(back),
        };
        let partition_0_ended = |(partition, ..): EntryKey| (partition == 0).then_some(outage);
        assert_eq!(
            acks.redelivered((0, 9, 1), back, partition_0_ended, no_loss),
            Redelivery::AckLost(vec![(0, 9, 1)]),
            "its stream ended 2 s after the ack; the bulk resend leaves out \
             the other partition's, which is older than the window"
        );
        assert_eq!(
            acks.redelivered((1, 9, 1), back, partition_0_ended, no_loss),
            Redelivery::Replay,
            "the other partition's stream never ended"
        );
        assert_eq!(
            acks.redelivered(
                (0, 9, 1),
                back + LOST_ACK_WINDOW * 2,
                partition_0_ended,
                no_loss
            ),
            Redelivery::AckLost(vec![(0, 9, 1)]),
            "taken from the queue long after the return, its ack is still \
             the one sent 2 s before the stream ended"
        );
        // A stream end before the ack says nothing about it.
        acks.record((0, 9, 2), back);
        assert_eq!(
            acks.redelivered(
                (0, 9, 2),
                back + LOST_ACK_WINDOW * 2,
                partition_0_ended,
                no_loss
            ),
            Redelivery::Replay
        );
    }

    #[test]
    fn an_ack_held_while_the_partition_was_subscribed_again_counts_from_its_return() {
        let ended = Instant::now();
        let acked = ended + Duration::from_secs(5);
        let back = ended + Duration::from_secs(30);
        let mut acks = RecentAcks::new(16);
        // Acked during the outage: held, and sent once the partition is
        // back, where the broker may deliver the message again first.
        acks.record((0, 9, 1), acked);
        acks.record((0, 9, 2), acked);
        let outage = |reopened| move |_: EntryKey| Some(Outage { ended, reopened });
        assert_eq!(
            acks.redelivered((0, 9, 1), back, outage(Some(back)), no_loss),
            Redelivery::AckLost(vec![(0, 9, 1), (0, 9, 2)]),
            "25 s after the ack, but at once after it was sent"
        );
        // A reset of the cursor well after the return replays it.
        let later = back + LOST_ACK_WINDOW * 2;
        assert_eq!(
            acks.redelivered((0, 9, 2), later, outage(Some(back)), no_loss),
            Redelivery::Replay
        );
        // An ack made after the return was sent when it was made.
        acks.record((0, 9, 3), back + Duration::from_secs(1));
        assert_eq!(
            acks.redelivered((0, 9, 3), later, outage(Some(back)), no_loss),
            Redelivery::Replay
        );
        // One made shortly before its redelivery is taken for lost (the
        // connection lost at the redelivery), however long after the return.
        acks.record((0, 9, 4), later - Duration::from_secs(5));
        assert_eq!(
            acks.redelivered((0, 9, 4), later, outage(Some(back)), no_loss),
            Redelivery::AckLost(vec![(0, 9, 4)])
        );
    }

    #[test]
    fn an_entry_recorded_again_stays_remembered_after_its_first_record_leaves() {
        let now = Instant::now();
        let mut acks = RecentAcks::new(2);
        acks.record((0, 9, 1), now);
        acks.record((0, 9, 1), now + Duration::from_secs(1));
        acks.record((0, 9, 2), now + Duration::from_secs(1));
        assert!(acks.contains((0, 9, 1)), "its stale first record went");
        assert_eq!(
            acks.redelivered(
                (0, 9, 2),
                now + Duration::from_secs(1),
                no_stream_end,
                no_loss
            ),
            Redelivery::AckLost(vec![(0, 9, 1), (0, 9, 2)]),
            "each entry resent once"
        );
    }

    #[test]
    fn an_ack_shortly_before_a_lost_connection_is_lost_however_long_the_reconnection() {
        let seen_open = Instant::now();
        let acked = seen_open + Duration::from_secs(3);
        let reconnected = acked + Duration::from_secs(40);
        let back = reconnected + Duration::from_secs(1);
        let mut acks = RecentAcks::new(16);
        acks.record((0, 9, 1), seen_open - LOST_ACK_WINDOW * 2);
        acks.record((0, 9, 2), seen_open - LOST_ACK_WINDOW / 2);
        acks.record((0, 9, 3), acked);
        let loss = ConnectionLoss {
            last_seen_open: seen_open,
            reconnected: Some(reconnected),
        };
        assert_eq!(
            acks.redelivered((0, 9, 3), back, no_stream_end, || loss.into()),
            Redelivery::AckLost(vec![(0, 9, 2), (0, 9, 3)]),
            "acked after the connection was last seen open, back 38 s after \
             the ack, at once after the reconnection; the bulk resend takes \
             the ack made 5 s before the last sighting, not the one made 20 s \
             before"
        );
        assert_eq!(
            acks.redelivered((0, 9, 1), back, no_stream_end, || loss.into()),
            Redelivery::Replay,
            "acked longer than the window before the connection was last seen"
        );
        acks.record((0, 9, 4), acked);
        assert_eq!(
            acks.redelivered(
                (0, 9, 4),
                reconnected + REDELIVERY_TAKEN_WITHIN,
                no_stream_end,
                || loss.into()
            ),
            Redelivery::AckLost(vec![(0, 9, 2), (0, 9, 3), (0, 9, 4)]),
            "taken from the consumer long after the reconnection (its \
             subscription's priority was not served), and a bulk re-send due"
        );
        assert_eq!(
            acks.redelivered((0, 9, 3), back, no_stream_end, || {
                ConnectionLoss {
                    reconnected: None,
                    ..loss
                }
                .into()
            }),
            Redelivery::Replay,
            "a connection lost and none made since explains no delivery"
        );
    }

    /// After a broker restart the crate can close one of the connections
    /// it made a while later: a loss of its own, which must not hide the
    /// restart's, whose lost acks are still coming back.
    #[test]
    fn an_ack_lost_in_an_outage_is_recognised_after_a_later_loss() {
        let seen_open = Instant::now();
        let acked = seen_open + Duration::from_secs(1);
        let reconnected = seen_open + Duration::from_secs(12);
        let outage = ConnectionLoss {
            last_seen_open: seen_open,
            reconnected: Some(reconnected),
        };
        let replaced = ConnectionLoss {
            last_seen_open: reconnected,
            reconnected: Some(reconnected + Duration::from_secs(15)),
        };
        let back = reconnected + Duration::from_secs(16);
        let mut acks = RecentAcks::new(16);
        acks.record((0, 9, 1), acked);
        acks.record((0, 9, 2), acked);
        assert_eq!(
            acks.redelivered((0, 9, 1), back, no_stream_end, || replaced.into()),
            Redelivery::Replay,
            "the later loss alone does not cover an ack made 11 s before it"
        );
        let both: ConnectionLosses = [outage, replaced].into_iter().collect();
        assert_eq!(
            acks.redelivered((0, 9, 2), back, no_stream_end, || both),
            Redelivery::AckLost(vec![(0, 9, 2)]),
            "the outage, kept, covers it"
        );
    }

    #[test]
    fn a_connection_loss_explains_no_delivery_long_after_the_reconnection() {
        let seen_open = Instant::now();
        let reconnected = seen_open + Duration::from_secs(30);
        let loss = || {
            ConnectionLoss {
                last_seen_open: seen_open,
                reconnected: Some(reconnected),
            }
            .into()
        };
        let mut acks = RecentAcks::new(16);
        acks.record((0, 9, 1), seen_open);
        acks.record((0, 9, 2), reconnected + Duration::from_secs(1));
        let reset = reconnected + REDELIVERY_TAKEN_WITHIN + Duration::from_secs(1);
        assert_eq!(
            acks.redelivered((0, 9, 1), reset, no_stream_end, loss),
            Redelivery::Replay,
            "a reset of the cursor well after the reconnection replays it"
        );
        assert_eq!(
            acks.redelivered((0, 9, 2), reset, no_stream_end, loss),
            Redelivery::Replay,
            "acked on the new connection"
        );
    }

    #[test]
    fn the_connection_loss_is_asked_only_when_the_rest_does_not_show_the_ack_lost() {
        let now = Instant::now();
        let mut acks = RecentAcks::new(16);
        acks.record((0, 9, 1), now);
        let unasked = || -> ConnectionLosses { panic!("asked") };
        assert_eq!(
            acks.redelivered((0, 9, 1), now, no_stream_end, unasked),
            Redelivery::AckLost(vec![(0, 9, 1)])
        );
        assert_eq!(
            acks.redelivered((0, 9, 2), now, no_stream_end, unasked),
            Redelivery::NotAcked
        );
    }
}
