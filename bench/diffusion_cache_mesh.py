"""Do images requests that ask for a feature cache and a sampler get, through the real mesh, the
speed-up the diffusion-cache report promises?

Starts `pagemesh up` with one diffusion worker (no LLM worker), then sends one-image requests
with the official `openai` client, one at a time (so each is alone in its forwards, as the
report's `ms alone` column), cycling through the settings round by round so a drifting shared
CPU falls on all of them. Each setting: its block fraction from the response's `usage`
(blocks_computed / (computed + skipped), exact), the client's median wall time per request, and
the PSNR of its images against the same seeds uncached (the PNGs at the native 8x8, one MSE over
all of a setting's images, as bench/experiments/image_metrics.py). Prints a markdown table.

    python -m pagemesh.bench.diffusion_cache_mesh [--rounds 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

# (sampler, steps, cache): the report's dpmsolver++ 25-step sweep and DDIM 50, each beside the
# equal-compute fewer-steps twin the report pairs it with.
SETTINGS = (
    ("dpmsolver++", 25, "none"),
    ("dpmsolver++", 25, "teacache:0.1"),
    ("dpmsolver++", 13, "none"),
    ("dpmsolver++", 25, "fbcache:0.1"),
    ("dpmsolver++", 17, "none"),
    ("ddim", 50, "none"),
    ("ddim", 50, "teacache:0.2"),
    ("ddim", 11, "none"),
)
DIGITS = 10  # one request per digit per round, seeded by round and digit


def main(argv: list[str] | None = None) -> None:
    import openai
    import torch

    from pagemesh.bench.experiments.image_metrics import psnr
    from pagemesh.bench.local_mesh import HANG_S, running_mesh
    from pagemesh.workers.diffusion.png import from_png_b64

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="requests per setting = rounds x 10 digits")
    p.add_argument("--threads", type=int, default=1, help="--diffusion-threads")
    args = p.parse_args(argv)
    flags = ["--prefill", "0", "--decode", "0", "--mixed", "0", "--diffusion", "1"]
    flags += ["--diffusion-threads", str(args.threads)]
    times: dict[tuple, list[float]] = {s: [] for s in SETTINGS}
    blocks: dict[tuple, list[tuple[int, int]]] = {s: [] for s in SETTINGS}
    images: dict[tuple, dict[int, np.ndarray]] = {s: {} for s in SETTINGS}
    load_before = os.getloadavg()
    with running_mesh(*flags) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)
        client.images.generate(prompt="a 1", size="8x8", extra_body={"num_inference_steps": 2})  # warm-up
        for round_ in range(args.rounds):
            for digit in range(DIGITS):
                seed = 1000 * round_ + digit
                order = SETTINGS if (round_ + digit) % 2 == 0 else tuple(reversed(SETTINGS))
                for setting in order:
                    sampler, steps, cache = setting
                    extra = {"sampler": sampler, "num_inference_steps": steps, "cache": cache}
                    extra |= {"seed": seed, "guidance_scale": 2.0}
                    began = time.perf_counter()
                    result = client.images.generate(prompt=f"a handwritten {digit}", size="8x8", extra_body=extra)
                    times[setting].append(time.perf_counter() - began)
                    usage = result.model_dump()["usage"]
                    blocks[setting].append((usage["blocks_computed"], usage["blocks_skipped"]))
                    images[setting][seed] = from_png_b64(result.data[0].b64_json)
    load_after = os.getloadavg()

    print(
        f"\nload average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
        f"{args.rounds * DIGITS} requests a setting"
    )
    print("\n| sampler | steps | cache | blocks | block speed-up | ms/request (median) | wall speed-up | PSNR dB |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for setting in SETTINGS:
        sampler, steps, cache = setting
        full = next(s for s in SETTINGS if s[0] == sampler and s[2] == "none")  # the first: the full run
        full_blocks = sum(c + k for c, k in blocks[full]) / len(blocks[full])
        fraction = sum(c for c, _ in blocks[setting]) / len(blocks[setting]) / full_blocks
        ms, full_ms = (statistics.median(times[s]) * 1e3 for s in (setting, full))
        seeds = sorted(images[setting])
        quality = psnr(*(torch.from_numpy(np.stack([images[s][k] for k in seeds])) for s in (setting, full)))
        print(
            f"| {sampler} | {steps} | {cache} | {fraction:.2f} | {1 / fraction:.2f}× | {ms:.0f} | "
            f"{full_ms / ms:.2f}× | {'∞' if np.isinf(quality) else f'{quality:.1f}'} |"
        )


if __name__ == "__main__":
    main()
