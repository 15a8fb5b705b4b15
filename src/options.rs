//! Subscription options: what `subscribe` takes besides the topic and
//! handler, and their resolution into what the engine runs.
//!
//! The options the dispatcher itself interprets (priority, receiver queue
//! size, negative-ack delay, error routing, replies) have the reference
//! dispatcher's defaults and are checked together before anything is
//! created; every consumer option of the `pulsar` crate is passed through,
//! but `receiver_queue_size` (set from the subscription's own) and the dead
//! letter policy's topic (made a full name, or defaulted).

use std::num::NonZeroUsize;
use std::time::Duration;

use pulsar::consumer::DeadLetterPolicy;
use pulsar::{ConsumerOptions, SubType};

use crate::backoff::{default_backoff, Backoff};
use crate::classify::ErrorClass;
use crate::engine::SubscriptionSpec;
use crate::error::{checked_duration, Error, MAX_KEY_BUFFER};
use crate::routing::{RetryPolicy, RoutingPolicy};
use crate::scheduler::{Ordering, SubscriptionConfig};
use crate::topic::{full_topic_name, is_non_persistent, overlap, refuse_non_persistent};
use crate::transport::ConsumerSpec;
pub use crate::transport::{DEFAULT_PARTITION_REFRESH_INTERVAL, DEFAULT_STALL_CHECK};

/// The priority a subscription gets unless told otherwise.
pub const DEFAULT_PRIORITY: i64 = 100;

/// How long a failed message waits before it is redelivered, unless told
/// otherwise; the same default as Pulsar's Java, C++ and Python clients.
pub const DEFAULT_NEGATIVE_ACK_REDELIVERY_DELAY: Duration = Duration::from_secs(60);

/// How many messages a key-ordered subscription may hold while their keys
/// are busy, unless told otherwise.
pub const DEFAULT_KEY_BUFFER: usize = 16;

/// How long `subscribe` waits for the broker unless told otherwise.
pub const DEFAULT_SUBSCRIBE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a consumer may keep failing to receive before the dispatcher
/// stops with an error, unless told otherwise.
pub const DEFAULT_RECEIVE_FAILURE_LIMIT: Duration = Duration::from_secs(60);

/// Options for one subscription.
///
/// ```
/// use std::time::Duration;
/// use pulsar_dispatcher::{SubscribeOptions, SubType};
///
/// let options = SubscribeOptions::new()
///     .priority(5)
///     .subscription("orders-sub")
///     .subscription_type(SubType::Shared)
///     .negative_ack_redelivery_delay(Duration::from_secs(5));
/// ```
#[must_use]
#[derive(Clone, Debug)]
pub struct SubscribeOptions {
    priority: i64,
    subscription: Option<String>,
    subscription_type: SubType,
    receiver_queue_size: u32,
    negative_ack_redelivery_delay: Duration,
    consumer_name: Option<String>,
    consumer_options: ConsumerOptions,
    dead_letter_policy: Option<DeadLetterPolicy>,
    unacked_message_resend_delay: Option<Duration>,
    processing_timeout: Option<Duration>,
    max_in_flight: Option<usize>,
    ordering: Ordering,
    key_buffer: Option<usize>,
    subscribe_timeout: Duration,
    receive_failure_limit: Duration,
    partition_refresh_interval: Duration,
    stall_check: Option<Duration>,
    fatal_errors: Option<ErrorClass>,
    retry_errors: Option<ErrorClass>,
    retry_topic: Option<String>,
    retry_backoff: Option<Backoff>,
    max_retries: Option<u32>,
    reply_topic: Option<String>,
}

