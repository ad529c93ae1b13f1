"""Hostile clients of the node hub, each run as a process of its own (a real gRPC client).

    python tests/chaos/hubclients.py oversized PORT --calls 4 --size 262144000
    python tests/chaos/hubclients.py silent PORT --calls 320
    python tests/chaos/hubclients.py guess PORT --calls 60
    python tests/chaos/hubclients.py flood PORT --node-id node-3 --token T [--refusal-bytes N]

Each prints one JSON line: what every call ended with (`code`, `details`) and after how many
seconds. `oversized` sends one message of `size` bytes as the first message of each call (the
hub's 250 MiB attack); `silent` opens calls that never send a hello, each on a connection of
its own; `guess` sends hellos with wrong tokens one after another; `flood` authenticates with a
valid token and then sends what a hostile Node could: config refusals of nearly a message's
worth of text, and the health of 100,000 providers the Edge never configured.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import sys
import time
from typing import Any

import grpc
import grpc.aio
import orjson

from iop.wire import PROTOCOL_VERSION
from iop.wire import runtime_pb2 as pb

METHOD = "/iop.runtime.v1.NodeRuntime/Connect"


def channel(port: int, index: int) -> grpc.aio.Channel:
    """A channel with a connection of its own (grpc shares connections between equal channels)."""
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}",
        options=[
            ("grpc.max_send_message_length", -1),
            ("grpc.use_local_subchannel_pool", 1),
            ("iop.test.channel", index),
        ],
    )


#: Seconds a client waits for the Edge to end its call before it reports it still `OPEN`.
GIVE_UP_S = 120.0


async def ended(call: Any) -> tuple[str, str]:
    """Read until the call ends (or `GIVE_UP_S`); its status code name and details."""
    try:
        async with asyncio.timeout(GIVE_UP_S):
            while await call.read() is not grpc.aio.EOF:
                pass
        return (await call.code()).name, await call.details() or ""
    except grpc.aio.AioRpcError as error:
        return error.code().name, error.details() or ""
    except TimeoutError:
        call.cancel()
        return "OPEN", f"still open after {GIVE_UP_S:g}s"


def oversized(port: int, calls: int, size: int) -> list[dict[str, Any]]:
    """With grpc's synchronous client, one thread a call: grpc.aio reports its own INTERNAL
    when the server ends a call while the client's write is still in flight (grpc/grpc#36066),
    which a 250 MiB write always is, so only the synchronous client reads what the server
    answered."""
    data = b"\0" * size

    def one(index: int) -> dict[str, Any]:
        options = [
            ("grpc.max_send_message_length", -1),
            ("grpc.use_local_subchannel_pool", 1),
            ("iop.test.channel", index),
        ]
        with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as ch:
            started = time.monotonic()
            try:
                connect: Any = ch.stream_stream(METHOD)
                for _ in connect(iter([data]), timeout=GIVE_UP_S):
                    pass
                code, details = "OK", ""
            except grpc.RpcError as error:
                code, details = error.code().name, error.details() or ""
            return {"code": code, "details": details[:200], "s": time.monotonic() - started}

    with concurrent.futures.ThreadPoolExecutor(calls) as pool:
        return list(pool.map(one, range(calls)))


async def silent(port: int, calls: int) -> list[dict[str, Any]]:
    async def one(index: int) -> dict[str, Any]:
        async with channel(port, index) as ch:
            started = time.monotonic()
            code, details = await ended(ch.stream_stream(METHOD)())
            return {"code": code, "details": details[:200], "s": time.monotonic() - started}

    return list(await asyncio.gather(*(one(i) for i in range(calls))))


def hello(node_id: str, token: str, **fields: Any) -> bytes:
    message = pb.NodeMessage(
        hello=pb.Hello(
            protocol_version=PROTOCOL_VERSION,
            node_id=node_id,
            token=token,
            instance_id=f"attacker-{time.monotonic_ns()}",
            started_at=time.time(),
            **fields,
        )
    )
    return message.SerializeToString()


async def guess(port: int, calls: int) -> list[dict[str, Any]]:
    results = []
    async with channel(port, 0) as ch:
        for index in range(calls):
            started = time.monotonic()
            call: Any = ch.stream_stream(METHOD)()
            with contextlib.suppress(Exception):  # refused when too many calls wait
                await call.write(hello("node-1", f"guess-{index}"))
            code, details = await ended(call)
            results.append(
                {"code": code, "details": details[:200], "s": time.monotonic() - started}
            )
    return results


async def flood(port: int, node_id: str, token: str, refusal_bytes: int) -> list[dict[str, Any]]:
    """A Node with a valid token that sends refusal text and health for unknown providers.
    `refusal_bytes`: each refusal's size; 0: as large as the Edge's welcome allows."""
    async with channel(port, 0) as ch:
        started = time.monotonic()
        call: Any = ch.stream_stream(
            METHOD, request_serializer=None, response_deserializer=pb.EdgeMessage.FromString
        )()
        await call.write(hello(node_id, token))
        welcome = await call.read()
        assert isinstance(welcome, pb.EdgeMessage), welcome
        # An Edge that predates the bound has no such field (nor a bound): 1 MiB then.
        limit = getattr(welcome.welcome, "max_message_bytes", 0) or 1024 * 1024
        generation = welcome.welcome.config.generation
        refusal = "no " * ((refusal_bytes or limit - 4096) // 3)
        for _ in range(5):  # five refusals, as large as a message may be unless told
            ack = pb.ConfigAck(generation=generation, config_hash="x", ok=False, error=refusal)
            await call.write(pb.NodeMessage(acks=[ack]).SerializeToString())
        sent = 0
        while sent < 100_000:  # the health of 100,000 providers nobody configured
            batch = [
                pb.ProviderHealth(provider_id=f"ghost-{sent + i}", healthy=False, detail="x" * 16)
                for i in range(20_000)
            ]
            sent += len(batch)
            await call.write(pb.NodeMessage(health=batch).SerializeToString())
        await call.write(pb.NodeMessage(heartbeat=pb.Heartbeat()).SerializeToString())
        await asyncio.sleep(1.0)  # the Edge reads it all
        call.cancel()
        return [
            {"code": "SENT", "details": f"{sent} health entries", "s": time.monotonic() - started}
        ]


async def main() -> None:
    global GIVE_UP_S
    parser = argparse.ArgumentParser()
    parser.add_argument("attack", choices=["oversized", "silent", "guess", "flood"])
    parser.add_argument("port", type=int)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--size", type=int, default=250 * 1024 * 1024)
    parser.add_argument("--node-id", default="node-3")
    parser.add_argument("--token", default="")
    parser.add_argument("--refusal-bytes", type=int, default=0)
    parser.add_argument("--give-up", type=float, default=GIVE_UP_S)
    args = parser.parse_args()
    GIVE_UP_S = args.give_up
    if args.attack == "oversized":
        results = await asyncio.to_thread(oversized, args.port, args.calls, args.size)
    elif args.attack == "silent":
        results = await silent(args.port, args.calls)
    elif args.attack == "guess":
        results = await guess(args.port, args.calls)
    else:
        try:
            results = await flood(args.port, args.node_id, args.token, args.refusal_bytes)
        except grpc.aio.AioRpcError as error:
            results = [{"code": error.code().name, "details": error.details() or "", "s": 0.0}]
    sys.stdout.write(orjson.dumps(results).decode() + "\n")


if __name__ == "__main__":
    asyncio.run(main())
