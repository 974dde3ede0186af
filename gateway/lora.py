"""LoRA adapters at the gateway (with `--enable-lora`), in vLLM's shapes:

    a request's `model` naming an adapter   ──▶ SamplingParams.lora, through the whole mesh
    GET  /v1/models                         ──▶ one card per adapter, `parent` the base model
    POST /v1/load_lora_adapter   {"lora_name", "lora_path"}  ──▶ loaded on every LLM worker
    POST /v1/unload_lora_adapter {"lora_name"}               ──▶ unloaded everywhere

The mesh's list of adapters is the scheduler's (services/scheduler/loras.py): every gateway
replica reads it from the scheduler's status, at most ADAPTERS_TTL_S old, and again at once for
a `model` it does not know (an adapter another replica has just loaded). A load or unload is
answered when every LLM worker has done it; one that failed anywhere changed nothing.
"""

from __future__ import annotations

import dataclasses
import time
import uuid

from aiohttp import web

from pagemesh.common.messages import LoRAAdapterRequest, LoRAOp
from pagemesh.common.sampling import MAX_LORA_NAME_LEN
from pagemesh.gateway.errors import ApiError, invalid
from pagemesh.gateway.parsing import ParsedRequest, parse_json

ADAPTERS_TTL_S = 1.0
STATUS_TIMEOUT_S = 1.0
LOAD_TIMEOUT_S = 120.0  # reading and checking an adapter on every worker
_FIELDS = {LoRAOp.LOAD: ("lora_name", "lora_path"), LoRAOp.UNLOAD: ("lora_name",)}


def _not_found(model: str) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


class LoRARoutes:
    """The adapters this gateway knows of, and the routes that change them."""

    def __init__(self, config, mesh, started: int):
        self.config, self.mesh, self.started = config, mesh, started
        self._adapters: dict[str, str] = {}  # name -> folder, as the scheduler last said
        self._read_at = float("-inf")

    async def adapters(self, fresh: bool = False) -> dict[str, str]:
        if not self.config.enable_lora:
            return {}
        if fresh or time.monotonic() - self._read_at > ADAPTERS_TTL_S:
            status = await self.mesh.status(STATUS_TIMEOUT_S)
            if status is not None:
                self._adapters = {a.name: a.path for a in status.lora_adapters}
                self._read_at = time.monotonic()
        return self._adapters

    async def resolve(self, parsed: ParsedRequest) -> ParsedRequest:
        """The request as the mesh runs it: under the adapter its `model` names (SamplingParams.lora),
        or the base model; 404 for a `model` that is neither."""
        model = parsed.model
        if model is None or model in self.config.model_names:
            return parsed
        if model in await self.adapters() or model in await self.adapters(fresh=True):
            return dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, lora=model))
        raise _not_found(model)

    async def cards(self) -> list[dict]:
        return [
            {
                "id": name,
                "object": "model",
                "created": self.started,
                "owned_by": "pagemesh",
                "kind": "lora",
                "root": path,
                "parent": self.config.served_model,
                "max_model_len": self.config.max_model_len,
            }
            for name, path in sorted((await self.adapters()).items())
        ]

    async def load(self, request: web.Request) -> web.Response:
        return await self._change(request, LoRAOp.LOAD)

    async def unload(self, request: web.Request) -> web.Response:
        return await self._change(request, LoRAOp.UNLOAD)

    async def _change(self, request: web.Request, op: LoRAOp) -> web.Response:
        if not self.config.enable_lora:
            raise invalid("LoRA adapters are not served: start the mesh with --enable-lora")
        body = parse_json(await request.read())
        unknown = sorted(set(body) - set(_FIELDS[op]))
        if unknown:
            raise invalid(f"{unknown[0]}: not a field of this route (fields: {', '.join(_FIELDS[op])})", unknown[0])
        name = body.get("lora_name")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_LORA_NAME_LEN:
            raise invalid(f"lora_name: must be a string of 1 to {MAX_LORA_NAME_LEN} characters", "lora_name")
        if name in self.config.model_names:
            raise invalid(f"lora_name: {name!r} is the base model's name", "lora_name")
        path = body.get("lora_path", "")
        if op is LoRAOp.LOAD and (not isinstance(path, str) or not path):
            raise invalid("lora_path: must be the path of a peft adapter folder on the workers' hosts", "lora_path")
        op_id = f"lora-{uuid.uuid4().hex}"
        msg = LoRAAdapterRequest(requester=self.mesh.identity, op_id=op_id, op=op, name=name, path=path)
        reply = await self.mesh.lora_op(msg, LOAD_TIMEOUT_S)
        if reply is None:
            raise ApiError(503, "Service unavailable: the scheduler did not answer; retry later.", "server_error")
        await self.adapters(fresh=True)
        if reply.status != 200:
            kind = "server_error" if reply.status >= 500 else "invalid_request_error"
            code = "model_not_found" if reply.status == 404 else None
            raise ApiError(reply.status, reply.message, kind, "lora_path" if op is LoRAOp.LOAD else "lora_name", code)
        return web.Response(text=reply.message)
