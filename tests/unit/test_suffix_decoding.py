"""SuffixDecoding's proposer (workers/engine/suffix_decoding.py), its config keys and the speculator's
use of it: drafts from the sequence itself and from a bounded cache of earlier outputs."""

import pytest

from pagemesh.workers.engine.speculative import SpeculativeConfig, Speculator
from pagemesh.workers.engine.suffix_decoding import SuffixCache, draft_from_sequence


def test_the_cache_proposes_the_most_frequent_continuation_of_the_longest_suffix():
    cache = SuffixCache(max_depth=8)
    cache.add([1, 2, 3, 4, 5])
    cache.add([9, 2, 3, 4, 6])
    cache.add([7, 2, 3, 4, 6])
    # "2 3 4" is followed by 6 twice, 5 once: 6 with probability 2/3
    tokens, score, matched = cache.draft([8, 2, 3, 4], 4, max_spec_factor=2.0, min_prob=0.1)
    assert tokens == [6] and score == pytest.approx(2 / 3) and matched == 3
    # the longer suffix "1 2 3 4" occurred once, followed by 5
    assert cache.draft([1, 2, 3, 4], 4, 2.0, 0.1)[0] == [5]
    assert cache.draft([42], 4, 2.0, 0.1) == ([], 0.0, 0)


def test_ties_go_to_the_most_recent_output_and_the_match_length_bounds_the_draft():
    cache = SuffixCache(max_depth=8)
    cache.add([1, 2, 3, 4, 5, 6])
    cache.add([1, 2, 7, 8, 9, 10])
    assert cache.draft([1, 2], 4, 1.0, 0.0)[0] == [7, 8]  # factor 1: as long as the 2-token match
    assert cache.draft([1, 2], 4, 2.0, 0.0)[0] == [7, 8, 9, 10]
    assert cache.draft([1, 2], 4, 2.0, 0.6)[0] == []  # 7 has probability 1/2 < 0.6


def test_the_cache_keeps_at_most_its_requests_and_takes_evicted_counts_back():
    cache = SuffixCache(max_depth=4, max_cached_requests=2)
    cache.add([1, 2, 3])
    nodes_one = cache.num_nodes
    cache.add([4, 5, 6])
    cache.add([7, 8, 9])  # evicts [1, 2, 3]
    assert len(cache.outputs) == 2 and cache.draft([1, 2], 4, 2.0, 0.0) == ([], 0.0, 0)
    assert cache.draft([4, 5], 4, 2.0, 0.0)[0] == [6]
    assert cache.num_nodes == 2 * nodes_one  # exactly the two cached outputs' substrings
    small = SuffixCache(max_depth=4, max_nodes=10)
    for i in range(5):
        small.add([10 * i + 1, 10 * i + 2, 10 * i + 3])
    assert small.num_nodes <= 10 and len(small.outputs) >= 1
    off = SuffixCache(max_cached_requests=0)
    off.add([1, 2, 3])
    assert off.num_nodes == 0


def test_the_sequence_itself_votes_over_its_recent_occurrences():
    # "5 6" occurred three times: followed by 8, then 7 2, then 7 1 (most recent first)
    tokens = [5, 6, 7, 1, 5, 6, 7, 2, 5, 6, 8, 3, 5, 6]
    got, score, matched = draft_from_sequence(tokens, 4, max_depth=8, max_spec_factor=1.0, min_prob=0.1)
    assert matched == 2 and got == [7, 2]  # 7 by 2 votes of 3; then 2 or 1 (one vote each): 2, the latest
    assert score == pytest.approx(2 / 3 + 2 / 3 * 1 / 2)
    # a longer repeated suffix wins over frequency: "3 5 6" occurred once, before nothing else
    assert draft_from_sequence([3, 5, 6, 9, 3, 5, 6], 2, 8, 1.0, 0.1)[0] == [9, 3]
    assert draft_from_sequence([1, 2, 3], 4, 8, 1.0, 0.1) == ([], 0.0, 0)


def test_config_takes_vllms_suffix_keys_and_refuses_bad_ones():
    cfg = SpeculativeConfig.from_json(
        '{"method": "suffix", "suffix_decoding_max_tree_depth": 16, "suffix_decoding_max_cached_requests": 100,'
        ' "suffix_decoding_max_spec_factor": 2.0, "suffix_decoding_min_token_prob": 0.2}'
    )
    assert cfg.num_speculative_tokens == 16  # vLLM: defaults to the tree depth for suffix
    assert SpeculativeConfig.from_json(cfg.to_json()) == cfg
    assert SpeculativeConfig.from_json('{"method": "ngram"}').max_decode_rows is None  # no cut-off
    for text, field in [
        ('{"method": "suffix", "suffix_decoding_min_token_prob": 1.5}', "min_token_prob"),
        ('{"method": "suffix", "suffix_decoding_max_spec_factor": 0}', "max_spec_factor"),
        ('{"method": "suffix", "suffix_decoding_max_tree_depth": 0}', "max_tree_depth"),
        ('{"method": "suffix", "suffix_decoding_max_cached_requests": -1}', "max_cached_requests"),
        ('{"method": "suffix", "suffix_decoding_tree": 3}', "unknown keys"),
    ]:
        with pytest.raises(ValueError, match=field):
            SpeculativeConfig.from_json(text)


def test_finished_outputs_feed_the_speculators_cache_and_aborts_do_not():
    spec = Speculator(SpeculativeConfig(method="suffix", num_speculative_tokens=4), 1024)
    prompt = [100, 101, 102]
    assert spec.drafts(prompt + [1, 2, 3], 4) == []
    spec.finished(1, [1, 2, 3, 4, 5, 6, 7], "stop")
    spec.finished(2, [1, 2, 3, 9, 9, 9, 9], "abort")
    assert spec.drafts([200, 1, 2, 3], 4) == [4, 5, 6]  # a 3-token match: at most 3 (factor 1)
    # the sequence's own text wins where it matches longer
    own = [50, 1, 2, 3, 8, 8, 8, 8, 51, 50, 1, 2, 3]
    assert spec.drafts(own, 4) == [8, 8, 8, 8]
    # equal scores (one occurrence each: probability 1 a token): the longer match wins
    spec.finished(3, [60, 61, 62, 63, 64, 65, 66, 67, 68], "length")
    echo = [62, 70, 62, 63, 64, 65, 66]  # own: "62" -> 70 (1-token match, 1 token); cache: "62 .. 66" -> 67 68
    assert spec.drafts(echo, 2) == [67, 68]
    assert Speculator(SpeculativeConfig(), 64).suffix_cache is None
