//! Hashing for maps keyed by numbers that are already spread: entry ids
//! (distinct counters) and ordering keys (already hashed). Hashing them
//! again would cost time and spread them no better.

use std::hash::{BuildHasherDefault, Hasher};

/// Builds [`IdentityHasher`]s, for `HashMap`/`HashSet` type parameters.
pub(crate) type BuildIdentity = BuildHasherDefault<IdentityHasher>;

/// Hashes a `u64` as itself; other input is folded in byte by byte.
#[derive(Default)]
pub(crate) struct IdentityHasher(u64);

impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}
