"""digits-vlm as a folder (train_digits_vlm.py writes it): its LlavaConfig over the GGUF's text
config, the vision tensors saved and loaded back with the GGUF's language model as HF loads them,
the greedy-answer accuracy on held-out and DiT-drawn digits, and the README with the figures."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from pagemesh.workers.diffusion.training.digits_data import NUM_CLASSES, heldout_split
from pagemesh.workers.diffusion.training.digits_vlm_data import (
    CANONICAL,
    END_OF_TURN_ID,
    FEATURE_LAYER,
    IMAGE_SIZE,
    IMAGE_TOKEN_ID,
    IMAGE_TOKENS,
    LAYOUTS,
    PATCH_SIZE,
    TEXT_CONFIG_DROP,
    TRAIN_SIZES,
    TrainConfig,
    image_processor,
    png_image,
    prompt_ids,
    to_uint8,
)


def build_config(lm_config: Any, config: TrainConfig) -> Any:
    from transformers import CLIPVisionConfig, LlavaConfig

    text = {k: v for k, v in lm_config.to_dict().items() if k not in TEXT_CONFIG_DROP}
    vision = CLIPVisionConfig(
        hidden_size=config.vision_hidden,
        intermediate_size=config.vision_intermediate,
        projection_dim=config.vision_hidden,
        num_hidden_layers=config.vision_layers,
        num_attention_heads=config.vision_heads,
        num_channels=3,
        image_size=IMAGE_SIZE,
        patch_size=PATCH_SIZE,
    )
    llava = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=text,
        image_token_index=IMAGE_TOKEN_ID,
        image_seq_length=IMAGE_TOKENS,
        projector_hidden_act="gelu",
        vision_feature_select_strategy="default",
        vision_feature_layer=FEATURE_LAYER,
        multimodal_projector_bias=True,
        tie_word_embeddings=True,
    )
    llava.architectures = ["LlavaForConditionalGeneration"]
    llava.pagemesh_text_weights = "default"
    return llava


def vision_state(model: Any) -> dict[str, torch.Tensor]:
    """The tensors a LLaVA checkpoint stores for the tower and the projector, under the names
    LlavaForConditionalGeneration.save_pretrained writes ("vision_tower.…",
    "multi_modal_projector.…": its `model.` prefix is dropped)."""
    out = {}
    for name, tensor in model.state_dict().items():
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.")):
            out[name.removeprefix("model.")] = tensor.detach().clone()
    return out


def attach_language_model(model: Any, lm: Any) -> Any:
    """Copies the GGUF language model's weights into a LLaVA model (the lm_head is tied)."""
    model.model.language_model.load_state_dict(lm.model.state_dict())
    head = model.get_output_embeddings().weight
    if head.data_ptr() != model.model.language_model.embed_tokens.weight.data_ptr():
        head.data.copy_(lm.lm_head.weight)
    return model


def load_folder(folder: Path, lm: Any, dtype: torch.dtype = torch.float32) -> Any:
    """The shipped folder as HF loads it, with the GGUF's language model in it."""
    from transformers import LlavaForConditionalGeneration
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the language model's weights are missing on purpose
    hf_logging.disable_progress_bar()
    try:
        model, info = LlavaForConditionalGeneration.from_pretrained(
            folder, dtype=torch.float32, output_loading_info=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
    if info["unexpected_keys"] or any(
        not k.startswith(("model.language_model.", "lm_head.")) for k in info["missing_keys"]
    ):
        raise RuntimeError(f"unexpected loading info: {info}")
    return attach_language_model(model, lm).to(dtype).eval()


def save_folder(model: Any, out: Path, *, dtype: torch.dtype = torch.bfloat16) -> None:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    image_processor().save_pretrained(out)
    tensors = {k: v.to(dtype).contiguous() for k, v in sorted(vision_state(model).items())}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)


@torch.no_grad()
def answers(
    model: Any, tokenizer: Any, images: list[Any], layout: tuple[str | None, bool], batch: int = 50
) -> list[str]:
    """Greedy answers (special tokens kept) of the model to one prompt over PIL images."""
    processor = image_processor()
    ids = torch.tensor([prompt_ids(tokenizer, *layout)])
    out = []
    for i in range(0, len(images), batch):
        chunk = images[i : i + batch]
        pixels = processor(images=chunk, return_tensors="pt")["pixel_values"].to(model.dtype)
        input_ids = ids.expand(len(chunk), -1)
        generated = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixels,
            max_new_tokens=2,
            do_sample=False,
            pad_token_id=END_OF_TURN_ID,
        )
        out += tokenizer.batch_decode(generated[:, input_ids.shape[1] :], skip_special_tokens=False)
    return out


