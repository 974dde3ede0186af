"""KV transfer with fp8 pools, in process on a tiny random model: pack -> wire frames -> check ->
write, as workers/llm/handoff_out.py and handoff_in.py do it (their per-rank calls, one rank).
fp8 pages travel as bytes with their scales; a pool of another dtype (or other scales) converts
on receipt."""

from __future__ import annotations

import pytest
import torch

from pagemesh.common import protocol
from pagemesh.common.messages import KVPagesHeader
from pagemesh.common.messages.base import ProtocolError
from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.llm_tiny import tiny_llama
from pagemesh.workers.engine.kv_handoff import write_rank_pages
from pagemesh.workers.engine.kv_quant import convert_pages, dequantize, quantize
from pagemesh.workers.llm.handoff_in import check_header
from pagemesh.workers.llm.handoff_out import pack_export

PAGE = 4
PROMPT = [(5 * i) % 250 + 1 for i in range(18)]  # 5 pages, the last one partly filled
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(seed=3)


def engine(model, kv_cache_dtype="auto"):
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    config = EngineConfig(
        dtype="float32",
        device="cpu",
        page_size=PAGE,
        num_pages=64,
        max_model_len=256,
        enable_prefix_caching=False,
        cuda_graphs=False,
        kv_cache_dtype=kv_cache_dtype,
    )
    return Engine(config, model=model)


def hand_off(p_engine, d_engine, rid="r1"):
    """Prefill on p, transfer through the wire encoding, import on d, decode to the end there.
    Returns (header, the tokens, d's block table of the prompt)."""
    p_engine.add_request(rid, PROMPT, PARAMS, prefill_only=True)
    while p_engine.take_prefilled(rid) is None:
        p_engine.step()
    # as HandoffOut packs (one rank: one part, with its scales)
    [(header, layers)] = pack_export(p_engine.export_prefilled(rid, 0))
    frames = [bytes(f) for f in protocol.encode_tensor_frames(header, layers)]
    header = protocol.decode(frames)
    p_engine.release_prefilled(rid)
    check_header(header, d_engine.runner.kv_cache.shape, len(PROMPT))
    tensors = protocol.decode_tensor_frames(header, frames[2:])
    tables = []

    def write(table):
        tables.append(list(table))
        # as HandoffIn writes: every rank's part with its header's scales, for that rank's pool
        kv_cache, own = d_engine.runner.kv_cache, d_engine.runner.rank_kv_scales
        write_rank_pages(kv_cache, table, [tensors], None, [header.kv_scales], own)

    d_engine.import_prefilled(rid, PROMPT, PARAMS, list(header.first_token_ids), write, [])
    tokens = list(header.first_token_ids)
    while d_engine.has_unfinished():
        for out in d_engine.step():
            tokens += out.outputs[0].new_token_ids if out.outputs else []
    return header, tokens, tables[0], layers


def prompt_slots(pages: torch.Tensor) -> torch.Tensor:
    """The values of PROMPT's 18 tokens in pages [..., 5, 2, PAGE, KVH, D], flat (the decode
    writes its tokens after them, into the last page)."""
    return torch.cat([pages[..., :4, :, :, :, :].flatten(), pages[..., 4, :, :2, :, :].flatten()])


def mixed_tokens(model, kv_cache_dtype):
    [result] = engine(model, kv_cache_dtype).generate([PROMPT], PARAMS)
    return result.token_ids[0]


def test_fp8_pages_travel_as_fp8_with_their_scales_and_decode_as_a_mixed_fp8_engine(tiny_model):
    p_engine, d_engine = engine(tiny_model, "fp8_e4m3"), engine(tiny_model, "fp8_e4m3")
    header, tokens, table, layers = hand_off(p_engine, d_engine)
    assert header.dtype == "float8_e4m3fn" and layers[0].dtype == torch.float8_e4m3fn
    assert header.kv_scales == p_engine.runner.kv_scales.flatten().tolist() and len(header.kv_scales) == 2 * 2 * 2
    # one byte per value on the wire: half of bf16's, a quarter of this fp32 model's
    assert sum(t.nbytes for t in layers) == 2 * 5 * 2 * PAGE * 2 * 16
    # the decode pool holds exactly the bytes sent, and the decode goes as in one fp8 engine
    got = d_engine.runner.kv_cache[:, table].view(torch.uint8)
    assert torch.equal(prompt_slots(got), prompt_slots(torch.stack([t.view(torch.uint8) for t in layers])))
    assert tokens == mixed_tokens(tiny_model, "fp8_e4m3")


