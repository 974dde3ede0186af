"""The parts of a pipeline-parallel worker that need no second process: how the layers split
into stages, the check of the sizes, which tensors a stage loads, and the flags."""

from __future__ import annotations

import pytest
import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.workers.engine.pipeline_parallel import check_pipeline_parallel, stage_group, stage_layers
from pagemesh.workers.model.llama import LlamaForCausalLM


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        architecture="llama",
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_layers=5,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.mark.parametrize(
    ("layers", "stages", "want"),
    [
        (2, 2, [range(0, 1), range(1, 2)]),
        (30, 2, [range(0, 15), range(15, 30)]),
        (30, 4, [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]),
        (5, 5, [range(i, i + 1) for i in range(5)]),
        (7, 1, [range(0, 7)]),
    ],
)
def test_stages_are_contiguous_as_even_as_can_be_the_first_ones_longer(layers, stages, want):
    assert [stage_layers(layers, stages, s) for s in range(stages)] == want


def test_a_stage_group_is_its_stages_tensor_parallel_ranks():
    assert stage_group(0, 2).ranks == (0, 1)
    assert stage_group(1, 2).ranks == (2, 3)
    assert stage_group(2, 1).ranks == (2,)
    assert stage_group(1, 3).group is None  # joined only once the worker's process group is up


def test_more_stages_than_layers_is_refused_naming_the_sizes():
    check_pipeline_parallel(tiny_config(), 5)
    with pytest.raises(ValueError, match=r"pipeline-parallel size 6 is more stages than the model's 5 layers"):
        check_pipeline_parallel(tiny_config(), 6)
    with pytest.raises(ValueError, match=r"must be >= 1, got 0"):
        check_pipeline_parallel(tiny_config(), 0)


@pytest.mark.parametrize("tied", [True, False])
def test_a_stage_holds_its_layers_and_loads_only_its_tensors(tied):
    cfg = tiny_config(tie_word_embeddings=tied)
    whole = LlamaForCausalLM(cfg)
    first, middle, last = (LlamaForCausalLM(cfg, layers=r) for r in (range(0, 2), range(2, 3), range(3, 5)))
    assert (len(first.layers), len(middle.layers), len(last.layers)) == (2, 1, 2)
    assert first.embed_tokens is not None and first.norm is None and first.lm_head is None
    assert middle.embed_tokens is None and middle.norm is None and middle.lm_head is None
    assert last.embed_tokens is None and last.norm is not None and last.lm_head is not None
    # the stage's layers read the stage's own KV pool from layer 0
    assert [layer.self_attn.layer_index for layer in last.layers] == [0, 1]
    names = whole._expected_names()
    assert first._expected_names() | middle._expected_names() | last._expected_names() == names
    assert all(".layers.2." in n for n in middle._expected_names())
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert head in last._expected_names() and "model.norm.weight" in last._expected_names()
    # a checkpoint streams every tensor to every stage: the others' are skipped, the tied
    # embedding fills the last stage's head
    weights = {n: torch.full(p.shape, float(i)) for i, (n, p) in enumerate(_hf_shapes(whole))}
    last.load_weights(weights.items())
    torch.testing.assert_close(last.lm_head.weight, weights[head])
    with pytest.raises(ValueError, match="unexpected tensor model.layers.9.mlp.up_proj.weight"):
        last.load_weights([("model.layers.9.mlp.up_proj.weight", torch.zeros(1))])


def _hf_shapes(model: LlamaForCausalLM):
    """(Hugging Face name, a tensor of its shape) for every tensor of a whole model's checkpoint."""
    cfg = model.config
    h, kv = cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim
    shapes = {
        "model.embed_tokens.weight": (cfg.vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (cfg.num_heads * cfg.head_dim, h)}
        shapes |= {p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.v_proj.weight": (kv, h)}
        shapes |= {p + "self_attn.o_proj.weight": (h, cfg.num_heads * cfg.head_dim)}
        shapes |= {p + "mlp.gate_proj.weight": (cfg.intermediate_size, h)}
        shapes |= {p + "mlp.up_proj.weight": (cfg.intermediate_size, h)}
        shapes |= {p + "mlp.down_proj.weight": (h, cfg.intermediate_size)}
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
    for name, shape in shapes.items():
        if name in model._expected_names() or name == "lm_head.weight":
            yield name, torch.empty(shape)


def test_the_flag_reaches_the_engine_config_and_the_child_command_line():
    import argparse

    from pagemesh.workers.engine.config import add_engine_arguments, engine_args_to_argv, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["-pp", "2", "-tp", "3"])
    config = engine_config_from_args(args)
    assert (config.pipeline_parallel_size, config.tensor_parallel_size) == (2, 3)
    argv = engine_args_to_argv(args)
    assert argv[argv.index("--pipeline-parallel-size") + 1] == "2"
    with pytest.raises(ValueError, match="pipeline_parallel_size: must be >= 1"):
        type(config)(pipeline_parallel_size=0)


def test_max_steps_in_flight_is_a_flag_defaulting_to_the_stages():
    import argparse

    from pagemesh.workers.engine.config import add_engine_arguments, engine_args_to_argv, engine_config_from_args
    from pagemesh.workers.engine.scheduler import StepSchedulerConfig

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert "--max-steps-in-flight" in parser.format_help()
    default = engine_config_from_args(parser.parse_args(["-pp", "3"]))
    assert default.max_steps_in_flight is None
    assert StepSchedulerConfig.for_engine(default, 1024, 4096).max_steps_in_flight == 3  # one per stage
    args = parser.parse_args(["-pp", "2", "--max-steps-in-flight", "4"])
    config = engine_config_from_args(args)
    assert config.max_steps_in_flight == 4
    assert StepSchedulerConfig.for_engine(config, 1024, 4096).max_steps_in_flight == 4
    argv = engine_args_to_argv(args)  # what `pagemesh up` hands each worker
    assert argv[argv.index("--max-steps-in-flight") + 1] == "4"
    assert "--max-steps-in-flight" not in engine_args_to_argv(parser.parse_args([]))
    with pytest.raises(ValueError, match="max_steps_in_flight: must be >= 1"):
        engine_config_from_args(parser.parse_args(["-pp", "2", "--max-steps-in-flight", "0"]))


def test_pagemesh_up_passes_the_stages_to_every_llm_worker(tmp_path):
    from pagemesh.services import launcher

    for flags, names in ((["--mixed", "1"], ["mixed-0"]), ([], ["prefill-0", "decode-0"])):
        args = launcher.parse([*flags, "-pp", "2"])  # no flags: the default mesh, a prefill and a decode worker
        workers = dict(launcher.plan(args, str(tmp_path)))
        for name in names:
            assert workers[name][workers[name].index("--pipeline-parallel-size") + 1] == "2"
