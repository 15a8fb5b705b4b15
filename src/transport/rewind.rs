//! Second copies and rewinds: the copies the broker delivers of messages
//! still being handled, and, on Exclusive and Failover subscriptions, the
//! entries a rewind skips.
//!
//! Whenever the broker gives a consumer's messages out again (a
//! reconnection after a topic unload or a broker restart, on every
//! subscription type; on Exclusive and Failover also every nack, which
//! rewinds the whole subscription), it delivers again everything not yet
//! acknowledged, messages still being handled included. Those second
//! copies are dropped as they arrive, on every persistent subscription: the
//! copy being handled settles the message (an ack, or a nack that brings
//! it back), and handling the second copy at the same time would run one
//! message twice at once (on Key_Shared, two handlers of one key).
//!
//! A rewind that meets a read the broker has in flight skips the entry
//! that read fetched: it stays unacknowledged and is not delivered again
//! until the next rewind or reconnection. The chaos suite shows it (a debug
//! trace of the `pulsar` crate: entries 2348, then 2465 after 2463 right
//! after a rewind, and 2464 never), and Java clients guard against it with
//! consumer epochs, which the crate does not send. So on Exclusive and
//! Failover a consumer that
//! nacked asks again once it has received nothing and holds nothing
//! unsettled for [`IDLE_BEFORE_REWIND`]: each partition it nacked on
//! rewinds once more. With nothing in flight nothing is delivered twice by
//! it, and whatever was left behind comes back. Two limits: on a partition
//! whose traffic never pauses for that long, a message left behind waits
//! for the pause (a rewind under load would only skip another entry); and
//! the repeated rewind could itself meet a message published at that
//! moment, which then waits for the next nack's rewind and pause, or a
//! reconnection.
//!
//! A Failover subscription has a third hole of the same kind: when the
//! broker hands a partition over to another consumer (the active one closed
//! or unsubscribed), the rewind it makes for the new one can meet a read in
//! flight, and the broker then waits for new entries while the backlog it
//! should deliver waits too (the Pulsar 4.2.4 broker of the tests does so
//! in most hand-overs of a partitioned topic; apache/pulsar#26164 describes
//! the same race). Nothing tells the consumer: the `pulsar` crate drops the
//! broker's notice of a new active consumer. So a [`StallCheck`] watches
//! each partition of a Failover subscription: once the partition has
//! delivered nothing and holds nothing unsettled for a whole check
//! interval, the consumer asks the broker for the subscription's backlog on
//! it, and a backlog that is not empty and has not moved since the check
//! before makes it ask for a rewind; messages the partition delivered and
//! could not read (encrypted, say), which stay in the backlog, count as
//! held, not stalled. A standby consumer's checks see the
//! active one drain the backlog, or see none, and ask nothing; a rewind
//! that a standby consumer does ask for (the active one stuck for two
//! intervals on a long handler) the broker ignores.

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::task::{ready, Context, Poll, Waker};
use std::time::Duration;

use pulsar::proto::MessageIdData;
use tokio::time::{Instant, Sleep};

use super::settlement::{entry_of, EntryKey};
use crate::hash::TrustedHashing;
use crate::message::MessageId;

/// How long a consumer that nacked stays idle before it asks for one more
/// rewind.
pub(super) const IDLE_BEFORE_REWIND: Duration = Duration::from_secs(1);

/// A message by where it sits on the broker: its entry, and its index in
/// the entry's batch.
type Position = (EntryKey, Option<i32>);

fn position(id: &MessageId) -> Position {
    (entry_of(id), id.batch_index())
}

/// What a consumer of a persistent topic keeps track of: the messages it
/// handed out and has not settled, and on a rewinding subscription when to
/// ask its partitions to rewind once more.
pub(super) struct RewindCheck {
    /// Messages handed out and not settled yet.
    unsettled: HashSet<Position, TrustedHashing>,
    /// Whether a nack rewinds the subscription (Exclusive and Failover), so
    /// that an idle consumer that nacked rewinds once more.
    rewinding: bool,
    /// Per partition, a message nacked there since the last repeated
    /// rewind (the
    /// broker rewinds the whole partition whichever id a request names).
    nacked: Vec<Option<MessageIdData>>,
    idle_since: Pin<Box<Sleep>>,
    /// Whether `idle_since` was set for the current idle spell.
    armed: bool,
    /// The receiver's waker, to wake when the last message is settled: the
    /// receiver polls only while it has room, and the wait starts in a poll.
    receiver: Option<Waker>,
    /// Rewinds asked for this way so far.
    pub(super) repeated: u64,
    /// Copies of messages still being handled, dropped so far.
    pub(super) dropped_in_flight: u64,
}