impl Default for SubscribeOptions {
    fn default() -> Self {
        SubscribeOptions {
            priority: DEFAULT_PRIORITY,
            subscription: None,
            subscription_type: SubType::Exclusive,
            receiver_queue_size: 1,
            negative_ack_redelivery_delay: DEFAULT_NEGATIVE_ACK_REDELIVERY_DELAY,
            consumer_name: None,
            consumer_options: ConsumerOptions::default(),
            dead_letter_policy: None,
            unacked_message_resend_delay: None,
            processing_timeout: None,
            max_in_flight: None,
            ordering: Ordering::Unordered,
            key_buffer: None,
            subscribe_timeout: DEFAULT_SUBSCRIBE_TIMEOUT,
            receive_failure_limit: DEFAULT_RECEIVE_FAILURE_LIMIT,
            partition_refresh_interval: DEFAULT_PARTITION_REFRESH_INTERVAL,
            stall_check: Some(DEFAULT_STALL_CHECK),
            fatal_errors: None,
            retry_errors: None,
            retry_topic: None,
            retry_backoff: None,
            max_retries: None,
            reply_topic: None,
        }
    }
}

impl SubscribeOptions {
    /// The defaults: priority 100, an Exclusive subscription with a
    /// generated name, receiver queue size 1, a 60 s negative-ack delay.
    pub fn new() -> Self {
        Self::default()
    }

    /// Scheduling priority; lower values are dispatched first. Any integer;
    /// gaps are fine and subscriptions may share a value.
    pub fn priority(mut self, priority: i64) -> Self {
        self.priority = priority;
        self
    }

    /// The subscription name. Without one, the transport makes up a random
    /// one for this subscribe call, which suits only throwaway
    /// subscriptions.
    pub fn subscription(mut self, name: impl Into<String>) -> Self {
        self.subscription = Some(name.into());
        self
    }

    /// The subscription type (Exclusive by default, as in Pulsar's clients).
    /// Delayed delivery, and so delayed retries, needs Shared or Key_Shared.
    pub fn subscription_type(mut self, subscription_type: SubType) -> Self {
        self.subscription_type = subscription_type;
        self
    }

    /// How many messages the consumer may prefetch from the broker
    /// (its flow permits). The default of 1 keeps the backlog on the broker;
    /// larger values trade client-side buffering for throughput.
    pub fn receiver_queue_size(mut self, size: u32) -> Self {
        self.receiver_queue_size = size;
        self
    }

    /// How long a message whose handler failed waits before it is nacked,
    /// and so redelivered. Zero nacks at once.
    pub fn negative_ack_redelivery_delay(mut self, delay: Duration) -> Self {
        self.negative_ack_redelivery_delay = delay;
        self
    }

    /// The consumer name the broker shows in its stats.
    pub fn consumer_name(mut self, name: impl Into<String>) -> Self {
        self.consumer_name = Some(name.into());
        self
    }

    /// The `pulsar` crate's consumer options (initial position, durability,
    /// metadata, read_compacted, priority level, ...). Their
    /// `receiver_queue_size` is replaced by [`receiver_queue_size`](Self::receiver_queue_size).
    pub fn consumer_options(mut self, options: ConsumerOptions) -> Self {
        self.consumer_options = options;
        self
    }

    /// The `pulsar` crate's dead letter policy: a message the handler keeps
    /// failing is handed over `max_redeliver_count + 1` times (its first
    /// delivery and `max_redeliver_count` redeliveries, as Pulsar's Java and
    /// C++ clients count them) and then moved to `dead_letter_topic`. An empty
    /// `dead_letter_topic` means Pulsar's default,
    /// `<topic>-<subscription>-DLQ`, and needs a
    /// [`subscription`](Self::subscription) name.
    pub fn dead_letter_policy(mut self, policy: DeadLetterPolicy) -> Self {
        self.dead_letter_policy = Some(policy);
        self
    }

    /// Redeliver messages left unacknowledged for this long (the `pulsar`
    /// crate's ack timeout). Off by default.
    pub fn unacked_message_resend_delay(mut self, delay: Duration) -> Self {
        self.unacked_message_resend_delay = Some(delay);
        self
    }

    /// Errors that send the message straight to the dead letter topic,
    /// however many redeliveries remain. Needs a dead letter topic: a
    /// [`subscription`](Self::subscription) name (for Pulsar's default
    /// `<topic>-<subscription>-DLQ`) or a
    /// [`dead_letter_policy`](Self::dead_letter_policy). When an error is
    /// both fatal and retryable, fatal wins.
    pub fn fatal_errors(mut self, class: ErrorClass) -> Self {
        self.fatal_errors = Some(class);
        self
    }

