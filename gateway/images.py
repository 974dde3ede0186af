"""`POST /v1/images/generations`: OpenAI's images API, served by the mesh's diffusion workers.

    body ──parse_image_request (shape checks: a 400 names the field)──▶ ImageRequest ──▶ scheduler
    ◀── ImageResult (base64 PNG per image) or RequestFailed (the worker's 400: size, prompt;
        the scheduler's 404 unknown model, 503 no worker / queue full; a worker lost: 503)

What only the model knows (its sizes, what a prompt must say, its step limit) the diffusion
worker checks; the gateway checks the shape of each field. Extras beyond OpenAI's fields are
those vLLM-Omni and SGLang users pass (`extra_body`): seed, num_inference_steps,
guidance_scale, negative_prompt, sampler; and pagemesh's `cache` (a feature-cache policy).
Unknown fields are ignored, as OpenAI's are.
"""

from __future__ import annotations

import re
from typing import Any

from pagemesh.common.messages import MAX_IMAGES, ImageParams, ImageResult
from pagemesh.gateway.errors import invalid

SAMPLERS = ("ddpm", "ddim", "dpmsolver++", "unipc", "euler", "lcm")  # a model offers some (its 400 names them)
MAX_PROMPT_CHARS = 4000  # as OpenAI's DALL·E 3
MAX_STEPS = 10_000  # a coarse bound; each model has its own (its 400 names it)
MAX_GUIDANCE = 100.0
MAX_SEED = (1 << 63) - 1
_SIZE = re.compile(r"^([1-9][0-9]{0,4})x([1-9][0-9]{0,4})$")


def parse_image_request(body: dict) -> tuple[str | None, ImageParams]:
    """(model or None, the request's parameters); raises a 400 ApiError for a bad field."""
    prompt = _text(body, "prompt", required=True)
    negative = _text(body, "negative_prompt", required=False)
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid("model: must be a non-empty string", "model")
    n = _int(body, "n", 1, 1, MAX_IMAGES)
    if body.get("response_format") not in (None, "b64_json"):
        raise invalid(
            "response_format: only 'b64_json' is supported (this server keeps no image URLs)", "response_format"
        )
    if body.get("output_format") not in (None, "png"):
        raise invalid("output_format: only 'png' is supported", "output_format")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid("user: must be a string", "user")
    width, height = _size(body.get("size"))
    sampler = body.get("sampler")
    if sampler is not None and sampler not in SAMPLERS:
        raise invalid(f"sampler: must be one of {', '.join(SAMPLERS)}", "sampler")
    guidance = body.get("guidance_scale")
    if guidance is not None:
        if isinstance(guidance, bool) or not isinstance(guidance, int | float) or not 0 <= guidance <= MAX_GUIDANCE:
            raise invalid(f"guidance_scale: must be a number in [0, {MAX_GUIDANCE:g}]", "guidance_scale")
        guidance = float(guidance)
    return model, ImageParams(
        prompt=prompt,
        negative_prompt=negative,
        n=n,
        width=width,
        height=height,
        num_inference_steps=_int(body, "num_inference_steps", None, 1, MAX_STEPS),
        guidance_scale=guidance,
        sampler=sampler,
        seed=_int(body, "seed", None, 0, MAX_SEED),
        cache=_cache(body.get("cache")),
    )


def image_response(result: ImageResult, created: int) -> dict[str, Any]:
    """OpenAI's ImagesResponse, with what pagemesh did in `usage`."""
    return {
        "created": created,
        "data": [{"b64_json": image} for image in result.images],
        "size": f"{result.width}x{result.height}",
        "output_format": "png",
        "usage": {
            "input_tokens": 0,
            "output_tokens": 0,
            "total_tokens": 0,
            "images": len(result.images),
            "num_inference_steps": result.steps,
            "sampler": result.sampler,
            "seed": result.seed,
            "native_size": f"{result.native_width}x{result.native_height}",
            "queue_time_s": round(result.queued_s, 6),
            "compute_time_s": round(result.compute_s, 6),
            "batched_with": result.batched_with,
            "cache": result.cache,
            "cache_over_budget": result.cache_over_budget,
            "blocks_computed": result.blocks_computed,
            "blocks_skipped": result.blocks_skipped,
        },
    }


def _text(body: dict, name: str, required: bool) -> str | None:
    value = body.get(name)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value.strip():
        raise invalid(f"{name}: must be a non-empty string", name)
    if len(value) > MAX_PROMPT_CHARS:
        raise invalid(f"{name}: longer than {MAX_PROMPT_CHARS} characters ({len(value)})", name)
    return value


def _int(body: dict, name: str, default: int | None, low: int, high: int) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise invalid(f"{name}: must be an integer in [{low}, {high}]", name)
    return value


def _cache(value: Any) -> str | None:
    """A feature-cache policy, e.g. "none", "interval:3", "fbcache:0.08", "teacache:0.3"; the
    worker knows the policies and says what it accepts."""
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= 64:
        raise invalid("cache: must be a policy name with an optional ':value', e.g. 'fbcache:0.08'", "cache")
    return value


def _size(value: Any) -> tuple[int | None, int | None]:
    """'WxH' -> (W, H); absent or 'auto' -> the model's default size."""
    if value is None or value == "auto":
        return None, None
    match = _SIZE.match(value) if isinstance(value, str) else None
    if match is None:
        raise invalid("size: must be 'WIDTHxHEIGHT' (e.g. '256x256') or 'auto'", "size")
    width, height = int(match.group(1)), int(match.group(2))
    if max(width, height) > 4096:
        raise invalid("size: at most 4096 pixels a side", "size")
    return width, height
