//! Rate-limited logging for failures that can repeat once per message: a
//! broker outage must not turn into thousands of log lines a second.
//!
//! A [`LogLimit`] lets the first failure be logged and then at most one
//! every [`LOG_INTERVAL`], and says how many it held back in between, so
//! that a logged line carries the count of the ones that were not; the
//! counters in `stats()` keep the exact totals.

use std::cell::Cell;
use std::time::Duration;

use tokio::time::Instant;

/// The shortest time between two logged lines of one kind.
pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// When one kind of failure was last logged, and how many were not since.
#[derive(Debug, Default)]
pub(crate) struct LogLimit {
    last_logged: Cell<Option<Instant>>,
    held_back: Cell<u64>,
}

impl LogLimit {
    /// Whether a failure at `now` is to be logged; if so, how many were
    /// held back since the last one logged.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let due = self
            .last_logged
            .get()
            .is_none_or(|logged| now.saturating_duration_since(logged) >= LOG_INTERVAL);
        if due {
            self.last_logged.set(Some(now));
            Some(self.held_back.take())
        } else {
            self.held_back.set(self.held_back.get() + 1);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_logged_then_one_an_interval_with_the_count_held_back() {
        let limit = LogLimit::default();
        let start = Instant::now();
        assert_eq!(limit.admit(start), Some(0));
        for _ in 0..5 {
            assert_eq!(limit.admit(start + Duration::from_secs(1)), None);
        }
        assert_eq!(limit.admit(start + LOG_INTERVAL), Some(5));
        assert_eq!(limit.admit(start + LOG_INTERVAL), None);
        assert_eq!(limit.admit(start + 2 * LOG_INTERVAL), Some(1));
    }
}
