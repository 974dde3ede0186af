"""The encoder step inside one engine (issue 32), on the tiny LLaVA and Qwen2-VL checkpoints of
tests/multimodal_checkpoints.py: greedy tokens equal Hugging Face's with prefill chunks of 8
that cut through every image (a chunk takes the rows of the image where the last one stopped),
requests with different images batched in one step, ten requests sharing one image encode it
once, and a sequence preempted by recompute encodes its image again and still gives HF's tokens.
The mesh and the openai client: test_mesh_multimodal.py."""

from __future__ import annotations

import pytest

from pagemesh.common.messages import ImageInput
from pagemesh.common.multimodal import ImageSpec, image_digest
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.multimodal_checkpoints import chat_prompt_ids, hf_greedy_after_each, image_png, save

pytestmark = pytest.mark.slow

NEW_TOKENS = 10
SIZES = {"llava": [(32, 32), (48, 40), (40, 64)], "qwen2_vl": [(56, 56), (84, 56), (112, 70)]}


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny-{request.param}")
    hf, processor = save(request.param, folder)
    return request.param, folder, hf, processor


def engine_for(folder, **overrides):
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    config = dict(model=str(folder), dtype="float32", max_num_batched_tokens=8, max_prefill_chunk=8, num_pages=128)
    return Engine(EngineConfig(**(config | overrides)))


def image_request(kind: str, folder, png: bytes, size: tuple[int, int], text: list[int]):
    """(prompt ids, its ImageInput) as the tokenizer makes them for [image, text]."""
    length, grid = ImageSpec.from_folder(folder).placeholders(*size)
    prompt = chat_prompt_ids(kind, text, [length])
    offset = 1 if kind == "llava" else 2  # after w3 (and Qwen2-VL's vision start token)
    return prompt, ImageInput(digest=image_digest(png), offset=offset, length=length, data=png, grid=grid)


def run(engine) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            for s in o.outputs:
                out.setdefault(o.request_id, []).extend(s.new_token_ids)
    return out


def test_batched_image_requests_give_hf_greedy_tokens(checkpoint):
    kind, folder, hf, processor = checkpoint
    engine = engine_for(folder)
    pngs = [image_png(i, *s) for i, s in enumerate(SIZES[kind])]
    requests = {}
    for i, (png, size) in enumerate(zip(pngs, SIZES[kind])):
        prompt, image = image_request(kind, folder, png, size, list(range(10, 13 + 4 * i)))
        requests[f"r{i}"] = prompt, png
        engine.admit(
            f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), images=[image]
        )
    served = run(engine)
    for rid, (prompt, png) in requests.items():
        assert served[rid] == hf_greedy_after_each(hf, kind, processor, prompt, [png], served[rid]), rid
    assert len({tuple(t) for t in served.values()}) == 3
    engine.blocks.check_invariants([])


def test_ten_requests_sharing_an_image_encode_it_once(checkpoint):
    kind, folder, hf, processor = checkpoint
    engine = engine_for(folder, max_num_batched_tokens=256, max_prefill_chunk=256)
    png = image_png(5, *SIZES[kind][0])
    prompts = []
    for i in range(10):
        prompt, image = image_request(kind, folder, png, SIZES[kind][0], [10 + i, 20 + i])
        prompts.append(prompt)
        engine.admit(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), images=[image])
    served = run(engine)
    assert engine.encoder_cache.encoded == 1
    for i, prompt in enumerate(prompts):
        assert served[f"r{i}"] == hf_greedy_after_each(hf, kind, processor, prompt, [png], served[f"r{i}"])


