"""The family structure (issue 30): every HF architecture the config maps has model code, each
family's config mapping reads its fields as transformers does and refuses by name what its code
does not implement, the RoPE scalings equal transformers' tables, and the fused C decode path is
used only by families whose layers it computes."""

from __future__ import annotations

import pytest
import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.common.model_families import GGUF_FAMILIES, HF_FAMILIES, ROPE_SCALING_TYPES
from pagemesh.workers.model.causal_lm import CausalLM
from pagemesh.workers.model.registry import MODEL_CLASSES, model_class
from pagemesh.workers.model.rope import ROPE_SCALINGS, RotaryEmbedding

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hf(arch: str, **fields) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": [arch], **SHAPE, **fields})


# ---- the registry ---------------------------------------------------------------------------
def test_every_mapped_architecture_has_model_code_and_rope_kinds_agree():
    assert {m.architecture for m in HF_FAMILIES.values()} | set(GGUF_FAMILIES) <= set(MODEL_CLASSES)
    for arch in HF_FAMILIES:
        cls = model_class(hf(arch, mrope_section=[4, 6, 6]))  # M-RoPE's sections: Qwen2-VL's LM needs them
        assert issubclass(cls, CausalLM), arch
    assert set(ROPE_SCALING_TYPES) == set(ROPE_SCALINGS)
    with pytest.raises(ValueError, match="no model code for architecture 'bert'"):
        model_class(ModelConfig(**{**vars(hf("LlamaForCausalLM")), "architecture": "bert"}))


# ---- config mappings ------------------------------------------------------------------------
def test_qwen3_has_qk_norms_and_qwen2s_windows():
    cfg = hf("Qwen3ForCausalLM", head_dim=32)
    assert (cfg.architecture, cfg.qk_norm, cfg.head_dim, cfg.attention_bias, cfg.layer_windows) == (
        "qwen3", True, 32, False, None,
    )  # fmt: skip
    assert hf("Qwen3ForCausalLM").head_dim == 128  # Qwen3Config's default, not hidden / heads
    windowed = hf("Qwen3ForCausalLM", sliding_window=16, use_sliding_window=True, max_window_layers=2)
    assert windowed.layer_windows == (None, None, 16, 16)
    typed = hf("Qwen3ForCausalLM", sliding_window=16, layer_types=["full_attention"] * 3 + ["sliding_attention"])
    assert typed.layer_windows == (None, None, None, 16)


def test_phi3_longrope_is_served_within_its_pretraining_context():
    rope = {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    cfg = hf("Phi3ForCausalLM", rope_scaling=rope, original_max_position_embeddings=64)
    assert cfg.max_position_embeddings == 64  # beyond, transformers itself mixes long and short factors
    scaling = cfg.rope_scaling_dict
    assert scaling["short_factor"] == (1.0,) * 8 and scaling["attention_factor"] == pytest.approx((1 + 2 / 6) ** 0.5)
    assert (
        hf("Phi3ForCausalLM", rope_scaling={**rope, "original_max_position_embeddings": 512}).max_position_embeddings
        == 256
    )
    with pytest.raises(ValueError, match="'longrope' without original_max_position_embeddings or short_factor"):
        hf("Phi3ForCausalLM", rope_scaling=rope)


def test_phi3_slides_on_every_layer_where_it_has_a_window():
    assert hf("Phi3ForCausalLM", sliding_window=16).layer_windows == (16,) * 4
    assert hf("Phi3ForCausalLM", sliding_window=None).layer_windows is None
    assert hf("Phi3ForCausalLM", sliding_window=256).layer_windows is None  # the whole context: no window


def test_gemma2_defaults_are_transformers():
    cfg = ModelConfig.from_hf_dict({"architectures": ["Gemma2ForCausalLM"], **SHAPE, "sliding_window": 16})
    assert (cfg.architecture, cfg.head_dim, cfg.query_pre_attn_scalar, cfg.tie_word_embeddings) == (
        "gemma2", 256, 256.0, True,
    )  # fmt: skip
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping, cfg.qk_norm) == (50.0, 30.0, False)
    assert cfg.layer_windows == (16, None, 16, None)  # without layer_types: even layers slide
    no_caps = hf("Gemma2ForCausalLM", attn_logit_softcapping=None, final_logit_softcapping=None)
    assert (no_caps.attn_logit_softcapping, no_caps.final_logit_softcapping) == (None, None)
    typed = hf("Gemma2ForCausalLM", sliding_window=16, layer_types=["full_attention"] * 3 + ["sliding_attention"])
    assert typed.layer_windows == (None, None, None, 16)


