//! Hashing done by the crate itself: an ordering key is hashed once, when
//! its message arrives, by a hash fast for the short keys messages carry.

/// Hashes an ordering key's bytes to 64 well-mixed bits, in a few
/// nanoseconds for the short keys messages carry.
///
/// Not keyed against chosen input, and it need not be: two keys that
/// collide are only ordered as if they were one, which key ordering
/// allows, and the table it feeds stays small (bounded by buffers and
/// permits).
pub(crate) fn hash_key(bytes: &[u8]) -> u64 {
    const ODD: u64 = 0x9E37_79B9_7F4A_7C15;
    let absorb = |state: u64, word: u64| (state ^ word).wrapping_mul(ODD).rotate_left(27);
    let mut words = bytes.chunks_exact(8);
    let mut state = (bytes.len() as u64).wrapping_mul(ODD);
    for word in &mut words {
        state = absorb(state, u64::from_le_bytes(word.try_into().expect("8 bytes")));
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        let mut padded = [0u8; 8];
        padded[..tail.len()].copy_from_slice(tail);
        state = absorb(state, u64::from_le_bytes(padded));
    }
    avalanche(state)
}

/// A [`Hasher`](std::hash::Hasher) made of [`hash_key`], for maps keyed by
/// names the crate chooses or trusts (the in-memory transport's topics):
/// a fraction of SipHash's cost for a short name, and no defence against
/// keys chosen to collide, which those maps need none of.
#[derive(Default)]
pub(crate) struct NameHasher(u64);

impl std::hash::Hasher for NameHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = avalanche(self.0 ^ hash_key(bytes));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// Builds [`NameHasher`]s, for `HashMap::with_hasher` and `Default`.
pub(crate) type NameHashing = std::hash::BuildHasherDefault<NameHasher>;

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

    use super::{hash_key, NameHashing};

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
        let hashing = NameHashing::default();
        let hashes: HashSet<u64> = names.iter().map(|n| hashing.hash_one(n)).collect();
        assert_eq!(hashes.len(), names.len());
        let map: HashMap<&str, usize, NameHashing> = names
            .iter()
            .enumerate()
            .map(|(at, n)| (n.as_str(), at))
            .collect();
        for (at, name) in names.iter().enumerate() {
            assert_eq!(map[name.as_str()], at);
        }
    }
}
