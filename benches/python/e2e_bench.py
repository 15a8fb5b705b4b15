"""The Python original (pulsar-dispatcher 0.1.0) end to end on a real broker.

Pre-produces N messages to a fresh topic with the official Python client,
then consumes them through `PulsarDispatcher` with a no-op handler and the
given receiver queue size. The clock runs from the handler of message
number `--warmup` (past what the client prefetched at subscribe) until the
last handler has run. Prints one JSON line.

With `--latency`, it produces nothing: it subscribes, prints `ready`, and
records for each message how long after the wall-clock stamp in the first
8 bytes of its payload (little-endian nanoseconds since 1970, written by
the Rust benchmark's producer just before sending) the handler started;
after N messages it prints them as one JSON line (`ages_ns`).

Usage: python e2e_bench.py --url pulsar://127.0.0.1:6650 --topic T --messages N --receiver-queue Q [--latency]
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


async def consume(url, topic, messages, receiver_queue, warmup):
    dispatcher = PulsarDispatcher(url, concurrency=20)
    handled = 0
    warm = None
    done = asyncio.get_running_loop().create_future()

    async def handler(_message):
        nonlocal handled, warm
        handled += 1
        if handled == warmup:
            warm = (time.perf_counter_ns(), time.process_time_ns())
        if handled == messages:
            done.set_result((time.perf_counter_ns(), time.process_time_ns()))
        return None

    await dispatcher.subscribe(
        topic,
        handler,
        subscription_name="bench",
        receiver_queue_size=receiver_queue,
    )
    runner = asyncio.create_task(dispatcher.run())
    end = await done
    await dispatcher.close()
    await runner
    return end[0] - warm[0], end[1] - warm[1]


async def latency(url, topic, messages, receiver_queue):
    dispatcher = PulsarDispatcher(url, concurrency=20)
    ages = []
    done = asyncio.get_running_loop().create_future()

    async def handler(message):
        now = time.time_ns()
        stamp = int.from_bytes(message.data()[:8], "little")
        ages.append(max(now - stamp, 0))
        if len(ages) == messages:
            done.set_result(None)
        return None

    await dispatcher.subscribe(
        topic,
        handler,
        subscription_name="bench",
        receiver_queue_size=receiver_queue,
    )
    runner = asyncio.create_task(dispatcher.run())
    print("ready", flush=True)
    await done
    await dispatcher.close()
    await runner
    return ages


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default="pulsar://127.0.0.1:6650")
    parser.add_argument("--topic", required=True)
    parser.add_argument("--messages", type=int, default=10000)
    parser.add_argument("--receiver-queue", type=int, default=1000)
    parser.add_argument("--payload-size", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--latency", action="store_true")
    args = parser.parse_args()
    if args.latency:
        ages = asyncio.run(
            latency(args.url, args.topic, args.messages, args.receiver_queue)
        )
        print(json.dumps({"bench": "python_e2e_latency", "ages_ns": ages}), flush=True)
        raise SystemExit(0)
    produce(args.url, args.topic, args.messages, args.payload_size)
    elapsed, cpu = asyncio.run(
        consume(
            args.url, args.topic, args.messages, args.receiver_queue, args.warmup
        )
    )
    print(
        json.dumps(
            {
                "bench": "python_e2e",
                "receiver_queue": args.receiver_queue,
                "messages": args.messages,
                "msgs_per_s": (args.messages - args.warmup) / (elapsed / 1e9),
                # Every thread of the process: asyncio and the C++ client's.
                "cpu_us_per_msg": cpu / 1e3 / (args.messages - args.warmup),
            }
        ),
        flush=True,
    )
