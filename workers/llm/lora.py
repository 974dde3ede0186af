"""An LLM worker's LoRA adapters as the mesh sees them: the scheduler's load and unload tasks,
run between steps, and the adapters its heartbeat reports (workers/engine/lora_adapters.py holds them)."""

from __future__ import annotations

from pagemesh.common.lora import AdapterError
from pagemesh.common.messages import LoRAAdapterDone, LoRAAdapterTask, LoRALoad, LoRAOp
from pagemesh.workers.engine.engine import Engine


def run_adapter_task(engine: Engine, worker_id: str, task: LoRAAdapterTask) -> LoRAAdapterDone:
    """Load or unload one adapter; how it went, with the HTTP status a client gets (200, 400,
    404). A load that fails changes nothing: the engine checks the adapter whole first."""

    def done(status: int, message: str = "") -> LoRAAdapterDone:
        return LoRAAdapterDone(worker_id=worker_id, op_id=task.op_id, status=status, message=message)

    adapters = engine.adapters
    if adapters is None:
        return done(400, "LoRA adapters are not served: start the mesh with --enable-lora")
    try:
        if task.op is LoRAOp.LOAD:
            if task.name in adapters.specs and adapters.specs[task.name].path == _resolved(task.path):
                return done(200)  # (a sync of what it has already)
            adapters.add(task.name, task.path)
        else:
            adapters.remove(task.name)
    except AdapterError as e:
        return done(404 if e.missing else 400, str(e))
    except ValueError as e:  # unloading one that running requests use
        return done(400, str(e))
    return done(200)


def lora_load(engine: Engine) -> LoRALoad | None:
    adapters = engine.adapters
    if adapters is None:
        return None
    slots, sched = adapters.slots, engine.scheduler
    return LoRALoad(
        known=sorted(adapters.specs),
        in_slots=slots.in_slots(),
        running=sorted({s.lora for s in sched.running if s.lora is not None}),
        waiting=sorted({s.lora for s in sched.waiting if s.lora is not None}),
        max_loras=slots.max_loras,
        loads=slots.loads,
        evictions=slots.evictions,
    )


def _resolved(path: str) -> str:
    from pathlib import Path

    return str(Path(path).resolve())