impl RewindCheck {
    pub(super) fn new(rewinding: bool) -> Self {
        RewindCheck {
            unsettled: HashSet::default(),
            rewinding,
            nacked: Vec::new(),
            idle_since: Box::pin(tokio::time::sleep(IDLE_BEFORE_REWIND)),
            armed: false,
            receiver: None,
            repeated: 0,
            dropped_in_flight: 0,
        }
    }

    /// A message arrived: whether to hand it out. Not a second copy of one
    /// still being handled: a reconnection (any subscription type) or a
    /// nack's rewind delivered it again, and the copy being handled settles
    /// it.
    pub(super) fn received(&mut self, id: &MessageId) -> bool {
        self.armed = false;
        if !self.unsettled.insert(position(id)) {
            self.dropped_in_flight += 1;
            return false;
        }
        true
    }

    /// A message handed out was settled (batch members one by one).
    pub(super) fn settled(&mut self, id: &MessageId) {
        self.unsettled.remove(&position(id));
        self.wake_if_idle();
    }

    /// Whether a message handed out from the partition with this index
    /// (any partition with `None`) is not settled yet.
    pub(super) fn holds_unsettled(&self, partition: Option<i32>) -> bool {
        match partition {
            None => !self.unsettled.is_empty(),
            Some(index) => self.unsettled.iter().any(|((on, _, _), _)| *on == index),
        }
    }

    /// A nack for `id` went to `partition`.
    pub(super) fn nacked(&mut self, partition: usize, id: MessageIdData) {
        if !self.rewinding {
            return;
        }
        if self.nacked.len() <= partition {
            self.nacked.resize(partition + 1, None);
        }
        self.nacked[partition] = Some(id);
        self.wake_if_idle();
    }

    fn wake_if_idle(&mut self) {
        if self.unsettled.is_empty() && !self.armed {
            if let Some(receiver) = self.receiver.take() {
                receiver.wake();
            }
        }
    }

    /// The partitions to rewind again, with an id to name, once the
    /// consumer has been idle long enough after a nack; `Pending` until then
    /// (the waker is woken when the wait is over). Called only when no
    /// partition has a message ready.
    pub(super) fn poll_due(&mut self, cx: &mut Context<'_>) -> Poll<Vec<(usize, MessageIdData)>> {
        if self.nacked.iter().all(Option::is_none) {
            return Poll::Pending;
        }
        if !self.unsettled.is_empty() {
            if !self
                .receiver
                .as_ref()
                .is_some_and(|w| w.will_wake(cx.waker()))
            {
                self.receiver = Some(cx.waker().clone());
            }
            return Poll::Pending;
        }
        if !self.armed {
            self.armed = true;
            let due = Instant::now() + IDLE_BEFORE_REWIND;
            self.idle_since.as_mut().reset(due);
        }
        if self.idle_since.as_mut().poll(cx).is_pending() {
            return Poll::Pending;
        }
        self.armed = false;
        let due: Vec<_> = std::mem::take(&mut self.nacked)
            .into_iter()
            .enumerate()
            .filter_map(|(partition, id)| Some((partition, id?)))
            .collect();
        self.repeated += due.len() as u64;
        Poll::Ready(due)
    }
}

/// Watches one partition of a Failover subscription for a backlog the
/// broker has stopped delivering (see the module's doc).
pub(super) struct StallCheck {
    every: Duration,
    next: Pin<Box<Sleep>>,
    /// Whether the partition delivered a message since the last check.
    delivered: bool,
    /// The backlog the last check read, if nothing was delivered since.
    last_backlog: Option<u64>,
    /// Messages delivered that cannot be read, left in the backlog, since
    /// the partition last asked for a rewind (which delivers them again).
    unreadable: u64,
    /// Rewinds asked for because the backlog stalled.
    pub(super) rewound: u64,
}