def accuracy(model: Any, tokenizer: Any, images: list[Any], labels: list[int], layouts: list[tuple]) -> float:
    """Share of images answered exactly "<digit><|im_end|>"; image i asks with layouts[i % len]."""
    right = 0
    for k, layout in enumerate(layouts):
        picked = list(range(k, len(images), len(layouts)))
        said = answers(model, tokenizer, [images[i] for i in picked], layout)
        right += sum(s == f"{labels[i]}<|im_end|>" for i, s in zip(picked, said, strict=True))
    return right / len(images)


def dit_digits(per_digit: int = 10, size: int = 256) -> tuple[list[Any], list[int]]:
    """`per_digit` digits of each class drawn by the embedded DiT at its defaults, as PNGs of
    `size` px (seeded)."""
    from pagemesh.common.messages import ImageParams
    from pagemesh.workers.diffusion.engine.config import EngineConfig
    from pagemesh.workers.diffusion.engine.engine import DiffusionEngine
    from pagemesh.workers.diffusion.engine.jobs import ImageJob
    from pagemesh.workers.diffusion.pipelines.embedded import DIGITS_NAME
    from pagemesh.workers.diffusion.pipelines.loader import load_pipeline

    engine = DiffusionEngine(load_pipeline(DIGITS_NAME), EngineConfig(max_running=10, max_batch_rows=200))
    for digit in range(NUM_CLASSES):
        params = ImageParams(
            prompt=f"a handwritten {digit}",
            negative_prompt=None,
            n=per_digit,
            width=None,
            height=None,
            num_inference_steps=None,
            guidance_scale=None,
            sampler=None,
            seed=7000 + digit,
        )
        engine.add(ImageJob(request_id=str(digit), params=params, arrival=0.0))
    finished = []
    while engine.has_work():
        finished += engine.step()
    images, labels = [], []
    for job in sorted(finished, key=lambda f: int(f.request_id)):
        for image in job.images.numpy():
            images.append(png_image(image, size))
            labels.append(int(job.request_id))
    return images, labels


def evaluate(folder: Path, tokenizer: Any, lm: Any, *, bf16: bool = True) -> dict[str, Any]:
    heldout = heldout_split()
    pictures = to_uint8(heldout.images)
    labels = heldout.labels.tolist()
    sizes = [TRAIN_SIZES[i % len(TRAIN_SIZES)] for i in range(len(labels))]
    images = [png_image(p, s) for p, s in zip(pictures, sizes, strict=True)]
    results: dict[str, Any] = {"heldout_images": len(labels)}
    start = time.perf_counter()
    model = load_folder(folder, lm, torch.float32)
    results["heldout_fp32_canonical"] = accuracy(model, tokenizer, images, labels, [CANONICAL])
    results["heldout_fp32_all_layouts"] = accuracy(model, tokenizer, images, labels, list(LAYOUTS))
    dit_images, dit_labels = dit_digits()
    results["dit_images"] = len(dit_labels)
    results["dit_fp32_canonical"] = accuracy(model, tokenizer, dit_images, dit_labels, [CANONICAL])
    if bf16:
        model = model.to(torch.bfloat16)
        results["heldout_bf16_canonical"] = accuracy(model, tokenizer, images, labels, [CANONICAL])
    results["eval_seconds"] = round(time.perf_counter() - start, 1)
    return results


