"""A request must fit the KV pool when it runs alone, or it waits (or is preempted and recomputed)
for ever: the validator refuses a prompt that cannot fit with one more token, and cuts a max_tokens
beyond the pool to what fits (the answer then ends with "length", as at the context length)."""

from __future__ import annotations

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.validation import RequestValidator

POOL = RequestValidator(vocab_size=100, max_model_len=1000, num_pages=19, page_size=4)  # 76 tokens


def test_a_prompt_that_fits_keeps_the_max_tokens_that_fit():
    params = SamplingParams(max_tokens=20)
    assert POOL.fit_pool(56, params) is params  # 76 tokens: exactly the pool


def test_a_max_tokens_beyond_the_pool_is_cut_to_what_fits():
    params = POOL.fit_pool(70, SamplingParams(max_tokens=500, min_tokens=10))
    assert (params.max_tokens, params.min_tokens) == (6, 6)


def test_a_prompt_that_cannot_fit_with_one_more_token_is_refused_naming_the_pool():
    with pytest.raises(ValueError, match=r"prompt: 76 tokens and one more do not fit .* \(19 pages of 4 tokens\)"):
        POOL.fit_pool(76, SamplingParams(max_tokens=1))
    params = SamplingParams(max_tokens=500)
    assert POOL.fit_pool(75, params, prefill_only=True) is params  # a prefill worker holds prompt + 1


def test_n_sequences_must_each_fit_alone_and_beams_side_by_side():
    assert POOL.fit_pool(40, SamplingParams(n=4, max_tokens=30, temperature=1.0)).max_tokens == 30
    # 4 beams of a 40-token prompt: 10 shared pages, 2 more each -> 8 tokens each
    assert POOL.fit_pool(40, SamplingParams(n=4, use_beam_search=True, max_tokens=30)).max_tokens == 8
    with pytest.raises(ValueError, match="4 beams of 70 tokens"):
        POOL.fit_pool(70, SamplingParams(n=4, use_beam_search=True, max_tokens=30))


def test_an_unbounded_pool_changes_nothing():
    params = SamplingParams(max_tokens=900)
    assert RequestValidator(vocab_size=100, max_model_len=1000).fit_pool(99, params) is params
