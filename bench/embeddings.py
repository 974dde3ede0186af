"""Embeddings per second at batch 1 and 32: through a whole mesh, and in one engine alone.

    python bench/embeddings.py [--batches 1 32] [--inputs 256] [--words 12] [--concurrency 1]
    python bench/embeddings.py --mesh-flags --mixed 1        # flags for `pagemesh up`
    python bench/embeddings.py --engine-only                  # no mesh: the engine's own rate

Mesh: `pagemesh up` (its default: a prefill and a decode worker; embeddings run on the one that
prefills) driven by the official openai client: `--concurrency` clients, each sending requests
of `batch` inputs one after another until `--inputs` inputs are embedded (as base64, what the
client asks for unless told otherwise); the figure is inputs/s over the wall time, and each
request's latency. Engine: the same inputs through
`workers.engine.pooling.embed`, `batch` at a time, on one engine (no sockets, no HTTP): what the
mesh's path costs on top. Inputs are distinct sentences of `--words` random words (no prefix-cache
hits), the same for every arm. Figures are wall time on this machine: quote `uptime` with them.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import threading
import time

WORDS = (
    "river stone light garden paper window music engine market winter silver forest morning "
    "letter bridge harbour candle mountain village thunder orange pocket shadow kettle meadow "
    "lantern rocket violin castle desert planet whisper compass ladder mirror island feather"
).split()


def sentences(count: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "." for i in range(count)]


def mesh_rate(url: str, model: str, texts: list[str], batch: int, concurrency: int) -> tuple[float, list[float]]:
    """(inputs/s, per-request latencies in s) of embedding `texts` in requests of `batch` inputs."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    requests = [texts[i : i + batch] for i in range(0, len(texts), batch)]
    client.embeddings.create(model=model, input=requests[0])  # warm the path
    latencies: list[float] = []
    lock = threading.Lock()
    work = iter(requests)

    def client_loop() -> None:
        while True:
            with lock:
                inputs = next(work, None)
            if inputs is None:
                return
            start = time.perf_counter()
            out = client.embeddings.create(model=model, input=inputs)  # base64, as the client asks by default
            assert len(out.data) == len(inputs)
            with lock:
                latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    threads = [threading.Thread(target=client_loop) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return len(texts) / (time.perf_counter() - start), latencies


def engine_rate(engine, texts: list[str], batch: int) -> float:
    from pagemesh.workers.engine.pooling import embed

    embed(engine, texts[:batch])  # warm
    start = time.perf_counter()
    for i in range(0, len(texts), batch):
        embed(engine, texts[i : i + batch])
    return len(texts) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--inputs", type=int, default=256, help="inputs embedded per arm")
    parser.add_argument("--words", type=int, default=12, help="words per input")
    parser.add_argument("--concurrency", type=int, default=1, help="clients sending requests at once (mesh)")
    parser.add_argument("--engine-only", action="store_true", help="no mesh")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the engine's torch threads (default: what `pagemesh up` gives each of 2 workers)",
    )
    parser.add_argument("--mesh-flags", nargs=argparse.REMAINDER, default=[], help="flags for `pagemesh up`")
    args = parser.parse_args()

    import torch

    from pagemesh.common.model_files import DEFAULT_MODEL_NAME
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // 2))
    texts = sentences(args.inputs, args.words)
    engine = Engine(EngineConfig())
    lengths = [len(engine.tokenizer.encode(t)) for t in texts]
    print(f"{len(texts)} inputs of {min(lengths)}-{max(lengths)} tokens (mean {statistics.mean(lengths):.1f})")
    print(f"engine alone ({engine.device.type}, {engine.runner.dtype}, {torch.get_num_threads()} threads):")
    for batch in args.batches:
        print(f"  batch {batch:>3}: {engine_rate(engine, texts, batch):8.1f} embeddings/s")
    engine.close()
    del engine
    if args.engine_only:
        return

    from pagemesh.bench.local_mesh import running_mesh

    with running_mesh(*args.mesh_flags) as url:
        flags = " ".join(args.mesh_flags) or "(default: a prefill and a decode worker)"
        print(f"mesh `pagemesh up {flags}`, {args.concurrency} client(s):")
        for batch in args.batches:
            rate, latencies = mesh_rate(url, DEFAULT_MODEL_NAME, texts, batch, args.concurrency)
            p50 = statistics.median(latencies) * 1e3
            print(f"  batch {batch:>3}: {rate:8.1f} embeddings/s, {p50:7.1f} ms a request (median)")


if __name__ == "__main__":
    main()
