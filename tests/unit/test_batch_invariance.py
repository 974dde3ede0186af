"""The batch-invariant mode's parts: each linear kernel it takes gives a row the same bits at every
row count and place in the batch (where the default path does not), the flag and its environment
variable reach the engine and a child's command line, and a device without such a path refuses."""

import argparse

import pytest
import torch

import pagemesh.kernels.cpu
from pagemesh.kernels.quantized import quantize_int8, with_tiles
from pagemesh.workers.engine.backend import select_backend
from pagemesh.workers.engine.config import add_engine_arguments, engine_args_to_argv, engine_config_from_args
from pagemesh.workers.model.layers import AMX_MAX_ROWS, DEQUANTIZE_MIN_ROWS, PackedWeight, linear

ROW_COUNTS = (1, 3, 8, 33, 64, 65, 130)


def rows_alone_and_in_batches(product, x: torch.Tensor) -> list[str]:
    """Where row 0's product differs from its product alone: 'M=<n>' for x[:n], 'moved' for row 0
    placed last behind other rows."""
    alone = product(x[:1])[0]
    differ = [f"M={m}" for m in ROW_COUNTS if not torch.equal(product(x[:m])[0], alone)]
    if not torch.equal(product(torch.cat([x[5:12], x[:1]]))[-1], alone):
        differ.append("moved")
    return differ


@pytest.fixture(scope="module")
def weight():
    torch.manual_seed(0)
    return torch.randn(1024, 576)


@pytest.fixture(scope="module")
def x():
    torch.manual_seed(1)
    return torch.randn(max(ROW_COUNTS), 576).bfloat16()


def test_a_quantized_linear_never_widens_its_weight_in_the_invariant_mode(weight, x):
    qw = with_tiles(quantize_int8(weight))
    assert rows_alone_and_in_batches(lambda a: linear(a, None, None, qw, invariant=True), x) == []
    # the default path widens W to bf16 from DEQUANTIZE_MIN_ROWS rows: another sum, other bits
    default = rows_alone_and_in_batches(lambda a: linear(a, None, None, qw), x)
    assert f"M={DEQUANTIZE_MIN_ROWS}" in default


@pytest.mark.skipif(not pagemesh.kernels.cpu.amx_available(), reason="this CPU has no AMX")
def test_a_packed_bf16_linear_stays_on_the_amx_kernel_in_the_invariant_mode():
    torch.manual_seed(2)
    w = torch.randn(49152, 576).bfloat16()  # an LM head's shape: oneDNN's product changes with the row count
    packed = PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, 32), pagemesh.kernels.cpu.amx_pack(w))
    x = torch.randn(max(ROW_COUNTS), 576).bfloat16()
    assert rows_alone_and_in_batches(lambda a: linear(a, w, None, packed, invariant=True), x) == []
    default = rows_alone_and_in_batches(lambda a: linear(a, w, None, packed), x)
    assert any(m.startswith("M=") and int(m[2:]) > AMX_MAX_ROWS for m in default)


def test_an_fp32_linear_goes_row_by_row_in_the_invariant_mode(weight, x):
    x32, bias = x.float(), torch.randn(weight.shape[0])
    assert rows_alone_and_in_batches(lambda a: linear(a, weight, bias, None, invariant=True), x32) == []
    assert rows_alone_and_in_batches(lambda a: linear(a, weight, bias, None), x32) != []  # MKL's blocking
    assert linear(x32[:0], weight, bias, None, invariant=True).shape == (0, weight.shape[0])


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(argv)


def test_the_flag_and_its_environment_variable_reach_the_engine_and_a_childs_argv(monkeypatch):
    monkeypatch.delenv("PAGEMESH_BATCH_INVARIANT", raising=False)
    assert engine_config_from_args(parse([])).batch_invariant is False
    on = parse(["--batch-invariant"])
    assert engine_config_from_args(on).batch_invariant is True
    assert "--batch-invariant" in engine_args_to_argv(on)
    assert "--no-batch-invariant" in engine_args_to_argv(parse([]))  # said either way to a child
    monkeypatch.setenv("PAGEMESH_BATCH_INVARIANT", "1")
    assert engine_config_from_args(parse([])).batch_invariant is True
    assert engine_config_from_args(parse(["--no-batch-invariant"])).batch_invariant is False


def test_a_device_without_a_row_invariant_path_refuses_the_mode():
    with pytest.raises(ValueError, match="only on a CPU"):
        select_backend(torch.device("cuda"), torch.bfloat16, batch_invariant=True)
