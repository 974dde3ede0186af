"""`/v1/models` and `/v1/models/{model}`: the LLM, its LoRA adapters (gateway/lora.py), the image
models the live diffusion workers serve and the speech-to-text models the live audio workers serve,
as OpenAI's model cards (with pagemesh's `kind`)."""

from __future__ import annotations

from aiohttp import web

from pagemesh.common.messages import WorkerKind
from pagemesh.gateway.errors import ApiError

STATUS_TIMEOUT_S = 1.0


class ModelRoutes:
    def __init__(self, config, mesh, loras, started: int):
        self.config, self.mesh, self.loras, self.started = config, mesh, loras, started

    async def list(self, request: web.Request) -> web.Response:
        cards = [self._llm_card(), *await self.loras.cards(), *await self._worker_cards()]
        return web.json_response({"object": "list", "data": cards})

    async def one(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name in self.config.model_names:
            return web.json_response(self._llm_card())
        for card in [*await self.loras.cards(), *await self._worker_cards()]:
            if card["id"] == name:
                return web.json_response(card)
        raise ApiError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")

    def _llm_card(self) -> dict:
        return {
            "id": self.config.served_model,
            "object": "model",
            "created": self.started,
            "owned_by": "pagemesh",
            "kind": "llm",
            "max_model_len": self.config.max_model_len,
        }

    async def _worker_cards(self) -> list[dict]:
        """The image and audio models live workers serve (none if the scheduler does not answer)."""
        status = await self.mesh.status(STATUS_TIMEOUT_S)
        cards: dict[str, dict] = {}
        for w in status.workers if status is not None else ():
            if w.alive and w.kind == WorkerKind.AUDIO and w.model not in cards:
                cards[w.model] = {
                    "id": w.model,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "pagemesh",
                    "kind": "audio",
                }
            if w.alive and w.images is not None and w.model not in cards:
                cards[w.model] = {
                    "id": w.model,
                    "object": "model",
                    "created": self.started,
                    "owned_by": "pagemesh",
                    "kind": "diffusion",
                    "sizes": w.images.sizes,
                    "samplers": w.images.samplers,
                    "default_sampler": w.images.default_sampler,
                    "default_steps": w.images.default_steps,
                    "max_steps": w.images.max_steps,
                    "conditioning": w.images.conditioning,
                }
        return list(cards.values())
