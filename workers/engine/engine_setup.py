"""How an engine gets its model: rank 0's shard and pipeline stage loaded from a path (its
shared-memory all-reduce file or its pipe to the next stage made first), the other ranks
started from the same path, and the model's tokenizer."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagemesh.common.model_config import read_model_config
from pagemesh.common.model_files import resolve_model_path
from pagemesh.common.quantization import resolve_quantization
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.kv_quant import calibration_token_ids
from pagemesh.workers.engine.lora_adapters import lora_runner_args
from pagemesh.workers.engine.pipeline_parallel import StagePipe, check_pipeline_parallel, stage_group, stage_layers
from pagemesh.workers.engine.tensor_parallel import (
    COLLECTIVE_TIMEOUT_S,
    FollowerRanks,
    FollowerSpec,
    check_rank_gpus,
    check_tensor_parallel,
    create_shared_all_reduce,
    rank_context,
)
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.loader import load_model


@dataclass
class FirstRank:
    """Rank 0's model (`model_path` None: a model built by the caller, one rank only), the
    config with its quantization resolved, its pipe to the next stage, and the shared-memory
    file of its tensor-parallel all-reduce (removed once every rank has mapped it)."""

    config: EngineConfig
    model_path: Path | None
    model: CausalLM
    pipe: StagePipe | None = None
    shm_path: str | None = None
    shm_numel: int = 0

    def start_followers(self, num_pages: int, tokenizer, device: torch.device) -> FollowerRanks:
        """The other ranks, each loading its shard and stage from the same path."""
        if self.model_path is None:
            raise ValueError("engine: tensor parallel needs a model path (the other ranks load their shards from it)")
        config, model = self.config, self.model
        spec = FollowerSpec(
            self.model_path,
            str(model.dtype).removeprefix("torch."),
            device.type,
            num_pages,
            config.page_size,
            model.tp.world_size,
            threads=torch.get_num_threads(),  # as many as this rank was given
            shm_path=self.shm_path,
            shm_numel=self.shm_numel,
            pipeline_size=config.pipeline_parallel_size,
            quantization=config.quantization,
            kv_cache_dtype=config.kv_cache_dtype,
            batch_invariant=config.batch_invariant,
            expert_parallel=config.enable_expert_parallel,
            lora=lora_runner_args(config),
            kv_calibration_ids=tuple(calibration_token_ids(tokenizer, model.config.vocab_size)),
        )
        return FollowerRanks(spec, model.tp.group)

    def unlink_shared_file(self) -> None:
        if self.shm_path is not None and os.path.exists(self.shm_path):
            os.unlink(self.shm_path)


def load_first_rank(config: EngineConfig, device: torch.device) -> FirstRank:
    """Rank 0's shard of stage 0 of the model at `config.model`, checked against the parallel
    sizes and the GPUs; a GGUF file serves from its own blocks unless `dtype` names one
    (`quantization` auto: common/quantization.py)."""
    model_path = resolve_model_path(config.model)
    config = dataclasses.replace(
        config, quantization=resolve_quantization(config.quantization, config.dtype, model_path)
    )
    tp_size, pp_size = config.tensor_parallel_size, config.pipeline_parallel_size
    model_config = read_model_config(model_path)
    check_tensor_parallel(model_config, tp_size, config.enable_expert_parallel)
    check_pipeline_parallel(model_config, pp_size)
    check_rank_gpus(device, tp_size, pp_size)
    dtype = config.resolve_dtype(device)
    first = FirstRank(config, model_path, None)
    group, layers = None, None
    if pp_size > 1:  # the stages' all-reduces go over gloo: one shared-memory file serves one group
        group = stage_group(0, tp_size) if tp_size > 1 else None
        layers = stage_layers(model_config.num_layers, pp_size, 0)
        first.pipe = StagePipe(0, tp_size, pp_size, model_config, dtype, device, COLLECTIVE_TIMEOUT_S)
    else:
        first.shm_path, first.shm_numel = create_shared_all_reduce(
            tp_size, model_config, config.max_num_batched_tokens, dtype, device
        )
    try:
        tp = rank_context(0, tp_size, first.shm_path, first.shm_numel, dtype, group, config.enable_expert_parallel)
        first.model = load_model(model_path, dtype, device, tp, layers, config.quantization)
    except BaseException:
        first.unlink_shared_file()
        raise
    return first


def model_tokenizer(model_path: Path | None):
    """The model's tokenizer; a folder without tokenizer files serves token ids only."""
    if model_path is None or (model_path.is_dir() and not (model_path / "tokenizer.json").exists()):
        return None
    from pagemesh.common.tokenizer import Tokenizer

    return Tokenizer.from_path(model_path)
