"""Images on their way in (issue 32): the gateway's image_url parts and limits (gateway/media.py,
gateway/parsing.py), the tokenizer's placement of each image's placeholders (services/tokenizer/
images.py, with the default model's real tokenizer and digits-vlm's image token), the prefix
cache's keys over images (common/multimodal.py), and ImageInput on the wire."""

from __future__ import annotations

import base64
import dataclasses
import io

import pytest
from PIL import Image

from pagemesh.common import protocol
from pagemesh.common.messages import GenerateRequest, ImageInput, RequestFailed, ScheduleRequest
from pagemesh.common.multimodal import IMAGE_MARK, ImageSpec, hash_token_ids, image_digest
from pagemesh.common.page_hash import prefix_page_hashes
from pagemesh.common.sampling import SamplingParams
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.media import MediaPolicy
from pagemesh.gateway.parsing import parse_chat
from pagemesh.services.tokenizer.core import TokenizerCore
from pagemesh.services.tokenizer.images import ImagePrompts
from pagemesh.tests.default_model import tokenizer as default_tokenizer

TOKENIZER = default_tokenizer()
SPEC = ImageSpec("llava", image_token_id=16, tokens_per_image=5)  # digits-vlm's token: <empty_output>


def png(color: int = 0, size: tuple[int, int] = (8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("L", size, color).save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat(*parts, role="user") -> dict:
    return {"messages": [{"role": role, "content": list(parts)}], "max_tokens": 4}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


# ---- gateway ---------------------------------------------------------------------------------


def test_image_parts_leave_a_mark_in_the_text_and_their_urls_in_order():
    parsed = parse_chat(chat(image_part("data:a"), {"type": "text", "text": "Which?"}, image_part("data:b")))
    assert parsed.messages[0]["content"] == f"{IMAGE_MARK}\nWhich?\n{IMAGE_MARK}"
    assert parsed.image_urls == ("data:a", "data:b")


@pytest.mark.parametrize(
    "body, param, words",
    [
        (chat(image_part("data:a"), role="assistant"), "messages[0].content", "only text content parts"),
        (chat({"type": "image_url", "image_url": {"url": "data:a", "size": 3}}),
         "messages[0].content[0].image_url", "unknown"),
        (chat({"type": "image_url", "image_url": {}}), "messages[0].content[0].image_url", "required"),
        (chat({"type": "text", "text": f"a {IMAGE_MARK}"}), "messages[0].content", "U+E000"),
        (chat({"type": "input_audio", "input_audio": {}}), "messages[0].content", "text and image_url"),
    ],
)  # fmt: skip
def test_bad_image_parts_are_400s_naming_the_field(body, param, words):
    with pytest.raises(ApiError) as e:
        parse_chat(body)
    assert e.value.param == param and words in e.value.message


def test_media_policy_decodes_data_urls_and_holds_its_limits(tmp_path):
    image = png()
    assert MediaPolicy().load((data_url(image),) * 2) == [image, image]
    with pytest.raises(ApiError, match="at most 1 per prompt"):
        MediaPolicy(images_per_prompt=1).load((data_url(image),) * 2)
    with pytest.raises(ApiError, match="at most 10 bytes"):
        MediaPolicy(max_image_bytes=10).load((data_url(image),))
    for url, words in [
        ("http://example.com/a.png", "not fetched"),
        ("data:image/png,abc", "must be base64"),
        ("data:image/png;base64,", "empty"),
        ("ftp://x", "must be a data: URL"),
        (f"file://{tmp_path}/a.png", "--allowed-local-media-path"),
    ]:
        with pytest.raises(ApiError, match=words):
            MediaPolicy().load((url,))


def test_local_files_only_under_the_allowed_folder(tmp_path):
    root = tmp_path / "media"
    root.mkdir()
    (root / "a.png").write_bytes(png())
    (tmp_path / "secret.png").write_bytes(png(255))
    (root / "link.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_media_path=root)
    assert policy.load((f"file://{root}/a.png",)) == [png()]
    for outside in (f"file://{root}/../secret.png", f"file://{root}/link.png", f"file://{root}/none.png"):
        with pytest.raises(ApiError):
            policy.load((outside,))


# ---- tokenizer -------------------------------------------------------------------------------


def request(messages, images) -> GenerateRequest:
    return GenerateRequest(
        request_id="r1",
        model="m",
        prompt_text=None,
        prompt_token_ids=None,
        messages=messages,
        sampling=SamplingParams(max_tokens=4).validate(),
        stream=False,
        reply_to="ipc:///tmp/gw",
        arrival_time=0.0,
        include_stop_str_in_output=False,
        images=images,
    )


def test_each_image_becomes_its_run_of_placeholders():
    core = TokenizerCore(TOKENIZER, 512, "ipc:///tmp/out", images=ImagePrompts(SPEC, TOKENIZER))
    a, b = png(0), png(200, (16, 24))
    messages = [{"role": "user", "content": f"{IMAGE_MARK}\nand\n{IMAGE_MARK}\nWhich digits?"}]
    out = core.admit(request(messages, [a, b]))
    assert isinstance(out, ScheduleRequest)
    ids = out.prompt_token_ids
    text_only = TOKENIZER.encode_chat(
        [{"role": "user", "content": "<empty_output>\nand\n<empty_output>\nWhich digits?"}]
    )
    assert len(ids) == len(text_only) + 2 * (5 - 1)
    first, second = out.images
    assert (first.digest, second.digest) == (image_digest(a), image_digest(b))
    assert ids[first.offset : first.offset + 5] == [16] * 5 and ids[second.offset : second.offset + 5] == [16] * 5
    assert ids[: first.offset] == text_only[: first.offset]  # the text around them as the template made it
    assert second.offset > first.offset + 5 and first.data == a


@pytest.mark.parametrize(
    "content, images, words",
    [
        (f"{IMAGE_MARK} hi", [b"not an image"], "could not be decoded"),
        (f"{IMAGE_MARK} hi", [png()[:30]], "could not be decoded"),  # truncated
        ("<empty_output> hi", [png()], "1 images but 0 image parts"),  # the mark is missing: a mismatch
        (f"{IMAGE_MARK} <empty_output>", [png()], "must not contain the model's image token"),
    ],
)
def test_an_image_the_model_cannot_take_is_a_400(content, images, words):
    core = TokenizerCore(TOKENIZER, 512, "ipc:///tmp/out", images=ImagePrompts(SPEC, TOKENIZER))
    out = core.admit(request([{"role": "user", "content": content}], images))
    assert isinstance(out, RequestFailed) and out.status == 400, out
    assert words in out.message and out.param == "messages"
    assert len(core) == 0


def test_a_text_only_model_refuses_images():
    core = TokenizerCore(TOKENIZER, 512, "ipc:///tmp/out")
    out = core.admit(request([{"role": "user", "content": f"{IMAGE_MARK} hi"}], [png()]))
    assert isinstance(out, RequestFailed) and "does not take images" in out.message


def test_qwen2_vl_placeholders_follow_the_image_size():
    spec = ImageSpec("qwen2_vl", 318, 317, 319, min_pixels=56 * 56, max_pixels=28 * 28 * 16)
    assert spec.placeholders(56, 56) == (4, [1, 4, 4])
    assert spec.placeholders(84, 56) == (6, [1, 4, 6])  # width 84: six patch columns, merged 2x2
    assert spec.placeholders(2000, 2000)[0] == 16  # shrunk to max_pixels


# ---- prefix-cache keys and the wire -----------------------------------------------------------


def image_at(data: bytes, offset: int, length: int) -> ImageInput:
    return ImageInput(digest=image_digest(data), offset=offset, length=length, data=data, grid=[])


def test_page_keys_tell_images_apart_behind_the_same_placeholders():
    ids = [1] * 4 + [16] * 20 + [2] * 20
    a, b = image_at(png(0), 4, 20), image_at(png(9), 4, 20)
    keys_a = prefix_page_hashes(hash_token_ids(ids, [a]), 16)
    keys_b = prefix_page_hashes(hash_token_ids(ids, [b]), 16)
    assert keys_a == prefix_page_hashes(hash_token_ids(ids, [a]), 16)  # the same image: the same keys
    assert not set(keys_a) & set(keys_b)  # every page from the image's on differs
    assert hash_token_ids(ids, []) == ids and min(hash_token_ids(ids, [a])) < 0


def test_image_inputs_cross_the_wire_and_bad_ones_are_refused():
    msg = ScheduleRequest(
        request_id="r",
        prompt_token_ids=[1] * 30,
        sampling=SamplingParams(),
        reply_to="x",
        arrival_time=0.0,
        images=[image_at(png(), 2, 5), image_at(png(3), 10, 5)],
    )
    assert protocol.decode(protocol.encode(msg)) == msg
    for bad in (
        [image_at(png(), 28, 5)],  # past the prompt
        [image_at(png(), 2, 5), image_at(png(3), 4, 5)],  # overlapping
    ):
        with pytest.raises(protocol.ProtocolError):
            protocol.decode(protocol.encode(dataclasses.replace(msg, images=bad)))


def test_a_responses_input_image_becomes_an_image_url_part():
    from pagemesh.gateway.openai_responses import parse_responses

    parts = [{"type": "input_image", "image_url": "data:image/png;base64,AAA"}, {"type": "input_text", "text": "hi"}]
    parsed = parse_responses({"model": "m", "input": [{"role": "user", "content": parts}]})
    assert parsed.image_urls == ("data:image/png;base64,AAA",)
    assert parsed.messages[-1]["content"] == f"{IMAGE_MARK}\nhi"
    with pytest.raises(ApiError, match="file_id: not supported"):
        parse_responses(
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}
        )
