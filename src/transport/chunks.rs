//! Chunked messages: a message too large for one broker entry, which its
//! producer split into chunks, each an entry of its own (Pulsar's Java and
//! C++ clients do when chunking is on). The `pulsar` crate hands each chunk
//! over as a message; the Pulsar transport puts a message's chunks back
//! together before it hands the message out, and settles every chunk's
//! entry when the message is settled.
//!
//! A consumer puts together at most [`ASSEMBLING_LIMIT`] messages at once;
//! past that the oldest is given up. A chunk that does not continue its
//! message (its first chunk never came here: acked before, or delivered to
//! another consumer of a Shared subscription) ends its message's assembly
//! too. Given up chunks are nacked, so that the broker delivers them again.
//! (A chunk of a message acked shortly before comes back on its own when
//! the tail of the message's acks was lost with a connection; the consumer
//! recognises it by its entry, as it does a whole message's, and acks it
//! again before it gets here.)

use std::collections::{HashMap, VecDeque};

use pulsar::proto::{MessageIdData, MessageMetadata};

use super::settlement::EntryKey;
use crate::hash::TrustedHashing;

/// How many messages a consumer puts together at once (the Java client's
/// default `maxPendingChunkedMessage`).
pub(super) const ASSEMBLING_LIMIT: usize = 10;

/// The most payload reserved up front for a message being put together,
/// whatever size its first chunk announces.
const RESERVE_LIMIT: usize = 16 << 20;

/// A chunk's entry: the index of the partition it came from, and its id.
pub(super) type ChunkId = (usize, MessageIdData);

/// The messages being put together, and the chunks of those handed out.
#[derive(Default)]
pub(super) struct ChunkedMessages {
    /// Oldest first.
    assembling: VecDeque<Assembly>,
    /// The chunks of each message handed out, but the last, by the last
    /// one's entry: a message is handed out with its last chunk's id.
    handed_out: HashMap<EntryKey, Vec<ChunkId>, TrustedHashing>,
}

/// One message whose chunks are arriving.
struct Assembly {
    partition: usize,
    uuid: String,
    chunks: i32,
    /// The chunk that continues the payload.
    next: i32,
    payload: Vec<u8>,
    /// Every chunk entry taken for the message, copies included: each is
    /// settled with the message.
    taken: Vec<MessageIdData>,
}

impl Assembly {
    /// The chunks taken, as the consumer settles them.
    fn into_chunk_ids(self) -> impl Iterator<Item = ChunkId> {
        let partition = self.partition;
        self.taken.into_iter().map(move |id| (partition, id))
    }
}

/// What a received payload gives.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Assembled {
    /// A message that is not chunked, as it came.
    Whole(Vec<u8>),
    /// The last chunk of a message: its whole payload, and its other chunks
    /// (for [`hand_out`](ChunkedMessages::hand_out)).
    Complete(Vec<u8>, Vec<ChunkId>),
    /// A chunk taken while its message waits for more.
    Held,
}

/// The chunk fields of a message's metadata: its producer's id for the
/// message, how many chunks it has, and which this is.
fn chunk_of(metadata: &MessageMetadata) -> Option<(&str, i32, i32)> {
    let chunks = metadata.num_chunks_from_msg.filter(|&chunks| chunks > 1)?;
    Some((metadata.uuid.as_deref()?, chunks, metadata.chunk_id?))
}

/// Whether a message is a chunk of a larger one.
pub(super) fn is_chunk(metadata: &MessageMetadata) -> bool {
    chunk_of(metadata).is_some()
}

impl ChunkedMessages {
    /// Takes a payload that partition `partition` delivered with `id`. The
    /// chunks of messages given up meanwhile go to `given_up`, to be nacked.
    pub(super) fn accept(
        &mut self,
        partition: usize,
        id: &MessageIdData,
        metadata: &MessageMetadata,
        data: Vec<u8>,
        given_up: &mut Vec<ChunkId>,
    ) -> Assembled {
        let Some((uuid, chunks, chunk)) = chunk_of(metadata) else {
            return Assembled::Whole(data);
        };
        let at = self
            .assembling
            .iter()
            .position(|assembly| assembly.partition == partition && assembly.uuid == uuid);
        let Some(at) = at else {
            if chunk == 0 {
                self.begin(partition, uuid, chunks, metadata, id, data, given_up);
            } else {
                given_up.push((partition, id.clone()));
            }
            return Assembled::Held;
        };
        let assembly = &mut self.assembling[at];
        assembly.taken.push(id.clone());
        if chunk == 0 {
            // Sent again from the start (its producer reconnected).
            assembly.payload = data;
            assembly.next = 1;
        } else if chunk == assembly.next {
            assembly.payload.extend_from_slice(&data);
            assembly.next += 1;
        } else if chunk > assembly.next {
            let gapped = self.assembling.remove(at).expect("found above");
            given_up.extend(gapped.into_chunk_ids());
            return Assembled::Held;
        }
        // (A chunk before `next` is a copy of one taken: held with it.)
        if assembly.next < assembly.chunks {
            return Assembled::Held;
        }
        let mut done = self.assembling.remove(at).expect("found above");
        done.taken.pop();
        let payload = std::mem::take(&mut done.payload);
        Assembled::Complete(payload, done.into_chunk_ids().collect())
    }

