"""The shipped digits-vlm folder (workers/llm/models/digits-vlm) is a Hugging Face LLaVA checkpoint
without its language model: LlavaForConditionalGeneration builds from its config.json, its
model.safetensors holds the vision tower and the projector under the names HF loads, the language
model's weights come from the embedded default GGUF, and the assembled model names held-out digits
given as the PNGs a client would send, in the prompt the server builds."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import torch

FOLDER = Path(__file__).resolve().parents[2] / "workers" / "llm" / "models" / "digits-vlm"
IMAGE_TOKEN, IMAGE_TOKEN_ID = "<empty_output>", 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def language_model():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagemesh.common.model_files import default_model_path

    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    lm = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return tokenizer, lm.eval()


@pytest.mark.slow  # loads the real model (the GGUF, ~20 s)
def test_config_is_a_llava_config_whose_text_weights_are_the_default_gguf(language_model):
    from transformers import LlavaConfig

    raw = json.loads((FOLDER / "config.json").read_text())
    assert raw["model_type"] == "llava" and raw["architectures"] == ["LlavaForConditionalGeneration"]
    assert raw["pagemesh_text_weights"] == "default"
    config = LlavaConfig.from_pretrained(FOLDER)
    assert config.image_token_index == IMAGE_TOKEN_ID and config.image_seq_length == 16
    assert config.vision_config.model_type == "clip_vision_model"
    vision = config.vision_config
    assert (vision.image_size // vision.patch_size) ** 2 == config.image_seq_length
    assert config.vision_feature_select_strategy == "default"
    # text_config is the GGUF's own LlamaConfig
    _, lm = language_model
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert getattr(config.text_config, key) == getattr(lm.config, key), key
    for key in ("num_key_value_heads", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "head_dim"):
        assert getattr(config.text_config, key) == getattr(lm.config, key), key
    assert config.text_config.model_type == "llama"


def test_weights_are_the_vision_tower_and_projector_only():
    from safetensors import safe_open

    file = FOLDER / "model.safetensors"
    assert file.stat().st_size < 2_000_000
    with safe_open(str(file), "pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith(("vision_tower.", "multi_modal_projector.")) for n in names)
    assert any(n.startswith("multi_modal_projector.") for n in names)


def _png(image, size: int):
    from PIL import Image

    from pagemesh.workers.diffusion.png import to_png_b64

    return Image.open(io.BytesIO(base64.b64decode(to_png_b64(image, size, size))))


@pytest.mark.slow
def test_the_assembled_model_names_held_out_digits(language_model):
    from transformers import AutoImageProcessor, LlavaForConditionalGeneration

    from pagemesh.workers.diffusion.training.digits_data import heldout_split

    tokenizer, lm = language_model
    model, info = LlavaForConditionalGeneration.from_pretrained(FOLDER, dtype=torch.float32, output_loading_info=True)
    # every stored tensor is one HF expects; what is missing is the language model's alone
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    missing = info["missing_keys"]
    assert missing and all(k.startswith(("model.language_model.", "lm_head.")) for k in missing)
    model.model.language_model.load_state_dict(lm.model.state_dict())
    model.lm_head.weight = model.model.language_model.embed_tokens.weight  # tied, as in the GGUF
    model.eval()

    # one held-out digit of each class, as a client's PNG (the DiT's "L" PNGs, nearest-upscaled)
    heldout = heldout_split()
    picks = [int((heldout.labels == d).nonzero()[0]) for d in range(10)]
    pixels = ((heldout.images[picks].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    images = [_png(image, size) for image, size in zip(pixels, [256, 64, 128, 512, 32] * 2, strict=True)]
    assert images[0].mode == "L"
    processor = AutoImageProcessor.from_pretrained(FOLDER)
    pixel_values = processor(images=images, return_tensors="pt")["pixel_values"]
    assert pixel_values.shape == (10, 3, 32, 32)

    # the server's prompt: the chat template over "<image>\n<text>", the placeholder expanded
    messages = [{"role": "user", "content": f"{IMAGE_TOKEN}\nWhat digit is this?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    at = ids.index(IMAGE_TOKEN_ID)
    ids = ids[:at] + [IMAGE_TOKEN_ID] * model.config.image_seq_length + ids[at + 1 :]
    input_ids = torch.tensor([ids] * len(images))
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixel_values,
            max_new_tokens=2,
            do_sample=False,
        )
    said = tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=False)
    right = sum(s == f"{d}<|im_end|>" for d, s in enumerate(said))
    assert right >= 9, said
