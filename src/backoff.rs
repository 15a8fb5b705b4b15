//! Retry delays: the backoff curve from a retry number to a delay.
//!
//! A backoff is any `Fn(u32) -> Duration`, called with the number of the
//! retry about to be scheduled (1 for a message's first retry). The two
//! curves here cost the same for retry 1 and retry `u32::MAX` and never
//! overflow: whether a delay reaches the maximum is decided in logarithms,
//! and the power is computed in floating point only below it.

use std::sync::Arc;
use std::time::Duration;

use crate::error::Error;

/// The default curve: 1, 2, 4, 8, ... seconds, at most 5 minutes.
pub fn default_backoff(retry: u32) -> Duration {
    exponential(Duration::from_secs(1), 2.0, Duration::from_secs(300), retry)
}

/// A curve that starts at `initial`, is multiplied by `multiplier` for each
/// further retry, and never exceeds `maximum`.
///
/// Refuses a multiplier below 1 (or not a number) and a maximum below the
/// initial delay.
///
/// ```
/// use std::time::Duration;
/// use pulsar_dispatcher::exponential_backoff;
///
/// let backoff = exponential_backoff(Duration::from_secs(5), 3.0, Duration::from_secs(600)).unwrap();
/// assert_eq!(backoff(1), Duration::from_secs(5));
/// assert_eq!(backoff(3), Duration::from_secs(45));
/// assert_eq!(backoff(10), Duration::from_secs(600));
/// ```
pub fn exponential_backoff(
    initial: Duration,
    multiplier: f64,
    maximum: Duration,
) -> Result<impl Fn(u32) -> Duration + Clone + 'static, Error> {
    if multiplier.is_nan() || multiplier < 1.0 {
        return Err(Error::InvalidOption {
            option: "exponential_backoff multiplier",
            reason: format!("must be at least 1, got {multiplier}"),
        });
    }
    if maximum < initial {
        return Err(Error::InvalidOption {
            option: "exponential_backoff maximum",
            reason: format!("{maximum:?} is below the initial delay {initial:?}"),
        });
    }
    Ok(move |retry| exponential(initial, multiplier, maximum, retry))
}

fn exponential(initial: Duration, multiplier: f64, maximum: Duration, retry: u32) -> Duration {
    if initial.is_zero() || multiplier == 1.0 {
        return initial;
    }
    let exponent = retry.saturating_sub(1);
    // Whether the delay reaches the maximum, compared in logarithms, which
    // no retry number overflows (a power computed directly overflows to
    // infinity, and a zero start times infinity is not a number).
    let log_seconds = initial.as_secs_f64().ln() + f64::from(exponent) * multiplier.ln();
    if log_seconds >= maximum.as_secs_f64().ln() {
        return maximum;
    }
    // Below the maximum, so the power is finite. The exponent can still be
    // any `u32` (a multiplier a hair above 1 grows that slowly), so it goes
    // to the power as a float, never through an `i32` that would wrap.
    let seconds = initial.as_secs_f64() * multiplier.powf(f64::from(exponent));
    Duration::from_secs_f64(seconds).min(maximum)
}

/// A backoff curve as stored in the options.
#[derive(Clone)]
pub(crate) struct Backoff(Arc<dyn Fn(u32) -> Duration + Send + Sync>);

impl Backoff {
    pub(crate) fn new(curve: impl Fn(u32) -> Duration + Send + Sync + 'static) -> Self {
        Backoff(Arc::new(curve))
    }

    pub(crate) fn delay(&self, retry: u32) -> Duration {
        (self.0)(retry)
    }
}

impl std::fmt::Debug for Backoff {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Backoff(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_curve_grows_past_two_billion_retries() {
        let curve = exponential_backoff(
            Duration::from_secs(1),
            1.000_000_001,
            Duration::from_secs(3600),
        )
        .unwrap();
        for retry in [1, 2_000_000_000, 2_147_483_649, 3_000_000_000, u32::MAX] {
            // 1.000000001^(retry - 1) s, about e^((retry - 1) / 10^9).
            let expected = ((f64::from(retry) - 1.0) * 1e-9).exp();
            let delay = curve(retry).as_secs_f64();
            assert!(
                (delay - expected).abs() < expected * 1e-6,
                "retry {retry}: {delay} s, expected {expected} s"
            );
        }
    }

    #[test]
    fn the_default_doubles_from_one_second_up_to_five_minutes() {
        let seconds: Vec<u64> = (1..=11).map(|r| default_backoff(r).as_secs()).collect();
        assert_eq!(seconds, [1, 2, 4, 8, 16, 32, 64, 128, 256, 300, 300]);
    }

    #[test]
    fn huge_retry_numbers_stay_at_the_maximum() {
        assert_eq!(default_backoff(u32::MAX), Duration::from_secs(300));
        let slow = exponential_backoff(Duration::ZERO, 1.0, Duration::ZERO).unwrap();
        assert_eq!(slow(u32::MAX), Duration::ZERO);
        let big = exponential_backoff(Duration::from_secs(1), 1e10, Duration::MAX).unwrap();
        assert_eq!(big(u32::MAX), Duration::MAX);
    }

    #[test]
    fn curves_at_their_edges_neither_panic_nor_flatten_early() {
        // A zero start stays zero, whatever the retry (never 0 × ∞).
        let from_zero = exponential_backoff(Duration::ZERO, 2.0, Duration::from_secs(10)).unwrap();
        assert_eq!(from_zero(1025), Duration::ZERO);
        assert_eq!(from_zero(u32::MAX), Duration::ZERO);
        // An infinite multiplier: the start, then the maximum.
        let steep = exponential_backoff(
            Duration::from_secs(1),
            f64::INFINITY,
            Duration::from_secs(9),
        )
        .unwrap();
        assert_eq!(
            (steep(1), steep(2)),
            (Duration::from_secs(1), Duration::from_secs(9))
        );
        // A multiplier near 1 keeps growing past retry 1,100: the exponent
        // is not capped.
        let gentle =
            exponential_backoff(Duration::from_secs(1), 1.001, Duration::from_secs(300)).unwrap();
        let at_2000 = gentle(2000).as_secs_f64();
        assert!((at_2000 - 1.001f64.powi(1999)).abs() < 1e-6, "{at_2000}");
        assert_eq!(gentle(u32::MAX), Duration::from_secs(300));
    }

    #[test]
    fn a_multiplier_of_one_gives_a_constant_delay() {
        let constant =
            exponential_backoff(Duration::from_secs(7), 1.0, Duration::from_secs(100)).unwrap();
        assert!((1..50).all(|r| constant(r) == Duration::from_secs(7)));
    }

    #[test]
    fn nonsense_curves_are_refused() {
        let second = Duration::from_secs(1);
        assert!(exponential_backoff(second, 0.5, second * 10).is_err());
        assert!(exponential_backoff(second, f64::NAN, second * 10).is_err());
        assert!(exponential_backoff(second * 10, 2.0, second).is_err());
    }
}
