"""The encoder step's plan (issue 32): which placeholder rows of a step take which image's rows,
which images are encoded first and which are forgotten (workers/engine/encoder_cache.py,
model_input.py), and an M-RoPE prompt's positions. Pure logic, exact expectations."""

from __future__ import annotations

from pagemesh.common.messages import ImageInput
from pagemesh.common.multimodal import MRopePositions
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.encoder_cache import EncoderCache
from pagemesh.workers.engine.model_input import build_model_input
from pagemesh.workers.engine.scheduler import ScheduledChunk, StepPlan
from pagemesh.workers.engine.sequence import Sequence


def image(name: str, offset: int, length: int) -> ImageInput:
    return ImageInput(digest=name * 64, offset=offset, length=length, data=name.encode(), grid=[])


def seq(n: int, images: list[ImageInput], mrope: MRopePositions | None = None) -> Sequence:
    return Sequence("r", 0, [7] * n, n, SamplingParams(), images=images, mrope=mrope)


def test_a_chunk_that_cuts_through_an_image_takes_its_rows_from_where_it_left_off():
    a, b = image("a", 2, 6), image("b", 10, 4)
    s = seq(16, [a, b])
    first = build_model_input(StepPlan([ScheduledChunk(s, 0, 5)]))
    assert first.image_rows == [(2, "a" * 64, 0, 3)]  # rows 2..4: a's rows 0..2
    assert first.image_encode == [a]
    second = build_model_input(StepPlan([ScheduledChunk(s, 5, 8)]))
    assert second.image_rows == [(0, "a" * 64, 3, 3), (5, "b" * 64, 0, 3)]
    assert second.image_encode == [a, b]
    # behind a decode of another sequence: rows count from the step's first row
    other = seq(4, [])
    other.num_computed = 3
    both = build_model_input(StepPlan([ScheduledChunk(other, 3, 1), ScheduledChunk(s, 13, 3)], num_decodes=1))
    assert both.image_rows == [(1, "b" * 64, 3, 1)]


def test_the_same_image_in_many_sequences_is_encoded_once_while_held():
    cache = EncoderCache(capacity=10)
    a, a_again, b, c = image("a", 0, 4), image("a", 9, 4), image("b", 0, 4), image("c", 0, 4)
    assert cache.plan([a, a_again]) == ([a], [])
    assert cache.plan([a_again]) == ([], [])  # held: a hit
    assert cache.plan([b]) == ([b], [])
    assert cache.plan([c]) == ([c], ["a" * 64])  # 12 rows > 10: the least recently used goes
    assert cache.plan([b, image("d", 0, 12)]) == ([image("d", 0, 12)], ["c" * 64])  # b is needed: kept
    assert (cache.encoded, cache.hits) == (4, 2)
    assert "b" * 64 in cache and cache.rows == 16  # over the capacity while one step needs it all


def test_mrope_rows_are_the_prompts_own_then_shifted_text_positions():
    prompt = ([0, 1, 1, 1, 1, 3], [0, 1, 1, 2, 2, 3], [0, 1, 2, 1, 2, 3])  # a 2x2 image at 1..4
    positions = MRopePositions(prompt, delta=-2)
    assert positions.rows(4, 4) == [[1, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5]]
    s = seq(6, [image("a", 1, 4)], positions)
    s.token_ids.append(9)
    step = build_model_input(StepPlan([ScheduledChunk(s, 5, 2)]))
    assert step.mrope_positions == [[3, 4], [3, 4], [3, 4]]  # index 6: 6 + delta
    text = seq(3, [])  # a text-only sequence beside it: its own positions on all three
    both = build_model_input(StepPlan([ScheduledChunk(s, 0, 3), ScheduledChunk(text, 0, 3)]))
    assert both.mrope_positions == [[0, 1, 1, 0, 1, 2], [0, 1, 1, 0, 1, 2], [0, 1, 2, 0, 1, 2]]
    assert build_model_input(StepPlan([ScheduledChunk(text, 0, 3)])).mrope_positions == []
