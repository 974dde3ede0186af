"""The tensor-parallel ranks of one LLM worker: rank 0 plans and samples, the others follow.

    rank 0: the worker process (shell, engine, scheduler, sampler)
      │  Engine.step → ModelRunner.execute(step) → FollowerRanks.send_step(step)
      │  msgpack(ModelInput), length-prefixed, down each follower's stdin pipe
      ▼
    rank 1 .. N-1: `python -m pagemesh.workers.engine.rank` (children of rank 0)
         read a step → ModelRunner.execute (the same page moves, the same forward) → no logits

    every rank: its shard of the weights (query and KV heads, MLP columns / rows) and a KV pool
    of its own KV heads; inside each layer two all-reduces (after o_proj and down_proj) over
    torch.distributed (gloo on a CPU, NCCL on CUDA), with a timeout: a rank gone mid-step makes
    the others raise, never wait forever.

With M pipeline stages (`--pipeline-parallel-size`) the followers are ranks 1 .. N×M-1, each
stage N ranks of its own layers: workers/engine/pipeline_parallel.py.

Why a pipe, not a broadcast, for the step: a follower waits for the next step as long as the
worker is idle (minutes, days), which no collective timeout allows; and the pipe's end of file
tells a follower at once that rank 0 is gone. Liveness both ways: rank 0 watches each follower
process (a thread per follower), and one that exits takes the whole worker down (the followers
are killed, rank 0 exits, the scheduler drops the worker and fails its requests); a follower
exits when its stdin closes or its parent changes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import struct
import subprocess
import tempfile
import threading
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

import torch

from pagemesh.common.cpu_threads import usable_cores
from pagemesh.common.gpus import rank_gpus, visible_gpu_ids
from pagemesh.common.model_config import ModelConfig
from pagemesh.common.python_command import python_module
from pagemesh.workers.engine.model_input import ModelInput, decode_model_input, encode_model_input
from pagemesh.workers.engine.pipeline_parallel import join_stage_groups
from pagemesh.workers.model.layers import ParallelContext, StageGroup
from pagemesh.workers.model.shm_allreduce import SharedMemoryAllReduce, create_file, shared_memory_supported

# Steps of up to this many tokens all-reduce through shared memory, longer ones over gloo: at 512
# tokens shared memory was 4-9x faster here, at 2048 level with gloo (bench/tp_allreduce.py).
SHARED_ALL_REDUCE_MAX_TOKENS = 1024
COLLECTIVE_TIMEOUT_S = 300.0  # bounds a hang inside a step (or the start), sized for a loaded machine
_LENGTH = struct.Struct("<Q")

log = logging.getLogger(__name__)  # stdlib: the engine imports no structlog (a GPU machine has none)


def check_tensor_parallel(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> None:
    """Raise ValueError, naming the sizes, unless `size` ranks can split this model evenly (a
    mixture of experts: each expert's intermediate size, or with `expert_parallel` the experts)."""
    if size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {size}")
    parts = {
        "query heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
    }
    if cfg.moe is None or cfg.moe.dense_layers:
        parts["MLP intermediate size"] = cfg.intermediate_size
    if cfg.moe is not None and expert_parallel:
        parts["experts"] = cfg.moe.num_experts
    elif cfg.moe is not None:
        parts["expert intermediate size"] = cfg.moe.intermediate_size
    bad = [f"{n} {name}" for name, n in parts.items() if n % size]
    if bad:
        raise ValueError(
            f"tensor-parallel size {size} does not divide the model's {' and '.join(bad)} "
            f"(it has {cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads)"
        )


def rank_gpu_names(tp: int, pp: int) -> list[str]:
    """On CUDA: rank i -> the GPU its process runs on, named as CUDA_VISIBLE_DEVICES names it: the
    i-th this worker sees (`pagemesh up` gives a worker tp x pp of its own). ValueError, naming
    the numbers, when it sees fewer (NCCL refuses two ranks on one GPU)."""
    return rank_gpus(visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count()), tp, pp)


def check_rank_gpus(device: torch.device, tp: int, pp: int) -> None:
    """Before anything loads: a worker of tp x pp ranks on CUDA sees a GPU for each."""
    if device.type == "cuda" and tp * pp > 1:
        rank_gpu_names(tp, pp)


