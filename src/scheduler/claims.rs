//! How many messages of a key-ordered subscription claim each key: a small
//! open-addressing table of counts, sized when the subscription is added
//! for every key its buffer and its permits can hold at once, so that steady
//! traffic never allocates and each claim or release is a probe or two.
//!
//! Keys arrive already hashed (well mixed), so a key's low bits pick its
//! home slot. A slot with a count of zero is empty. Deleting shifts the
//! entries after the hole back instead of leaving tombstones, so the table
//! never needs cleaning however keys churn.

/// One slot: a key and its number of claims (zero: empty).
#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    count: u32,
}

pub(super) struct Claims {
    slots: Box<[Slot]>,
    /// `slots.len() - 1` (a power of two less one), kept rather than
    /// derived at each probe.
    mask: usize,
    /// Keys with at least one claim.
    len: usize,
}

impl Claims {
    /// A table for `keys` distinct keys at a time without growing.
    pub(super) fn with_room(keys: usize) -> Self {
        let size = Self::size_for(keys);
        Claims {
            slots: vec![Slot::default(); size].into_boxed_slice(),
            mask: size - 1,
            len: 0,
        }
    }

    /// At most half full keeps probe sequences short.
    fn size_for(keys: usize) -> usize {
        (keys.max(4) * 2).next_power_of_two()
    }

    fn home(&self, key: u64) -> usize {
        key as usize & self.mask
    }

    /// The slot holding `key`, or the empty slot where it would go.
    fn find(&self, key: u64) -> usize {
        let mut at = self.home(key);
        while self.slots[at].count != 0 && self.slots[at].key != key {
            at = (at + 1) & self.mask;
        }
        at
    }

    /// Adds a claim on `key`; returns how many it has now.
    #[inline(always)]
    pub(super) fn claim(&mut self, key: u64) -> u32 {
        if (self.len + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let at = self.find(key);
        let slot = &mut self.slots[at];
        if slot.count == 0 {
            *slot = Slot { key, count: 0 };
            self.len += 1;
        }
        slot.count += 1;
        slot.count
    }

    /// Drops a claim on `key`, which must have one; returns how many are
    /// left.
    #[inline(always)]
    pub(super) fn unclaim(&mut self, key: u64) -> u32 {
        let at = self.find(key);
        let slot = &mut self.slots[at];
        assert!(slot.count > 0, "a key released more often than claimed");
        slot.count -= 1;
        let left = slot.count;
        if left == 0 {
            self.len -= 1;
            self.close_hole(at);
        }
        left
    }

    /// Closes the hole at `hole` (a slot whose count just fell to zero, so
    /// already empty), moving back each later entry of the run whose home
    /// lies outside the cyclic range after the hole up to its own slot (an
    /// entry at its home stays), so that every entry
    /// stays reachable from its home without a gap; each entry moved
    /// leaves the next hole. Inlined by force into its one caller, where
    /// the first slot after the hole is empty most of the time (the table
    /// is at most half full) and nothing is written; out of line, its call
    /// cost about 10 instructions per release.
    #[inline(always)]
    fn close_hole(&mut self, mut hole: usize) {
        let mask = self.mask;
        let mut next = (hole + 1) & mask;
        while self.slots[next].count != 0 {
            let home = self.home(self.slots[next].key);
            let from_home = next.wrapping_sub(home) & mask;
            let from_hole = next.wrapping_sub(hole) & mask;
            if from_home >= from_hole {
                self.slots[hole] = self.slots[next];
                self.slots[next].count = 0;
                hole = next;
            }
            next = (next + 1) & mask;
        }
    }

    /// Doubles the table. A safety net: the table is sized for every key
    /// a subscription can claim at once (its buffer plus its permits, which
    /// do not change after it is added), so traffic does not get here; if
    /// it did, probing a full table would never end.
    fn grow(&mut self) {
        let old = std::mem::replace(self, Claims::with_room(self.slots.len()));
        for slot in old.slots.iter().filter(|slot| slot.count != 0) {
            let at = self.find(slot.key);
            self.slots[at] = *slot;
            self.len += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::Claims;

    #[test]
    fn claims_count_up_and_down_per_key() {
        let mut claims = Claims::with_room(4);
        assert_eq!(claims.claim(7), 1);
        assert_eq!(claims.claim(7), 2);
        assert_eq!(claims.claim(15), 1, "same home slot as 7, another key");
        assert_eq!(claims.unclaim(7), 1);
        assert_eq!(claims.unclaim(7), 0);
        assert_eq!(claims.unclaim(15), 0);
        assert_eq!(claims.len, 0);
        assert!(claims.slots.iter().all(|slot| slot.count == 0));
    }

    #[test]
    fn a_table_holds_the_keys_it_is_sized_for_without_growing_past_half_full() {
        for keys in 1..=40u64 {
            let mut claims = Claims::with_room(keys as usize);
            let size = claims.slots.len();
            assert!(size >= 2 * keys as usize, "{keys} keys in {size} slots");
            for key in 0..keys {
                assert_eq!(claims.claim(key.wrapping_mul(0x9e37_79b9_7f4a_7c15)), 1);
            }
            assert_eq!(claims.slots.len(), size, "{keys} keys grew the table");
        }
    }

    #[test]
    fn a_key_sits_in_its_home_slot_when_that_is_free() {
        let mut claims = Claims::with_room(4);
        // Claimed in reverse, so that a probe from any other start would
        // put them elsewhere.
        for key in (0..4u64).rev() {
            claims.claim(key);
        }
        for key in 0..4u64 {
            let at = claims.find(key);
            assert_eq!(at, key as usize, "key {key}");
            assert_eq!((claims.slots[at].key, claims.slots[at].count), (key, 1));
        }
    }

    #[test]
    fn more_keys_than_sized_for_grow_the_table() {
        let mut claims = Claims::with_room(2);
        for key in 0..100 {
            assert_eq!(claims.claim(key * 8), 1);
            assert!(
                claims.len * 2 <= claims.slots.len(),
                "{} keys in {} slots: more than half full",
                claims.len,
                claims.slots.len()
            );
        }
        for key in 0..100 {
            assert_eq!(claims.unclaim(key * 8), 0);
        }
        assert_eq!(claims.len, 0);
    }

    proptest! {
        /// Any sequence of claims and releases, on keys chosen to collide
        /// (few home slots), counts what a plain map counts.
        #[test]
        fn counts_match_a_map(steps in prop::collection::vec((0u64..40, any::<bool>()), 0..400)) {
            let mut claims = Claims::with_room(8);
            let mut model: HashMap<u64, u32> = HashMap::new();
            for (key, add) in steps {
                // Keys 0..40 spread over few homes: many share one.
                let key = key * 16 + key % 3;
                let held = model.get(&key).copied().unwrap_or(0);
                if add || held == 0 {
                    prop_assert_eq!(claims.claim(key), held + 1);
                    model.insert(key, held + 1);
                } else {
                    prop_assert_eq!(claims.unclaim(key), held - 1);
                    if held == 1 {
                        model.remove(&key);
                    } else {
                        model.insert(key, held - 1);
                    }
                }
                prop_assert_eq!(claims.len, model.len());
                for (&key, &count) in &model {
                    let at = claims.find(key);
                    prop_assert_eq!(claims.slots[at].count, count);
                }
            }
        }
    }
}