def test_float_pages_into_an_fp8_pool_are_quantized_with_the_receivers_scales(tiny_model):
    p_engine, d_engine = engine(tiny_model), engine(tiny_model, "fp8_e5m2")
    header, tokens, table, layers = hand_off(p_engine, d_engine)
    assert header.dtype == "float32" and header.kv_scales == []
    scales = d_engine.runner.kv_scales
    for layer, pages in enumerate(layers):
        want = torch.stack([quantize(pages[:, kind].reshape(-1, 2, 16), scales[layer, kind], torch.float8_e5m2)
                            .view(pages[:, kind].shape) for kind in (0, 1)], dim=1)  # fmt: skip
        got = d_engine.runner.kv_cache[layer, table].view(torch.uint8)
        assert torch.equal(prompt_slots(got), prompt_slots(want.view(torch.uint8)))
    # the same bytes a mixed fp8 engine writes for this prompt: the same tokens
    assert tokens == mixed_tokens(tiny_model, "fp8_e5m2")


def test_fp8_pages_into_a_float_pool_are_dequantized(tiny_model):
    p_engine, d_engine = engine(tiny_model, "fp8_e4m3"), engine(tiny_model)
    header, tokens, table, layers = hand_off(p_engine, d_engine)
    scales = p_engine.runner.kv_scales
    for layer, pages in enumerate(layers):
        want = torch.stack(
            [
                dequantize(pages[:, k].reshape(-1, 2, 16), scales[layer, k], torch.float32).view(pages[:, k].shape)
                for k in (0, 1)
            ],
            dim=1,
        )
        got = d_engine.runner.kv_cache[layer, table]
        assert torch.equal(prompt_slots(got), prompt_slots(want))
    assert len(tokens) == PARAMS.max_tokens


def test_pages_quantized_with_other_scales_are_requantized():
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 2, PAGE, 2, 8, generator=gen)
    s1, s2 = torch.tensor([[0.01, 0.02], [0.03, 0.04]]), torch.tensor([[0.02, 0.01], [0.005, 0.04]])
    sent = convert_pages(x, None, torch.float8_e4m3fn, s1)
    got = convert_pages(sent, s1, torch.float8_e4m3fn, s2)
    want = convert_pages(convert_pages(sent, s1, torch.float32, None), None, torch.float8_e4m3fn, s2)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), sent.view(torch.uint8))
    assert convert_pages(sent, s1, torch.float8_e4m3fn, s1.clone()) is sent  # same scales: as sent


def test_an_fp8_header_must_carry_one_positive_scale_per_layer_kind_and_head():
    fields = dict(
        request_id="r",
        seq_index=0,
        num_tokens=5,
        layer_start=0,
        layer_end=2,
        num_pages=1,
        dtype="float8_e5m2",
        page_shape=[2, PAGE, 3, 8],
        checksum=0,
        first_token_ids=[1],
        last=True,
        page_indices=[0],
    )
    KVPagesHeader(**fields, kv_scales=[0.5] * 12)._check()
    for bad in ([0.5] * 11, [0.5] * 11 + [0.0], [0.5] * 11 + [float("nan")]):
        with pytest.raises(ProtocolError, match="kv_scales"):
            KVPagesHeader(**fields, kv_scales=bad)._check()
    with pytest.raises(ProtocolError, match="kv_scales"):
        KVPagesHeader(**{**fields, "dtype": "bfloat16"}, kv_scales=[0.5] * 12)._check()