def threads_per_rank(world_size: int, worker_threads: int | None = None) -> int:
    """Torch (and OpenMP) threads for each rank: the worker's threads (default: the host's
    cores) shared out, at least one."""
    return max(1, (worker_threads or usable_cores()) // world_size)


def init_group(rank: int, world_size: int, init_method: str, device_type: str) -> None:
    """Join the worker's process group (the default group: the model's all-reduces use it)."""
    import torch.distributed as dist

    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )


def rank_context(
    rank: int,
    world_size: int,
    shm_path: str | None,
    shm_numel: int,
    dtype: torch.dtype,
    group: StageGroup | None = None,
    expert_parallel: bool = False,
) -> ParallelContext:
    """A rank's ParallelContext (`rank` of `world_size`: within its pipeline stage): all-reduces
    through the shared-memory file where there is one, else over the stage's `group` (None: the
    default group); `expert_parallel`: MoE experts whole on ranks (`--enable-expert-parallel`)."""
    shared = None
    if shm_path is not None:
        shared = SharedMemoryAllReduce(shm_path, rank, world_size, shm_numel, dtype, COLLECTIVE_TIMEOUT_S)
    return ParallelContext(rank, world_size, shared, group, expert_parallel)


def create_shared_all_reduce(
    world_size: int, cfg: ModelConfig, max_tokens: int, dtype: torch.dtype, device: torch.device
) -> tuple[str | None, int]:
    """Rank 0, before anything else: the shared-memory file of the group's all-reduces, sized
    for a step of `max_tokens`, at most SHARED_ALL_REDUCE_MAX_TOKENS: (path, elements per slot);
    (None, 0) where gloo must do (not an x86 CPU). `FollowerRanks` unlinks the file once every
    rank has mapped it."""
    if world_size == 1 or not shared_memory_supported(device):
        return None, 0
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(folder, f"pagemesh-tp-{os.getpid()}-{os.urandom(4).hex()}")
    numel = min(max_tokens, SHARED_ALL_REDUCE_MAX_TOKENS) * cfg.hidden_size
    create_file(path, world_size, numel, dtype)
    return path, numel


def write_step(pipe: BinaryIO, step: ModelInput) -> None:
    write_frame(pipe, encode_model_input(step))


def write_frame(pipe: BinaryIO, data: bytes) -> None:
    """One length-prefixed frame down a follower's pipe: a step, or a KV page command
    (workers/engine/kv_relay.py)."""
    pipe.write(_LENGTH.pack(len(data)) + data)
    pipe.flush()


def read_frame(pipe: BinaryIO) -> bytes | None:
    """The next frame's bytes, or None at end of file (rank 0 closed the pipe or is gone)."""
    head = pipe.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        return None
    (length,) = _LENGTH.unpack(head)
    data = pipe.read(length)
    if len(data) < length:
        return None
    return data


def read_step(pipe: BinaryIO) -> ModelInput | None:
    """The next step, or None at end of file (rank 0 closed the pipe or is gone)."""
    data = read_frame(pipe)
    return None if data is None else decode_model_input(data)


@dataclasses.dataclass(frozen=True)
class FollowerSpec:
    """What a follower rank needs to build the same runner as rank 0 (shard aside)."""

    model_path: Path
    dtype: str  # a torch dtype's name
    device: str  # cpu | cuda
    num_pages: int
    page_size: int
    world_size: int
    threads: int | None = None
    shm_path: str | None = None  # the shared-memory all-reduce's file (None: gloo only)
    shm_numel: int = 0
    pipeline_size: int = 1  # stages (workers/engine/pipeline_parallel.py); world_size ranks each
    quantization: str = "none"  # the linears' (workers/model/quantization.py): each rank its shard
    kv_cache_dtype: str = "auto"  # an fp8 pool: every rank calibrates its heads' scales, together
    batch_invariant: bool = False  # --batch-invariant: every rank's linears and attention row-invariant
    expert_parallel: bool = False  # --enable-expert-parallel: MoE experts whole on ranks
    kv_calibration_ids: tuple[int, ...] = ()  # the calibration pass's tokens (rank 0's tokenizer's)
    lora: tuple[int, int, int] | None = None  # LoRA slots: (max_loras, max_rank, max_cpu_loras), each rank its shard

    @property
    def total_ranks(self) -> int:
        return self.world_size * self.pipeline_size


