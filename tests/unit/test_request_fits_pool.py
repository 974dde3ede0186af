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


CONTEXT = RequestValidator(vocab_size=100, max_model_len=10)


def test_a_library_callers_request_gets_every_check_and_none_means_what_the_context_leaves():
    ids, params = CONTEXT.new_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=None, min_tokens=8))
    assert (ids, params.max_tokens, params.min_tokens) == ([1, 2, 3, 4], 6, 6)
    with pytest.raises(ValueError, match=r"max_tokens: prompt \(4 tokens\) \+ max_tokens \(7\) exceeds"):
        CONTEXT.new_request("r", [1, 2, 3, 4], SamplingParams(max_tokens=7))
    with pytest.raises(ValueError, match="temperature"):
        CONTEXT.new_request("r", [1], SamplingParams(temperature=-1.0))
    with pytest.raises(ValueError, match=r"prompt: token id 100 outside vocabulary"):
        CONTEXT.new_request("r", [100], SamplingParams())


def test_a_resumed_request_resumes_its_one_choice_or_each_of_several():
    assert RequestValidator.resumable([5, 6], (), SamplingParams(max_tokens=4)) == [(0, [5, 6])]
    several = SamplingParams(n=3, temperature=1.0, max_tokens=4)
    assert RequestValidator.resumable([], [(0, [5]), (2, [6, 7])], several) == [(0, [5]), (2, [6, 7])]
    with pytest.raises(ValueError, match="resumes by resumed_choices"):
        RequestValidator.resumable([5], (), SamplingParams(n=2, temperature=1.0))
    with pytest.raises(ValueError, match="below n"):
        RequestValidator.resumable([], [(3, [5])], several)
    with pytest.raises(ValueError, match="only a streamed request of several choices"):
        RequestValidator.resumable([], [(0, [5])], SamplingParams(n=2, best_of=3, temperature=1.0))
    with pytest.raises(ValueError, match="leave none of max_tokens"):
        RequestValidator.resumable([], [(0, [5, 6, 7, 8])], several)
    with pytest.raises(ValueError, match="leave none of max_tokens"):
        CONTEXT.check_output_ids([5, 6], SamplingParams(max_tokens=2))
