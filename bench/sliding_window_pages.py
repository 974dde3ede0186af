"""KV pages a sliding-window sequence holds as it runs, with the pages its window has passed handed
back (`BlockManager.free_passed`, driven by the engine's update) and without.

    python bench/sliding_window_pages.py [--tokens 4096] [--prompt 1024] [--window 1024] [--page-size 16]

One sequence of `--tokens` positions (a `--prompt`-token prompt in 512-token chunks, then greedy
decodes to the end) runs through the real Engine on a tiny random Mistral-shaped model (every
layer slides through `--window`; the model's size changes no page count), once as served and once
with the freeing turned off (`blocks.window = None`: the pre-issue-30 bookkeeping). Printed: the
pages held (in use; freed pages that are published wait evictable, reusable by anyone) at the end
of the prompt, at the peak and at the last step, and what they would weigh for Mistral-7B's KV
(32 layers x 8 KV heads x 128, bf16: 128 KiB a token).
"""

from __future__ import annotations

import argparse

import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.model.loader import build_random_model

MISTRAL_7B = ModelConfig(
    architecture="mistral",
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=14336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
)


def tiny_mistral(window: int, context: int) -> torch.nn.Module:
    cfg = ModelConfig(
        architecture="mistral",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        layer_windows=(window, window),
    )
    return build_random_model(cfg, torch.float32, torch.device("cpu"), seed=0)


def pages_held(model, args, freeing: bool) -> tuple[int, int, int]:
    """(pages in use after the prompt, at the peak, at the last step before it finished) of one
    sequence."""
    config = EngineConfig(
        dtype="float32",
        page_size=args.page_size,
        num_pages=args.tokens // args.page_size + 8,
        max_model_len=args.tokens,
        max_num_batched_tokens=512,
        max_prefill_chunk=512,
    )
    engine = Engine(config, model=model)
    if not freeing:
        engine.blocks.window = None
    prompt = torch.randint(0, 256, (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.tokens - args.prompt, ignore_eos=True)
    engine.add_request("r", prompt, params)
    seq = engine.requests["r"].seqs[0]
    after_prompt = peak = last = 0
    while engine.has_unfinished():
        engine.step()
        if seq.finished:  # its pages went back with it
            break
        last = engine.blocks.num_used_pages
        peak = max(peak, last)
        if not after_prompt and seq.num_computed >= args.prompt:
            after_prompt = last
    return after_prompt, peak, last


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--page-size", type=int, default=16)
    args = parser.parse_args()
    model = tiny_mistral(args.window, args.tokens)
    page_mib = MISTRAL_7B.kv_bytes_per_token(2) * args.page_size / 2**20
    print(
        f"one sequence of {args.tokens} tokens ({args.prompt}-token prompt), window {args.window}, "
        f"pages of {args.page_size} tokens ({page_mib:.0f} MiB each at Mistral-7B's KV, bf16)"
    )
    print(f"{'':>16} {'after prompt':>14} {'peak':>14} {'last step':>14}")
    for freeing in (False, True):
        held = pages_held(model, args, freeing)
        cells = " ".join(f"{n:>5} ({n * page_mib:>5.0f} MiB)" for n in held)
        print(f"{'freed' if freeing else 'kept (before)':>16} {cells}")


if __name__ == "__main__":
    main()
