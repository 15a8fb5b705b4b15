"""Consumes messages with the official Python client (pulsar-client).

Interop peer for tests/smoke_pulsar.rs. Reads a JSON request on stdin:

    {"service_url": "...", "topic": "...", "subscription": "...",
     "count": N, "timeout_ms": 20000,
     "crypto": {"public_key": "pub.pem", "private_key": "priv.pem"}}

Subscribes (Shared, from the earliest message), receives and acknowledges N
messages and prints `RESULT {"messages": [...]}`, one object per message with
its payload, properties, partition key, ordering key, event and publish
timestamps and redelivery count. Exits with status 2 if fewer than N messages
arrive in time. `crypto`, optional, names the PEM files of the RSA key pair
that encrypted the messages.
"""

import json
import sys
import time

import pulsar


def describe(msg):
    return {
        "payload": msg.data().decode("utf-8"),
        "properties": msg.properties(),
        "partition_key": msg.partition_key() or None,
        "ordering_key": msg.ordering_key() or None,
        "event_timestamp": msg.event_timestamp(),
        "publish_timestamp": msg.publish_timestamp(),
        "redelivery_count": msg.redelivery_count(),
        "topic": msg.topic_name(),
    }


def main():
    request = json.load(sys.stdin)
    # The client's own console logger, warnings only. (A Python `logging`
    # logger makes pulsar-client 3.13 abort now and then at interpreter exit:
    # "terminate called without an active exception".)
    client = pulsar.Client(
        request["service_url"],
        operation_timeout_seconds=10,
        logger=pulsar.ConsoleLogger(pulsar.LoggerLevel.Warn),
    )
    received = []
    try:
        crypto = {}
        if request.get("crypto"):
            keys = request["crypto"]
            crypto["crypto_key_reader"] = pulsar.CryptoKeyReader(keys["public_key"], keys["private_key"])
        consumer = client.subscribe(
            request["topic"],
            request["subscription"],
            **crypto,
            consumer_type=pulsar.ConsumerType.Shared,
            initial_position=pulsar.InitialPosition.Earliest,
        )
        deadline = time.monotonic() + request.get("timeout_ms", 20000) / 1000.0
        while len(received) < request["count"]:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                break
            try:
                msg = consumer.receive(timeout_millis=min(left_ms, 1000))
            except pulsar.Timeout:
                continue
            received.append(describe(msg))
            consumer.acknowledge(msg)
        consumer.close()
    finally:
        client.close()
    print("RESULT " + json.dumps({"messages": received}), flush=True)
    if len(received) < request["count"]:
        print(f"received {len(received)} of {request['count']} messages", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
