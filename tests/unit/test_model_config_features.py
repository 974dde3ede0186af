"""What common/model_config.py makes of config features: each layer's sliding window as
transformers reads it (served over the whole context), and the features the Llama-family code does
not implement refused by name."""

import json

import pytest

from pagemesh.common.model_config import ModelConfig, default_max_model_len

SHAPE = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def hf(arch: str = "MistralForCausalLM", **fields) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": [arch], **SHAPE, **fields})


def served(cfg: ModelConfig) -> tuple[int, tuple[int | None, ...] | None]:
    return cfg.max_position_embeddings, cfg.layer_windows


# ---- sliding windows --------------------------------------------------------------------------
def test_a_mistral_window_slides_on_every_layer_over_the_whole_context():
    cfg = hf(sliding_window=16)
    assert served(cfg) == (256, (16, 16, 16)) and cfg.kv_window == 16


@pytest.mark.parametrize("window", [None, 256, 4096])
def test_no_window_or_one_at_least_the_context_changes_nothing(window):
    cfg = hf(sliding_window=window)
    assert served(cfg) == (256, None) and cfg.kv_window is None


def test_mistral_without_the_field_has_transformers_default_window_of_4096():
    cfg = ModelConfig.from_hf_dict({"architectures": ["MistralForCausalLM"], **SHAPE, "max_position_embeddings": 32768})
    assert served(cfg) == (32768, (4096,) * 3)


def test_mistral_slides_on_every_layer_whatever_layer_types_say():
    assert served(hf(sliding_window=16, layer_types=["full_attention"] * 3)) == (256, (16, 16, 16))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"sliding_window": 16}, None),  # Qwen2.5's configs: a window, use_sliding_window false
        ({"sliding_window": 16, "use_sliding_window": False, "max_window_layers": 0}, None),
        ({"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 2}, (None, None, 16)),
        ({"sliding_window": 16, "use_sliding_window": True}, None),  # max_window_layers 28 > 3 layers
        ({"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 3}, None),
        ({"sliding_window": 16, "use_sliding_window": True, "max_window_layers": 0}, (16, 16, 16)),
        ({"sliding_window": None, "use_sliding_window": True, "max_window_layers": 0}, None),
        # transformers >= 5 writes layer_types, which then decide
        ({"sliding_window": 16, "use_sliding_window": True, "layer_types": ["full_attention"] * 3}, None),
        (
            {
                "sliding_window": 16,
                "use_sliding_window": True,
                "layer_types": ["full_attention", "sliding_attention", "full_attention"],
            },
            (None, 16, None),
        ),
        # a sliding layer named without use_sliding_window (transformers fails there): it slides
        ({"sliding_window": 16, "layer_types": ["sliding_attention"] * 3}, (16, 16, 16)),
    ],
)
def test_qwen2_windows_as_transformers_reads_them(fields, expected):
    cfg = hf("Qwen2ForCausalLM", **fields)
    assert served(cfg) == (256, expected)
    assert cfg.kv_window == (16 if expected == (16, 16, 16) else None)  # a full layer keeps every page


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"sliding_window": None}, None),
        ({"sliding_window": 16}, (16, 16, 16)),  # Llama's modeling code ignores it; the model was trained with it
        ({"sliding_window": 16, "layer_types": ["full_attention"] * 3}, None),
        (
            {"sliding_window": 16, "layer_types": ["sliding_attention", "full_attention", "full_attention"]},
            (16, None, None),
        ),
    ],
)
def test_llama_windows(fields, expected):
    assert served(hf("LlamaForCausalLM", **fields)) == (256, expected)


def test_layer_types_of_another_length_are_refused():
    with pytest.raises(ValueError, match="layer_types names 2 layers, num_hidden_layers is 3"):
        hf("Qwen2ForCausalLM", sliding_window=16, use_sliding_window=True, layer_types=["sliding_attention"] * 2)


@pytest.mark.parametrize("window", [0, -4, True, "16", 16.0])
def test_a_window_that_is_not_a_positive_count_is_refused(window):
    with pytest.raises(ValueError, match="sliding_window="):
        hf(sliding_window=window)


def test_a_windowed_model_serves_its_whole_context(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["MistralForCausalLM"], **SHAPE, "sliding_window": 16})
    )
    assert default_max_model_len(tmp_path) == 256  # what the tokenizer and the gateway serve by default


def gguf_meta(**extra) -> dict:
    p = "llama."
    meta = {
        "general.architecture": "llama",
        p + "attention.head_count": 4,
        p + "attention.head_count_kv": 2,
        p + "embedding_length": 64,
        p + "feed_forward_length": 160,
        p + "block_count": 3,
        p + "attention.layer_norm_rms_epsilon": 1e-5,
        p + "context_length": 256,
        p + "vocab_size": 320,
        p + "rope.dimension_count": 16,
    }
    return meta | {p + k: v for k, v in extra.items()}


def test_gguf_sliding_window_key_slides_every_layer_and_partial_rope_is_refused():
    names = {"output.weight"}
    assert served(ModelConfig.from_gguf_fields(gguf_meta(), names)) == (256, None)
    windowed = ModelConfig.from_gguf_fields(gguf_meta(**{"attention.sliding_window": 16}), names)
    assert served(windowed) == (256, (16, 16, 16))
    assert served(ModelConfig.from_gguf_fields(gguf_meta(**{"attention.sliding_window": 512}), names)) == (256, None)
    with pytest.raises(ValueError, match=r"llama\.rope\.dimension_count=8"):
        ModelConfig.from_gguf_fields(gguf_meta(**{"rope.dimension_count": 8}), names)
    with pytest.raises(ValueError, match=r"llama\.attention\.value_length=32"):
        ModelConfig.from_gguf_fields(gguf_meta(**{"attention.value_length": 32}), names)


# ---- other features the Llama-family code does not have -------------------------------------
@pytest.mark.parametrize(
    ("arch", "fields", "message"),
    [
        ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias=True"),
        ("LlamaForCausalLM", {"attention_bias": True}, "attention_bias=True"),
        ("LlamaForCausalLM", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ("Qwen2ForCausalLM", {"hidden_act": "relu"}, "hidden_act='relu'"),
        ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
        (
            "LlamaForCausalLM",
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor=0.5",
        ),
        ("LlamaForCausalLM", {"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope scaling 'dynamic'"),
        (
            "MistralForCausalLM",
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
            "rope scaling 'yarn' without original_max_position_embeddings",
        ),
        ("LlamaForCausalLM", {"quantization_config": {"quant_method": "awq", "bits": 4}}, "quant_method='awq'"),
        ("DeepseekV3ForCausalLM", {}, "architecture 'DeepseekV3ForCausalLM'"),
    ],
)
def test_unimplemented_features_are_refused_by_name(arch, fields, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        hf(arch, **fields)


def test_what_works_is_not_refused():
    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 5e5,
    }
    cfg = hf("LlamaForCausalLM", rope_parameters=llama3, mlp_bias=False, attention_bias=False, hidden_act="silu")
    assert cfg.rope_scaling_dict["rope_type"] == "llama3" and not cfg.attention_bias
    assert hf("Qwen2ForCausalLM", attention_bias=False).attention_bias  # Qwen2: q/k/v biases always
    assert not hf(attention_bias=True, sliding_window=None).attention_bias  # transformers' Mistral has none
    assert hf("LlamaForCausalLM", head_dim=32, hidden_act="swish", partial_rotary_factor=1.0).head_dim == 32
    assert hf("LlamaForCausalLM", rope_scaling={"type": "default"}).rope_scaling is None
