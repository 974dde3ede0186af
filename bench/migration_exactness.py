"""Does a migrated greedy stream keep its fault-free text? The issue-35 trial, repeated, with and
without `--batch-invariant`.

    python bench/migration_exactness.py [--trials 3] [--tokens 200] [--after 40] [--modes default,invariant]

For each mode, one mesh of a prefill and two decode workers (the default model as served by
default: its GGUF blocks, bf16), started process by process so that one can be killed. Each trial:
a greedy chat stream of `--tokens` tokens with `ignore_eos`, run once without a fault; then the
same stream again, its decode worker killed (SIGKILL) after `--after` text deltas and started
again. Prints, per trial, the two texts' lengths, whether they are equal and where they first
differ; and per mode how many trials kept the fault-free text. The prompt differs per trial.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import tempfile

import openai

from pagemesh.bench.local_mesh import HANG_S, SeparateProcesses, metrics, per_worker, sample_until, wait_until
from pagemesh.common.model_files import DEFAULT_MODEL_NAME

TOPICS = ["the history of the Fens", "how lighthouses work", "the life of bees", "building a canal", "tides"]


def stream(client, pieces: list[str], messages, tokens: int) -> None:
    for chunk in client.chat.completions.create(
        model=DEFAULT_MODEL_NAME,
        messages=messages,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)


def pool(mesh) -> list[str]:
    return sorted(n for n in mesh.children if n.startswith("decode-"))


def running(mesh) -> dict[str, float]:
    samples = per_worker(metrics(mesh.url), "pagemesh_num_requests_running")
    return {n: v for n, v in samples.items() if n in pool(mesh)}


def trial(mesh, client, messages, tokens: int, after: int) -> tuple[str, str]:
    expected: list[str] = []
    stream(client, expected, messages, tokens)
    wait_until(lambda: sum(running(mesh).values()) == 0)
    pieces: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        done = ex.submit(stream, client, pieces, messages, tokens)
        counts = sample_until(lambda: running(mesh), lambda c: sum(c.values()) == 1 and len(pieces) >= after)
        victim = max(counts, key=counts.get)
        mesh.kill(victim)
        try:
            done.result(timeout=HANG_S)
        finally:
            mesh.restart(victim)
    return "".join(expected), "".join(pieces)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--after", type=int, default=40)
    parser.add_argument("--modes", default="default,invariant")
    args = parser.parse_args()
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    for mode in args.modes.split(","):
        flags = ["--prefill", "1", "--decode", "2", "--max-migrations", "3"]
        flags += ["--batch-invariant"] if mode == "invariant" else []
        mesh = SeparateProcesses(tempfile.mkdtemp(prefix="pagemesh-migration-"), *flags)
        kept = 0
        try:
            mesh.start()
            client = openai.OpenAI(base_url=mesh.url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
            for i in range(args.trials):
                topic = TOPICS[i % len(TOPICS)]
                messages = [{"role": "user", "content": f"Write a long essay about {topic}."}]
                expected, got = trial(mesh, client, messages, args.tokens, args.after)
                first = next((j for j, (a, b) in enumerate(zip(expected, got)) if a != b), None)
                kept += expected == got
                print(
                    f"{mode} trial {i + 1}: fault-free {len(expected)} chars, migrated {len(got)}, "
                    f"equal={expected == got}, first difference at {first}",
                    flush=True,
                )
        finally:
            mesh.stop()
        print(f"{mode}: {kept} of {args.trials} migrated streams kept the fault-free text", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