    /// Errors that republish the message to the
    /// [`retry_topic`](Self::retry_topic) with a delay; the two go together.
    pub fn retry_errors(mut self, class: ErrorClass) -> Self {
        self.retry_errors = Some(class);
        self
    }

    /// The topic delayed retries are published to. The dispatcher does not
    /// consume it for you: subscribe to it too, with a Shared or Key_Shared
    /// subscription so that the delays are honoured.
    pub fn retry_topic(mut self, topic: impl Into<String>) -> Self {
        self.retry_topic = Some(topic.into());
        self
    }

    /// The delay before retry number `n` (starting at 1); by default
    /// [`default_backoff`]. See also
    /// [`exponential_backoff`](crate::exponential_backoff).
    pub fn retry_backoff(
        mut self,
        backoff: impl Fn(u32) -> Duration + Send + Sync + 'static,
    ) -> Self {
        self.retry_backoff = Some(Backoff::new(backoff));
        self
    }

    /// Dead-letter a message that fails again after this many retries
    /// (at least 1), keeping its RECONSUMETIMES. Needs a retry topic and a
    /// dead letter topic.
    pub fn max_retries(mut self, retries: u32) -> Self {
        self.max_retries = Some(retries);
        self
    }

    /// Publish what the handler returns (bytes) to this topic before the
    /// message is acked. A handler that returns nothing publishes nothing.
    pub fn reply_topic(mut self, topic: impl Into<String>) -> Self {
        self.reply_topic = Some(topic.into());
        self
    }

    /// The longest a handler may run on one message. Past it, the handler's
    /// future is dropped (so it stops at its next `.await`), the message is
    /// treated as a retryable failure (republished to the retry topic when
    /// there is one, dead-lettered once `max_retries` are used up, nacked
    /// otherwise), its permit is freed, and a warning
    /// names the topic, the message id and the deadline. Off by default.
    pub fn processing_timeout(mut self, limit: Duration) -> Self {
        self.processing_timeout = Some(limit);
        self
    }

    /// The most of this subscription's messages in flight at once (at least
    /// 1; by default only the dispatcher's concurrency limit applies). A
    /// subscription at its limit is passed over, without holding up others,
    /// until one of its handlers returns; the global limit still applies.
    pub fn max_in_flight(mut self, limit: usize) -> Self {
        self.max_in_flight = Some(limit);
        self
    }

    /// How this subscription's messages may overlap (unordered by default;
    /// see [`Ordering`]).
    pub fn ordering(mut self, ordering: Ordering) -> Self {
        self.ordering = ordering;
        self
    }

    /// With [`Ordering::Key`]: how many messages the subscription may hold
    /// while their keys are busy (16 by default, at least 1, at most
    /// [`MAX_KEY_BUFFER`]). A message whose key is busy waits in this
    /// buffer while other keys run; once it is full, no more messages are
    /// taken from the broker until a key is free, so a busy key never makes
    /// the dispatcher pull the backlog.
    pub fn key_buffer(mut self, messages: usize) -> Self {
        self.key_buffer = Some(messages);
        self
    }

    /// How long `subscribe` waits for the broker to create the consumer and
    /// the producers the subscription publishes with (30 s by default).
    /// The broker answers a subscription that another consumer holds
    /// exclusively with "consumer busy", which the `pulsar` crate retries;
    /// past this limit, `subscribe` fails with [`Error::SubscribeTimeout`],
    /// or [`Error::ProducerTimeout`] naming the producer's topic.
    pub fn subscribe_timeout(mut self, limit: Duration) -> Self {
        self.subscribe_timeout = limit;
        self
    }

    /// How long the consumer may keep returning errors instead of messages
    /// before the dispatcher stops and `run()` returns
    /// [`Error::ConsumerFailing`] (60 s by default). Until then, receiving
    /// is retried with a growing delay (10 ms doubling to 5 s) and the
    /// errors are logged at most every 10 s.
    pub fn receive_failure_limit(mut self, limit: Duration) -> Self {
        self.receive_failure_limit = limit;
        self
    }

