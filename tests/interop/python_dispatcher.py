"""Runs the Python original dispatcher (pulsar-dispatcher) with a failing handler.

Mixed-fleet peer for tests/mixed_fleet_pulsar.rs. Reads a JSON request on
stdin:

    {"service_url": "...",
     "subscriptions": [{"topic": "...", "subscription": "...",
                        "retry_topic": "...", "max_retries": 3,
                        "backoff_seconds": 1, "priority": 10}, ...],
     "stop_after": N, "linger_ms": 0, "timeout_ms": 60000}

Subscribes each topic (Shared, from the earliest message) with topics and
names passed to PulsarDispatcher.subscribe() exactly as given, so short names
stay short, as its users write them. The handler records every message it is
given and raises `Unavailable`, the subscriptions' retry_exception_class, so
the dispatcher retries it to retry_topic or, once max_retries retries are
used up, dead-letters it. A subscription without a retry_topic instead nacks
it (after "nack_delay_ms", 60000 by default), and with a
"dead_letter_policy": {"max_redeliver_count": n, "dead_letter_topic": "..."}
the client dead-letters it. After N handled messages (or timeout_ms), and
linger_ms more to let further deliveries show, the dispatcher is closed,
which waits for the retries and dead letters of the handled messages to be
published and acked.

Prints `RESULT {"version": "...", "handled": [...]}`, one object per handled
message with its topic, payload, properties and message id as the Python
client prints it. Exits with status 2 if fewer than N messages were handled
in time.
"""

import asyncio
import json
import logging
import os
import sys
import warnings

import pulsar
import pulsar_dispatcher
from pulsar_dispatcher import PulsarDispatcher, RetryTopicWarning


class Unavailable(Exception):
    """Retryable: the handler always raises it."""


async def run(request):
    # In a mixed fleet another service consumes the retry topic.
    warnings.filterwarnings("ignore", category=RetryTopicWarning)
    dispatcher = PulsarDispatcher(
        request["service_url"],
        concurrency=4,
        operation_timeout_seconds=10,
        # The client's own console logger, warnings only (see consume.py).
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn),
    )
    handled = []
    enough = asyncio.Event()

    async def handler(message):
        handled.append(
            {
                "topic": message.topic_name(),
                "payload": message.data().decode("utf-8"),
                "properties": message.properties(),
                "message_id": str(message.message_id()),
                "redelivery_count": message.redelivery_count(),
            }
        )
        if len(handled) >= request["stop_after"]:
            enough.set()
        raise Unavailable("always")

    for spec in request["subscriptions"]:
        options = {}
        if spec.get("retry_topic") is not None:
            backoff = int(spec.get("backoff_seconds", 1))
            options["retry_exception_class"] = Unavailable
            options["retry_topic"] = spec["retry_topic"]
            options["retry_backoff_function"] = lambda retry, backoff=backoff: backoff
        if spec.get("max_retries") is not None:
            options["max_retries"] = int(spec["max_retries"])
        if spec.get("nack_delay_ms") is not None:
            options["negative_ack_redelivery_delay_ms"] = int(spec["nack_delay_ms"])
        if spec.get("dead_letter_policy") is not None:
            policy = spec["dead_letter_policy"]
            options["dead_letter_policy"] = pulsar.ConsumerDeadLetterPolicy(
                max_redeliver_count=int(policy["max_redeliver_count"]),
                dead_letter_topic=policy["dead_letter_topic"],
            )
        await dispatcher.subscribe(
            spec["topic"],
            handler,
            priority=int(spec.get("priority", 100)),
            subscription_name=spec["subscription"],
            consumer_type=pulsar.ConsumerType.Shared,
            initial_position=pulsar.InitialPosition.Earliest,
            **options,
        )

    running = asyncio.create_task(dispatcher.run())
    waiting = asyncio.create_task(enough.wait())
    await asyncio.wait(
        [running, waiting],
        timeout=request.get("timeout_ms", 60000) / 1000.0,
        return_when=asyncio.FIRST_COMPLETED,
    )
    waiting.cancel()
    await asyncio.sleep(request.get("linger_ms", 0) / 1000.0)
    # Waits for in-flight handlers, their retries and dead letters.
    await dispatcher.close()
    await running
    return handled


def main():
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    request = json.load(sys.stdin)
    handled = asyncio.run(run(request))
    result = {"version": pulsar_dispatcher.__version__, "handled": handled}
    print("RESULT " + json.dumps(result), flush=True)
    status = 0
    if len(handled) < request["stop_after"]:
        print(
            f"handled {len(handled)} of {request['stop_after']} messages",
            file=sys.stderr,
        )
        status = 2
    # The dispatcher and its client are closed and everything is published;
    # leave without the interpreter's shutdown. close() cancels reader tasks
    # blocked in the asyncio client's consumer.receive(), and with
    # pulsar-client 3.13.0 that makes the interpreter abort now and then as it
    # exits ("terminate called without an active exception", SIGABRT), after
    # all the work is done.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