    /// Starts a message's assembly with its first chunk, giving up the
    /// oldest one if as many as the limit are being put together.
    #[allow(clippy::too_many_arguments)]
    fn begin(
        &mut self,
        partition: usize,
        uuid: &str,
        chunks: i32,
        metadata: &MessageMetadata,
        id: &MessageIdData,
        data: Vec<u8>,
        given_up: &mut Vec<ChunkId>,
    ) {
        if self.assembling.len() >= ASSEMBLING_LIMIT {
            let oldest = self.assembling.pop_front().expect("at the limit");
            given_up.extend(oldest.into_chunk_ids());
        }
        // What the first chunk announces, within the limit, but never less
        // than the chunk itself (which may be larger than the limit where a
        // broker takes entries of more than 16 MiB).
        let total = metadata.total_chunk_msg_size.unwrap_or(0).max(0) as usize;
        let mut payload = Vec::with_capacity(total.min(RESERVE_LIMIT).max(data.len()));
        payload.extend_from_slice(&data);
        self.assembling.push_back(Assembly {
            partition,
            uuid: uuid.to_owned(),
            chunks,
            next: 1,
            payload,
            taken: vec![id.clone()],
        });
    }

    /// Records the other chunks of a message handed out with the id whose
    /// entry is `last`, to settle with it.
    pub(super) fn hand_out(&mut self, last: EntryKey, others: Vec<ChunkId>) {
        if !others.is_empty() {
            self.handed_out.insert(last, others);
        }
    }

