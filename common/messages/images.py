"""The image channel: gateway ⇄ scheduler ⇄ diffusion workers.

    gateway   ──ImageRequest──▶ scheduler ──ImageTask──▶ diffusion worker
    gateway   ◀──ImageResult / RequestFailed── diffusion worker (to the request's `reply_to`)
    gateway   ◀──RequestFailed── scheduler (refused: no worker, unknown model, queue full)
    gateway   ──AbortRequest──▶ scheduler ──AbortRequest──▶ diffusion worker (client gone)

No tokenizer is on this path: a diffusion model conditions on its own prompt encoding (the
embedded digits model maps the prompt to a class; a text-to-image folder has its text encoder),
so the worker checks what only it can know (sizes, what the prompt must say) and answers 400s
itself. Images travel as base64 PNG text, which is what the OpenAI response carries.
"""

from __future__ import annotations

from pagemesh.common.messages.base import ProtocolError, message, record

MAX_IMAGES = 10  # n per request (OpenAI's bound)
MAX_SIDE = 4096  # pixels, a coarse bound; each model says which sizes it makes


@record
class ImageParams:
    """What a client asked for, with the gateway's shape checks done. None: the model's default."""

    prompt: str
    negative_prompt: str | None
    n: int
    width: int | None
    height: int | None
    num_inference_steps: int | None
    guidance_scale: float | None
    sampler: str | None
    seed: int | None
    cache: str | None = None  # a feature-cache policy, "<policy>[:<value>]" (the worker checks it)

    def _check(self) -> None:
        if not 1 <= self.n <= MAX_IMAGES:
            raise ProtocolError(f"ImageParams.n: must be in [1, {MAX_IMAGES}]")
        for name in ("width", "height"):
            side = getattr(self, name)
            if side is not None and not 1 <= side <= MAX_SIDE:
                raise ProtocolError(f"ImageParams.{name}: must be in [1, {MAX_SIDE}]")
        if self.num_inference_steps is not None and self.num_inference_steps < 1:
            raise ProtocolError("ImageParams.num_inference_steps: must be >= 1")


@record
class ImageModelInfo:
    """What a diffusion worker serves, as it registers (and the gateway lists in /v1/models)."""

    sizes: list[str]  # "WxH", the first is the default
    samplers: list[str]
    default_sampler: str
    default_steps: int
    max_steps: int
    conditioning: str  # what a prompt must say, in words (shown in 400s)


@record
class FeatureCacheLoad:
    """A diffusion worker's feature caches, in each heartbeat (and the scheduler's status): what
    the running requests' caches hold now, the most they held together, and the budget."""

    bytes: int
    peak_bytes: int
    budget_bytes: int

    def _check(self) -> None:
        if min(self.bytes, self.peak_bytes, self.budget_bytes) < 0:
            raise ProtocolError("FeatureCacheLoad: byte counts must be >= 0")


@message
class ImageRequest:
    """Gateway -> scheduler: an image request to place on a diffusion worker. `model` None:
    the mesh's image model (the only one, or the first registered)."""

    request_id: str
    model: str | None
    params: ImageParams
    reply_to: str  # the gateway's reply address
    arrival_time: float


@message
class ImageTask:
    """Scheduler -> diffusion worker."""

    request_id: str
    params: ImageParams
    reply_to: str
    queued_s: float = 0.0  # time the request waited in the scheduler


@message
class ImageResult:
    """Diffusion worker -> gateway: the request's images, in order, as base64 PNG."""

    request_id: str
    images: list[str]
    width: int
    height: int
    native_width: int  # the model's own resolution (images are upscaled nearest-neighbour to `width`)
    native_height: int
    steps: int  # denoising steps run per image
    sampler: str
    seed: int
    queued_s: float  # scheduler + worker queue
    compute_s: float  # from the first denoising step to the last image encoded
    batched_with: int  # the most other requests that shared one of its forwards
    cache: str = "none"  # the feature-cache policy it ran with, "<policy>[:<value>]"
    cache_over_budget: bool = False  # it asked for a cache the worker's cache budget could not hold: ran uncached
    blocks_computed: int = 0  # transformer-block evaluations, over its rows (CFG's too) and steps
    blocks_skipped: int = 0  # those its feature cache answered from a cached residual
