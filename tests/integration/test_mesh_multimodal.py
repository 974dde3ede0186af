"""Images into the LLM through the mesh (issue 32), driven by the official `openai` client.

For each architecture a tiny random checkpoint and its image processor are made at test time by
transformers (tests/multimodal_checkpoints.py) and served by `pagemesh up --model <folder>
--dtype float32`: LLaVA on the default prefill + decode mesh (its KV pages, keyed by the image,
cross to the decode worker), Qwen2-VL (M-RoPE, a placeholder count that depends on the size) on
one mixed worker with small prefill chunks that cut through the images. Six (image, prompt)
pairs, sent one after another so the prefix cache holds the earlier ones, each give Hugging
Face's greedy continuation: the same image behind another prompt, another image behind the same
prompt (a wrong prefix-cache hit would give the first image's answer), an image sent twice
(the second time from the prefix cache: cached_tokens). Each image changes HF's answer, so the
equality cannot come from images being ignored on both sides.
"""

from __future__ import annotations

import base64

import openai
import pytest

from pagemesh.bench.local_mesh import running_mesh
from pagemesh.tests.integration.conftest import openai_client
from pagemesh.tests.multimodal_checkpoints import IMAGE_TOKENS, chat_prompt_ids, hf_greedy_after_each, image_png, save

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
TEXTS = (list(range(10, 30)), [40, 41, 42, 43, 44])  # the first: a full page after any image
SIZES = {"llava": [(32, 32), (48, 40), (40, 64)], "qwen2_vl": [(56, 56), (84, 56), (112, 70)]}
FLAGS = {
    "llava": (),  # the default: one prefill and one decode worker
    "qwen2_vl": ("--mixed", "1", "--max-num-batched-tokens", "8"),  # chunks of 8 cut through every image
}
# (image, text) in the order sent: one image behind two prompts, two images behind one, a repeat
PAIRS = [(0, 0), (1, 0), (0, 1), (2, 1), (1, 1), (0, 0)]


def data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def answer_ids(chat, kind: str) -> list[int]:
    """The answer's token ids, from its logprobs' tokens (its text leaves out special tokens,
    which these random models do write: an image token now and then)."""
    specials = IMAGE_TOKENS[kind]
    return [specials.get(t.token.strip()) or int(t.token.strip()[1:]) for t in chat.choices[0].logprobs.content]


def image_message(png: bytes, text_ids: list[int]) -> list[dict]:
    text = " ".join(f"w{i}" for i in text_ids)
    parts = [{"type": "image_url", "image_url": {"url": data_url(png)}}, {"type": "text", "text": text}]
    return [{"role": "user", "content": parts}]


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def served(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(f"tiny-{kind}")
    hf, processor = save(kind, folder)
    flags = ("--model", str(folder), "--dtype", "float32", "--threads-per-worker", "1", *FLAGS[kind])
    with running_mesh(*flags) as url:
        client = openai_client(type("Mesh", (), {"url": url}))
        yield kind, hf, processor, client


def placeholders(kind: str, width: int, height: int) -> int:
    from pagemesh.common.mrope import image_grid, image_tokens
    from pagemesh.tests.multimodal_checkpoints import QWEN_PIXELS

    if kind == "llava":
        return 16
    return image_tokens(image_grid(height, width, 14, 2, QWEN_PIXELS["min_pixels"], QWEN_PIXELS["max_pixels"]))


def test_image_chats_give_hf_greedy_tokens(served):
    kind, hf, processor, client = served
    model = client.models.list().data[0].id
    pngs = [image_png(i, *size) for i, size in enumerate(SIZES[kind])]
    answers = []
    for image, text in PAIRS:
        chat = client.chat.completions.create(
            model=model,
            messages=image_message(pngs[image], TEXTS[text]),
            max_tokens=NEW_TOKENS,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True},
        )
        answer = answer_ids(chat, kind)
        prompt = chat_prompt_ids(kind, TEXTS[text], [placeholders(kind, *SIZES[kind][image])])
        assert chat.usage.prompt_tokens == len(prompt)
        assert answer == hf_greedy_after_each(hf, kind, processor, prompt, [pngs[image]], answer), (image, text)
        answers.append((answer, chat.usage))
    # every image moves the answer: the same prompt behind three images gives three answers
    assert len({tuple(answers[i][0]) for i in (2, 3, 4)}) == 3
    assert answers[5][0] == answers[0][0]
    details = answers[5][1].prompt_tokens_details
    assert details is not None and details.cached_tokens > 0  # the repeat came from the prefix cache


def test_two_images_in_one_message(served):
    kind, hf, processor, client = served
    model = client.models.list().data[0].id
    pngs = [image_png(10 + i, *size) for i, size in enumerate(SIZES[kind][:2])]
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs]
    parts.append({"type": "text", "text": "w30 w31"})
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": parts}],
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    answer = answer_ids(chat, kind)
    prompt = chat_prompt_ids(kind, [30, 31], [placeholders(kind, *s) for s in SIZES[kind][:2]])
    assert answer == hf_greedy_after_each(hf, kind, processor, prompt, pngs, answer)


@pytest.mark.parametrize(
    "url, says",
    [
        ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAAB", "could not be decoded"),  # a truncated PNG
        ("data:image/png;base64,@@@", "base64 is malformed"),
        ("https://example.com/cat.png", "not fetched"),
        ("file:///etc/hostname", "--allowed-local-media-path"),
        ("data:text/plain;base64,aGVsbG8=", "is not an image"),
    ],
)
def test_a_bad_image_is_a_400_naming_messages(served, url, says):
    _, _, _, client = served
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "w10"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert says in e.value.body["message"] and e.value.body["param"].startswith("messages")


def test_too_many_images_is_a_400(served):
    _, _, _, client = served
    png = data_url(image_png(0))
    content = [{"type": "image_url", "image_url": {"url": png}}] * 9  # the default limit is 8
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=[{"role": "user", "content": content}], max_tokens=2
        )
    assert "at most 8 per prompt" in e.value.body["message"]


def test_an_encoder_pool_sends_the_rows_and_the_answers_stay_hf(tmp_path):
    """Encode, prefill, decode disaggregation: `--prefill 1 --decode 1 --encoder 1`. The encoder
    worker encodes every image (its count of images encoded, on /status) and pushes the rows to
    the prefill worker, whose answers stay HF's."""
    import json
    import time
    import urllib.request

    kind = "llava"
    hf, processor = save(kind, tmp_path)
    flags = ("--model", str(tmp_path), "--dtype", "float32", "--threads-per-worker", "1", "--encoder", "1")
    with running_mesh(*flags) as url:
        client = openai_client(type("Mesh", (), {"url": url}))
        model = client.models.list().data[0].id
        for i, size in enumerate(SIZES[kind]):
            png = image_png(40 + i, *size)
            chat = client.chat.completions.create(
                model=model,
                messages=image_message(png, TEXTS[1]),
                max_tokens=NEW_TOKENS,
                temperature=0,
                logprobs=True,
                extra_body={"ignore_eos": True},
            )
            answer = answer_ids(chat, kind)
            prompt = chat_prompt_ids(kind, TEXTS[1], [16])
            assert answer == hf_greedy_after_each(hf, kind, processor, prompt, [png], answer)
        deadline = time.monotonic() + 30
        while True:  # the encoder worker's next heartbeat carries its count
            workers = json.load(urllib.request.urlopen(url + "/status"))["workers"]
            encoders = [w for w in workers if w["kind"] == "encoder"]
            if encoders and encoders[0]["produced"] >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert encoders and encoders[0]["produced"] == 3
