//! How the scheduler chooses among priority levels that have work:
//! strictly by priority, by weighted shares, or by priority improved with
//! waiting time; and the permits reserved for a level or better.

use std::collections::BTreeMap;
use std::time::Duration;

/// How the next message is chosen among priority levels that have work.
/// Within a level, subscriptions always take turns.
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub enum SchedulingPolicy {
    /// The best level with work always goes first (the default, and the
    /// Python dispatcher's behaviour): lower levels wait as long as better
    /// ones have work.
    #[default]
    Strict,
    /// While several levels have work, each receives dispatches in
    /// proportion to its weight (deficit round robin across levels), so
    /// that no level starves.
    Weighted(Weights),
    /// A waiting message's effective priority improves with its wait,
    /// without limit, so that a long wait at a lower level eventually beats
    /// fresh work at a better one; only levels within the aging's
    /// `max_boost` of the best level with work compete.
    Aging(Aging),
}

/// The weights of [`SchedulingPolicy::Weighted`], by priority level.
///
/// ```
/// use pulsar_dispatcher::{SchedulingPolicy, Weights};
///
/// // While both have work, priority 10 gets 8 dispatches for every 2 of
/// // priority 20; levels not named get 1.
/// let policy = SchedulingPolicy::Weighted(Weights::new().level(10, 8).level(20, 2));
/// ```
#[must_use]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Weights {
    by_level: BTreeMap<i64, u32>,
    others: u32,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            by_level: BTreeMap::new(),
            others: 1,
        }
    }
}

impl Weights {
    /// Every level weighs 1 until told otherwise.
    pub fn new() -> Self {
        Self::default()
    }

    /// The weight of the level `priority` (at least 1; 0 counts as 1).
    pub fn level(mut self, priority: i64, weight: u32) -> Self {
        self.by_level.insert(priority, weight.max(1));
        self
    }

    /// The weight of levels not named with [`level`](Self::level) (1 by
    /// default; 0 counts as 1).
    pub fn others(mut self, weight: u32) -> Self {
        self.others = weight.max(1);
        self
    }

    pub(super) fn of(&self, priority: i64) -> u32 {
        self.by_level.get(&priority).copied().unwrap_or(self.others)
    }
}

/// The aging of [`SchedulingPolicy::Aging`]: a message that has waited `w`
/// competes as if its priority value were lower by `w × per_second`,
/// against the levels within `max_boost` of the best level with work (so
/// it overtakes at most [`boost`](Self::boost) points of priority).
///
/// ```
/// use std::time::Duration;
/// use pulsar_dispatcher::{Aging, SchedulingPolicy};
///
/// // One priority point per 100 ms of waiting, at most 50 points.
/// let policy = SchedulingPolicy::Aging(Aging::new(10.0, 50));
/// assert_eq!(Aging::new(10.0, 50).boost(Duration::from_millis(250)), 2);
/// assert_eq!(Aging::new(10.0, 50).boost(Duration::from_secs(60)), 50);
/// ```
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Aging {
    per_second: f64,
    max_boost: i64,
}

impl Aging {
    /// `per_second` priority points per second of waiting (negative or
    /// non-finite counts as 0), at most `max_boost` points (at least 0).
    pub fn new(per_second: f64, max_boost: i64) -> Self {
        let per_second = if per_second.is_finite() && per_second > 0.0 {
            per_second
        } else {
            0.0
        };
        Aging {
            per_second,
            max_boost: max_boost.max(0),
        }
    }

    /// How many points of priority a message that has waited `waited` can
    /// overtake (of fresh messages): `min(max_boost, waited × per_second)`.
    pub fn boost(&self, waited: Duration) -> i64 {
        let points = waited.as_secs_f64() * self.per_second;
        if points >= self.max_boost as f64 {
            self.max_boost
        } else {
            points as i64
        }
    }

    /// A wait in priority points, without limit.
    pub(super) fn points(&self, waited: Duration) -> f64 {
        waited.as_secs_f64() * self.per_second
    }

    /// The largest boost: a level further than this from the best level
    /// with work is never served before it.
    pub fn max_boost(&self) -> i64 {
        self.max_boost
    }

    /// How long a message waits for the largest boost (`Duration::MAX`
    /// where that is longer than a `Duration` holds); `None` when
    /// `per_second` is 0, as nothing then ages.
    pub fn bound(&self) -> Option<Duration> {
        (self.per_second > 0.0).then(|| {
            Duration::try_from_secs_f64(self.max_boost as f64 / self.per_second)
                .unwrap_or(Duration::MAX)
        })
    }
}

/// Permits kept for levels of a priority or better.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct Reservations {
    /// (priority, permits), by priority.
    by_level: BTreeMap<i64, usize>,
}

impl Reservations {
    pub(super) fn reserve(&mut self, priority: i64, permits: usize) {
        *self.by_level.entry(priority).or_default() += permits;
    }

    pub(super) fn total(&self) -> usize {
        self.by_level.values().sum()
    }

    /// How many free permits a message at `priority` must leave: those
    /// reserved for strictly better levels.
    pub(super) fn to_leave(&self, priority: i64) -> usize {
        self.by_level
            .range(..priority)
            .map(|(_, permits)| permits)
            .sum()
    }
}
