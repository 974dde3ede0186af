"""What CurveZMQ costs on the mesh's sockets: throughput of KV-sized frames and the round trip
of a small control message, over ipc:// between two processes, with and without the mesh's keys.

    PYTHONPATH=. python bench/zmq_curve.py [--frame-mib 16] [--frames 32] [--pings 2000]

Prints MiB/s for the frames (one direction, DEALER -> ROUTER with the KV socket options, as a
prefill worker sends pages) and µs per round trip (DEALER <-> ROUTER, control options).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import tempfile
import time

from pagemesh.common import transport as t  # noqa: E402
from pagemesh.common import transport_curve as curve  # noqa: E402
from pagemesh.common.protocol import KVPagesAck, Ping, Pong, encode  # noqa: E402


def sender(address: str, frame_bytes: int, frames: int, pings: int, keys: str | None) -> None:
    if keys:
        os.environ[curve.KEYS_ENV] = keys

    async def main() -> None:
        with t.Dealer(address, "prefill", options=t.KV) as dealer:
            payload = bytes(frame_bytes)
            ack = encode(KVPagesAck(request_id="r", ok=True, error=None))
            for _ in range(frames):
                await dealer.send_frames([*ack, payload])
            for _ in range(pings):
                await dealer.send(Ping(sender="bench"))
                await dealer.recv()

    asyncio.run(main())


def run(frame_bytes: int, frames: int, pings: int, keys: str | None) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as run_dir:
        address = t.ipc_address(run_dir, "bench")
        if keys:
            os.environ[curve.KEYS_ENV] = keys
        else:
            os.environ.pop(curve.KEYS_ENV, None)

        async def receive() -> tuple[float, float]:
            with t.Router(address, options=t.KV) as router:
                proc = multiprocessing.get_context("spawn").Process(
                    target=sender, args=(address, frame_bytes, frames, pings, keys)
                )
                proc.start()
                # raw frames (the socket's cost, not the decoder's); the first one starts the clock
                await router._sock.recv_multipart(copy=False)
                start = time.perf_counter()
                for _ in range(frames - 1):
                    await router._sock.recv_multipart(copy=False)
                mib_s = (frames - 1) * frame_bytes / (time.perf_counter() - start) / (1 << 20)
                start = time.perf_counter()
                for _ in range(pings):
                    peer, _ = await router.recv()
                    await router.send(peer, Pong(service="bench", instance="bench"))
                rtt_us = (time.perf_counter() - start) / max(1, pings) * 1e6
                proc.join()
                return mib_s, rtt_us

        return asyncio.run(receive())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frame-mib", type=float, default=16)
    parser.add_argument("--frames", type=int, default=32)
    parser.add_argument("--pings", type=int, default=2000)
    args = parser.parse_args()
    frame_bytes = int(args.frame_mib * (1 << 20))
    with tempfile.TemporaryDirectory() as keys:
        curve.make_keys(keys)
        for label, folder in (("plain", None), ("curve", keys)):
            mib_s, rtt_us = run(frame_bytes, args.frames, args.pings, folder)
            print(f"{label:6} {args.frame_mib:g} MiB frames: {mib_s:8.0f} MiB/s   control round trip: {rtt_us:6.0f} µs")


if __name__ == "__main__":
    main()
