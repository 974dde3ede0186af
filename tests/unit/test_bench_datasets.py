"""pagemesh.bench.loadgen.datasets with the default model's tokenizer: exact lengths, stable tokens."""

from __future__ import annotations

import itertools
import random

import pytest

from pagemesh.bench.loadgen.datasets import (
    Conversation,
    DatasetSpec,
    Segment,
    Turn,
    build_prompt,
    chat_messages,
    conversations,
    length_bounds,
    random_segment,
)
from pagemesh.tests.default_model import tokenizer as default_tokenizer


def _take(spec, n):
    return list(itertools.islice(conversations(spec, default_tokenizer()), n))


@pytest.mark.parametrize("length", [1, 7, 32, 128, 512])
def test_random_segment_has_the_length_and_reencodes_to_the_same_ids(length):
    rng = random.Random(length)
    for _ in range(5):
        segment = random_segment(default_tokenizer(), length, rng)
        assert len(segment.ids) == length
        assert default_tokenizer().encode(segment.text, add_special_tokens=False) == list(segment.ids)
        assert default_tokenizer().decode(segment.ids) == segment.text


def test_random_dataset_lengths_are_fixed_without_a_range():
    convs = _take(DatasetSpec("random", input_len=128, output_len=16, seed=3), 20)
    assert all(len(c.turns) == 1 and c.system is None and not c.chat for c in convs)
    assert {len(c.turns[0].user.ids) for c in convs} == {128}
    assert {c.turns[0].output_len for c in convs} == {16}
    for c in convs[:5]:
        text_prompt = build_prompt(c, 0, [], default_tokenizer(), chat_endpoint=False, as_token_ids=False)
        id_prompt = build_prompt(c, 0, [], default_tokenizer(), chat_endpoint=False, as_token_ids=True)
        assert text_prompt.prompt_len == id_prompt.prompt_len == 128
        assert default_tokenizer().encode(text_prompt.text) == id_prompt.ids


def test_range_ratio_bounds_and_spread():
    assert length_bounds(100, 0.25) == (75, 125)
    assert length_bounds(10, 0.33) == (6, 14)
    assert length_bounds(1, 0.9) == (1, 2)
    convs = _take(DatasetSpec("random", input_len=40, output_len=20, range_ratio=0.5, seed=1), 200)
    inputs = [len(c.turns[0].user.ids) for c in convs]
    outputs = [c.turns[0].output_len for c in convs]
    assert min(inputs) >= 20 and max(inputs) <= 60 and len(set(inputs)) > 20
    assert min(outputs) >= 10 and max(outputs) <= 30 and len(set(outputs)) > 10


def test_same_seed_same_data_other_seed_other_data():
    a = _take(DatasetSpec(seed=7, input_len=16), 3)
    assert a == _take(DatasetSpec(seed=7, input_len=16), 3)
    assert a != _take(DatasetSpec(seed=8, input_len=16), 3)


def test_shared_prefix_is_one_system_prompt_with_distinct_suffixes():
    convs = _take(DatasetSpec("shared-prefix", input_len=16, output_len=4, prefix_len=64), 4)
    assert len({c.system for c in convs}) == 1 and len(convs[0].system.ids) == 64
    assert len({c.turns[0].user for c in convs}) == 4
    prompt = build_prompt(convs[0], 0, [], default_tokenizer(), chat_endpoint=False, as_token_ids=True)
    assert prompt.ids == list(convs[0].system.ids) + list(convs[0].turns[0].user.ids) and prompt.prompt_len == 80
    chat = build_prompt(convs[0], 0, [], default_tokenizer(), chat_endpoint=True, as_token_ids=False)
    assert chat.messages == [
        {"role": "system", "content": convs[0].system.text},
        {"role": "user", "content": convs[0].turns[0].user.text},
    ]
    assert chat.prompt_len == len(default_tokenizer().encode_chat(chat.messages))


def test_multi_turn_prompts_carry_earlier_replies():
    [conv] = _take(DatasetSpec("multi-turn", input_len=12, output_len=5, turns=3), 1)
    assert conv.chat and len(conv.turns) == 3
    replies = ["first reply", "second reply"]
    messages = chat_messages(conv, 2, replies)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert [messages[1]["content"], messages[3]["content"]] == replies
    assert messages[4]["content"] == conv.turns[2].user.text
    lens = [
        build_prompt(conv, t, replies[:t], default_tokenizer(), chat_endpoint=False, as_token_ids=True).prompt_len
        for t in range(3)
    ]
    assert lens[0] < lens[1] < lens[2]
    text = build_prompt(conv, 1, replies[:1], default_tokenizer(), chat_endpoint=False, as_token_ids=False)
    assert text.text == default_tokenizer().apply_chat_template(chat_messages(conv, 1, replies[:1]))
    with pytest.raises(ValueError, match="earlier replies"):
        chat_messages(conv, 2, replies[:1])


def test_token_ids_need_the_completions_endpoint_and_specs_are_checked():
    conv = Conversation((Turn(Segment("hi", (1,)), 3),))
    with pytest.raises(ValueError, match="prompt-as-token-ids"):
        build_prompt(conv, 0, [], default_tokenizer(), chat_endpoint=True, as_token_ids=True)
    for bad in (dict(name="sharegpt"), dict(range_ratio=1.0), dict(input_len=0), dict(turns=0)):
        with pytest.raises(ValueError):
            DatasetSpec(**bad)