README = """# digits-vlm

A small vision-language model that names the digit in a picture: a Hugging Face LLaVA checkpoint
(`LlavaForConditionalGeneration`) made of

- the embedded default language model, SmolLM2-135M-Instruct, frozen. Its weights and tokenizer
  are **not stored here**: they are the embedded GGUF (`"pagemesh_text_weights": "default"` in
  config.json); `text_config` is that GGUF's LlamaConfig;
- a tiny CLIP vision tower (32x32 RGB in, 8x8 patches, {layers} layers, hidden {hidden}) whose
  last layer's 16 patch features (`vision_feature_layer` -1, strategy "default": CLS dropped)
  go through
- the LLaVA projector (gelu MLP {hidden} -> 576 -> 576): 16 image tokens.

`model.safetensors` holds only `vision_tower.*` and `multi_modal_projector.*` ({parameters:,}
parameters, bf16), under the names `save_pretrained` writes.

**Prompt.** SmolLM2 has no `<image>` token: the placeholder is `<empty_output>` (id 16,
`image_token_index`), a special token the chat model never emits. The prompt is the GGUF's chat
template (its default system prompt included) over one user message whose content is the
placeholder and the user's text joined by "\\n" in their order, e.g. `<empty_output>\\nWhat digit
is this?`, with the generation prompt; the one placeholder is expanded to 16 before the model
sees it. The answer is the numeral and end of turn: `7<|im_end|>`.

**Images.** `preprocessor_config.json` is a CLIPImageProcessor (the PIL one; torchvision is not
needed): RGB, shortest edge to 32 with BOX resampling, center crop 32x32, rescale, CLIP's
mean/std. BOX gives a digit upscaled nearest-neighbour from 8x8 to any multiple of 32 px (the
DiT's PNGs: 64, 128, 256, 512) back as exact 4x4 blocks.

## Training

    python -P -m pagemesh.workers.diffusion.training.train_digits_vlm --out DIR

workers/diffusion/training/train_digits_vlm.py, seeded: {total:.0f} s in all on {threads} CPU
thread of a shared 2-core machine (torch {torch}), then {eval_seconds} s of evaluation. Data:
scikit-learn's digits in the split of workers/diffusion/training/digits_data.py (1,497 train,
300 held out); each training image and its eight one-pixel shifts as greyscale PNGs of a random
size in 32-256 px (workers/diffusion/png.py), through the image processor.

1. A soft prompt (16 embeddings) per digit that makes the frozen language model answer it, in
   every layout: "What digit is this?", "Which number is shown in the image?", "Name the
   digit.", "What is this?", "Read the digit in this picture." before or after the image, and
   the image alone. Loss on the answer tokens only, under noise and blends towards the other
   digits' prompts: {prompt_steps} steps of {prompt_rows} rows, {prompt_seconds:.0f} s, final loss {prompt_loss}.
2. The vision tower and the projector (AdamW) make each image its digit's prompt: squared error
   and a softmax over the distances to the ten prompts, plus a linear probe on the tower (not
   shipped). {vision_steps} steps of {vision_batch} images, {vision_seconds:.0f} s, final loss {vision_loss}.
3. The tower and the projector on the answer loss through the frozen language model (the system
   prompt's keys and values, the same in every row, computed once): {steps} steps of
   {batch_size}, {answer_seconds:.0f} s, final loss {answer_loss}.

## Accuracy

Greedy answers of this folder loaded as HF loads it (the language model from the GGUF), right
when exactly `<digit><|im_end|>`:

| images | prompt | fp32 | bf16 |
| --- | --- | --- | --- |
| {n_heldout} held-out digits, PNG 32-256 px | `<image>\\nWhat digit is this?` | {h32} | {h16} |
| {n_heldout} held-out digits, PNG 32-256 px | each of the 11 layouts in turn | {all32} | |
| {n_dit} digits by digits-dit (10 per class, defaults), PNG 256 px | `<image>\\nWhat digit is this?` | {dit32} | |

The DiT's digits are counted against the class asked for, whether or not the DiT drew it well.
The model knows only digits like scikit-learn's 8x8 scans (light strokes on black); any other
picture still gets a digit.
"""


def write_readme(out: Path, trained: dict[str, Any], results: dict[str, Any]) -> None:
    """DIR/README.md: what the folder is, how it was trained (this run's record), its accuracy."""
    from safetensors.torch import load_file

    def percent(key: str) -> str:
        return f"{100 * results[key]:.1f}%" if key in results else "not measured"

    text = README.format(
        layers=trained["vision_layers"],
        hidden=trained["vision_hidden"],
        parameters=sum(t.numel() for t in load_file(out / "model.safetensors").values()),
        total=trained["total_seconds"],
        threads=trained["threads"],
        torch=trained["torch"],
        eval_seconds=results.get("eval_seconds", "no"),
        prompt_steps=trained["prompt_steps"],
        prompt_rows=trained["prompt_rows"],
        prompt_seconds=trained["prompts"]["seconds"],
        prompt_loss=trained["prompts"]["loss"],
        vision_steps=trained["vision_steps"],
        vision_batch=trained["vision_batch"],
        vision_seconds=trained["vision"]["seconds"],
        vision_loss=trained["vision"]["loss"],
        steps=trained["steps"],
        batch_size=trained["batch_size"],
        answer_seconds=trained["answers"]["seconds"],
        answer_loss=trained["answers"]["loss"],
        n_heldout=results.get("heldout_images", 300),
        n_dit=results.get("dit_images", 100),
        h32=percent("heldout_fp32_canonical"),
        h16=percent("heldout_bf16_canonical"),
        all32=percent("heldout_fp32_all_layouts"),
        dit32=percent("dit_fp32_canonical"),
    )
    (out / "README.md").write_text(text)
