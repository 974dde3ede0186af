"""A burst of long prompts through the default disaggregated mesh: how many fail.

    python bench/handoff_burst.py [--requests 48] [--words 400] [--tokens 16] [-- extra pagemesh up flags]

Starts `pagemesh up` (a prefill and a decode worker), sends `--requests` completions of prompts
of `--words` words at once (greedy, `--tokens` each, the client's retries off) and prints how many
succeeded, the errors of the others, and the wall time. Each request's decode task reaches its
decode worker at once, its pages only after its prompt's prefill: a burst queues the prefills.
Before bafe7c5 a task waited one `--transfer-timeout` (30 s) for its pages, and 24 of 48
prompts of 400 words failed here with 503 "the KV handoff timed out".
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import time

import openai

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.common.model_files import DEFAULT_MODEL_NAME


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--words", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("flags", nargs="*", help="more `pagemesh up` flags (after --)")
    args = parser.parse_args()
    with running_mesh("--diffusion", "0", *args.flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)

        def one(i: int) -> str | None:
            try:
                client.completions.create(
                    model=DEFAULT_MODEL_NAME,
                    prompt=f"{i}: " + "word " * args.words,
                    max_tokens=args.tokens,
                    temperature=0,
                )
            except openai.APIError as e:
                return f"{type(e).__name__}: {e}"
            return None

        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(args.requests) as pool:
            errors = [e for e in pool.map(one, range(args.requests)) if e is not None]
        elapsed = time.monotonic() - start
    print(
        f"{args.requests - len(errors)} of {args.requests} succeeded, {len(errors)} failed, in {elapsed:.1f} s; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for error in sorted(set(errors)):
        print(f"  {errors.count(error)} x {error[:200]}")


if __name__ == "__main__":
    main()
