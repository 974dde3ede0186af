"""What images in the LLM cost (issue 32).

    python bench/multimodal.py encoder [--requests 8] [--rounds 3]
    python bench/multimodal.py bytes
    python bench/multimodal.py ttft [--model digits-vlm] [--clients 1 16] [--requests 32]

`encoder`: `--requests` requests share one image through the in-process engine, on a LLaVA whose
vision tower is CLIP ViT-B/16 at 224 px (86M parameters, 196 rows an image; random weights: the
cost is the shapes') in front of a small language model, prefix caching off (so only the
encoder cache can save work). Each request runs after the last (one at a time), with the encoder
cache (the image is encoded once) and without it (capacity 0: each request encodes it again),
alternating, `--rounds` rounds: images per second of encoder time and requests per second.
`bytes`: what crosses process boundaries for one image chat to digits-vlm (a 256x256 PNG of a
digit, as the DiT draws them): the HTTP body, each message on its way, as the codec encodes it.
`ttft`: time to first token of image chats through `pagemesh up --model <model>` with the
`openai` client, `--clients` at once, each image its own, with and without `--encoder 1`, under
mixed load (half the requests text only). Every figure is printed with the load average.
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _png(seed: int, size: int = 224, gray: bool = False) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    if gray:  # an 8x8 digit-like picture, upscaled nearest as the DiT's outputs are
        small = (rng.random((8, 8)) * 255).astype(np.uint8)
        image = Image.fromarray(small).resize((size, size), Image.Resampling.NEAREST)
    else:
        image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _clip_b16_llava(folder: Path) -> None:
    import torch
    from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration

    from pagemesh.tests.multimodal_checkpoints import TEXT, write_tokenizer

    torch.manual_seed(0)
    vision = dict(model_type="clip_vision_model", hidden_size=768, intermediate_size=3072, num_hidden_layers=12)
    vision.update(num_attention_heads=12, image_size=224, patch_size=16)
    text = dict(TEXT, hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4)
    cfg = LlavaConfig(vision_config=vision, text_config=dict(model_type="llama", **text), image_token_index=319)
    LlavaForConditionalGeneration(cfg).save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(folder)
    write_tokenizer("llava", folder)


def encoder(args) -> None:
    from pagemesh.common.messages import ImageInput
    from pagemesh.common.multimodal import ImageSpec, image_digest
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    folder = Path(tempfile.mkdtemp(prefix="bench-llava-"))
    _clip_b16_llava(folder)
    engine = Engine(EngineConfig(model=str(folder), dtype="bfloat16", enable_prefix_caching=False, num_pages=512))
    encoder_s = [0.0]
    encode = engine.runner.image_encoder.encode

    def timed(images):
        start = time.perf_counter()
        out = encode(images)
        encoder_s[0] += time.perf_counter() - start
        return out

    engine.runner.image_encoder.encode = timed
    png = _png(0)
    encode([(_png(1), [])])  # warm: the first bf16 matmuls pick their kernels
    length = ImageSpec.from_folder(folder).placeholders(224, 224)[0]
    prompt = [3] + [319] * length + [10, 11, 12, 4, 5]
    image = ImageInput(digest=image_digest(png), offset=1, length=length, data=png, grid=[])
    print(f"# {args.requests} requests sharing one image, one after another; CLIP ViT-B/16 224px, bf16; load {_load()}")
    print("| encoder cache | images encoded | encoder s | images/s of encoder time | requests/s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    results: dict[str, list[tuple[int, float, float]]] = {"on": [], "off": []}
    for _ in range(args.rounds):
        for mode in ("on", "off"):
            engine.encoder_cache.clear()
            engine.runner.image_embeds.clear()
            engine.encoder_cache.capacity = 1 << 20 if mode == "on" else 0
            before, encoder_s[0] = engine.encoder_cache.encoded, 0.0
            start = time.perf_counter()
            for i in range(args.requests):
                engine.admit(f"{mode}-{i}", prompt, SamplingParams(temperature=0, max_tokens=4), images=[image])
                while engine.has_unfinished():
                    engine.step()
            results[mode].append((engine.encoder_cache.encoded - before, encoder_s[0], time.perf_counter() - start))
    for mode in ("on", "off"):
        encoded = results[mode][0][0]
        enc_s = statistics.median(r[1] for r in results[mode])
        wall = statistics.median(r[2] for r in results[mode])
        print(f"| {mode} | {encoded} | {enc_s:.3f} | {args.requests / enc_s:.1f} | {args.requests / wall:.2f} |")


def message_bytes(png: bytes) -> list[tuple[str, int]]:
    """(hop, bytes) for one image chat to digits-vlm on the default prefill + decode mesh."""
    from pagemesh.common import protocol
    from pagemesh.common.messages import DecodeTask, GenerateRequest, PrefillTask, ScheduleRequest
    from pagemesh.common.model_files import resolve_model_path
    from pagemesh.common.multimodal import IMAGE_MARK, ImageSpec
    from pagemesh.common.sampling import SamplingParams
    from pagemesh.common.tokenizer import Tokenizer
    from pagemesh.services.tokenizer.core import TokenizerCore
    from pagemesh.services.tokenizer.images import ImagePrompts

    folder = resolve_model_path("digits-vlm")
    tokenizer = Tokenizer.from_path(folder)
    core = TokenizerCore(tokenizer, 2048, "ipc:///t", images=ImagePrompts(ImageSpec.from_folder(folder), tokenizer))
    body = (
        '{"model":"digits-vlm","messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":'
        f'"data:image/png;base64,{base64.b64encode(png).decode()}"}}}},'
        '{"type":"text","text":"What digit is this?"}]}]}'
    )
    sampling = SamplingParams(temperature=0, max_tokens=4).validate()
    request = GenerateRequest(
        request_id="r",
        model="m",
        prompt_text=None,
        prompt_token_ids=None,
        messages=[{"role": "user", "content": f"{IMAGE_MARK}\nWhat digit is this?"}],
        sampling=sampling,
        stream=False,
        reply_to="ipc:///g",
        arrival_time=0.0,
        include_stop_str_in_output=False,
        images=[png],
    )
    schedule = core.admit(request)
    assert isinstance(schedule, ScheduleRequest), schedule
    common = dict(request_id="r", prompt_token_ids=schedule.prompt_token_ids, sampling=schedule.sampling, reply_to="t")
    prefill = PrefillTask(**common, decode_worker_id="d", decode_kv_endpoint="ipc:///kv", images=schedule.images)
    decode = DecodeTask(**common, prefill_worker_id="p", images=schedule.images)

    def size(msg) -> int:
        return sum(len(f) for f in protocol.encode(msg))

    return [
        ("client -> gateway: HTTP body (base64 PNG)", len(body)),
        ("gateway -> tokenizer: GenerateRequest", size(request)),
        ("tokenizer -> scheduler: ScheduleRequest", size(schedule)),
        ("scheduler -> prefill worker: PrefillTask", size(prefill)),
        ("scheduler -> decode worker: DecodeTask", size(decode)),
    ]


def bytes_(args) -> None:
    png = _png(3, 256, gray=True)
    print(f"# one image chat to digits-vlm: a {len(png)}-byte 256x256 PNG; load {_load()}")
    print("| hop | bytes |")
    print("| --- | ---: |")
    for hop, n in message_bytes(png):
        print(f"| {hop} | {n} |")
    print("| encoder worker -> prefill worker (with --encoder): 16 rows x 576, bf16 | " + str(16 * 576 * 2) + " |")


def ttft(args) -> None:
    import openai

    from pagemesh.bench.local_mesh import running_mesh

    print(f"# TTFT of image chats, {args.model}, half the requests text only; load {_load()}")
    print("| encoder pool | clients | image TTFT p50 s | image TTFT p90 s | text TTFT p50 s |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for pool in ([], ["--encoder", "1"]):
        with running_mesh("--model", args.model, "--diffusion", "0", *pool) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
            for clients in args.clients:
                image_t, text_t = _drive(client, clients, args.requests)
                p90 = statistics.quantiles(image_t, n=10)[8]
                image_p50, text_p50 = statistics.median(image_t), statistics.median(text_t)
                label = "--encoder 1" if pool else "none"
                print(f"| {label} | {clients} | {image_p50:.3f} | {p90:.3f} | {text_p50:.3f} |")


def _drive(client, clients: int, requests: int) -> tuple[list[float], list[float]]:
    lock, image_t, text_t, next_i = threading.Lock(), [], [], [0]

    def one(i: int) -> None:
        content: list[dict] = [{"type": "text", "text": "What digit is this?"}]
        if i % 2 == 0:
            url = "data:image/png;base64," + base64.b64encode(_png(100 + i, 256, gray=True)).decode()
            content.insert(0, {"type": "image_url", "image_url": {"url": url}})
        start = time.perf_counter()
        stream = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": content}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        first = None
        for _ in stream:
            first = first or time.perf_counter() - start
        with lock:
            (image_t if i % 2 == 0 else text_t).append(first)

    def worker() -> None:
        while True:
            with lock:
                i = next_i[0]
                next_i[0] += 1
            if i >= requests:
                return
            one(i)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return image_t, text_t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("encoder")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    sub.add_parser("bytes")
    p = sub.add_parser("ttft")
    p.add_argument("--model", default="digits-vlm")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 16])
    p.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    {"encoder": encoder, "bytes": bytes_, "ttft": ttft}[args.command](args)


if __name__ == "__main__":
    main()
