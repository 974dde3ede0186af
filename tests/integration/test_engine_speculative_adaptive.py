"""Suffix decoding and the adaptive draft length on the real model (offline engine): greedy tokens
equal those of the same engine without speculation, earlier outputs feed later drafts, and a
batch far above the old 8-row cut-off still speculates."""

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.integration.test_engine_speculative import (
    FREE,
    QUOTING,
    SUMMARIZING,
    assert_same_outputs,
    speculating,
)
from pagemesh.workers.engine.speculative import SpeculativeConfig

pytestmark = pytest.mark.slow


AGENT = "Call the weather tool for Paris as JSON with the keys tool and city. Answer:"
CASES = [
    (QUOTING, SamplingParams(temperature=0, max_tokens=32, logprobs=2)),
    (QUOTING, SamplingParams(temperature=0, max_tokens=7)),  # cut mid-draft
    (QUOTING, SamplingParams(temperature=0, max_tokens=32, stop_token_ids=(260,))),  # " the": ends mid-draft
    (QUOTING, SamplingParams(temperature=0, max_tokens=16, n=2, repetition_penalty=1.2, min_tokens=5)),
    (SUMMARIZING, SamplingParams(temperature=0, max_tokens=16)),
    (FREE, SamplingParams(temperature=0, max_tokens=16)),
    (AGENT, SamplingParams(temperature=0, max_tokens=24)),
]


def test_suffix_greedy_outputs_equal_those_without_and_earlier_outputs_are_drafted_again(engine_fp32):
    prompts = [p for p, _ in CASES]
    params = [c for _, c in CASES]
    plain = engine_fp32.generate(prompts, params)
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    with speculating(engine_fp32, config) as stats:
        spec = engine_fp32.generate(prompts, params)
        assert_same_outputs(spec, plain, params)
        assert spec[2].finish_reasons == ["stop"] and spec[1].finish_reasons == ["length"]
        assert stats.passes > 0 and stats.accepted > 0.5 * stats.proposed, stats  # mostly quoting
        first = (stats.passes, stats.proposed, stats.accepted)
        # the same free-text requests again (an agent repeating itself): the cache of the first
        # run's outputs drafts them, which the requests' own text could not
        again = [FREE, AGENT]
        again_params = [params[5], params[6]]
        repeat = engine_fp32.generate(again, again_params)
        assert_same_outputs(repeat, [plain[5], plain[6]], again_params)
        accepted, proposed = stats.accepted - first[2], stats.proposed - first[1]
        assert accepted >= 20 and accepted > 0.8 * proposed, (accepted, proposed)
    assert sum(stats.accepted_per_pos) == stats.accepted and stats.accepted_per_pos[0] >= stats.accepted_per_pos[-1]
    assert engine_fp32.blocks.num_used_pages == 0
    engine_fp32.blocks.check_invariants([])


def test_a_batch_of_32_speculates_without_a_cut_off_and_keeps_greedy_outputs(engine_fp32):
    prompts = [QUOTING] * 32
    params = SamplingParams(temperature=0, max_tokens=12)
    plain = engine_fp32.generate(prompts, params)
    with speculating(engine_fp32, SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1)) as stats:
        spec = engine_fp32.generate(prompts, params)
    assert_same_outputs(spec, plain, [params] * 32)
    assert stats.passes >= 32 and stats.accepted > 0.5 * stats.proposed, stats  # 32 rows > the old cut-off of 8
    assert engine_fp32.blocks.num_used_pages == 0
