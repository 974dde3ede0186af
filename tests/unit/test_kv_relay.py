"""The parallel KV handoff's parts: KV page commands share a follower's pipe with the steps and
are told apart from them; a transfer between workers of different tensor-parallel sizes or
pipeline shapes is refused with both named; the relay gathers and scatters each pipeline stage's
own layers (four ranks in a real gloo group; the pages travel between workers in
tests/integration/test_mesh_tensor_parallel_disagg.py)."""

from __future__ import annotations

import dataclasses
import io
import multiprocessing

import pytest
import torch

from pagemesh.bench.local_mesh import HANG_S
from pagemesh.common.messages import KVPagesHeader
from pagemesh.common.messages.base import ProtocolError
from pagemesh.tests.unit.kv_relay_ranks import LAYERS, PP, TP, pool_of, run_rank, scales_of
from pagemesh.workers.engine.kv_relay import (
    KVPageCommand,
    decode_kv_command,
    encode_kv_command,
    is_kv_command,
    rank_layers,
)
from pagemesh.workers.engine.model_input import ModelInput, decode_model_input, encode_model_input
from pagemesh.workers.engine.tensor_parallel import read_frame, write_frame, write_step
from pagemesh.workers.llm.handoff_in import check_header, parts_cover, rank_parts

STEP = ModelInput([5, 6], [2], [2], [[3]], [1], [])


def test_kv_commands_and_steps_cross_one_pipe_in_order_and_are_told_apart():
    pipe = io.BytesIO()
    export = KVPageCommand(export=True, pages=[4, 9, 2])
    write_step(pipe, STEP)
    write_frame(pipe, encode_kv_command(export))
    write_frame(pipe, encode_kv_command(KVPageCommand(export=False, pages=[7])))
    pipe.seek(0)
    frames = [read_frame(pipe) for _ in range(3)]
    assert read_frame(pipe) is None
    assert [is_kv_command(f) for f in frames] == [False, True, True]
    assert decode_model_input(frames[0]) == STEP
    assert decode_kv_command(frames[1]) == export
    assert decode_kv_command(frames[2]) == KVPageCommand(export=False, pages=[7])
    with pytest.raises(ValueError, match="kv command"):
        decode_kv_command(encode_model_input(STEP))


def header(tp_rank: int, tp_size: int) -> KVPagesHeader:
    return KVPagesHeader(
        request_id="r",
        seq_index=0,
        num_tokens=20,
        layer_start=0,
        layer_end=2,
        num_pages=2,
        dtype="float32",
        page_shape=[2, 16, 1, 8],
        checksum=0,
        first_token_ids=[3],
        last=True,
        page_indices=[0, 1],
        tp_rank=tp_rank,
        tp_size=tp_size,
    )


def test_pages_from_a_worker_of_another_tensor_parallel_size_are_refused_naming_both():
    pool_shape = (2, 8, 2, 16, 1, 8)  # a rank's pool: [layers, pages, K/V, slots, KV heads of a rank, head dim]
    assert check_header(header(2, 3), pool_shape, prompt_len=20, tp_size=3) == 0
    with pytest.raises(ValueError, match="tensor-parallel size 3, this worker's is 1"):
        check_header(header(0, 3), pool_shape, prompt_len=20, tp_size=1)
    with pytest.raises(ValueError, match="tensor-parallel size 1, this worker's is 3"):
        check_header(header(0, 1), pool_shape, prompt_len=20, tp_size=3)


def test_a_header_with_its_rank_outside_its_size_is_malformed():
    with pytest.raises(ProtocolError, match="tp_rank < tp_size"):
        header(3, 3)._check()


