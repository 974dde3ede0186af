"""The mesh's LoRA adapters, as the scheduler keeps them. Pure Python.

    --lora-modules (the mesh's start) ──┐
    LoRAAdapterRequest (a gateway)  ────┴─▶ adapters {name: folder} ──sync──▶ every LLM worker

A load or an unload is one operation over every live LLM worker: a LoRAAdapterTask to each, and
one LoRAAdapterReply to the gateway once all have answered (or left). It takes effect in the
mesh's list only if every worker did it; a load that failed somewhere is undone where it
succeeded, so that a client's 400 means the mesh serves nothing new. Workers that register
later, or restart, are brought to the list by their heartbeats (`sync`): each reports the
adapters it knows, and the scheduler loads what it lacks and unloads what the mesh dropped.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagemesh.common.messages import (
    LoRAAdapter,
    LoRAAdapterDone,
    LoRAAdapterReply,
    LoRAAdapterRequest,
    LoRAAdapterTask,
    LoRAOp,
)

Outputs = list[tuple[bytes | str, object]]


@dataclass
class _Op:
    requester: bytes | None  # the gateway's identity; None: a sync or an undo (nobody waits)
    op_id: str
    op: LoRAOp
    name: str
    path: str
    waiting: set[str]
    succeeded: list[str] = field(default_factory=list)
    failure: tuple[int, str] | None = None


class MeshAdapters:
    """`request` starts an operation, `done` and `worker_gone` finish it, `sync` keeps a worker
    in step; each returns what to send, as (destination, message) pairs."""

    def __init__(self, modules: tuple[tuple[str, str], ...] = ()):
        self.adapters: dict[str, str] = dict(modules)
        self.ops: dict[str, _Op] = {}
        self._ids = itertools.count()

    def listed(self) -> list[LoRAAdapter]:
        return [LoRAAdapter(name=n, path=p) for n, p in sorted(self.adapters.items())]

    def serves(self, name: str) -> bool:
        return name in self.adapters

    def _busy(self, name: str, worker_id: str | None = None) -> bool:
        return any(op.name == name and (worker_id is None or worker_id in op.waiting) for op in self.ops.values())

    def request(self, identity: bytes, msg: LoRAAdapterRequest, workers: list[str]) -> Outputs:
        def reply(status: int, text: str) -> Outputs:
            return [(identity, LoRAAdapterReply(op_id=msg.op_id, status=status, message=text))]

        if msg.op is LoRAOp.LOAD and msg.name in self.adapters:
            return reply(400, f"The lora adapter '{msg.name}' has already been loaded.")
        if msg.op is LoRAOp.UNLOAD and msg.name not in self.adapters:
            return reply(404, f"The lora adapter '{msg.name}' cannot be found.")
        if self._busy(msg.name):
            return reply(409, f"The lora adapter '{msg.name}' is being loaded or unloaded; retry later.")
        if not workers:
            return reply(503, "Service unavailable: no LLM worker is up to load the adapter; retry later.")
        op = _Op(identity, msg.op_id, msg.op, msg.name, msg.path, set(workers))
        return self._start(op)

    def _start(self, op: _Op) -> Outputs:
        self.ops[op.op_id] = op
        task = LoRAAdapterTask(op_id=op.op_id, op=op.op, name=op.name, path=op.path)
        return [(w, task) for w in sorted(op.waiting)]

    def done(self, msg: LoRAAdapterDone) -> Outputs:
        op = self.ops.get(msg.op_id)
        if op is None or msg.worker_id not in op.waiting:
            return []  # a late answer to an operation already decided
        op.waiting.discard(msg.worker_id)
        if msg.status == 200:
            op.succeeded.append(msg.worker_id)
        elif op.failure is None:
            op.failure = (msg.status, msg.message or f"worker {msg.worker_id} could not {op.op} the adapter")
        return self._finish(op) if not op.waiting else []

    def worker_gone(self, worker_id: str) -> Outputs:
        out: Outputs = []
        for op in list(self.ops.values()):
            if worker_id in op.waiting:
                op.waiting.discard(worker_id)
                if not op.waiting:
                    out += self._finish(op)
        return out

    def _finish(self, op: _Op) -> Outputs:
        del self.ops[op.op_id]
        out: Outputs = []
        if op.requester is None:
            return out
        if op.failure is None:
            if op.op is LoRAOp.LOAD:
                self.adapters[op.name] = op.path
                text = f"Success: LoRA adapter '{op.name}' added successfully."
            else:
                self.adapters.pop(op.name, None)
                text = f"Success: LoRA adapter '{op.name}' removed successfully."
            return [(op.requester, LoRAAdapterReply(op_id=op.op_id, status=200, message=text))]
        status, text = op.failure
        if op.op is LoRAOp.LOAD and op.succeeded:  # nothing new is served: undo it where it went
            undo = _Op(None, self._new_id("undo"), LoRAOp.UNLOAD, op.name, "", set(op.succeeded))
            out += self._start(undo)
        # an unload that failed somewhere (a worker runs requests under it) keeps the adapter in the
        # list: `sync` loads it again on the workers that dropped it
        return out + [(op.requester, LoRAAdapterReply(op_id=op.op_id, status=status, message=text))]

    def sync(self, worker_id: str, known: list[str]) -> Outputs:
        """A heartbeat's list of the adapters a worker knows: load what it lacks, unload what the
        mesh no longer serves (not while an operation on that adapter is under way)."""
        out: Outputs = []
        have = set(known)
        for name, path in sorted(self.adapters.items()):
            if name not in have and not self._busy(name):
                out += self._start(_Op(None, self._new_id("sync"), LoRAOp.LOAD, name, path, {worker_id}))
        for name in sorted(have - set(self.adapters)):
            if not self._busy(name):
                out += self._start(_Op(None, self._new_id("sync"), LoRAOp.UNLOAD, name, "", {worker_id}))
        return out

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{next(self._ids)}"
