"""The Python original (pulsar-dispatcher 0.1.0) end to end on a real broker.

Pre-produces N messages to a fresh topic with the official Python client,
then consumes them through `PulsarDispatcher` with a no-op handler and the
given receiver queue size. The clock runs from
`run()` until the last handler has run. Prints one JSON line.

Usage: python e2e_bench.py --url pulsar://127.0.0.1:6650 --topic T --messages N --receiver-queue Q
"""

import argparse
import asyncio
import json
import time

import pulsar
from pulsar_dispatcher import PulsarDispatcher


def produce(url, topic, messages, payload_size):
    client = pulsar.Client(url)
    # The subscription must exist before producing, or nothing keeps the
    # messages for it.
    client.subscribe(topic, "bench").close()
    producer = client.create_producer(
        topic, batching_enabled=False, block_if_queue_full=True
    )
    payload = b"x" * payload_size
    failures = []

    def sent(result, _message_id):
        if result != pulsar.Result.Ok:
            failures.append(result)

    for _ in range(messages):
        producer.send_async(payload, sent)
    producer.flush()
    client.close()
    if failures:
        raise RuntimeError(f"{len(failures)} sends failed: {failures[0]}")


async def consume(url, topic, messages, receiver_queue):
    dispatcher = PulsarDispatcher(url, concurrency=20)
    handled = 0
    done = asyncio.get_running_loop().create_future()

    async def handler(_message):
        nonlocal handled
        handled += 1
        if handled == messages:
            done.set_result(None)
        return None

    await dispatcher.subscribe(
        topic,
        handler,
        subscription_name="bench",
        receiver_queue_size=receiver_queue,
    )
    start = time.perf_counter_ns()
    runner = asyncio.create_task(dispatcher.run())
    await done
    elapsed = time.perf_counter_ns() - start
    await dispatcher.close()
    await runner
    return elapsed


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="pulsar://127.0.0.1:6650")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--receiver-queue", type=int, default=1000)
    parser.add_argument("--payload-size", type=int, default=64)
    args = parser.parse_args()
    produce(args.url, args.topic, args.messages, args.payload_size)
    elapsed = asyncio.run(
        consume(args.url, args.topic, args.messages, args.receiver_queue)
    )
    print(
        json.dumps(
            {
                "bench": "python_e2e",
                "receiver_queue": args.receiver_queue,
                "messages": args.messages,
                "msgs_per_s": args.messages / (elapsed / 1e9),
            }
        ),
        flush=True,
    )