# ---- pipeline stages: each rank's pages are its stage's layers -----------------------------------
def test_the_relay_gathers_and_scatters_each_stage_its_own_layers_over_gloo(tmp_path):
    """Four real ranks (tp 2 x pp 2, stages of 2 and 1 layers) in a gloo group: rank 0 gathers
    every rank's pages with that rank's layers only, and scatters each rank its own; an fp8
    pool's too, and every rank's fp8 scales reach rank 0."""
    ctx = multiprocessing.get_context("spawn")
    queues = [ctx.Queue() for _ in range(TP * PP - 1)]
    init = f"file://{tmp_path}/group"
    procs = [ctx.Process(target=run_rank, args=(r, init, queues, str(tmp_path))) for r in range(TP * PP)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(HANG_S)
        assert proc.exitcode == 0
    for dtype in (torch.float32, torch.float8_e4m3fn):
        gathered, scales = torch.load(tmp_path / f"gathered-{dtype}.pt")
        assert [g.shape[0] for g in gathered] == [2, 2, 1, 1]  # rank r: tp rank r % 2 of stage r // 2
        assert all(torch.equal(got, scales_of(rank)) for rank, got in enumerate(scales))
        for rank, shard in enumerate(gathered):
            before = pool_of(rank).to(dtype).view(torch.uint8)  # compared as bytes: fp8 has no equal
            assert shard.dtype == dtype
            assert torch.equal(shard.view(torch.uint8), before.index_select(1, torch.tensor([1, 3])))
            pool = torch.load(tmp_path / f"pool{rank}-{dtype}.pt").view(torch.uint8)
            negated = (-pool_of(rank).index_select(1, torch.tensor([2, 4]))).to(dtype).view(torch.uint8)
            assert torch.equal(pool[:, 4:], negated)
            assert torch.equal(pool[:, :4], before[:, :4])  # nothing else written


def test_a_stage_split_of_uneven_layers_and_the_order_of_ranks():
    assert rank_layers(3, 2, 2) == [range(0, 2), range(0, 2), range(2, 3), range(2, 3)]
    assert rank_layers(30, 1, 4) == [range(0, 8), range(8, 16), range(16, 23), range(23, 30)]
    assert rank_layers(30, 3, 1) == [range(0, 30)] * 3


def stage_header(tp_rank: int, tp_size: int, layers: range) -> KVPagesHeader:
    return dataclasses.replace(header(tp_rank, tp_size), layer_start=layers.start, layer_end=layers.stop)


def test_the_decode_side_waits_for_every_tp_rank_to_cover_the_layers_then_orders_the_parts_by_rank():
    sent = {
        (h.tp_rank, h.layer_start): h
        for h in (stage_header(t, 2, r) for t in (0, 1) for r in (range(0, 2), range(2, 3)))
    }
    partial = dict(sent)
    del partial[(1, 2)]
    assert not parts_cover(partial, 2, LAYERS)  # tp rank 1 of stage 1 is on its way
    assert parts_cover(sent, 2, LAYERS)
    assert rank_parts(sent, 2, 2, LAYERS) == [(0, 0), (1, 0), (0, 2), (1, 2)]


def test_pages_from_a_worker_of_another_pipeline_shape_are_refused_naming_both_shapes():
    one_stage = {(0, 0): stage_header(0, 1, range(0, 30))}
    assert parts_cover(one_stage, 1, 30)
    with pytest.raises(
        ValueError,
        match=r"worker of tp 1 x pp 1 \(layers \[0, 30\)\), this worker is tp 1 x pp 2 "
        r"\(layers \[0, 15\) \[15, 30\)\)",
    ):
        rank_parts(one_stage, 1, 2, 30)
    three = {(0, r.start): stage_header(0, 1, r) for r in rank_layers(30, 1, 3)}
    with pytest.raises(ValueError, match=r"tp 1 x pp 3 .*this worker is tp 1 x pp 2"):
        rank_parts(three, 1, 2, 30)
    with pytest.raises(ValueError, match=r"layers \[0, 2\) but this worker's stage holds \[2, 3\)"):
        check_header(header(0, 1), (1, 8, 2, 16, 1, 8), prompt_len=20, layers=range(2, 3))