impl StallCheck {
    pub(super) fn new(every: Duration) -> Self {
        StallCheck {
            every,
            next: Box::pin(tokio::time::sleep(every)),
            delivered: false,
            last_backlog: None,
            unreadable: 0,
            rewound: 0,
        }
    }

    /// The partition delivered a message: it is not stalled.
    #[inline]
    pub(super) fn delivered(&mut self) {
        self.delivered = true;
    }

    /// A message the partition delivered cannot be read: it stays in the
    /// backlog, which is then held, not stalled.
    pub(super) fn unreadable(&mut self) {
        self.unreadable += 1;
    }

    /// The partition asked for a rewind (a nack) or is being subscribed
    /// again: the broker
    /// delivers everything unacknowledged again, unreadable messages too.
    pub(super) fn rewinding(&mut self) {
        self.unreadable = 0;
    }

    /// Ready when the broker should be asked for the partition's backlog:
    /// a check interval has passed, and the partition has delivered
    /// nothing meanwhile and holds nothing unsettled (`holds_unsettled`,
    /// asked only then). `Pending` otherwise; the waker is woken at the
    /// next check. Called when the partition has no message ready.
    pub(super) fn poll_due(
        &mut self,
        cx: &mut Context<'_>,
        holds_unsettled: impl Fn() -> bool,
    ) -> Poll<()> {
        ready!(self.next.as_mut().poll(cx));
        self.next.as_mut().reset(Instant::now() + self.every);
        // Registers the waker for the next check.
        let _ = self.next.as_mut().poll(cx);
        if std::mem::take(&mut self.delivered) || holds_unsettled() {
            self.last_backlog = None;
            return Poll::Pending;
        }
        Poll::Ready(())
    }

    /// What the broker answered (`None` when it could not be asked):
    /// whether to ask for a rewind, because the backlog holds more than the
    /// unreadable messages delivered and stood still since the check
    /// before, with nothing delivered between. After a rewind it takes two
    /// more such checks to ask again.
    pub(super) fn stalled(&mut self, backlog: Option<u64>) -> bool {
        if let Some(backlog) = backlog {
            // Fewer: another consumer settled some (after a hand-over).
            self.unreadable = self.unreadable.min(backlog);
        }
        let stalled = !self.delivered
            && backlog.is_some_and(|backlog| {
                backlog > self.unreadable && self.last_backlog == Some(backlog)
            });
        self.last_backlog = if stalled { None } else { backlog };
        self.rewound += u64::from(stalled);
        stalled
    }
}

#[cfg(test)]
mod tests {
    use std::task::Context;

    use futures::task::noop_waker_ref;

    use super::*;

    fn message(entry: u64) -> MessageId {
        MessageId::new(1, entry, -1, None)
    }

    fn id(entry: u64) -> MessageIdData {
        MessageIdData {
            ledger_id: 1,
            entry_id: entry,
            ..MessageIdData::default()
        }
    }

