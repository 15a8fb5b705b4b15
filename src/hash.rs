//! Hashing done by the crate itself, for keys it chooses or trusts: an
//! ordering key, hashed once when its message arrives, and the keys of the
//! maps on the per-message path (topic names, the broker's message
//! positions), by a hash fast for short keys and integers.

/// An odd constant near 2^64 / phi: multiplying by it spreads a word's bits.
const ODD: u64 = 0x9E37_79B9_7F4A_7C15;

/// Mixes one word into a running state.
fn absorb(state: u64, word: u64) -> u64 {
    (state ^ word).wrapping_mul(ODD).rotate_left(27)
}

/// Hashes an ordering key's bytes to 64 well-mixed bits, in a few
/// nanoseconds for the short keys messages carry.
///
/// Not keyed against chosen input, and it need not be: two keys that
/// collide are only ordered as if they were one, which key ordering
/// allows, and the table it feeds stays small (bounded by buffers and
/// permits).
pub(crate) fn hash_key(bytes: &[u8]) -> u64 {
    let mut words = bytes.chunks_exact(8);
    let mut state = (bytes.len() as u64).wrapping_mul(ODD);
    for word in &mut words {
        state = absorb(state, u64::from_le_bytes(word.try_into().expect("8 bytes")));
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        state = absorb(state, tail_word(tail));
    }
    avalanche(state)
}

/// The last 1 to 7 bytes of a key as a little-endian word padded with
/// zeros, as copying them into a zeroed word gives, read with fixed-size
/// loads, which avoid a variable-length copy (a `memcpy` call per key).
/// Two overlapping loads of 4 bytes cover 4 to 7 bytes, three loads of 1
/// cover 1 to 3.
fn tail_word(tail: &[u8]) -> u64 {
    let len = tail.len();
    debug_assert!((1..8).contains(&len));
    if len >= 4 {
        let low = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes"));
        let high = u32::from_le_bytes(tail[len - 4..].try_into().expect("4 bytes"));
        // `high` holds bytes len - 4 .. len; its top len - 4 are bytes 4 .. len.
        u64::from(low) | (u64::from(high) >> (8 * (8 - len))) << 32
    } else {
        let middle = len / 2;
        u64::from(tail[0])
            | u64::from(tail[middle]) << (8 * middle)
            | u64::from(tail[len - 1]) << (8 * (len - 1))
    }
}

/// A [`Hasher`](std::hash::Hasher) for maps keyed by what the crate
/// chooses or trusts: the in-memory transport's topic names, and the
/// positions the broker gives messages (partition, ledger, entry, batch
/// index), which the Pulsar transport looks up a few times per message. A
/// byte string costs one [`hash_key`], each field one multiply and a
/// rotation, and the whole key one final mix: a fraction of SipHash's cost, with no
/// defence against keys chosen to collide, which none of those maps needs
/// (the broker is trusted as much as the topics' names).
#[derive(Default)]
pub(crate) struct TrustedHasher(u64);

impl std::hash::Hasher for TrustedHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.write_u64(hash_key(bytes));
    }

    fn write_u8(&mut self, word: u8) {
        self.write_u64(u64::from(word));
    }

    fn write_u32(&mut self, word: u32) {
        self.write_u64(u64::from(word));
    }

    fn write_i32(&mut self, word: i32) {
        // Sign-extended: any i32 maps to a distinct u64.
        self.write_u64(i64::from(word) as u64);
    }

    fn write_u64(&mut self, word: u64) {
        // One cheap step per word, the state offset by `ODD` first (a zero
        // state would let leading zero fields vanish). Each step is a
        // bijection of the state for a given word and of the word for a
        // given state, so keys that differ in a single field never collide
        // before `finish`, which mixes once for the table's bits.
        self.0 = absorb(self.0.wrapping_add(ODD), word);
    }

    fn write_usize(&mut self, word: usize) {
        self.write_u64(word as u64);
    }

    fn write_isize(&mut self, word: isize) {
        self.write_u64(word as u64);
    }

    fn finish(&self) -> u64 {
        // The keys are small integers a few low bits apart: the steps
        // alone leave them close, and the table takes its bucket from the
        // low bits and its tag from the high ones.
        avalanche(self.0)
    }
}

/// Builds [`TrustedHasher`]s, for `HashMap::with_hasher` and `Default`.
pub(crate) type TrustedHashing = std::hash::BuildHasherDefault<TrustedHasher>;

