//! Error classes: which handler errors are fatal and which are retried.
//!
//! The Python dispatcher matches exception classes and their subclasses.
//! The Rust equivalent is a type check along the error's `source()` chain:
//! [`ErrorClass::of::<E>()`] matches an error of type `E` and any error
//! caused by one. [`ErrorClass::matching`] takes any predicate instead.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

/// A set of handler errors, used to route failures to dead-lettering or to
/// delayed retries.
///
/// ```
/// use pulsar_dispatcher::ErrorClass;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("service unavailable")]
/// struct ServiceUnavailable;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("calling the warehouse failed")]
/// struct WarehouseError(#[source] ServiceUnavailable);
///
/// let class = ErrorClass::of::<ServiceUnavailable>();
/// assert!(class.matches(&ServiceUnavailable));
/// assert!(class.matches(&WarehouseError(ServiceUnavailable)));
/// assert!(!class.matches(&std::fmt::Error));
/// ```
///
/// # Errors wrapped with `#[error(transparent)]`
///
/// A `thiserror` variant marked `#[error(transparent)]` forwards both
/// `Display` and `source()` to the error it wraps, so that error itself is
/// never in the chain: `ErrorClass::of::<Inner>()` cannot see it. Either
/// wrap it as a source (`#[error("...")] Variant(#[from] Inner)`), which
/// keeps it in the chain, or match the variant of your own enum:
///
/// ```
/// use pulsar_dispatcher::ErrorClass;
///
/// #[derive(Debug, thiserror::Error)]
/// #[error("service unavailable")]
/// struct ServiceUnavailable;
///
/// #[derive(Debug, thiserror::Error)]
/// enum Transparent {
///     #[error(transparent)]
///     Busy(#[from] ServiceUnavailable),
/// }
///
/// #[derive(Debug, thiserror::Error)]
/// enum Sourced {
///     #[error("the warehouse is busy")]
///     Busy(#[from] ServiceUnavailable),
/// }
///
/// let by_type = ErrorClass::of::<ServiceUnavailable>();
/// assert!(!by_type.matches(&Transparent::Busy(ServiceUnavailable)));
/// assert!(by_type.matches(&Sourced::Busy(ServiceUnavailable)));
///
/// let by_variant = ErrorClass::matching(|error| {
///     matches!(error.downcast_ref::<Transparent>(), Some(Transparent::Busy(_)))
/// });
/// assert!(by_variant.matches(&Transparent::Busy(ServiceUnavailable)));
/// ```
#[derive(Clone)]
pub struct ErrorClass {
    matches: Arc<Predicate>,
}

type Predicate = dyn Fn(&(dyn StdError + 'static)) -> bool + Send + Sync;

impl ErrorClass {
    /// Errors of type `E`, and errors whose `source()` chain contains one.
    pub fn of<E: StdError + 'static>() -> Self {
        Self::matching(|error| {
            let mut next = Some(error);
            while let Some(current) = next {
                if current.is::<E>() {
                    return true;
                }
                next = current.source();
            }
            false
        })
    }

    /// Errors for which `predicate` returns true.
    ///
    /// The predicate gets the handler's error as converted to a
    /// [`HandlerError`](crate::HandlerError); an `anyhow::Error` comes in a
    /// wrapper of the dispatcher's whose `source()` is the error anyhow
    /// wraps, so a predicate that looks for a type walks the `source()`
    /// chain, as [`ErrorClass::of`] does.
    pub fn matching(
        predicate: impl Fn(&(dyn StdError + 'static)) -> bool + Send + Sync + 'static,
    ) -> Self {
        ErrorClass {
            matches: Arc::new(predicate),
        }
    }

    /// Errors in this class or in `other`.
    pub fn or(self, other: ErrorClass) -> Self {
        Self::matching(move |error| self.matches(error) || other.matches(error))
    }

    /// Whether `error` belongs to this class.
    pub fn matches(&self, error: &(dyn StdError + 'static)) -> bool {
        (self.matches)(error)
    }
}

impl fmt::Debug for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ErrorClass(..)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("invalid")]
    struct Invalid;

    #[derive(Debug, thiserror::Error)]
    #[error("wrapped")]
    struct Wrapper(#[source] Box<dyn StdError + 'static>);

    #[test]
    fn a_type_matches_anywhere_in_the_source_chain() {
        let class = ErrorClass::of::<Invalid>();
        let deep = Wrapper(Box::new(Wrapper(Box::new(Invalid))));
        assert!(class.matches(&deep));
        let boxed: Box<dyn StdError> = Box::new(Invalid);
        assert!(class.matches(boxed.as_ref()));
        assert!(!class.matches(&Wrapper("other".into())));
    }

    #[test]
    fn predicates_and_unions() {
        let timeout = ErrorClass::matching(|e| e.to_string().contains("timed out"));
        let either = timeout.clone().or(ErrorClass::of::<Invalid>());
        let boxed: Box<dyn StdError> = "request timed out".into();
        assert!(timeout.matches(boxed.as_ref()));
        assert!(either.matches(&Invalid));
        assert!(!timeout.matches(&Invalid));
    }
}