class FollowerRanks:
    """Rank 0's side: starts ranks 1..N×M-1 (N tensor-parallel ranks in each of M pipeline
    stages), joins their process group (and `stage_group`, rank 0's stage's tensor-parallel
    group, where there are several stages of several ranks), sends them every step, and takes
    the worker down if one of them exits."""

    def __init__(self, spec: FollowerSpec, stage_group: StageGroup | None = None):
        self.spec = spec
        self.closing = False
        gpus = rank_gpu_names(spec.world_size, spec.pipeline_size) if spec.device == "cuda" else None
        self.rendezvous = tempfile.mkdtemp(prefix="pagemesh-tp-")
        init_method = "file://" + os.path.join(self.rendezvous, "group")
        self.procs: list[subprocess.Popen] = []
        for rank in range(1, spec.total_ranks):
            self.procs.append(self._start(rank, init_method, gpus[rank] if gpus else None))
        for rank, proc in enumerate(self.procs, start=1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"tp-rank-{rank}").start()
        try:
            init_group(0, spec.total_ranks, init_method, spec.device)  # every rank has mapped the file
            join_stage_groups(0, spec.world_size, spec.pipeline_size, stage_group)
        finally:
            # (the rendezvous file stays until close(): ranks still read it after the group is up)
            if spec.shm_path is not None and os.path.exists(spec.shm_path):
                os.unlink(spec.shm_path)
        log.info(
            "worker ranks up: tp %d x pp %d, followers %s",
            spec.world_size,
            spec.pipeline_size,
            [p.pid for p in self.procs],
        )

    def _start(self, rank: int, init_method: str, gpu: str | None) -> subprocess.Popen:
        """Rank `rank`'s process; on CUDA it sees only `gpu` (its cuda:0)."""
        s = self.spec
        argv = [
            *python_module("pagemesh.workers.engine.rank"),
            f"--rank={rank}",
            f"--world-size={s.world_size}",
            f"--init-method={init_method}",
            f"--model={s.model_path}",
            f"--dtype={s.dtype}",
            f"--device={s.device}",
            f"--num-pages={s.num_pages}",
            f"--page-size={s.page_size}",
            f"--threads={s.threads or threads_per_rank(s.total_ranks)}",
            f"--pipeline-size={s.pipeline_size}",
        ]
        if s.shm_path is not None:
            argv += [f"--shm-path={s.shm_path}", f"--shm-numel={s.shm_numel}"]
        argv += [f"--quantization={s.quantization}", f"--kv-cache-dtype={s.kv_cache_dtype}"]
        if s.expert_parallel:
            argv.append("--enable-expert-parallel")
        if s.batch_invariant:
            argv.append("--batch-invariant")
        if s.kv_calibration_ids:
            argv.append("--kv-calibration-ids=" + ",".join(map(str, s.kv_calibration_ids)))
        if s.lora is not None:
            argv.append("--lora=" + ",".join(map(str, s.lora)))
        env = dict(os.environ)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        return subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if self.closing:
            return
        # A rank is gone: the worker cannot run another step (its collectives would fail or
        # wait), so it goes down as a whole and the scheduler fails and drops what it held.
        log.error("tensor-parallel rank %d (pid %d) exited with %s: stopping the worker", rank, proc.pid, code)
        self.closing = True
        for other in self.procs:  # at once: they wait in an all-reduce, not on their pipe
            if other.poll() is None:
                other.kill()
        shutil.rmtree(self.rendezvous, ignore_errors=True)
        os._exit(1)

    def send_step(self, step: ModelInput) -> None:
        self.send_frame(encode_model_input(step))

    def send_frame(self, data: bytes) -> None:
        """The same frame to every follower (a step, or a KV page command)."""
        for proc in self.procs:
            try:
                write_frame(proc.stdin, data)
            except (BrokenPipeError, ValueError):  # that rank is gone: its watcher stops the worker
                pass

    def close(self) -> None:
        """Stop the followers (their stdin closes; they exit), killing any that linger."""
        self.closing = True
        for proc in self.procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.rendezvous, ignore_errors=True)


def follower_step(step: ModelInput, computes_logits: bool = False) -> ModelInput:
    """A follower's copy of the step: the same tokens and page moves, but no logit rows (only
    rank 0 samples, so the others skip the LM head), unless it `computes_logits` for rank 0
    (the last pipeline stage's tp rank 0: `StagePipe.sends_logits`), and no pooling (rank 0 has
    every hidden state after the final norm: the all-reduces left the whole of it on each rank)."""
    if computes_logits:
        return dataclasses.replace(step, pool_spans=[])
    return dataclasses.replace(step, sample_rows=[], prompt_logprob_rows=[], pool_spans=[])