def test_a_preempted_image_request_recomputes_to_hf_tokens(checkpoint):
    """A pool too small for all three: the scheduler preempts by recompute; a recomputed prompt
    needs its image's rows again (held in the encoder cache, or encoded again once dropped)."""
    kind, folder, hf, processor = checkpoint
    # no prefix cache: a recompute runs its whole prompt (its image's rows too) again
    engine = engine_for(folder, num_pages=8, page_size=8, enable_prefix_caching=False)
    engine.encoder_cache.capacity = 1  # nothing held past its step: a recompute encodes again
    requests = {}
    for i, size in enumerate(SIZES[kind]):
        png = image_png(20 + i, *size)
        prompt, image = image_request(kind, folder, png, size, [30 + i])
        requests[f"r{i}"] = prompt, png
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        engine.admit(f"r{i}", prompt, params, images=[image])
    served = run(engine)
    assert engine.scheduler.num_preemptions > 0
    assert engine.encoder_cache.encoded > 3  # an image encoded again for a recompute
    for rid, (prompt, png) in requests.items():
        assert served[rid] == hf_greedy_after_each(hf, kind, processor, prompt, [png], served[rid]), rid
    engine.blocks.check_invariants([])


def test_a_prompt_waits_for_an_encoder_workers_rows_or_encodes_after_the_deadline(checkpoint, monkeypatch):
    """`images_remote`: the prompt does not run before the rows come (receive_image_rows); rows
    that never come are encoded here once REMOTE_IMAGES_WAIT_S has passed."""
    import pagemesh.workers.engine.engine_images as engine_images
    from pagemesh.workers.model.loader import hf_folder_weights
    from pagemesh.workers.model.vision.encoder import ImageEncoder

    kind, folder, hf, processor = checkpoint
    engine = engine_for(folder)
    remote = ImageEncoder(folder, engine.runner.dtype, engine.runner.device)  # an encoder worker's tower
    remote.load(hf_folder_weights(folder))
    png = image_png(7, *SIZES[kind][1])
    prompt, image = image_request(kind, folder, png, SIZES[kind][1], [11, 12])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.admit("r", prompt, params, images=[image], images_remote=True)
    for _ in range(3):
        assert engine.step() == [] and engine.stalled  # waiting for the rows
    (rows,) = remote.encode([(png, image.grid)])
    engine.receive_image_rows("r", image.digest, rows)
    served = run(engine)["r"]
    assert served == hf_greedy_after_each(hf, kind, processor, prompt, [png], served)
    assert engine.encoder_cache.encoded == 0  # every row came from the other tower

    # rows that come before the request (the encoder worker beat the scheduler's other message)
    early = image_png(6, *SIZES[kind][2])
    prompt, image = image_request(kind, folder, early, SIZES[kind][2], [12])
    (rows,) = remote.encode([(early, image.grid)])
    engine.receive_image_rows("early", image.digest, rows)
    engine.admit("early", prompt, params, images=[image], images_remote=True)
    served = run(engine)["early"]
    assert served == hf_greedy_after_each(hf, kind, processor, prompt, [early], served)
    assert engine.encoder_cache.encoded == 0

    monkeypatch.setattr(engine_images, "REMOTE_IMAGES_WAIT_S", 0.0)
    late = image_png(8, *SIZES[kind][0])
    prompt, image = image_request(kind, folder, late, SIZES[kind][0], [13])
    engine.admit("late", prompt, params, images=[image], images_remote=True)
    served = run(engine)["late"]
    assert engine.encoder_cache.encoded == 1  # encoded here after the deadline
    assert served == hf_greedy_after_each(hf, kind, processor, prompt, [late], served)


def test_a_migrated_image_request_continues_where_it_was(checkpoint):
    """A request resumed on another engine (its worker lost: `output_token_ids`, what its client
    has) recomputes the prompt with its image and the tokens so far, and goes on with HF's."""
    kind, folder, hf, processor = checkpoint
    png = image_png(9, *SIZES[kind][2])
    prompt, image = image_request(kind, folder, png, SIZES[kind][2], [14, 15, 16])
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = engine_for(folder)
    first.admit("r", prompt, params, images=[image])
    whole = run(first)["r"]
    second = engine_for(folder)
    second.admit("r", prompt, params, output_token_ids=whole[:4], images=[image])
    rest = run(second)["r"]
    assert whole[:4] + rest == whole == hf_greedy_after_each(hf, kind, processor, prompt, [png], whole)
