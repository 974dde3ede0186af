"""The embedded model that sees (issue 32): `pagemesh up --model digits-vlm` serves the default
language model with a vision tower trained on the digits (workers/llm/models/digits-vlm), beside
the diffusion worker of the default mesh (a prefill and a decode worker, the images' rows and
KV pages crossing between them). The DiT draws 100 digits through /v1/images/generations, ten of
each, and the VLM, given each PNG in a chat message through the official `openai` client, names
the digit; then 100 of scikit-learn's held-out digits, which neither model saw in training.
Each accuracy is printed (the figures of the closing note) and held to a floor below what the
training script measured, so a model that stops seeing fails here.
"""

from __future__ import annotations

import base64
import concurrent.futures
import io
import re

import numpy as np
import openai
import pytest
from PIL import Image

from pagemesh.bench.local_mesh import HANG_S, running_mesh

pytestmark = pytest.mark.slow

PER_DIGIT = 10
DIT_FLOOR = 0.80  # over the DiT's drawings: some are poor digits (the classifier judges them too)
HELDOUT_FLOOR = 0.90  # over scikit-learn's held-out digits
QUESTIONS = ("What digit is this?", "Which number is shown in the image?")


@pytest.fixture(scope="module")
def client():
    with running_mesh("--model", "digits-vlm", "--diffusion", "1") as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)


def ask(client: openai.OpenAI, png: bytes, question: str) -> str:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    chat = client.chat.completions.create(
        model="digits-vlm",
        messages=[
            {
                "role": "user",
                "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}],
            }
        ],
        max_tokens=4,
        temperature=0,
    )
    return chat.choices[0].message.content


def named_digit(answer: str) -> int | None:
    found = re.search(r"\d", answer)
    return int(found.group()) if found else None


def accuracy(client: openai.OpenAI, pngs: list[bytes], labels: list[int]) -> float:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda k: ask(client, pngs[k], QUESTIONS[k % 2]), range(len(pngs))))
    named = [named_digit(a) for a in answers]
    return sum(n == y for n, y in zip(named, labels, strict=True)) / len(labels)


def test_the_vlm_names_the_digits_the_dit_draws(client):
    pngs, labels = [], []
    for digit in range(10):
        drawn = client.images.generate(
            model="digits-dit", prompt=f"a handwritten {digit}", n=PER_DIGIT, extra_body={"seed": digit}
        )
        pngs += [base64.b64decode(d.b64_json) for d in drawn.data]
        labels += [digit] * PER_DIGIT
    score = accuracy(client, pngs, labels)
    print(f"digits-vlm on {len(pngs)} DiT drawings (the digit asked for): {score:.2%}")
    assert score >= DIT_FLOOR


def test_the_vlm_names_held_out_digits(client):
    from pagemesh.workers.diffusion.training.digits_data import heldout_split

    heldout = heldout_split()
    pngs, labels = [], []
    for image, label in list(zip(heldout.images, heldout.labels, strict=True))[:100]:
        pixels = ((np.asarray(image[0]) + 1) / 2 * 255).round().astype(np.uint8)  # [-1, 1] -> 0..255
        out = io.BytesIO()
        Image.fromarray(pixels).resize((256, 256), Image.Resampling.NEAREST).save(out, format="PNG")
        pngs.append(out.getvalue())
        labels.append(int(label))
    score = accuracy(client, pngs, labels)
    print(f"digits-vlm on {len(pngs)} held-out scikit-learn digits: {score:.2%}")
    assert score >= HELDOUT_FLOOR


def test_a_text_question_still_gets_text(client):
    chat = client.chat.completions.create(
        model="digits-vlm", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content.strip()
