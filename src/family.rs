//! Topic families: one handler over topics split by priority level.
//!
//! A family is a prefix and two enums: priority levels (live, batch, ...)
//! and optional sublevels (high, low, retry, ...). Each pair becomes a topic
//! named `<prefix>_<level>_<sublevel>` (member names lowercased) at priority
//! level value plus sublevel value; without sublevels, one topic
//! `<prefix>_<level>` per level at the level's value. The [`priorities!`]
//! macro declares such an enum. Every rule is checked when the family's
//! topics are computed, before anything is subscribed.
//!
//! [`priorities!`]: crate::priorities

use std::collections::HashSet;
use std::marker::PhantomData;

use crate::error::Error;

/// An enum whose members name priority levels and carry their values;
/// declare one with [`priorities!`](crate::priorities).
pub trait PriorityLevel: Copy + 'static {
    /// Every member, in declaration order.
    fn members() -> &'static [Self];
    /// The member's name as declared (topic names use it lowercased).
    fn name(self) -> &'static str;
    /// The member's priority value.
    fn value(self) -> i64;
}

/// Declares an enum of priority levels (or sublevels) for a
/// [`TopicFamily`].
///
/// ```
/// pulsar_dispatcher::priorities! {
///     /// How urgent the work is.
///     pub enum Level { Live = 100, Batch = 200 }
/// }
/// use pulsar_dispatcher::PriorityLevel;
/// assert_eq!(Level::Batch.value(), 200);
/// assert_eq!(Level::members().len(), 2);
/// ```
#[macro_export]
macro_rules! priorities {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $($(#[$member_meta:meta])* $member:ident = $value:expr),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        $vis enum $name {
            $($(#[$member_meta])* $member),+
        }

        impl $crate::PriorityLevel for $name {
            fn members() -> &'static [Self] {
                &[$($name::$member),+]
            }
            fn name(self) -> &'static str {
                match self {
                    $($name::$member => stringify!($member)),+
                }
            }
            fn value(self) -> i64 {
                match self {
                    $($name::$member => $value),+
                }
            }
        }
    };
}

/// The sublevel type of a family that has none.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoSublevels {}

impl PriorityLevel for NoSublevels {
    fn members() -> &'static [Self] {
        &[]
    }
    fn name(self) -> &'static str {
        match self {}
    }
    fn value(self) -> i64 {
        match self {}
    }
}

/// A family of topics `<prefix>_<level>[_<sublevel>]` consumed by one
/// handler; subscribe it with
/// [`Dispatcher::subscribe_family`](crate::Dispatcher::subscribe_family).
///
/// ```
/// use pulsar_dispatcher::{priorities, TopicFamily};
///
/// priorities! { pub enum Level { Live = 100, Batch = 200 } }
/// priorities! { pub enum Sublevel { High = 10, Low = 20, Retry = 50 } }
///
/// let family = TopicFamily::<Level, Sublevel>::new("orders").retry_sublevel(Sublevel::Retry);
/// let topics = family.topics().unwrap();
/// assert_eq!(topics[0].name, "orders_live_high");
/// assert_eq!(topics[0].priority, 110);
/// assert_eq!(topics[0].retry_topic.as_deref(), Some("orders_live_retry"));
/// assert_eq!(topics[5].name, "orders_batch_retry");
/// assert_eq!(topics[5].priority, 250);
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct TopicFamily<L: PriorityLevel, S: PriorityLevel = NoSublevels> {
    prefix: String,
    retry_sublevel: Option<S>,
    levels: PhantomData<L>,
}

/// One member of a [`TopicFamily`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FamilyTopic {
    /// `<prefix>_<level>[_<sublevel>]`, as short topic name.
    pub name: String,
    /// Level value plus sublevel value.
    pub priority: i64,
    /// The level's retry topic, when the family has a retry sublevel.
    pub retry_topic: Option<String>,
}

impl<L: PriorityLevel, S: PriorityLevel> TopicFamily<L, S> {
    /// The family of `prefix` over the members of `L` and `S`.
    pub fn new(prefix: impl Into<String>) -> Self {
        TopicFamily {
            prefix: prefix.into(),
            retry_sublevel: None,
            levels: PhantomData,
        }
    }

