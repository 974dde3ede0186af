"""LoRA adapters made at test time by peft on the default model (issue 31's oracle), shared by
the engine's and the mesh's tests: random, non-zero B on every linear, "poet" rank 8 and
"coder" rank 16 with rsLoRA."""

from __future__ import annotations

from pathlib import Path

import torch

from pagemesh.tests.integration.conftest import hf_argmax_after_each

ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model_path: Path, root: Path):
    """(a peft model on the default model holding "poet" and "coder", {name: folder})."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32)
    torch.manual_seed(0)
    poet = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_LINEARS, init_lora_weights=False)
    peft_model = get_peft_model(base, poet, adapter_name="poet")
    coder = LoraConfig(r=16, lora_alpha=8, use_rslora=True, target_modules=ALL_LINEARS, init_lora_weights=False)
    peft_model.add_adapter("coder", coder)
    with torch.no_grad():  # peft's random B at full size turns a 135M model's text to noise
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.3)
    peft_model.save_pretrained(root)  # adapters other than "default" go to root/<name>
    return peft_model.eval(), {"poet": str(root / "poet"), "coder": str(root / "coder")}


def hf_tokens(peft_model, adapter: str | None, prompt: list[int], tokens: list[int]) -> list[int]:
    """HF + peft's greedy choice after the prompt and each prefix of `tokens`, under `adapter`
    (None: the base model): equal to `tokens` exactly when they are its greedy continuation."""
    if adapter is None:
        with peft_model.disable_adapter():
            return hf_argmax_after_each(peft_model, prompt, tokens)
    peft_model.set_adapter(adapter)
    return hf_argmax_after_each(peft_model, prompt, tokens)


def hf_greedy_text(peft_model, tokenizer, adapter: str | None, prompt: list[int], max_new_tokens: int) -> str:
    """HF + peft's greedy continuation of `prompt` under `adapter` (None: the base model), as text."""
    from pagemesh.tests.integration.conftest import hf_greedy

    if adapter is None:
        with peft_model.disable_adapter():
            return tokenizer.decode(hf_greedy(peft_model, prompt, max_new_tokens))
    peft_model.set_adapter(adapter)
    return tokenizer.decode(hf_greedy(peft_model, prompt, max_new_tokens))


def tiny_llama():
    """A tiny random Llama (2 layers, 4 heads, 2 KV heads: tensor-parallel 2 divides it), fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def tiny_llama_with_adapters(root: Path) -> dict:
    """root/base (the tiny Llama), root/a (rank 8 on every linear), root/b (rank 16, rsLoRA, its own
    alpha, on q, v and down only); {"a": peft model, "b": peft model}."""
    from peft import LoraConfig, get_peft_model

    tiny_llama().save_pretrained(root / "base", safe_serialization=True)
    models = {}
    for name, seed, lora in (
        ("a", 1, dict(r=8, lora_alpha=16, target_modules=ALL_LINEARS)),
        ("b", 2, dict(r=16, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"])),
    ):
        torch.manual_seed(seed)
        model = get_peft_model(tiny_llama(), LoraConfig(init_lora_weights=False, **lora))
        model.save_pretrained(root / name)
        models[name] = model.eval()
    return models
