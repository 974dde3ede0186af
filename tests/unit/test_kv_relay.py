"""The parts of the tensor-parallel KV handoff that need no second process: KV page commands
share a follower's pipe with the steps and are told apart from them, and a transfer between
workers of different tensor-parallel sizes is refused with both sizes named (the pages
themselves travel rank i -> rank i in tests/integration/test_mesh_tensor_parallel_disagg.py)."""

from __future__ import annotations

import io

import pytest
import torch

from common.messages import KVPagesHeader
from common.messages.base import ProtocolError
from workers.engine.kv_relay import KVPageCommand, decode_kv_command, encode_kv_command, is_kv_command
from workers.engine.model_input import ModelInput, decode_model_input, encode_model_input
from workers.engine.tensor_parallel import read_frame, write_frame, write_step
from workers.llm.kv_pages import check_header

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
    rank_pool = torch.zeros(2, 8, 2, 16, 1, 8)  # [layers, pages, K/V, slots, KV heads of a rank, head dim]
    assert check_header(header(2, 3), rank_pool, prompt_len=20, tp_size=3) == 0
    with pytest.raises(ValueError, match="tensor-parallel size 3, this worker's is 1"):
        check_header(header(0, 3), rank_pool, prompt_len=20, tp_size=1)
    with pytest.raises(ValueError, match="tensor-parallel size 1, this worker's is 3"):
        check_header(header(0, 1), rank_pool, prompt_len=20, tp_size=3)


def test_a_header_with_its_rank_outside_its_size_is_malformed():
    with pytest.raises(ProtocolError, match="tp_rank < tp_size"):
        header(3, 3)._check()