    /// The other chunks of the message handed out with the id whose entry
    /// is `last`, once, when it is settled.
    pub(super) fn settled(&mut self, last: EntryKey) -> Option<Vec<ChunkId>> {
        if self.handed_out.is_empty() {
            return None;
        }
        self.handed_out.remove(&last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(entry: u64) -> MessageIdData {
        MessageIdData {
            ledger_id: 7,
            entry_id: entry,
            ..Default::default()
        }
    }

    fn chunk(uuid: &str, chunk: i32, chunks: i32) -> MessageMetadata {
        MessageMetadata {
            uuid: Some(uuid.to_owned()),
            chunk_id: Some(chunk),
            num_chunks_from_msg: Some(chunks),
            total_chunk_msg_size: Some(6),
            ..Default::default()
        }
    }

    fn accept(
        chunked: &mut ChunkedMessages,
        entry: u64,
        metadata: &MessageMetadata,
        data: &str,
    ) -> (Assembled, Vec<ChunkId>) {
        let mut given_up = Vec::new();
        let assembled = chunked.accept(0, &id(entry), metadata, data.into(), &mut given_up);
        (assembled, given_up)
    }

    #[test]
    fn a_message_that_is_not_chunked_passes_as_it_came() {
        let mut chunked = ChunkedMessages::default();
        let plain = MessageMetadata::default();
        assert_eq!(
            accept(&mut chunked, 1, &plain, "whole"),
            (Assembled::Whole("whole".into()), vec![])
        );
        // One chunk is a whole message too.
        let single = chunk("u", 0, 1);
        assert_eq!(
            accept(&mut chunked, 2, &single, "one").0,
            Assembled::Whole("one".into())
        );
        assert!(!is_chunk(&plain) && !is_chunk(&single));
        assert!(is_chunk(&chunk("u", 1, 2)));
    }

    #[test]
    fn chunks_in_order_make_the_message_and_its_last_id_settles_the_rest() {
        let mut chunked = ChunkedMessages::default();
        assert_eq!(
            accept(&mut chunked, 1, &chunk("u", 0, 3), "ab").0,
            Assembled::Held
        );
        // Another message's chunk between them changes nothing.
        let plain = MessageMetadata::default();
        assert_eq!(
            accept(&mut chunked, 2, &plain, "x").0,
            Assembled::Whole("x".into())
        );
        assert_eq!(
            accept(&mut chunked, 3, &chunk("u", 1, 3), "cd").0,
            Assembled::Held
        );
        let (assembled, given_up) = accept(&mut chunked, 4, &chunk("u", 2, 3), "ef");
        assert_eq!(
            assembled,
            Assembled::Complete("abcdef".into(), vec![(0, id(1)), (0, id(3))])
        );
        assert!(given_up.is_empty());
        let Assembled::Complete(_, others) = assembled else {
            unreachable!()
        };
        let last = (-1, 7, 4);
        chunked.hand_out(last, others);
        assert_eq!(chunked.settled(last), Some(vec![(0, id(1)), (0, id(3))]));
        assert_eq!(chunked.settled(last), None, "once");
    }

    #[test]
    fn copies_and_a_restart_are_settled_with_the_message() {
        let mut chunked = ChunkedMessages::default();
        accept(&mut chunked, 1, &chunk("u", 0, 2), "ab");
        // A copy of the first chunk, then the producer starting over.
        assert_eq!(
            accept(&mut chunked, 1, &chunk("u", 0, 2), "ab").0,
            Assembled::Held
        );
        assert_eq!(
            accept(&mut chunked, 5, &chunk("u", 0, 2), "AB").0,
            Assembled::Held
        );
        let (assembled, _) = accept(&mut chunked, 6, &chunk("u", 1, 2), "CD");
        assert_eq!(
            assembled,
            Assembled::Complete("ABCD".into(), vec![(0, id(1)), (0, id(1)), (0, id(5))])
        );
    }

    #[test]
    fn a_chunk_that_does_not_continue_its_message_gives_it_up() {
        let mut chunked = ChunkedMessages::default();
        // Its first chunk never came.
        assert_eq!(
            accept(&mut chunked, 3, &chunk("u", 1, 3), "cd"),
            (Assembled::Held, vec![(0, id(3))])
        );
        // A gap.
        accept(&mut chunked, 4, &chunk("v", 0, 3), "ab");
        assert_eq!(
            accept(&mut chunked, 6, &chunk("v", 2, 3), "ef"),
            (Assembled::Held, vec![(0, id(4)), (0, id(6))])
        );
        // Nothing of it is left: its next first chunk starts it anew.
        accept(&mut chunked, 7, &chunk("v", 0, 2), "ab");
        let (assembled, given_up) = accept(&mut chunked, 8, &chunk("v", 1, 2), "cd");
        assert_eq!(
            assembled,
            Assembled::Complete("abcd".into(), vec![(0, id(7))])
        );
        assert!(given_up.is_empty());
    }

    #[test]
    fn past_the_limit_the_oldest_message_is_given_up() {
        let mut chunked = ChunkedMessages::default();
        for n in 0..ASSEMBLING_LIMIT as u64 {
            let (_, given_up) = accept(&mut chunked, n, &chunk(&format!("m{n}"), 0, 2), "a");
            assert!(given_up.is_empty());
        }
        let (_, given_up) = accept(&mut chunked, 99, &chunk("late", 0, 2), "a");
        assert_eq!(given_up, vec![(0, id(0))]);
        // The others still complete.
        let (assembled, _) = accept(&mut chunked, 100, &chunk("m1", 1, 2), "b");
        assert_eq!(
            assembled,
            Assembled::Complete("ab".into(), vec![(0, id(1))])
        );
    }

    #[test]
    fn a_first_chunk_larger_than_the_reserve_limit_is_taken() {
        let mut chunked = ChunkedMessages::default();
        let mut given_up = Vec::new();
        let mut first = chunk("u", 0, 2);
        first.total_chunk_msg_size = Some(i32::MAX);
        let large = vec![b'a'; RESERVE_LIMIT + 1];
        let held = chunked.accept(0, &id(1), &first, large, &mut given_up);
        assert_eq!(held, Assembled::Held);
        let last = chunked.accept(0, &id(2), &chunk("u", 1, 2), b"b".to_vec(), &mut given_up);
        let Assembled::Complete(payload, others) = last else {
            panic!("the message is whole");
        };
        assert_eq!(payload.len(), RESERVE_LIMIT + 2);
        assert_eq!(others, vec![(0, id(1))]);
        assert!(given_up.is_empty());
    }

    #[test]
    fn the_same_uuid_on_two_partitions_is_two_messages() {
        let mut chunked = ChunkedMessages::default();
        let mut given_up = Vec::new();
        let first = chunk("u", 0, 2);
        chunked.accept(0, &id(1), &first, "a".into(), &mut given_up);
        chunked.accept(1, &id(1), &first, "b".into(), &mut given_up);
        let last = chunk("u", 1, 2);
        let on_one = chunked.accept(1, &id(2), &last, "B".into(), &mut given_up);
        assert_eq!(on_one, Assembled::Complete("bB".into(), vec![(1, id(1))]));
        let on_zero = chunked.accept(0, &id(2), &last, "A".into(), &mut given_up);
        assert_eq!(on_zero, Assembled::Complete("aA".into(), vec![(0, id(1))]));
        assert!(given_up.is_empty());
    }
}
