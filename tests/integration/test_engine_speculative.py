"""N-gram speculative decoding on the real model (offline engine): the tokens are those of the
same engine without speculation, for every kind of request, and the pool is left clean."""

import contextlib

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.speculative import SpeculativeConfig, use_speculation

pytestmark = pytest.mark.slow

PARAGRAPH = (
    "The lighthouse keeper climbed the narrow stairs every evening at dusk. He lit the great lamp, "
    "wound the clockwork that turned the lens, and wrote the weather in a leather book. Ships passed "
    "the rocks safely for forty years, and nobody in the village ever learned his name."
)
PROMPTS = [
    f"Copy this text exactly.\nText: {PARAGRAPH}\nCopy: {PARAGRAPH[:60]}",  # quoting
    f"{PARAGRAPH}\nIn one sentence, the lighthouse keeper",  # summarizing
    "My favourite thing about autumn is",  # free text
]


@contextlib.contextmanager
def speculating(engine, config: SpeculativeConfig):
    """The session's engine with speculation on for the duration."""
    try:
        yield use_speculation(engine, config)
    finally:
        use_speculation(engine, None)


QUOTING, SUMMARIZING, FREE = PROMPTS
JSON_PROMPT = 'Answer in JSON.\n{"name": "lighthouse", "name": "lighthouse", "name": "'
NAMES = '{"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]+$"}}, "required": ["name"]}'
CASES = [  # (prompt, params): one batch, run with and without speculation
    (QUOTING, SamplingParams(temperature=0, max_tokens=32, logprobs=2)),
    (QUOTING, SamplingParams(temperature=0, max_tokens=7)),  # cut mid-draft
    (QUOTING, SamplingParams(temperature=0, max_tokens=16, n=2, repetition_penalty=1.2, min_tokens=5)),
    (QUOTING, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(260,))),  # " the": ends mid-draft
    (QUOTING, SamplingParams(temperature=0.7, seed=11, max_tokens=16)),
    (SUMMARIZING, SamplingParams(temperature=0, max_tokens=16)),
    (FREE, SamplingParams(temperature=0, max_tokens=16)),
    (JSON_PROMPT, SamplingParams(temperature=0, max_tokens=16, json_object=True)),  # a mask per draft position
    (JSON_PROMPT, SamplingParams(temperature=0, max_tokens=16, json_schema=NAMES)),
    (QUOTING, SamplingParams(temperature=0, max_tokens=16, structured=("regex", "[a-z ,.]+"))),
]


def assert_same_outputs(spec, plain, params) -> None:
    """Each request's tokens and finish reasons equal, and its logprobs where it asked for them."""
    for a, b, p in zip(spec, plain, params, strict=True):
        assert a.token_ids == b.token_ids, p
        assert a.finish_reasons == b.finish_reasons, p
        if p.logprobs:
            for got, want in zip(a.logprobs[0], b.logprobs[0]):
                assert got.token_id == want.token_id and got.top_ids == want.top_ids
                assert got.logprob == pytest.approx(want.logprob, abs=1e-3)


def test_greedy_and_seeded_outputs_equal_those_without_speculation(engine_fp32):
    prompts = [p for p, _ in CASES]
    params = [c for _, c in CASES]
    plain = engine_fp32.generate(prompts, params)
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, max_decode_rows=64)
    with speculating(engine_fp32, config) as stats:
        spec = engine_fp32.generate(prompts, params)
    assert_same_outputs(spec, plain, params)
    assert spec[3].finish_reasons == ["stop"] and spec[1].finish_reasons == ["length"]
    assert stats.accepted > 0.5 * stats.proposed, stats  # mostly quoting
    assert stats.mean_accepted_length > 2.0, stats
    assert engine_fp32.blocks.num_used_pages == 0
    engine_fp32.blocks.check_invariants([])


# ---- draft_quantized: the model's own Q4_1 weights propose --------------------------------------
CHAT = "Write a short story about a robot who learns to paint."
DRAFT_CASES = [  # (prompt, params, chat template)
    (CHAT, SamplingParams(temperature=0, max_tokens=24, logprobs=2), True),
    (FREE, SamplingParams(temperature=0, max_tokens=7), False),  # cut mid-draft (K=4: 1 + 5 + 1)
    (FREE, SamplingParams(temperature=0, max_tokens=12, n=2, repetition_penalty=1.2, min_tokens=5), False),
    (SUMMARIZING, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=(253,)), False),  # " a"
    (CHAT, SamplingParams(temperature=0.8, seed=5, max_tokens=12), True),
]


def test_quantized_draft_outputs_equal_those_without_speculation(engine_fp32):
    """Greedy and seeded outputs are the target's alone; the draft sees each prompt (acceptance
    on free text, which n-gram lookup gets ~0.2 of); the pool is left clean after the rollbacks."""
    encode = engine_fp32.tokenizer.encode_chat
    prompts = [encode([{"role": "user", "content": p}]) if chat else p for p, _, chat in DRAFT_CASES]
    params = [c for _, c, _ in DRAFT_CASES]
    plain = engine_fp32.generate(prompts, params)
    config = SpeculativeConfig(method="draft_quantized", num_speculative_tokens=4, max_decode_rows=64)
    try:
        with speculating(engine_fp32, config) as stats:
            spec = engine_fp32.generate(prompts, params)
        assert_same_outputs(spec, plain, params)
        assert spec[1].finish_reasons == ["length"] and len(spec[1].token_ids[0]) == 7
        assert spec[3].finish_reasons == ["stop"], spec[3]
        assert len(spec[2].token_ids) == 2
        # a 4-bit copy of the same model agrees with it most of the time, on any text
        assert stats.acceptance_rate > 0.5, stats
        assert stats.mean_accepted_length > 2.0, stats
        assert engine_fp32.blocks.num_used_pages == 0  # both pools' pages: one block table each
        engine_fp32.blocks.check_invariants([])
    finally:
        engine_fp32.drafter = None  # the session's other tests do not need its pool
