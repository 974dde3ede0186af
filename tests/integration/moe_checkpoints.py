"""Tiny random mixture-of-experts checkpoints made by transformers at test time (fixed seed, fp32,
well under 1 MB): Mixtral and Qwen3-MoE folders with safetensors weights and a small byte-level
BPE tokenizer, shaped so that `-tp 2` splits them either way (4 query heads, 2 KV heads, 8
experts whose intermediate size is even), and with the LM head scaled so that greedy choices are
never near-ties."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
EXPERTS = 8
TEXT = [
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Mixture of experts routes every token to a few experts; each expert is a small MLP.",
    "Tensor parallelism shards each expert; expert parallelism places whole experts on ranks.",
]


def tokenizer():
    """A byte-level BPE of at most VOCAB tokens over ASCII text only, so every token is printable
    text (its bytes name it exactly in a logprobs entry); id 0 is `<|endoftext|>`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(TEXT * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


VOCAB_SIZE = len(tokenizer())  # the models' vocabulary: the tokenizer's, so every id decodes


def _common(**extra) -> dict:
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.3,
        num_experts_per_tok=2,
        bos_token_id=None,
        eos_token_id=0,
        **extra,
    )


def mixtral_model(sliding_window: int | None = None):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**_common(intermediate_size=32, num_local_experts=EXPERTS, sliding_window=sliding_window))
    return _random(MixtralForCausalLM, cfg)


def qwen3_moe_model(mlp_only_layers: tuple[int, ...] = (1,), norm_topk_prob: bool = False):
    """Layer 1 is dense (`mlp_only_layers`), the others sparse; q/k RMSNorm as Qwen3."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **_common(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=EXPERTS,
            norm_topk_prob=norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=list(mlp_only_layers),
        )
    )
    return _random(Qwen3MoeForCausalLM, cfg)


def _random(model_class, cfg):
    torch.manual_seed(0)
    model = model_class(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # q/k and layer norms: not all ones, so they are tested
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
        model.lm_head.weight.mul_(4.0)  # spread-out logits: no near-tie decides a greedy token
    return model


def save(model, folder: Path) -> Path:
    """The model as an HF folder (safetensors, config.json, tokenizer): what `--model` takes."""
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer().save_pretrained(str(folder))
    assert json.loads((folder / "config.json").read_text())["architectures"] == [type(model).__name__]
    return folder


def prompts(count: int = 8, seed: int = 1) -> list[list[int]]:
    """`count` prompts of token ids (1..VOCAB_SIZE-1: no end-of-text), of lengths 3..24."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 25, (count,), generator=gen).tolist()
    return [torch.randint(1, VOCAB_SIZE, (n,), generator=gen).tolist() for n in lengths]


def save_qwen3moe_gguf(model, path: Path, expert_type: str = "F32") -> Path:
    """A Qwen3-MoE model (every layer sparse) as llama.cpp's `qwen3moe` GGUF with the tokenizer:
    experts stacked [experts, rows, cols] in `expert_type` (F32 or a block format such as Q8_0),
    everything else F32; q/k rows in HF order (llama.cpp permutes them for `llama` files only)."""
    import gguf

    cfg = model.config
    assert not cfg.mlp_only_layers, "llama.cpp's qwen3moe has no dense layers"
    assert cfg.norm_topk_prob, "llama.cpp's qwen3moe renormalises the top k"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    vocab = tokenizer().backend_tokenizer
    tokens = [vocab.id_to_token(i) for i in range(vocab.get_vocab_size())]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in json.loads(vocab.to_str())["model"]["merges"]])
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)

    def add(name: str, t: torch.Tensor, kind: str = "F32") -> None:
        data = t.detach().float().contiguous().numpy()
        if kind == "F32":
            writer.add_tensor(name, data)
        else:
            qtype = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    hf = model.state_dict()
    add("token_embd.weight", hf["model.embed_tokens.weight"])
    add("output_norm.weight", hf["model.norm.weight"])
    add("output.weight", hf["lm_head.weight"])
    inter = cfg.moe_intermediate_size
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (
            ("attn_norm", "input_layernorm"),
            ("ffn_norm", "post_attention_layernorm"),
            ("attn_q_norm", "self_attn.q_norm"),
            ("attn_k_norm", "self_attn.k_norm"),
            ("attn_q", "self_attn.q_proj"),
            ("attn_k", "self_attn.k_proj"),
            ("attn_v", "self_attn.v_proj"),
            ("attn_output", "self_attn.o_proj"),
            ("ffn_gate_inp", "mlp.gate"),
        ):
            add(f"{b}{ours}.weight", hf[f"{p}{theirs}.weight"])
        gate_up = hf[p + "mlp.experts.gate_up_proj"]  # [experts, 2I, H]: gate rows, then up rows
        add(b + "ffn_gate_exps.weight", gate_up[:, :inter], expert_type)
        add(b + "ffn_up_exps.weight", gate_up[:, inter:], expert_type)
        add(b + "ffn_down_exps.weight", hf[p + "mlp.experts.down_proj"], expert_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def served_token_ids(choice, vocab: dict[str, int]) -> list[int]:
    """A completion's tokens by their logprobs entries: this tokenizer is byte-level BPE over
    ASCII, so a token's text names it exactly."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()
    return [vocab["".join(chars[b] for b in token.encode())] for token in choice.logprobs.tokens]


def mesh_greedy_tokens(url: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation through a mesh serving a checkpoint with this tokenizer,
    all sent at once (batched steps), with the official `openai` client."""
    import concurrent.futures

    from pagemesh.tests.integration.conftest import openai_client

    vocab = tokenizer().get_vocab()
    client = openai_client(type("Mesh", (), {"url": url}))
    model = client.models.list().data[0].id

    def complete(prompt: list[int]) -> list[int]:
        r = client.completions.create(
            model=model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True},
        )
        return served_token_ids(r.choices[0], vocab)

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(complete, prompts))
