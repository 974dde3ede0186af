"""SamplingParams validation and the sampler's per-row behaviour."""

import pytest
import torch

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.sampler import SampleRow, argmax_only, sample


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"stop": ("",)}, "stop"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((True, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((1, float("nan")),)}, "logit_bias"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
        ({"logit_bias": ((1, 1.0, 2.0),)}, "logit_bias"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"json_object": True, "ignore_eos": True}, "json_object"),
        ({"json_object": True, "use_beam_search": True, "n": 2}, "json_object"),
        ({"json_schema": '{"type":"object"}', "ignore_eos": True}, "json_schema"),
        ({"json_schema": "{}", "json_object": True}, "json_schema"),
        ({"json_schema": "x" * 70000}, "json_schema"),
        ({"structured": ("regex", "a+"), "use_beam_search": True, "n": 2}, "structured"),
        ({"structured": ("regex", "a+"), "json_schema": "{}"}, "structured"),
        ({"structured": ("yaml", "a: 1")}, "structured"),
        ({"structured": ("regex", "a" * 70000)}, "structured"),
        ({"structured": ("regex",)}, "structured"),
        ({"structured": ["regex", "a+"]}, "structured"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
    ],
)
def test_out_of_range_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        SamplingParams(**kwargs).validate()


def test_round_trip_through_dict():
    p = SamplingParams(
        n=2, temperature=0.5, stop=("x",), stop_token_ids=(3,), seed=4, logprobs=2, logit_bias=((9, -100.0), (3, 0.5))
    )
    assert SamplingParams.from_dict(p.to_dict()) == p
    constrained = SamplingParams(temperature=0, structured=("choice", '["yes", "no"]'))
    assert constrained.to_dict()["structured"] == ["choice", '["yes", "no"]']  # msgpack has no tuples
    assert SamplingParams.from_dict(constrained.to_dict()) == constrained
    with pytest.raises(ValueError, match="^logit_bias:"):
        SamplingParams.from_dict({"logit_bias": [5]})
    with pytest.raises(ValueError, match="unknown"):
        SamplingParams.from_dict({"bogus": 1})


def rows(params, n=1, gen=None):
    return [SampleRow(params, [1, 2], [], gen) for _ in range(n)]


def test_greedy_and_top_k_1_pick_the_argmax():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    expected = logits.argmax(-1).tolist()
    got = sample(logits.clone(), rows(SamplingParams(temperature=0), 3), torch.Generator())
    assert [t for t, _ in got] == expected
    got = sample(logits.clone(), rows(SamplingParams(temperature=1.0, top_k=1), 3), torch.Generator())
    assert [t for t, _ in got] == expected


def test_seeded_row_does_not_depend_on_its_batch():
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = sample(
        logits[2:3].clone(), [SampleRow(seeded, [], [], torch.Generator().manual_seed(42))], torch.Generator()
    )
    batch_rows = rows(SamplingParams(temperature=1.0), 4)
    batch_rows[2] = SampleRow(seeded, [], [], torch.Generator().manual_seed(42))
    together = sample(logits.clone(), batch_rows, torch.Generator().manual_seed(7))
    assert together[2][0] == alone[0][0]


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    picks = {
        sample(logits.clone(), rows(SamplingParams(top_p=0.7)), torch.Generator().manual_seed(s))[0][0]
        for s in range(200)
    }
    assert picks == {0, 1}


def test_min_p_drops_tokens_below_the_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1]]))
    picks = {
        sample(logits.clone(), rows(SamplingParams(min_p=0.4)), torch.Generator().manual_seed(s))[0][0]
        for s in range(200)
    }
    assert picks == {0, 1}