    /// How often the partitions of a partitioned topic are counted again
    /// (60 s by default): partitions an operator adds after `subscribe` are
    /// subscribed at the next count, on the same subscription, and consumed
    /// like the others. A failed count or subscribe is logged and tried
    /// again at the next. A topic that is not partitioned is not counted.
    pub fn partition_refresh_interval(mut self, every: Duration) -> Self {
        self.partition_refresh_interval = every;
        self
    }

    /// On a Failover subscription, how long a partition may deliver nothing
    /// before the dispatcher checks that the broker has not stopped
    /// delivering its backlog (5 s by default; `None` turns it off).
    ///
    /// When the broker hands a partition over to this consumer (the active
    /// one closed or unsubscribed), the rewind it makes can meet a read in
    /// flight and leave it waiting for new entries while the backlog waits
    /// too; nothing tells the consumer. So while a partition delivers
    /// nothing and none of its messages waits to be settled, the consumer
    /// asks the broker for its backlog once per interval (one small
    /// request, no log on the broker), and when the backlog is not empty
    /// and stood still over two checks, it asks the broker to deliver it
    /// again (`stalls_rewound` counts those): a stalled backlog moves again
    /// within about two intervals. Other subscription types are not
    /// checked.
    pub fn stall_check(mut self, every: Option<Duration>) -> Self {
        self.stall_check = every;
        self
    }

    /// Whether retry errors have been set.
    pub(crate) fn has_retry_errors(&self) -> bool {
        self.retry_errors.is_some()
    }

    /// Whether a retry topic has been set.
    pub(crate) fn has_retry_topic(&self) -> bool {
        self.retry_topic.is_some()
    }

    /// Checks the options together and resolves them for `topic` (as the
    /// user wrote it) into what the engine runs. Nothing is created, so a
    /// refusal leaves no trace.
    pub(crate) fn resolve(&self, topic: &str) -> Result<SubscriptionSpec, Error> {
        let topic = full_topic_name(topic)?;
        let (routing, dead_letter_policy) = self.routing_policy(&topic)?;
        let nack_delay = checked_duration(
            "negative_ack_redelivery_delay",
            self.negative_ack_redelivery_delay,
            true,
        )?;
        if let Some(delay) = self.unacked_message_resend_delay {
            checked_duration("unacked_message_resend_delay", delay, false)?;
        }
        let processing_timeout = self
            .processing_timeout
            .map(|limit| checked_duration("processing_timeout", limit, false))
            .transpose()?;
        let subscribe_timeout =
            checked_duration("subscribe_timeout", self.subscribe_timeout, false)?;
        let receive_failure_limit =
            checked_duration("receive_failure_limit", self.receive_failure_limit, false)?;
        let partition_refresh_interval = checked_duration(
            "partition_refresh_interval",
            self.partition_refresh_interval,
            false,
        )?;
        let stall_check = self
            .stall_check
            .map(|every| checked_duration("stall_check", every, false))
            .transpose()?;
        Ok(SubscriptionSpec {
            consumer: ConsumerSpec {
                topic,
                subscription: self.subscription.clone(),
                subscription_type: self.subscription_type,
                receiver_queue_size: self.receiver_queue_size,
                consumer_name: self.consumer_name.clone(),
                consumer_options: self.consumer_options.clone(),
                dead_letter_policy,
                unacked_message_resend_delay: self.unacked_message_resend_delay,
                partition_refresh_interval,
                stall_check,
            },
            scheduling: self.scheduling()?,
            nack_delay,
            processing_timeout,
            subscribe_timeout,
            receive_failure_limit,
            routing,
        })
    }