    /// Within each level, the topic of this sublevel is the retry topic of
    /// every topic of that level, so a retried message stays ahead of all
    /// lower levels. Excludes a subscription-wide
    /// [`retry_topic`](crate::SubscribeOptions::retry_topic).
    pub fn retry_sublevel(mut self, sublevel: S) -> Self {
        self.retry_sublevel = Some(sublevel);
        self
    }

    pub(crate) fn has_retry_sublevel(&self) -> bool {
        self.retry_sublevel.is_some()
    }

    /// The family's topics, level by level, after checking every rule:
    /// distinct lowercased names, non-negative sublevels, a largest
    /// sublevel below the smallest gap between level values (so that every
    /// topic of a level outranks every topic of the next), and every
    /// level plus sublevel within `i64`.
    pub fn topics(&self) -> Result<Vec<FamilyTopic>, Error> {
        let levels = L::members();
        let sublevels = S::members();
        if levels.is_empty() {
            return Err(invalid(
                "levels",
                "a family needs at least one level".into(),
            ));
        }
        distinct_names(levels, "levels")?;
        distinct_names(sublevels, "sublevels")?;
        if let Some(negative) = sublevels.iter().find(|s| s.value() < 0) {
            return Err(invalid(
                "sublevels",
                format!(
                    "{} is {}; sublevels must not be negative",
                    negative.name(),
                    negative.value()
                ),
            ));
        }
        if let (Some(largest), Some(gap)) = (
            sublevels.iter().map(|s| s.value()).max(),
            smallest_gap(levels),
        ) {
            if largest >= gap {
                return Err(invalid(
                    "sublevels",
                    format!("the largest sublevel ({largest}) must be below the smallest gap between levels ({gap})"),
                ));
            }
        }
        let lower = |name: &str| name.to_lowercase();
        let mut topics = Vec::new();
        for level in levels {
            let level_name = format!("{}_{}", self.prefix, lower(level.name()));
            let retry_topic = self
                .retry_sublevel
                .map(|retry| format!("{level_name}_{}", lower(retry.name())));
            if sublevels.is_empty() {
                topics.push(FamilyTopic {
                    name: level_name.clone(),
                    priority: level.value(),
                    retry_topic: None,
                });
            }
            for sublevel in sublevels {
                // Saturated, two sublevels would share a priority.
                let priority = level.value().checked_add(sublevel.value()).ok_or_else(|| {
                    invalid(
                        "sublevels",
                        format!(
                            "{} plus {} ({} + {}) is beyond the largest priority",
                            level.name(),
                            sublevel.name(),
                            level.value(),
                            sublevel.value()
                        ),
                    )
                })?;
                topics.push(FamilyTopic {
                    name: format!("{level_name}_{}", lower(sublevel.name())),
                    priority,
                    retry_topic: retry_topic.clone(),
                });
            }
        }
        // Members with underscores in their names can spell one topic twice
        // (`live` with `high_low`, `live_high` with `low`), which would
        // subscribe that topic at two priorities.
        let mut names = HashSet::new();
        if let Some(twice) = topics
            .iter()
            .find(|topic| !names.insert(topic.name.as_str()))
        {
            return Err(invalid(
                "sublevels",
                format!(
                    "two level and sublevel pairs make the topic name {}",
                    twice.name
                ),
            ));
        }
        Ok(topics)
    }
}

fn invalid(option: &'static str, reason: String) -> Error {
    Error::InvalidOption { option, reason }
}

fn distinct_names<P: PriorityLevel>(members: &[P], option: &'static str) -> Result<(), Error> {
    let mut seen = HashSet::new();
    for member in members {
        if !seen.insert(member.name().to_lowercase()) {
            return Err(invalid(
                option,
                format!(
                    "two members are named {:?} once lowercased",
                    member.name().to_lowercase()
                ),
            ));
        }
    }
    Ok(())
}

