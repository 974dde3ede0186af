"""pagemesh.bench.loadgen.metrics and .stream: summaries of hand-made timings, with exact numbers."""

from __future__ import annotations

import pytest

from pagemesh.bench.loadgen.metrics import latency_stats, parse_goodput, summarize
from pagemesh.bench.loadgen.stream import RequestResult, StreamAccumulator


def _result(prompt, out, ttft, latency, itl, success=True):
    return RequestResult(
        prompt_len=prompt,
        output_len=out,
        success=success,
        ttft=ttft,
        latency=latency,
        itl=list(itl),
        output_tokens=out,
        text="x" * out,
        error="" if success else "boom",
    )


RESULTS = [
    _result(10, 5, 0.1, 0.5, [0.1, 0.1, 0.1, 0.1]),  # TPOT (0.5-0.1)/4 = 0.1
    _result(20, 3, 0.2, 0.6, [0.3, 0.1]),  # TPOT (0.6-0.2)/2 = 0.2
    _result(30, 1, 0.3, 0.3, []),  # one token: no TPOT
    _result(40, 7, 0.0, 0.0, [], success=False),
]


def _summary(**kwargs):
    return summarize(RESULTS, 2.0, count_tokens=len, **kwargs)


def test_counts_and_throughputs():
    s = _summary()
    assert (s["completed"], s["failed"]) == (3, 1)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (60, 9)
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(34.5)
    assert s["request_goodput"] is None


def test_latency_statistics_interpolate_linearly():
    s = _summary()
    # TTFT 100, 200, 300 ms: p90 sits at rank 1.8, p99 at 1.98.
    assert [
        s[k] for k in ("mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms")
    ] == pytest.approx([200, 200, 200, 280, 298])
    assert s["std_ttft_ms"] == pytest.approx((20000 / 3) ** 0.5)
    # TPOT only from requests with more than one token: 100, 200 ms.
    assert [s[k] for k in ("mean_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")] == pytest.approx([150, 190, 199])
    # ITL: every gap of every successful request: 100 x5, 300.
    assert [s[k] for k in ("mean_itl_ms", "median_itl_ms", "p90_itl_ms", "p99_itl_ms")] == pytest.approx(
        [800 / 6, 100, 200, 290]
    )
    # E2EL 500, 600, 300 ms.
    assert [s[k] for k in ("mean_e2el_ms", "median_e2el_ms", "p90_e2el_ms", "p99_e2el_ms")] == pytest.approx(
        [1400 / 3, 500, 580, 598]
    )


@pytest.mark.parametrize(
    "slos, good",
    [
        ({"ttft": 250, "tpot": 150}, 1),  # only the first meets both
        ({"e2el": 400}, 1),  # only the one-token request
        ({"tpot": 0}, 1),  # a one-token request's TPOT counts as 0
        ({"ttft": 300, "e2el": 600}, 3),  # bounds are inclusive
        ({"ttft": 99}, 0),
    ],
)
def test_goodput_counts_requests_meeting_every_slo(slos, good):
    assert _summary(goodput_ms=slos)["request_goodput"] == pytest.approx(good / 2.0)


def test_missing_output_tokens_are_counted_from_text():
    r = _result(4, 0, 0.1, 0.4, [0.1, 0.1, 0.1])
    r.output_tokens, r.text = None, "abcd"
    s = summarize([r], 1.0, count_tokens=len)
    assert s["total_output_tokens"] == 4
    assert s["mean_tpot_ms"] == pytest.approx(100)


def test_custom_percentiles_and_empty_lists():
    stats = latency_stats("itl", [], [99.9])
    assert stats == {"mean_itl_ms": 0.0, "median_itl_ms": 0.0, "std_itl_ms": 0.0, "p99_9_itl_ms": 0.0}
    assert latency_stats("x", [0.001, 0.002], [25])["p25_x_ms"] == pytest.approx(1.25)


def test_parse_goodput():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:1e4"]) == {"ttft": 500.0, "tpot": 50.5, "e2el": 10000.0}
    for bad in ("ttft", "itl:5", "ttft:fast", "tpot:-1"):
        with pytest.raises(ValueError, match="goodput"):
            parse_goodput([bad])


def _stream(payloads):
    acc = StreamAccumulator(RequestResult(start=10.0))
    for at, payload in payloads:
        acc.feed(payload, at)
    return acc.finish(12.0)


def test_stream_completions_text_chunks_and_final_usage():
    r = _stream(
        [
            (10.5, {"choices": [{"text": "a"}]}),
            (10.75, {"choices": [{"text": "b"}]}),
            (11.0, {"choices": [{"text": "c", "finish_reason": "length"}]}),
            (11.1, {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}),
        ]
    )
    assert r.success and r.text == "abc" and r.chunks == 3
    assert (r.ttft, r.latency, r.output_tokens, r.server_prompt_tokens) == (0.5, 2.0, 3, 7)
    assert r.itl == [0.25, 0.25]


def test_stream_chat_role_chunk_is_not_the_first_token():
    r = _stream(
        [
            (10.1, {"choices": [{"delta": {"role": "assistant", "content": ""}}]}),
            (10.4, {"choices": [{"delta": {"content": "hi"}}]}),
            (10.6, {"choices": [{"delta": {"content": "!"}}]}),
        ]
    )
    assert r.ttft == pytest.approx(0.4) and r.text == "hi!" and r.itl == pytest.approx([0.2])
    assert r.output_tokens is None


def test_stream_splits_a_multi_token_chunk_gap_per_token():
    # Token counts from logprobs (completions), token_ids, and continuous usage.
    r = _stream(
        [
            (10.2, {"choices": [{"text": "a", "logprobs": {"tokens": ["a"]}}]}),
            (10.8, {"choices": [{"text": "bcd", "logprobs": {"tokens": ["b", "c", "d"]}}]}),
            (11.0, {"choices": [{"text": "ef", "token_ids": [5, 6]}]}),
        ]
    )
    assert r.itl == pytest.approx([0.2, 0.2, 0.2, 0.1, 0.1])
    r = _stream(
        [
            (10.2, {"choices": [{"text": "a"}], "usage": {"completion_tokens": 1}}),
            (10.5, {"choices": [{"text": "bc"}], "usage": {"completion_tokens": 3}}),
        ]
    )
    assert r.itl == pytest.approx([0.15, 0.15]) and r.output_tokens == 3


def test_stream_final_usage_on_a_choice_chunk_is_a_total_not_a_chunk_count():
    # llama-server's last chunk: empty text, finish_reason, and the request's usage.
    r = _stream(
        [
            (10.2, {"choices": [{"text": "a"}]}),
            (10.4, {"choices": [{"text": "b"}]}),
            (
                10.5,
                {
                    "choices": [{"text": "", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 2},
                },
            ),
        ]
    )
    assert r.itl == pytest.approx([0.2]) and r.chunks == 2 and r.output_tokens == 2
    r = _stream(
        [(10.2, {"choices": [{"text": "a"}]}), (10.4, {"choices": [{"text": "b"}], "usage": {"completion_tokens": 2}})]
    )
    assert r.itl == pytest.approx([0.2]) and r.output_tokens == 2


def test_stream_errors():
    r = _stream([(10.1, {"error": {"message": "too long", "code": 400}})])
    assert not r.success and r.error == "too long"
    r = _stream([(10.1, {"choices": [], "usage": {"completion_tokens": 0}})])
    assert not r.success and r.error == "the stream carried no output"
