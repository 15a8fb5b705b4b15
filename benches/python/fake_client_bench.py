"""The Python original (pulsar-dispatcher 0.1.0) on an in-memory fake client.

Runs the same workload as the Rust in-memory benchmarks: N messages,
already waiting, through K subscriptions at concurrency C, with a no-op
handler. The fake replaces `pulsar.asyncio.Client` in the dispatcher's
module with a client that keeps topics in memory, and does per message what
the Rust in-memory transport does: it keeps each received message until it
is settled and records every ack. Prints one JSON line with the wall time
and the process CPU time per message (the interpreter is single-threaded
here).

Usage: python fake_client_bench.py --subscriptions K --concurrency C --messages N
"""

import argparse
import asyncio
import collections
import json
import time

import pulsar_dispatcher.dispatcher as reference


class FakeMessage:
    __slots__ = ("_topic", "_id", "_data")

    def __init__(self, topic, message_id, data):
        self._topic = topic
        self._id = message_id
        self._data = data

    def data(self):
        return self._data

    def message_id(self):
        return self._id

    def topic_name(self):
        return self._topic

    def properties(self):
        return {}

    def partition_key(self):
        return ""

    def ordering_key(self):
        return ""

    def event_timestamp(self):
        return 0


class FakeTopic:
    def __init__(self, name):
        self.name = name
        self.backlog = collections.deque()
        self.unsettled = {}
        self.acked = []
        self.nacked = []
        self.arrived = None
        self.next_id = 0

    def send(self, data):
        self.backlog.append(FakeMessage(self.name, self.next_id, data))
        self.next_id += 1
        if self.arrived is not None and not self.arrived.done():
            self.arrived.set_result(None)


class FakeConsumer:
    def __init__(self, topic):
        self.topic = topic

    async def receive(self):
        topic = self.topic
        while not topic.backlog:
            topic.arrived = asyncio.get_running_loop().create_future()
            await topic.arrived
        message = topic.backlog.popleft()
        topic.unsettled[message.message_id()] = message
        return message

    async def acknowledge(self, message):
        self.topic.unsettled.pop(message.message_id(), None)
        self.topic.acked.append(message.message_id())

    async def negative_acknowledge(self, message):
        self.topic.unsettled.pop(message.message_id(), None)
        self.topic.nacked.append(message.message_id())
        self.topic.backlog.appendleft(message)

    async def close(self):
        pass


class FakeProducer:
    def __init__(self, topic):
        self.topic = topic

    async def send(self, content, **_kwargs):
        self.topic.send(content)


class FakeClient:
    """What `PulsarDispatcher` calls on `pulsar.asyncio.Client`."""

    topics = {}

    def __init__(self, url, **_kwargs):
        self.url = url

    @classmethod
    def topic(cls, name):
        if name not in cls.topics:
            cls.topics[name] = FakeTopic(name)
        return cls.topics[name]

    async def subscribe(self, topic, **_kwargs):
        return FakeConsumer(self.topic(topic))

    async def create_producer(self, topic, **_kwargs):
        return FakeProducer(self.topic(topic))

    async def close(self):
        pass


async def main(subscriptions, concurrency, messages, levels):
    reference.Client = FakeClient
    FakeClient.topics = {}
    dispatcher = reference.PulsarDispatcher("fake://", concurrency=concurrency)
    handled = 0
    done = asyncio.get_running_loop().create_future()

    async def handler(_message):
        nonlocal handled
        handled += 1
        if handled == messages:
            done.set_result(None)
        return None

    names = [f"bench-{i}" for i in range(subscriptions)]
    for index, name in enumerate(names):
        await dispatcher.subscribe(name, handler, priority=index % levels)
    for index in range(messages):
        FakeClient.topic(names[index % subscriptions]).send(b"")
    start = time.perf_counter_ns()
    cpu_start = time.process_time_ns()
    runner = asyncio.create_task(dispatcher.run())
    await done
    elapsed = time.perf_counter_ns() - start
    cpu = time.process_time_ns() - cpu_start
    await dispatcher.close()
    await runner
    acked = sum(len(FakeClient.topic(n).acked) for n in names)
    assert acked == messages, (acked, messages)
    print(
        json.dumps(
            {
                "bench": "python_fake",
                "subscriptions": subscriptions,
                "concurrency": concurrency,
                "messages": messages,
                "ns_per_msg": elapsed / messages,
                "cpu_ns_per_msg": cpu / messages,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--subscriptions", type=int, default=1)
    parser.add_argument("--concurrency", type=int, default=20)
    parser.add_argument("--messages", type=int, default=20000)
    parser.add_argument("--levels", type=int, default=1)
    args = parser.parse_args()
    asyncio.run(main(args.subscriptions, args.concurrency, args.messages, args.levels))
