//! Topic names: expansion to the full form that Pulsar's clients use.
//!
//! The `pulsar` crate sends short names (`orders`) to the broker as given,
//! while the Java, C++ and Python clients expand them to
//! `persistent://public/default/orders`. The dispatcher expands every name
//! itself, so that topics compare equal however they were written and the
//! names it stamps into properties mean the same to every client.

use crate::error::Error;

/// The full form of a topic name: `persistent://public/default/orders` for
/// `orders`, `persistent://tenant/ns/orders` for `tenant/ns/orders`; names
/// with a domain are kept as they are.
pub fn full_topic_name(name: &str) -> Result<String, Error> {
    let invalid = |reason: &str| Error::InvalidTopic {
        topic: name.to_owned(),
        reason: reason.to_owned(),
    };
    if name.chars().any(char::is_control) {
        return Err(invalid("a topic name has no control characters"));
    }
    if let Some((domain, rest)) = name.split_once("://") {
        if domain != "persistent" && domain != "non-persistent" {
            return Err(invalid("the domain must be persistent or non-persistent"));
        }
        // Exactly tenant/namespace/topic: the four-part form with a
        // cluster is not accepted by brokers.
        if rest.split('/').count() != 3 || rest.split('/').any(str::is_empty) {
            return Err(invalid("expected <domain>://<tenant>/<namespace>/<topic>"));
        }
        return Ok(name.to_owned());
    }
    let parts: Vec<&str> = name.split('/').collect();
    if parts.iter().any(|part| part.is_empty()) {
        return Err(invalid("a topic name has no empty parts"));
    }
    match parts.len() {
        1 => Ok(format!("persistent://public/default/{name}")),
        3 => Ok(format!("persistent://{name}")),
        _ => Err(invalid("expected <topic> or <tenant>/<namespace>/<topic>")),
    }
}

/// What a partition's name adds to its partitioned topic's, before the
/// partition's index (`orders-partition-3`).
const PARTITION_SUFFIX: &str = "-partition-";

/// The name of partition `index` of `topic`.
pub(crate) fn partition_name(topic: &str, index: u32) -> String {
    format!("{topic}{PARTITION_SUFFIX}{index}")
}

/// The partitioned topic that a partition's full name belongs to, read as
/// Pulsar's clients and broker read it (`.../orders` for
/// `.../orders-partition-3`), or `None` for a name that is no partition's.
fn partitioned_topic_of(full_name: &str) -> Option<&str> {
    let (topic, index) = full_name.rsplit_once(PARTITION_SUFFIX)?;
    let is_index = !index.is_empty() && index.bytes().all(|byte| byte.is_ascii_digit());
    is_index.then_some(topic)
}

/// Whether two full topic names name one topic, or one names a partition
/// of the other: consumers of both, with one subscription name, share the
/// partition's messages.
pub(crate) fn overlap(first: &str, second: &str) -> bool {
    first == second
        || partitioned_topic_of(first) == Some(second)
        || partitioned_topic_of(second) == Some(first)
}

/// Refuses, for `option`, a topic that must keep the messages the
/// dispatcher lets go of (a retry or dead letter topic: the original is
/// acked once published there) when it is non-persistent, which keeps
/// nothing for a subscriber that is not connected.
pub(crate) fn refuse_non_persistent(option: &'static str, full_name: &str) -> Result<(), Error> {
    if !is_non_persistent(full_name) {
        return Ok(());
    }
    Err(Error::InvalidOption {
        option,
        reason: format!(
            "{full_name} is non-persistent: it keeps nothing for a subscriber that is not connected"
        ),
    })
}

/// Whether a full topic name is of a non-persistent topic: one whose
/// broker keeps nothing to deliver again, and which gives its messages no
/// ids of their own (every message of a partition is `0:0`).
pub(crate) fn is_non_persistent(full_name: &str) -> bool {
    full_name.starts_with("non-persistent://")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_names_expand_like_the_other_clients() {
        assert_eq!(
            full_topic_name("orders").unwrap(),
            "persistent://public/default/orders"
        );
        assert_eq!(
            full_topic_name("shop/prod/orders").unwrap(),
            "persistent://shop/prod/orders"
        );
        assert_eq!(
            full_topic_name("non-persistent://public/default/x").unwrap(),
            "non-persistent://public/default/x"
        );
    }

    #[test]
    fn a_topic_overlaps_itself_and_its_partitions_only() {
        let orders = "persistent://public/default/orders";
        let partition = "persistent://public/default/orders-partition-2";
        assert_eq!(partition_name(orders, 2), partition);
        assert!(overlap(orders, orders));
        assert!(overlap(orders, partition));
        assert!(overlap(partition, orders));
        for other in [
            "persistent://public/default/orders-partition-1",
            "persistent://public/default/orders-partition-",
            "persistent://public/default/orders-partition-x",
            "persistent://public/default/order",
            "non-persistent://public/default/orders",
        ] {
            assert!(!overlap(partition, other), "{partition} and {other}");
        }
        // Topics whose names only look like a partition's of orders.
        for lookalike in [
            "persistent://public/default/orders-partition-",
            "persistent://public/default/orders-partition-x",
            "persistent://public/default/orders-partition-2x",
        ] {
            assert!(!overlap(orders, lookalike), "{orders} and {lookalike}");
            assert!(!overlap(lookalike, orders), "{lookalike} and {orders}");
        }
    }

    #[test]
    fn malformed_names_are_rejected() {
        for bad in [
            "",
            "a/b",
            "a//b",
            "http://a/b/c",
            "persistent://a/b",
            "persistent://a/b/c/d",
            "a/b/c/d",
            "orders\n",
            "a/b/c\td",
        ] {
            assert!(full_topic_name(bad).is_err(), "{bad:?} was accepted");
        }
    }
}