def test_gemma3_two_ropes_in_either_config_format():
    old = hf(
        "Gemma3ForCausalLM",
        num_hidden_layers=7,
        sliding_window=16,
        rope_theta=1e6,
        rope_local_base_freq=1e4,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    )
    new = hf(
        "Gemma3ForCausalLM",
        num_hidden_layers=7,
        sliding_window=16,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    for cfg in (old, new):
        assert (cfg.rope_theta, cfg.rope_scaling_dict, cfg.rope_local_theta) == (
            1e6, {"rope_type": "linear", "factor": 8.0}, 1e4,
        )  # fmt: skip
        assert cfg.qk_norm and cfg.final_logit_softcapping is None and cfg.attn_logit_softcapping is None
        assert cfg.layer_windows == (16, 16, 16, 16, 16, None, 16)  # sliding_window_pattern 6: every 6th is full
        assert cfg.rope_local_layers == (0, 1, 2, 3, 4, 6)
    assert hf("Gemma3ForCausalLM", sliding_window=16, sliding_window_pattern=2).layer_windows == (16, None, 16, None)
    whole = hf("Gemma3ForCausalLM", sliding_window=256, sliding_window_pattern=2)  # a window the whole context
    assert whole.layer_windows is None and whole.rope_local_layers == (0, 2)  # still the local RoPE there


def test_llama_rope_scalings_read():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "rope_theta": 1e4}
    assert hf("LlamaForCausalLM", rope_parameters=yarn).rope_scaling_dict == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
    }  # fmt: skip
    assert hf("LlamaForCausalLM", rope_scaling={"type": "linear", "factor": 2.0}).rope_scaling_dict["factor"] == 2.0


@pytest.mark.parametrize(
    ("arch", "fields", "message"),
    [
        ("Qwen3ForCausalLM", {"attention_bias": True}, "attention_bias=True is not supported for qwen3"),
        ("Qwen3ForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("Phi3ForCausalLM", {"rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}},
         "rope scaling 'su'"),
        ("Phi3ForCausalLM", {"partial_rotary_factor": 0.75}, "partial_rotary_factor=0.75"),
        ("Gemma2ForCausalLM", {"attention_bias": True}, "attention_bias=True is not supported for gemma2"),
        ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
        ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        (
            "Gemma3ForCausalLM",
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                 "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
            "rope scaling 'linear' on sliding layers",
        ),
        (
            "Gemma3ForCausalLM",
            {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 0.5}}},
            "partial_rotary_factor=0.5",
        ),
        ("Gemma3ForConditionalGeneration", {}, "architecture 'Gemma3ForConditionalGeneration'"),
        ("LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear"}}, "rope scaling 'linear' without factor"),
    ],
)  # fmt: skip
def test_what_a_familys_code_does_not_implement_is_refused_by_name(arch, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        hf(arch, **fields)


# ---- RoPE scalings against transformers' tables ---------------------------------------------
@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32, "beta_fast": 16, "beta_slow": 2},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 0.7,
         "mscale_all_dim": 1.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "attention_factor": 1.5,
         "truncate": False},
        {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
         "original_max_position_embeddings": 64},
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "longrope", "short_factor": [1.0 + 0.25 * i for i in range(16)],
         "long_factor": [4.0] * 16, "original_max_position_embeddings": 64},
        {"rope_type": "longrope", "short_factor": [1.5] * 16, "long_factor": [4.0] * 16,
         "original_max_position_embeddings": 64, "attention_factor": 1.25, "factor": 8.0},
    ],
)  # fmt: skip
def test_rope_tables_equal_transformers(params):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    head_dim, theta, positions = 32, 5e5, torch.arange(0, 256, 7)
    if params["rope_type"] == "longrope":  # served within the pretraining context, where HF uses short_factor
        positions = torch.arange(0, 64, 3)
    hf_cfg = LlamaConfig(
        hidden_size=128,
        num_attention_heads=4,
        max_position_embeddings=256,
        rope_parameters={**params, "rope_theta": theta},
    )
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(torch.zeros(1, dtype=torch.float32), positions[None])
    cfg = hf("LlamaForCausalLM", hidden_size=128, rope_parameters={**params, "rope_theta": theta})
    ours = RotaryEmbedding(head_dim, 256, cfg.rope_theta, cfg.rope_scaling_dict).cos_sin_cache[positions]
    half = head_dim // 2
    torch.testing.assert_close(ours[:, :half], cos[0, :, :half], rtol=0, atol=1e-6)
    torch.testing.assert_close(ours[:, half:], sin[0, :, :half], rtol=0, atol=1e-6)


# ---- the fused C decode path ------------------------------------------------------------------
def family_config(arch: str) -> ModelConfig:
    return hf(arch, head_dim=16, tie_word_embeddings=False)