    /// The subscription's place in the scheduler.
    fn scheduling(&self) -> Result<SubscriptionConfig, Error> {
        let invalid = |option: &'static str, reason: &str| Error::InvalidOption {
            option,
            reason: reason.to_owned(),
        };
        let max_in_flight = match self.max_in_flight {
            None => None,
            Some(limit) => Some(
                NonZeroUsize::new(limit)
                    .ok_or_else(|| invalid("max_in_flight", "must be at least 1"))?,
            ),
        };
        if self.ordering == Ordering::Subscription && self.max_in_flight.is_some_and(|n| n > 1) {
            return Err(invalid(
                "max_in_flight",
                "Ordering::Subscription runs one message at a time",
            ));
        }
        let key_buffer = match (self.key_buffer, self.ordering) {
            (None, _) => DEFAULT_KEY_BUFFER,
            (Some(0), _) => return Err(invalid("key_buffer", "must be at least 1")),
            (Some(size), _) if size > MAX_KEY_BUFFER => {
                return Err(invalid(
                    "key_buffer",
                    "must be at most MAX_KEY_BUFFER (65,536)",
                ))
            }
            (Some(size), Ordering::Key) => size,
            (Some(_), _) => return Err(invalid("key_buffer", "needs Ordering::Key")),
        };
        Ok(SubscriptionConfig {
            priority: self.priority,
            max_in_flight,
            ordering: self.ordering,
            key_buffer,
        })
    }

    /// Checks the options together and resolves their topics for `topic`
    /// (a full name); also the dead letter policy as the consumer gets it
    /// (see [`resolved_dead_letter_policy`](Self::resolved_dead_letter_policy)).
    fn routing_policy(
        &self,
        topic: &str,
    ) -> Result<(RoutingPolicy, Option<DeadLetterPolicy>), Error> {
        let invalid = |option: &'static str, reason: &str| Error::InvalidOption {
            option,
            reason: reason.to_owned(),
        };
        if self.receiver_queue_size == 0 {
            return Err(invalid("receiver_queue_size", "must be at least 1"));
        }
        if self.receiver_queue_size > i32::MAX as u32 {
            // The broker reads it as an `int`: a negative count of permits
            // makes it drop the connection, every consumer and producer on
            // it with it, again at each reconnection.
            return Err(invalid(
                "receiver_queue_size",
                "must be at most 2,147,483,647 (the broker reads it as an int)",
            ));
        }
        if self
            .subscription
            .as_ref()
            .is_some_and(|name| name.trim().is_empty())
        {
            // The broker refuses it, and the crate asks again until the
            // subscribe timeout.
            return Err(invalid("subscription", "must not be empty or blank"));
        }
        match (&self.retry_errors, &self.retry_topic) {
            (Some(_), None) => return Err(invalid("retry_errors", "needs a retry_topic")),
            (None, Some(_)) => return Err(invalid("retry_topic", "needs retry_errors")),
            _ => {}
        }
        if self.retry_backoff.is_some() && self.retry_topic.is_none() {
            return Err(invalid("retry_backoff", "needs a retry_topic"));
        }
        if let Some(max) = self.max_retries {
            if self.retry_topic.is_none() {
                return Err(invalid("max_retries", "needs a retry_topic"));
            }
            if max == 0 {
                return Err(invalid("max_retries", "must be at least 1"));
            }
        }
        if self
            .dead_letter_policy
            .as_ref()
            .is_some_and(|policy| policy.max_redeliver_count == 0)
        {
            // The crate would dead-letter every message it is sent again,
            // or, when the broker leaves the count out, read 0 as 1.
            return Err(invalid(
                "dead_letter_policy",
                "max_redeliver_count must be at least 1",
            ));
        }
        let dead_letter_policy = self.resolved_dead_letter_policy(topic)?;
        let dead_letters_from = if self.fatal_errors.is_some() {
            Some("fatal_errors")
        } else if self.max_retries.is_some() {
            Some("max_retries")
        } else {
            None
        };
        let dead_letter_topic = match &dead_letter_policy {
            Some(policy) => Some(policy.dead_letter_topic.clone()),
            None => self.default_dead_letter_topic(topic, dead_letters_from)?,
        };
        if let (None, Some(option)) = (&dead_letter_topic, dead_letters_from) {
            return Err(invalid(
                option,
                "needs a dead letter topic: set a subscription name or a dead_letter_policy",
            ));
        }
        let retry = match (&self.retry_topic, &self.retry_errors) {
            (Some(retry_topic), Some(errors)) => Some(RetryPolicy {
                topic: persistent_topic("retry_topic", retry_topic)?,
                errors: errors.clone(),
                backoff: self
                    .retry_backoff
                    .clone()
                    .unwrap_or_else(|| Backoff::new(default_backoff)),
                max_retries: self.max_retries,
            }),
            _ => None,
        };
        let routing = RoutingPolicy {
            fatal: self.fatal_errors.clone(),
            retry,
            dead_letter_topic,
            reply_topic: self
                .reply_topic
                .as_deref()
                .map(|reply_topic| option_topic("reply_topic", reply_topic))
                .transpose()?,
        };
        Ok((routing, dead_letter_policy))
    }

    /// The dead letter policy as the consumer gets it, its topic a full
    /// name. A policy without a topic (the crate's `String` left empty)
    /// takes Pulsar's default, as the Python original and Pulsar's own
    /// clients do, and so needs a subscription name.
    fn resolved_dead_letter_policy(&self, topic: &str) -> Result<Option<DeadLetterPolicy>, Error> {
        let Some(policy) = &self.dead_letter_policy else {
            return Ok(None);
        };
        let dead_letter_topic = if policy.dead_letter_topic.is_empty() {
            self.default_dead_letter_topic(topic, Some("dead_letter_policy"))?
                .ok_or_else(|| Error::InvalidOption {
                    option: "dead_letter_policy",
                    reason: "needs a dead_letter_topic or a subscription name".to_owned(),
                })?
        } else {
            let dead_letter_topic =
                persistent_topic("dead_letter_policy", &policy.dead_letter_topic)?;
            if overlap(&dead_letter_topic, topic) {
                return Err(Error::InvalidOption {
                    option: "dead_letter_policy",
                    reason: format!(
                        "{dead_letter_topic} is the subscription's own topic {topic}, or a partition of one of them: its dead letters would come back to the handler that failed them"
                    ),
                });
            }
            dead_letter_topic
        };
        Ok(Some(DeadLetterPolicy {
            max_redeliver_count: policy.max_redeliver_count,
            dead_letter_topic,
        }))
    }

    /// Pulsar's default dead letter topic, `<topic>-<subscription>-DLQ`, for
    /// a named subscription. A non-persistent topic's default is
    /// non-persistent too, and keeps nothing for a subscriber that is not
    /// connected: refused, as a named one would be, with the option
    /// (`sent_by`) that would send dead letters there; with none, there is
    /// no dead letter topic (not stamped on retries either: the retry
    /// topic's subscription, which would follow it, dead-letters to its
    /// own).
    fn default_dead_letter_topic(
        &self,
        topic: &str,
        sent_by: Option<&'static str>,
    ) -> Result<Option<String>, Error> {
        let Some(subscription) = &self.subscription else {
            return Ok(None);
        };
        let default = format!("{topic}-{subscription}-DLQ");
        if !is_non_persistent(&default) {
            return Ok(Some(default));
        }
        match sent_by {
            None => Ok(None),
            Some(option) => Err(Error::InvalidOption {
                option,
                reason: format!(
                    "the default dead letter topic, {default}, is non-persistent like its topic and keeps nothing for a subscriber that is not connected: set a dead_letter_policy with a persistent dead_letter_topic"
                ),
            }),
        }
    }
}

/// The full name of a topic an option names; a malformed one is refused
/// with the option's name.
fn option_topic(option: &'static str, name: &str) -> Result<String, Error> {
    full_topic_name(name).map_err(|error| Error::InvalidOption {
        option,
        reason: error.to_string(),
    })
}

/// The full name of a topic that keeps the messages the dispatcher lets
/// go of (a retry or dead letter topic given by name), which must be
/// persistent (see `refuse_non_persistent`).
fn persistent_topic(option: &'static str, name: &str) -> Result<String, Error> {
    let full_name = option_topic(option, name)?;
    refuse_non_persistent(option, &full_name)?;
    Ok(full_name)
}
