//! Subscription options: what `subscribe` takes besides the topic and handler.
//!
//! The options the dispatcher itself interprets (priority, receiver queue
//! size, negative-ack delay) have the reference dispatcher's defaults; every
//! consumer option of the `pulsar` crate is passed through untouched.

use std::time::Duration;

use pulsar::consumer::DeadLetterPolicy;
use pulsar::{ConsumerOptions, SubType};

use crate::error::Error;

/// The priority a subscription gets unless told otherwise.
pub const DEFAULT_PRIORITY: i64 = 100;

/// How long a failed message waits before it is redelivered, unless told
/// otherwise; the same default as Pulsar's Java, C++ and Python clients.
pub const DEFAULT_NEGATIVE_ACK_REDELIVERY_DELAY: Duration = Duration::from_secs(60);

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
#[derive(Clone, Debug)]
pub struct SubscribeOptions {
    pub(crate) priority: i64,
    pub(crate) subscription: Option<String>,
    pub(crate) subscription_type: SubType,
    pub(crate) receiver_queue_size: u32,
    pub(crate) negative_ack_redelivery_delay: Duration,
    pub(crate) consumer_name: Option<String>,
    pub(crate) consumer_options: ConsumerOptions,
    pub(crate) dead_letter_policy: Option<DeadLetterPolicy>,
    pub(crate) unacked_message_resend_delay: Option<Duration>,
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

    /// The subscription name. Without one, the `pulsar` crate makes one up,
    /// which suits only throwaway subscriptions.
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

    /// The `pulsar` crate's dead letter policy: after `max_redeliver_count`
    /// redeliveries a message is moved to `dead_letter_topic`.
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

    /// The subscription name, if one was given.
    pub fn subscription_name(&self) -> Option<&str> {
        self.subscription.as_deref()
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.receiver_queue_size == 0 {
            return Err(Error::InvalidOption {
                option: "receiver_queue_size",
                reason: "must be at least 1".into(),
            });
        }
        Ok(())
    }
}