fn smallest_gap<P: PriorityLevel>(levels: &[P]) -> Option<i64> {
    let mut values: Vec<i64> = levels.iter().map(|l| l.value()).collect();
    values.sort_unstable();
    values
        .windows(2)
        .map(|pair| pair[1].saturating_sub(pair[0]))
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    crate::priorities! { enum Level { Live = 100, Batch = 200 } }
    crate::priorities! { enum Sub { High = 10, Low = 20, Retry = 50 } }

    #[test]
    fn six_topics_with_the_documented_names_priorities_and_retry_topics() {
        let topics = TopicFamily::<Level, Sub>::new("orders")
            .retry_sublevel(Sub::Retry)
            .topics()
            .unwrap();
        let table: Vec<(&str, i64, Option<&str>)> = topics
            .iter()
            .map(|t| (t.name.as_str(), t.priority, t.retry_topic.as_deref()))
            .collect();
        assert_eq!(
            table,
            [
                ("orders_live_high", 110, Some("orders_live_retry")),
                ("orders_live_low", 120, Some("orders_live_retry")),
                ("orders_live_retry", 150, Some("orders_live_retry")),
                ("orders_batch_high", 210, Some("orders_batch_retry")),
                ("orders_batch_low", 220, Some("orders_batch_retry")),
                ("orders_batch_retry", 250, Some("orders_batch_retry")),
            ]
        );
    }

    #[test]
    fn without_sublevels_one_topic_per_level() {
        let topics = TopicFamily::<Level>::new("orders").topics().unwrap();
        let table: Vec<_> = topics
            .iter()
            .map(|t| (t.name.as_str(), t.priority))
            .collect();
        assert_eq!(table, [("orders_live", 100), ("orders_batch", 200)]);
    }

    #[test]
    fn sublevels_must_fit_between_levels() {
        crate::priorities! { enum Close { A = 100, B = 130, C = 300 } }
        let error = TopicFamily::<Close, Sub>::new("x").topics().unwrap_err();
        assert!(
            error
                .to_string()
                .contains("smallest gap between levels (30)"),
            "{error}"
        );
        crate::priorities! { enum Equal { A = 100, B = 100 } }
        assert!(TopicFamily::<Equal, Sub>::new("x").topics().is_err());
        assert!(TopicFamily::<Equal>::new("x").topics().is_ok());
    }

    #[test]
    fn negative_sublevels_and_clashing_names_are_refused() {
        crate::priorities! { enum Negative { Up = 5, Down = -1 } }
        let error = TopicFamily::<Level, Negative>::new("x")
            .topics()
            .unwrap_err();
        assert!(
            error.to_string().contains("must not be negative"),
            "{error}"
        );
        crate::priorities! { enum FromZero { First = 0, Second = 1 } }
        let topics = TopicFamily::<Level, FromZero>::new("x").topics().unwrap();
        assert_eq!(topics[0].priority, 100, "a sublevel of 0 is not negative");
        #[allow(non_camel_case_types, clippy::upper_case_acronyms)]
        mod clash {
            crate::priorities! { pub enum Clash { Live = 100, LIVE = 200 } }
        }
        let error = TopicFamily::<clash::Clash>::new("x").topics().unwrap_err();
        assert!(error.to_string().contains("\"live\""), "{error}");
    }

    #[test]
    fn a_level_and_sublevel_beyond_the_largest_priority_are_refused() {
        crate::priorities! { enum Top { Top = 9_223_372_036_854_775_797 } }
        // Top + High fits; Top + Low and Top + Retry would both saturate.
        let error = TopicFamily::<Top, Sub>::new("x").topics().unwrap_err();
        assert!(
            matches!(&error, Error::InvalidOption { option: "sublevels", reason } if reason.contains("Low")),
            "{error}"
        );
    }

    #[test]
    fn pairs_that_spell_one_topic_name_twice_are_refused() {
        #[allow(non_camel_case_types)]
        mod underscores {
            crate::priorities! { pub enum Level { Live = 100, Live_High = 300 } }
            crate::priorities! { pub enum Sub { High_Low = 10, Low = 20 } }
        }
        // live + high_low and live_high + low: orders_live_high_low twice.
        let error = TopicFamily::<underscores::Level, underscores::Sub>::new("orders")
            .topics()
            .unwrap_err();
        assert!(
            matches!(&error, Error::InvalidOption { option: "sublevels", reason } if reason.contains("orders_live_high_low")),
            "{error}"
        );
    }
}
