"""Publishes messages with the official Python client (pulsar-client).

Interop peer for tests/smoke_pulsar.rs. Reads a JSON request on stdin:

    {"service_url": "...", "topic": "...", "batching": false,
     "compression": "LZ4", "schema": "json",
     "encryption": {"public_key": "pub.pem", "private_key": "priv.pem"},
     "messages": [{"payload": "text", "properties": {"k": "v"},
                   "partition_key": "pk", "ordering_key": "ok",
                   "event_timestamp": 1700000000000}, ...]}

Optional fields may be null or missing; `compression` names a member of
`pulsar.CompressionType` (NONE, LZ4, ZLib, ZSTD, SNAPPY); `encryption` names
the PEM files of an RSA key pair, and the messages are encrypted with it;
`schema` is "string" (each payload sent with `StringSchema`) or "json" (each
payload sent as the `text` field of a record with `JsonSchema`), and the
producer registers that schema on the topic. Prints `RESULT {"sent": N}` when every
message has been acknowledged by the broker.
"""

import json
import sys

import pulsar
from pulsar.schema import JsonSchema, Record, String, StringSchema


class Text(Record):
    """The record of a "json" schema request: the payload as its one field."""

    text = String()


def _schema(name):
    """The schema a request names, and how a payload is turned into a value of it."""
    if name == "string":
        return {"schema": StringSchema()}, lambda payload: payload
    if name == "json":
        return {"schema": JsonSchema(Text)}, lambda payload: Text(text=payload)
    if name:
        raise ValueError(f"unknown schema {name!r}")
    return {}, lambda payload: payload.encode("utf-8")


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
    try:
        batching = bool(request.get("batching", False))
        compression = getattr(pulsar.CompressionType, request.get("compression") or "NONE")
        encryption = {}
        if request.get("encryption"):
            keys = request["encryption"]
            encryption = {
                "encryption_key": "test-key",
                "crypto_key_reader": pulsar.CryptoKeyReader(keys["public_key"], keys["private_key"]),
            }
        schema, value_of = _schema(request.get("schema"))
        producer = client.create_producer(
            request["topic"],
            **schema,
            **encryption,
            compression_type=compression,
            batching_enabled=batching,
            # With batching on, hold messages long enough that they share a batch.
            batching_max_publish_delay_ms=50,
            batching_max_messages=1000,
        )
        pending = []
        for spec in request["messages"]:
            kwargs = {}
            if spec.get("properties"):
                kwargs["properties"] = spec["properties"]
            for key in ("partition_key", "ordering_key", "event_timestamp"):
                if spec.get(key) is not None:
                    kwargs[key] = spec[key]
            payload = value_of(spec["payload"])
            if batching:
                pending.append(None)
                producer.send_async(payload, callback=_collect(pending, len(pending) - 1), **kwargs)
            else:
                producer.send(payload, **kwargs)
        if batching:
            producer.flush()
            failed = [r for r in pending if r != pulsar.Result.Ok]
            if failed:
                raise RuntimeError(f"send failed: {failed}")
        producer.close()
        print("RESULT " + json.dumps({"sent": len(request["messages"])}), flush=True)
    finally:
        client.close()


def _collect(results, index):
    def callback(result, _message_id):
        results[index] = result

    return callback


if __name__ == "__main__":
    main()