@pytest.mark.parametrize(
    ("arch", "fused"),
    [("LlamaForCausalLM", True), ("Phi3ForCausalLM", True), ("Qwen3ForCausalLM", False),
     ("Gemma2ForCausalLM", False), ("Gemma3ForCausalLM", False)],
)  # fmt: skip
def test_the_fused_c_decode_path_runs_only_the_families_it_computes(arch, fused):
    """Every linear int8 on a CPU with the C kernels: DecodeLayers applies to Llama-shaped
    layers only (Qwen3's and Gemma's norms, GeGLU and two RoPEs are not in its C code)."""
    from pagemesh.kernels import cpu
    from pagemesh.kernels.cpu import quant

    if not (cpu.available() and quant.available()):
        pytest.skip(f"CPU kernels did not build: {cpu.load_error()}")
    from pagemesh.workers.engine.model_runner import ModelRunner
    from pagemesh.workers.model.decode_layers import DecodeLayers
    from pagemesh.workers.model.loader import build_random_model
    from pagemesh.workers.model.quantization import quantize_int8_model

    model = build_random_model(family_config(arch), torch.float32, torch.device("cpu"))
    assert quantize_int8_model(model) == 4 * 4 + 1  # every layer's four linears and the head
    runner = ModelRunner(model, 16, 4, torch.device("cpu"), cuda_graphs=False)
    assert isinstance(runner.decode_layers, DecodeLayers) == fused


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_random_models_start_with_identity_norms(arch):
    """build_random_model (benchmarks): every norm's weight leaves its input's scale alone, which
    is 1 for Llama-style norms and 0 for Gemma's (1 + w)."""
    from pagemesh.workers.model.loader import build_random_model

    model = build_random_model(family_config(arch), torch.float32, torch.device("cpu"))
    norms = [(n, p) for n, p in model.named_parameters() if "norm" in n]
    identity = 0.0 if arch.startswith("Gemma") else 1.0
    assert norms and all(bool((p == identity).all()) for _, p in norms)
    assert model.lm_head.weight.std() > 0.01


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_two_pipeline_stages_give_the_whole_models_logits(arch):
    """Stage 0 (layers 0-1) hands its [2, T, hidden] activations to stage 1 (layers 2-3, the
    final norm and the head): the whole model's logits, bit for bit."""
    from pagemesh.workers.attention.metadata import AttentionMetadata
    from pagemesh.workers.engine.backend import TorchAttentionBackend
    from pagemesh.workers.model.context import ForwardContext
    from pagemesh.workers.model.layers import ParallelContext
    from pagemesh.workers.model.ops import TorchOps

    cfg = ModelConfig.from_hf_dict(
        {"architectures": [arch], **SHAPE, "head_dim": 16, "tie_word_embeddings": False, "sliding_window": 4}
    )
    cpu = torch.device("cpu")
    whole = model_class(cfg)(cfg)
    whole.init_random(seed=1)
    stages = [model_class(cfg)(cfg, ParallelContext(), layers) for layers in (range(0, 2), range(2, 4))]
    state = whole.state_dict()
    for stage in stages:  # the whole model's weights, under each stage's own layer numbering
        own = {}
        for name in stage.state_dict():
            if name.startswith("layers."):
                _, i, rest = name.split(".", 2)
                own[name] = state[f"layers.{int(i) + stage.layer_range.start}.{rest}"]
            else:
                own[name] = state[name]
        stage.load_state_dict(own)

    def run(model, layers: int, hidden=None):
        md = AttentionMetadata.build([9], [9], [[1, 2, 3]], 4, cpu, for_cpu=True, decode_gather=True)
        kv = torch.zeros(layers, 4, 2, 4, cfg.num_kv_heads, cfg.head_dim)
        ctx = ForwardContext(kv, md, TorchAttentionBackend(), TorchOps())
        return model(torch.arange(5, 14), ctx, torch.arange(9), hidden)

    expected = run(whole, 4)
    assert torch.equal(run(stages[1], 2, run(stages[0], 2)), expected)


def test_gguf_architectures_qwen3_and_phi3_and_what_is_refused():
    def meta(arch: str, **extra) -> dict:
        p = f"{arch}."
        fields = {"attention.head_count": 4, "attention.head_count_kv": 2, "embedding_length": 64}
        fields |= {"feed_forward_length": 160, "block_count": 2, "attention.layer_norm_rms_epsilon": 1e-6}
        fields |= {"context_length": 256, "vocab_size": 320, "attention.key_length": 128, **extra}
        return {"general.architecture": arch} | {p + k: v for k, v in fields.items()}

    qwen3 = ModelConfig.from_gguf_fields(meta("qwen3"), {"output.weight"})
    assert (qwen3.architecture, qwen3.qk_norm, qwen3.head_dim) == ("qwen3", True, 128)
    phi3 = ModelConfig.from_gguf_fields(meta("phi3", **{"attention.sliding_window": 16}), {"output.weight"})
    assert (phi3.architecture, phi3.qk_norm, phi3.layer_windows) == ("phi3", False, (16, 16))
    # as llama.cpp writes every Phi-3: the original context, and 0 for no window
    plain = meta("phi3", **{"attention.sliding_window": 0, "rope.scaling.original_context_length": 256})
    assert ModelConfig.from_gguf_fields(plain, {"output.weight"}).layer_windows is None
    with pytest.raises(ValueError, match=r"GGUF rope scaling \(phi3\.rope\.scaling\.attn_factor\)"):  # LongRoPE
        ModelConfig.from_gguf_fields(meta("phi3", **{"rope.scaling.attn_factor": 1.19}), {"output.weight"})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gemma2'"):
        ModelConfig.from_gguf_fields(meta("gemma2"), {"output.weight"})
