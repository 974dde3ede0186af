"""Tiny random multimodal checkpoints made by transformers at test time, saved as a hub folder
(safetensors, config.json, preprocessor_config.json, a word-level tokenizer with a chat
template), and Hugging Face's greedy tokens on them: the oracle of the multimodal tests.

    llava     a CLIP vision tower (32x32 images, 8x8 patches: 16 rows), an MLP projector, Llama
    qwen2_vl  Qwen2-VL's ViT (14-pixel patches merged 2x2) and Qwen2 with M-RoPE; an image's
              placeholders depend on its size

The tokenizer's token i is the word `w{i}` (so an answer's text gives its ids); the image
tokens are special tokens (`<image>`; `<|vision_start|><|image_pad|><|vision_end|>`). The chat
template writes "w3 {content} w4 " per message, then "w5". The vision weights are drawn wide
(std 0.2) so that each image moves the language model's greedy tokens (checked in the tests).
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

VOCAB = 320
IMAGE_TOKENS = {
    "llava": {"<image>": 319},
    "qwen2_vl": {"<|vision_start|>": 317, "<|image_pad|>": 318, "<|vision_end|>": 319},
}
TEXT = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.3,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)
CHAT_TEMPLATE = (
    "{% for message in messages %}w3 {{ message['content'] }} w4 {% endfor %}"
    "{% if add_generation_prompt %}w5{% endif %}"
)
QWEN_PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16)  # at most 16 placeholders an image


def build(kind: str):
    """The HF model (fp32, eval) and its image processor."""
    torch.manual_seed(0)
    if kind == "llava":
        from transformers import CLIPImageProcessor, LlavaConfig, LlavaForConditionalGeneration

        vision = dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            image_size=32,
            patch_size=8,
        )
        cfg = LlavaConfig(
            vision_config=vision,
            text_config=dict(model_type="llama", **TEXT),
            image_token_index=319,
            image_seq_length=16,
        )
        model = LlavaForConditionalGeneration(cfg)
        processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    else:
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessor

        vision = dict(
            depth=2,
            embed_dim=32,
            hidden_size=64,
            num_heads=4,
            in_chans=3,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
        )
        text = dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, rope_theta=10000.0)
        cfg = Qwen2VLConfig(
            vision_config=vision,
            text_config=text,
            image_token_id=318,
            vision_start_token_id=317,
            vision_end_token_id=319,
        )
        model = Qwen2VLForConditionalGeneration(cfg)
        processor = Qwen2VLImageProcessor(**QWEN_PIXELS)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif any(k in name for k in ("vision_tower", "visual", "multi_modal_projector")):
                p.normal_(0.0, 0.2)
        model.lm_head.weight.mul_(4.0)  # spread-out logits: no near-tie decides a greedy token
    return model.eval(), processor


def save(kind: str, folder: Path):
    """Make the checkpoint in `folder`; returns (HF model, image processor)."""
    model, processor = build(kind)
    model.save_pretrained(folder, safe_serialization=True)
    processor.save_pretrained(folder)
    write_tokenizer(kind, folder)
    return model, processor


def write_tokenizer(kind: str, folder: Path) -> None:
    """The word-level tokenizer (`w{i}`) with the kind's image tokens and the chat template."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    specials = IMAGE_TOKENS[kind]
    vocab = {f"w{i}": i for i in range(VOCAB) if i not in specials.values()} | specials
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "w1", "eos_token": "w2", "add_bos_token": False, "chat_template": CHAT_TEMPLATE}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def image_png(seed: int, width: int = 32, height: int = 32) -> bytes:
    """A random RGB image as a PNG file."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def hf_inputs(kind: str, processor, files: list[bytes]) -> dict:
    """The image part of HF's forward arguments for these files."""
    images = [Image.open(io.BytesIO(f)).convert("RGB") for f in files]
    batch = processor(images=images, return_tensors="pt")
    keys = ("pixel_values",) if kind == "llava" else ("pixel_values", "image_grid_thw")
    return {k: batch[k] for k in keys}


def hf_greedy_after_each(hf, kind: str, processor, prompt_ids: list[int], files: list[bytes], served: list[int]):
    """HF's greedy choice after the prompt (its placeholders widened) and each prefix of
    `served`, from one teacher-forced pass with the images."""
    ids = torch.tensor([list(prompt_ids) + list(served)])
    extra = hf_inputs(kind, processor, files) if files else {}
    if kind == "qwen2_vl":
        extra["mm_token_type_ids"] = (ids == IMAGE_TOKENS[kind]["<|image_pad|>"]).long()
    with torch.inference_mode():
        logits = hf(input_ids=ids, attention_mask=torch.ones_like(ids), **extra).logits[0]
    n = len(prompt_ids)
    return logits[n - 1 : n - 1 + len(served)].argmax(-1).tolist()


def chat_prompt_ids(kind: str, text_ids: list[int], placeholders: list[int]) -> list[int]:
    """The prompt the tokenizer makes of a chat with one user message whose parts are the
    images then the text ("<image>\\nw10 w11 ..."): the template's w3 ... w4 w5 around it,
    each image as its placeholders (`placeholders[i]` of them)."""
    tokens = IMAGE_TOKENS[kind]
    out = [3]
    for n in placeholders:
        if kind == "llava":
            out += [tokens["<image>"]] * n
        else:
            out += [tokens["<|vision_start|>"]] + [tokens["<|image_pad|>"]] * n + [tokens["<|vision_end|>"]]
    return out + list(text_ids) + [4, 5]
