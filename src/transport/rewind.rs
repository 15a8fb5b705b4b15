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

use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
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
    /// Per partition, a message nacked there since the last check (the
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
    /// still being handled: a rewind delivered it again, and the copy being
    /// handled settles it.
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
        check.settled(&message(1));
        check.nacked(0, id(3));
        let mut cx = Context::from_waker(&waker);
        assert!(check.poll_due(&mut cx).is_pending(), "one still unsettled");
        check.settled(&message(2));
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
}