def test_banned_ids_and_penalties_change_the_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    [(tok, _)] = sample(
        logits.clone(), [SampleRow(SamplingParams(temperature=0), [], [], None, banned_ids=(0,))], torch.Generator()
    )
    assert tok == 1
    freq = SamplingParams(temperature=0, frequency_penalty=2.0)
    [(tok, _)] = sample(logits.clone(), [SampleRow(freq, [], [0], None)], torch.Generator())
    assert tok == 1  # 5 - 2*1 = 3 < 4
    rep = SamplingParams(temperature=0, repetition_penalty=2.0)
    [(tok, _)] = sample(logits.clone(), [SampleRow(rep, [0], [], None)], torch.Generator())
    assert tok == 1  # 5 / 2 = 2.5 < 4


def test_logit_bias_is_added_before_sampling_and_logprobs_stay_raw():
    logits = torch.tensor([[5.0, 4.0, 1.0, 0.0]])
    ban_best = SamplingParams(temperature=0, logit_bias=((0, -100.0),), logprobs=1)
    [(tok, lp)] = sample(logits.clone(), rows(ban_best), torch.Generator())
    assert tok == 1 and lp.logprob == pytest.approx(float(torch.log_softmax(logits, -1)[0, 1]))
    lift = SamplingParams(temperature=0, logit_bias=((3, 5.5), (2, 3.0)))  # 0 + 5.5 > 5 > 1 + 3
    assert sample(logits.clone(), rows(lift), torch.Generator())[0][0] == 3
    force = SamplingParams(temperature=1.0, logit_bias=((2, 100.0),))
    picks = {sample(logits.clone(), rows(force), torch.Generator().manual_seed(s))[0][0] for s in range(50)}
    assert picks == {2}
    mixed = sample(logits.repeat(2, 1), [rows(lift)[0], rows(SamplingParams(temperature=0))[0]], torch.Generator())
    assert [t for t, _ in mixed] == [3, 0]  # a row's bias stays in its row


def test_logprobs_are_the_raw_log_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    [(tok, lp)] = sample(logits.clone(), rows(SamplingParams(temperature=0, logprobs=2)), torch.Generator())
    ref = torch.log_softmax(logits, -1)[0]
    assert tok == 0 and lp.top_ids == [0, 1]
    assert lp.logprob == pytest.approx(float(ref[0]))
    assert lp.top_logprobs == pytest.approx(ref[:2].tolist())


@pytest.mark.parametrize(
    "params, row_kwargs, plain",
    [
        (SamplingParams(temperature=0), {}, True),
        (SamplingParams(temperature=0, seed=3, top_k=5), {}, True),  # greedy: seed and top-k change nothing
        (SamplingParams(temperature=0.7), {}, False),
        (SamplingParams(temperature=0, logprobs=0), {}, False),
        (SamplingParams(temperature=0), {"want_logprob": True}, False),
        (SamplingParams(temperature=0), {"banned_ids": (2,)}, False),
        (SamplingParams(temperature=0, repetition_penalty=1.2), {}, False),
        (SamplingParams(temperature=0, frequency_penalty=0.5), {}, False),
        (SamplingParams(temperature=0, presence_penalty=0.5), {}, False),
        (SamplingParams(temperature=0, logit_bias=((1, -5.0),)), {}, False),
    ],
)
def test_only_plain_greedy_rows_keep_their_logits_on_the_gpu(params, row_kwargs, plain):
    """On a GPU a batch of rows that pass is one argmax; the others take the full sampler.
    Either way a plain greedy row's token is its first maximum."""
    row = SampleRow(params, [1, 2], [2], None, **row_kwargs)
    assert argmax_only(row) is plain
    logits = torch.tensor([[0.0, 3.0, 3.0, -1.0]])
    if plain:
        assert sample(logits.clone(), [row], torch.Generator()) == [(1, None)]