/// Makes every output bit depend on every input bit (the finalizer of
/// SplitMix64), so the table's bucket and tag bits both vary.
fn avalanche(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::{hash_key, TrustedHasher, TrustedHashing};

    #[test]
    fn distinct_short_keys_hash_apart_and_each_bit_varies() {
        let keys: Vec<String> = (0..10_000).map(|n| format!("key-{n}")).collect();
        let hashes: HashSet<u64> = keys.iter().map(|k| hash_key(k.as_bytes())).collect();
        assert_eq!(hashes.len(), keys.len());
        // Padding must not make a key equal to itself followed by zeros.
        assert_ne!(hash_key(b"a"), hash_key(b"a\0"));
        assert_ne!(hash_key(b""), hash_key(b"\0"));
        // Every bit is set by some hash and clear in another: the claims
        // table takes a key's home slot from its low bits.
        let ones = hashes.iter().fold(0u64, |acc, h| acc | h);
        let zeros = hashes.iter().fold(0u64, |acc, h| acc | !h);
        assert_eq!((ones, zeros), (u64::MAX, u64::MAX));
    }

    #[test]
    fn a_tail_reads_as_its_bytes_padded_with_zeros() {
        let bytes: Vec<u8> = (1..=7).map(|b| b * 31).collect();
        for len in 1..8 {
            let tail = &bytes[..len];
            let mut padded = [0u8; 8];
            padded[..len].copy_from_slice(tail);
            assert_eq!(
                super::tail_word(tail),
                u64::from_le_bytes(padded),
                "{len} bytes"
            );
        }
    }

    #[test]
    fn hashing_depends_on_the_bytes_alone() {
        let long = "a partition key longer than one word of eight bytes";
        assert_eq!(
            hash_key(long.as_bytes()),
            hash_key(long.to_owned().as_bytes())
        );
        assert_ne!(hash_key(long.as_bytes()), hash_key(&long.as_bytes()[1..]));
    }

    #[test]
    fn names_hash_apart_and_a_map_finds_each() {
        use std::collections::HashMap;
        use std::hash::BuildHasher;
        let names: Vec<String> = (0..1_000)
            .map(|n| format!("persistent://public/default/topic-{n}"))
            .collect();
        let hashing = TrustedHashing::default();
        let hashes: HashSet<u64> = names.iter().map(|n| hashing.hash_one(n)).collect();
        assert_eq!(hashes.len(), names.len());
        let map: HashMap<&str, usize, TrustedHashing> = names
            .iter()
            .enumerate()
            .map(|(at, n)| (n.as_str(), at))
            .collect();
        for (at, name) in names.iter().enumerate() {
            assert_eq!(map[name.as_str()], at);
        }
    }

    #[test]
    fn every_integer_width_counts_in_the_hash() {
        use std::hash::{BuildHasher, Hasher};
        // A write the hasher ignored would put every key of that type in
        // one bucket: correct, but each lookup a scan of the table.
        type WriteOne = fn(&mut TrustedHasher, u8);
        let widths: [(&str, WriteOne); 6] = [
            ("u8", |hasher, n| hasher.write_u8(n)),
            ("u32", |hasher, n| hasher.write_u32(u32::from(n))),
            ("i32", |hasher, n| hasher.write_i32(-i32::from(n))),
            ("u64", |hasher, n| hasher.write_u64(u64::from(n))),
            ("usize", |hasher, n| hasher.write_usize(usize::from(n))),
            ("isize", |hasher, n| hasher.write_isize(-isize::from(n))),
        ];
        let hashing = TrustedHashing::default();
        for (width, write) in widths {
            let hashes: HashSet<u64> = (0..=u8::MAX)
                .map(|n| {
                    let mut hasher = hashing.build_hasher();
                    write(&mut hasher, n);
                    hasher.finish()
                })
                .collect();
            assert_eq!(hashes.len(), 256, "{width}");
        }
    }

    #[test]
    fn each_input_bit_flips_each_output_bit_about_half_the_time() {
        // The claims table takes a key's home slot from the low bits of its
        // hash, and the maps their buckets from the low bits and their tags
        // from the high ones: a bit of the input that reached only some of
        // the output would leave keys that differ in it crowded together.
        const SAMPLES: u32 = 2_000;
        let mut flips = [[0u32; 64]; 64];
        let mut input = 1u64;
        for _ in 0..SAMPLES {
            // A fixed pseudo-random walk: the same inputs every run.
            input = input
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let output = super::avalanche(input);
            for (bit, row) in flips.iter_mut().enumerate() {
                let changed = output ^ super::avalanche(input ^ (1 << bit));
                for (out_bit, count) in row.iter_mut().enumerate() {
                    *count += u32::from(changed >> out_bit & 1 == 1);
                }
            }
        }
        for (bit, row) in flips.iter().enumerate() {
            for (out_bit, &count) in row.iter().enumerate() {
                assert!(
                    (SAMPLES * 2 / 5..=SAMPLES * 3 / 5).contains(&count),
                    "input bit {bit} flipped output bit {out_bit} {count} times in {SAMPLES}"
                );
            }
        }
    }

    #[test]
    fn message_positions_hash_apart_and_a_set_finds_each() {
        use std::hash::BuildHasher;
        // (partition, ledger, entry, batch index), as the Pulsar transport
        // keys them: neighbours differ in one field by one.
        let positions: Vec<(i32, u64, u64, Option<i32>)> = (-1..3)
            .flat_map(|partition| (0..4).map(move |ledger| (partition, ledger)))
            .flat_map(|(partition, ledger)| (0..50).map(move |entry| (partition, ledger, entry)))
            .flat_map(|(partition, ledger, entry)| {
                [None, Some(0), Some(1), Some(-1)]
                    .map(|batch_index| (partition, ledger, entry, batch_index))
            })
            .collect();
        let hashing = TrustedHashing::default();
        let hashes: HashSet<u64> = positions.iter().map(|p| hashing.hash_one(p)).collect();
        assert_eq!(hashes.len(), positions.len());
        // The table takes its bucket from the low bits and its tag from
        // the high ones: every bit varies across neighbouring positions.
        let ones = hashes.iter().fold(0u64, |acc, h| acc | h);
        let zeros = hashes.iter().fold(0u64, |acc, h| acc | !h);
        assert_eq!((ones, zeros), (u64::MAX, u64::MAX));
        let set: HashSet<_, TrustedHashing> = positions.iter().copied().collect();
        assert_eq!(set.len(), positions.len());
        assert!(positions.iter().all(|p| set.contains(p)));
        assert!(!set.contains(&(0, 0, 50, None)));
    }
}