    fn due(check: &mut RewindCheck) -> Option<Vec<(usize, u64)>> {
        let mut cx = Context::from_waker(noop_waker_ref());
        match check.poll_due(&mut cx) {
            Poll::Ready(due) => Some(due.into_iter().map(|(p, id)| (p, id.entry_id)).collect()),
            Poll::Pending => None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn without_rewinds_copies_are_dropped_and_nothing_is_rewound_again() {
        let mut check = RewindCheck::new(false);
        assert!(check.received(&message(1)));
        assert!(!check.received(&message(1)), "a copy of one being handled");
        check.settled(&message(1));
        check.nacked(0, id(1));
        assert!(check.received(&message(1)), "delivered again once settled");
        check.settled(&message(1));
        tokio::time::advance(IDLE_BEFORE_REWIND * 2).await;
        assert_eq!(due(&mut check), None, "a nack rewinds nothing here");
        assert_eq!(check.dropped_in_flight, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_idle_consumer_that_nacked_rewinds_each_nacked_partition_once() {
        let mut check = RewindCheck::new(true);
        assert_eq!(due(&mut check), None, "nothing nacked");
        tokio::time::advance(IDLE_BEFORE_REWIND * 2).await;
        assert_eq!(due(&mut check), None, "nothing nacked, however long");

        assert!(check.received(&message(1)));
        assert!(check.received(&message(2)));
        check.settled(&message(1));
        check.nacked(2, id(7));
        check.nacked(0, id(5));
        check.nacked(2, id(9));
        assert_eq!(due(&mut check), None, "one message still unsettled");
        tokio::time::advance(IDLE_BEFORE_REWIND * 2).await;
        assert_eq!(due(&mut check), None, "still unsettled, however long");

        check.settled(&message(2));
        assert_eq!(due(&mut check), None, "idle from now on");
        tokio::time::advance(IDLE_BEFORE_REWIND / 2).await;
        assert_eq!(due(&mut check), None, "not idle long enough");
        tokio::time::advance(IDLE_BEFORE_REWIND / 2).await;
        assert_eq!(due(&mut check), Some(vec![(0, 5), (2, 9)]));
        assert_eq!(check.repeated, 2);
        tokio::time::advance(IDLE_BEFORE_REWIND * 2).await;
        assert_eq!(due(&mut check), None, "once per nack");
    }

    #[tokio::test(start_paused = true)]
    async fn a_message_received_while_waiting_starts_the_wait_again() {
        let mut check = RewindCheck::new(true);
        check.nacked(0, id(1));
        assert_eq!(due(&mut check), None);
        tokio::time::advance(IDLE_BEFORE_REWIND - Duration::from_millis(1)).await;
        assert!(check.received(&message(1)));
        check.settled(&message(1));
        assert_eq!(due(&mut check), None, "the wait starts again");
        tokio::time::advance(IDLE_BEFORE_REWIND - Duration::from_millis(1)).await;
        assert_eq!(due(&mut check), None);
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(due(&mut check), Some(vec![(0, 1)]));
    }

    #[tokio::test(start_paused = true)]
    async fn the_receiver_is_woken_when_the_last_message_is_settled() {
        struct Count(std::sync::atomic::AtomicUsize);
        impl futures::task::ArcWake for Count {
            fn wake_by_ref(count: &std::sync::Arc<Self>) {
                count.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let count = std::sync::Arc::new(Count(0.into()));
        let waker = futures::task::waker(count.clone());
        let woken = || count.0.load(std::sync::atomic::Ordering::SeqCst);
        let mut check = RewindCheck::new(true);
        assert!(check.received(&message(1)));
        assert!(check.received(&message(2)));
        assert!(check.received(&message(3)));
        check.settled(&message(1));
        check.nacked(0, id(3));
        let mut cx = Context::from_waker(&waker);
        assert!(check.poll_due(&mut cx).is_pending(), "two still unsettled");
        check.settled(&message(2));
        assert_eq!(woken(), 0, "one still unsettled: nothing to poll for");
        check.settled(&message(3));
        assert_eq!(
            woken(),
            1,
            "idle now: the receiver polls again and the wait starts"
        );
    }

    #[tokio::test]
    async fn a_second_copy_of_a_message_being_handled_is_dropped() {
        let mut check = RewindCheck::new(true);
        let member = |index| MessageId::new(1, 8, 2, Some(index));
        assert!(check.received(&message(4)));
        assert!(check.received(&member(0)));
        assert!(
            check.received(&member(1)),
            "a batch-mate is another message"
        );
        assert!(
            !check.received(&message(4)),
            "delivered again while handled"
        );
        assert!(!check.received(&member(1)));
        assert_eq!(check.dropped_in_flight, 2);
        check.settled(&message(4));
        assert!(
            check.received(&message(4)),
            "settled (nacked): handed out again"
        );
        assert!(
            check.received(&MessageId::new(1, 4, 0, None)),
            "the same entry on another partition"
        );
    }

    #[tokio::test]
    async fn unsettled_messages_are_told_apart_by_partition() {
        let mut check = RewindCheck::new(false);
        let on = |partition, entry| MessageId::new(1, entry, partition, None);
        assert!(!check.holds_unsettled(None));
        assert!(check.received(&on(0, 4)));
        assert!(check.received(&on(2, 4)));
        let held = |check: &RewindCheck| {
            [None, Some(0), Some(1), Some(2)].map(|partition| check.holds_unsettled(partition))
        };
        assert_eq!(held(&check), [true, true, false, true]);
        check.settled(&on(0, 4));
        assert_eq!(held(&check), [true, false, false, true]);
        check.settled(&on(2, 4));
        assert_eq!(held(&check), [false; 4]);
    }

    fn stall_due(check: &mut StallCheck, holds_unsettled: bool) -> bool {
        let mut cx = Context::from_waker(noop_waker_ref());
        check.poll_due(&mut cx, || holds_unsettled).is_ready()
    }

    const EVERY: Duration = Duration::from_secs(5);

    #[tokio::test(start_paused = true)]
    async fn a_partition_is_checked_once_per_interval_while_it_delivers_nothing() {
        let mut check = StallCheck::new(EVERY);
        assert!(
            !stall_due(&mut check, false),
            "not before the first interval"
        );
        tokio::time::advance(EVERY - Duration::from_millis(1)).await;
        assert!(!stall_due(&mut check, false));
        tokio::time::advance(Duration::from_millis(1)).await;
        assert!(stall_due(&mut check, false));
        assert!(!stall_due(&mut check, false), "once per interval");
        tokio::time::advance(EVERY).await;
        assert!(stall_due(&mut check, false));
    }

    #[tokio::test(start_paused = true)]
    async fn a_partition_that_delivered_or_holds_unsettled_messages_is_not_checked() {
        let mut check = StallCheck::new(EVERY);
        check.delivered();
        tokio::time::advance(EVERY).await;
        assert!(!stall_due(&mut check, false), "it delivered meanwhile");
        tokio::time::advance(EVERY).await;
        assert!(
            !stall_due(&mut check, true),
            "one of its messages is unsettled"
        );
        tokio::time::advance(EVERY).await;
        assert!(stall_due(&mut check, false), "idle for a whole interval");
    }

    #[tokio::test(start_paused = true)]
    async fn a_rewind_takes_a_backlog_that_stood_still_over_two_checks() {
        let mut check = StallCheck::new(EVERY);
        assert!(!check.stalled(Some(25)), "one reading says nothing yet");
        assert!(check.stalled(Some(25)), "the same backlog, not empty");
        assert!(
            !check.stalled(Some(25)),
            "after a rewind, two readings again"
        );
        assert!(check.stalled(Some(25)));

        assert!(!check.stalled(Some(20)), "the active consumer drains it");
        assert!(!check.stalled(Some(18)));
        assert!(!check.stalled(Some(0)));
        assert!(!check.stalled(Some(0)), "an empty backlog never stalls");
        assert!(!check.stalled(None), "the broker could not be asked");
        assert!(!check.stalled(Some(3)));
        assert!(check.stalled(Some(3)));
        assert_eq!(check.rewound, 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_backlog_of_unreadable_messages_is_held_not_stalled() {
        let mut check = StallCheck::new(EVERY);
        check.unreadable();
        check.unreadable();
        assert!(!check.stalled(Some(2)));
        assert!(!check.stalled(Some(2)), "two unreadable messages stay");
        assert!(!check.stalled(Some(3)));
        assert!(check.stalled(Some(3)), "one more message than those");
        check.rewinding();
        assert!(!check.stalled(Some(2)));
        assert!(
            check.stalled(Some(2)),
            "after a rewind they are counted again"
        );
        check.unreadable();
        check.unreadable();
        assert!(!check.stalled(Some(1)), "another consumer settled one");
        assert!(!check.stalled(Some(1)));
        assert!(
            !check.stalled(Some(2)),
            "the count followed the backlog down"
        );
        assert!(check.stalled(Some(2)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_delivery_or_unsettled_message_between_two_checks_forgets_the_reading() {
        let mut check = StallCheck::new(EVERY);
        tokio::time::advance(EVERY).await;
        assert!(stall_due(&mut check, false));
        assert!(!check.stalled(Some(7)));
        check.delivered();
        tokio::time::advance(EVERY).await;
        assert!(!stall_due(&mut check, false));
        tokio::time::advance(EVERY).await;
        assert!(stall_due(&mut check, false));
        assert!(
            !check.stalled(Some(7)),
            "the reading before the delivery is forgotten"
        );
        tokio::time::advance(EVERY).await;
        assert!(!stall_due(&mut check, true));
        tokio::time::advance(EVERY).await;
        assert!(stall_due(&mut check, false));
        assert!(
            !check.stalled(Some(7)),
            "so is one before an unsettled message"
        );
        assert!(check.stalled(Some(7)));
    }
}