def test_the_sampler_keeps_every_tensor_on_the_logits_device(monkeypatch):
    """Logits on the `meta` device stand in for a GPU: torch refuses any op that mixes them with
    a host tensor, which is the bug a GPU run would find. Meta tensors hold no values, so the
    reads to the host (tolist, float) and bincount (no meta kernel) return zeros for them."""
    real_tolist, real_float, real_bincount = torch.Tensor.tolist, torch.Tensor.__float__, torch.bincount

    def on_meta(real, stub):
        return lambda t, *a, **k: stub(t, *a, **k) if t.device.type == "meta" else real(t, *a, **k)

    monkeypatch.setattr(
        torch.Tensor, "tolist", on_meta(real_tolist, lambda t: torch.zeros(t.shape, dtype=t.dtype).tolist())
    )
    monkeypatch.setattr(torch.Tensor, "__float__", on_meta(real_float, lambda t: 0.0))
    monkeypatch.setattr(
        torch,
        "bincount",
        on_meta(real_bincount, lambda t, minlength=0: torch.zeros(minlength, dtype=torch.int64, device=t.device)),
    )
    kinds = [
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.0, top_k=20, min_p=0.05, logprobs=3),
        SamplingParams(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.4, seed=3),
        SamplingParams(temperature=0, presence_penalty=0.5, logprobs=2),
        SamplingParams(temperature=0),
    ]
    rows_ = [
        SampleRow(
            p,
            [5, 6, 7],
            [8, 8, 9],
            torch.Generator().manual_seed(p.seed) if p.seed else None,
            banned_ids=(3,) if i == 4 else (),
        )
        for i, p in enumerate(kinds)
    ]
    got = sample(torch.empty(5, 100, device="meta"), rows_, torch.Generator())
    assert [tok for tok, _ in got] == [0] * 5 and got[1][1].top_ids == [0, 0, 0]
    # all plain greedy: one argmax on the device
    assert (
        sample(torch.empty(3, 100, device="meta"), rows(SamplingParams(temperature=0), 3), torch.Generator())
        == [(0, None)] * 3
    )
    with pytest.raises(RuntimeError, match="device"):  # the check is real: a host tensor meets it
        torch.empty(3, device="meta") + torch.ones(3)


@pytest.mark.parametrize(
    "penalties, prompt_read, output_read",
    [
        ({}, False, False),
        ({"repetition_penalty": 1.3}, True, True),
        ({"frequency_penalty": 0.5}, False, True),
        ({"presence_penalty": 0.5}, False, True),
    ],
)
def test_the_engine_hands_the_sampler_the_token_lists_its_penalties_read(penalties, prompt_read, output_read):
    """A row carries the prompt and output ids only when a penalty reads them (copying long
    contexts for every row at every step costs the host ~0.3 ms per step at 128 x 4096)."""
    from pagemesh.common.model_config import ModelConfig
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine
    from pagemesh.workers.model.loader import build_random_model

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    engine = Engine(
        EngineConfig(device="cpu", dtype="float32", num_pages=16, page_size=4, enable_prefix_caching=False),
        model=build_random_model(cfg, torch.float32, torch.device("cpu")),
    )
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, **penalties))
    engine.step()
    engine.step()
    [seq] = engine.requests["r"].seqs
    row = engine.updater.sample_row(seq, None)
    assert row.prompt_ids == ([5, 6, 7] if prompt_read else [])
    assert row.output_ids == (seq.output_token_ids if output_read else []) and len(seq.output_token_ids) == 2


def test_subnormal_numbers_are_refused_as_the_worker_would_read_them_as_zero():
    # A worker's process flushes subnormals (its fast-math C kernels set the CPU's flags on load):
    # there 5e-324 > 0 is false. The gateway's process does not. Check both; the flags are the
    # process's, so put back what they were.
    was_flushing = not 0.0 < 5e-324
    try:
        torch.set_flush_denormal(False)  # as the gateway runs
        for field in ("top_p", "repetition_penalty", "temperature", "min_p", "presence_penalty"):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: 5e-324}).validate()
        if torch.set_flush_denormal(True):  # as a worker runs
            assert not 0.0 < 5e-324
            for field in ("top_p", "repetition_penalty"):  # what the worker would have dropped
                with pytest.raises(ValueError, match=field):
                    SamplingParams(**{field: 5e-324}).validate()
        SamplingParams(top_p=1e-300, repetition_penalty=1e-300).validate()  # small but normal: alike everywhere
    finally:
        torch.set_flush_denormal(was_flushing)
