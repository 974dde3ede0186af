"""A chat's images placed in its prompt (common/multimodal.py has the whole path).

    messages  "Look: \\ue000 and \\ue000?"           IMAGE_MARK where each image part stood
    text      "Look: <image> and <image>?"          the model's image prompt text (Qwen2-VL:
                                                    <|vision_start|><|image_pad|><|vision_end|>)
    ids       [.., 32000, .., 32000, ..]            the chat template, then the tokenizer
    prompt    [.., 32000 × 576, .., 32000 × 576, ..] each image token widened to its placeholders,
                                                    one ImageInput per image (offset, length)

Each image is decoded here once (a corrupt file is the client's 400, not a worker's failure)
for its size, which decides its placeholder count where the model's encoder takes any size.
"""

from __future__ import annotations

import io

from PIL import Image, UnidentifiedImageError

from pagemesh.common.messages import ImageInput
from pagemesh.common.multimodal import IMAGE_MARK, ImageSpec, image_digest
from pagemesh.common.tokenizer import Tokenizer

MAX_IMAGE_PIXELS = 8192 * 8192  # a decoded image larger than this is refused before its pixels are read


class ImagePrompts:
    """Puts a request's images into its chat: `render` swaps each IMAGE_MARK for the model's
    image prompt text, `place` widens the image tokens of the tokenized prompt and describes
    each image (`ImageInput`). Raises ValueError (the client's 400, naming `messages`)."""

    def __init__(self, spec: ImageSpec, tokenizer: Tokenizer):
        self.spec = spec
        ids = [i for i in (spec.start_token_id, spec.image_token_id, spec.end_token_id) if i is not None]
        self.prompt_text = "".join(tokenizer.token_text(i) for i in ids)

    def render(self, messages: list[dict], count: int) -> list[dict]:
        """The messages with each IMAGE_MARK replaced by the image prompt text; there must be
        `count` marks (the gateway put one per image)."""
        marks = sum(str(m.get("content") or "").count(IMAGE_MARK) for m in messages)
        if marks != count:
            raise ValueError(f"messages: {count} images but {marks} image parts")
        out = []
        for m in messages:
            content = m.get("content")
            out.append({**m, "content": content.replace(IMAGE_MARK, self.prompt_text)} if content else m)
        return out

    def place(self, ids: list[int], files: list[bytes]) -> tuple[list[int], list[ImageInput]]:
        """The prompt with each image token widened to its run of placeholders, and the images."""
        token = self.spec.image_token_id
        at = [i for i, t in enumerate(ids) if t == token]
        if len(at) != len(files):  # the text itself spelled the image token
            raise ValueError(
                f"messages: the prompt has {len(at)} image placeholder tokens for {len(files)} images; "
                "the text must not contain the model's image token"
            )
        out: list[int] = []
        images: list[ImageInput] = []
        last = 0
        for n, (pos, data) in enumerate(zip(at, files, strict=True)):
            width, height = _image_size(data, n)
            try:
                length, grid = self.spec.placeholders(width, height)
            except ValueError as e:
                raise ValueError(f"messages: image {n} ({width}x{height}) cannot be taken by this model: {e}") from None
            out += ids[last:pos]
            images.append(ImageInput(digest=image_digest(data), offset=len(out), length=length, data=data, grid=grid))
            out += [token] * length
            last = pos + 1
        out += ids[last:]
        return out, images


def _image_size(data: bytes, n: int) -> tuple[int, int]:
    """(width, height) of an image file, decoded in full so that a truncated or corrupt file is
    found here."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise ValueError(f"messages: image {n} is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels")
            image.load()
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as e:
        raise ValueError(f"messages: image {n} could not be decoded as an image ({type(e).__name__})") from None
    if width < 1 or height < 1:
        raise ValueError(f"messages: image {n} is empty")
    return width, height
