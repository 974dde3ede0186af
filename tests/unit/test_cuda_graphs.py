"""The decode-graph runner on CPU: size buckets, padding onto the null page, and the whole
static-buffer path (Triton kernels in the interpreter, graph capture replaced by eager calls)
against the torch path. The real capture and replay are tested in tests/gpu/test_engine_gpu.py."""

import importlib
import sys

import pytest
import torch

from pagemesh.common.model_config import ModelConfig
from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.backend import TritonAttentionBackend
from pagemesh.workers.engine.config import EngineConfig
from pagemesh.workers.engine.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes, pad_decode_batch
from pagemesh.workers.engine.engine import Engine
from pagemesh.workers.engine.model_runner import ModelRunner
from pagemesh.workers.model.loader import build_random_model
from pagemesh.workers.model.ops import TorchOps, TritonOps

TINY = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)
PAGE = 4


def eager_capture(fn):
    """Stands in for a CUDA graph: same static buffers and padding, the forward run on replay."""
    out = fn()

    def replay():
        with torch.inference_mode():
            out.copy_(fn())

    return replay, out


def no_capture(fn):
    return None, None


@pytest.fixture(scope="module")
def tiny_model():
    return build_random_model(TINY, torch.float32, torch.device("cpu"), seed=3)


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert capture_sizes(128) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128]
    assert capture_sizes(200)[-5:] == [112, 128, 160, 192, 200]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 33, 49, 64)] == [1, 2, 4, 8, 8, 16, 48, 64, 64]
    assert bucket_for(65, sizes) is None


def test_padding_rows_are_null_page_sequences_of_one_token():
    batch = pad_decode_batch([7, 8], [5, 17], [[3, 4], [9, 10, 11, 12, 13]], 4)
    assert batch.token_ids == [7, 8, 0, 0]
    assert batch.seq_lens == [5, 17, 1, 1]
    assert batch.block_tables == [[3, 4], [9, 10, 11, 12, 13], [0], [0]]
    md = AttentionMetadata.build([1] * 4, batch.seq_lens, batch.block_tables, PAGE, torch.device("cpu"), for_cpu=False)
    # real rows write at their last position; padding rows at page 0, slot 0 and read only that
    assert md.positions.tolist() == [4, 16, 0, 0]
    assert md.slot_mapping.tolist() == [4 * PAGE + 0, 13 * PAGE + 0, 0, 0]
    assert md.block_tables[2:].tolist() == [[0] * 5, [0] * 5]
    with pytest.raises(ValueError, match="do not fit"):
        pad_decode_batch([1, 2, 3], [1, 1, 1], [[1], [2], [3]], 2)


def test_only_decode_only_batches_that_fit_run_as_graphs(tiny_model):
    runner = ModelRunner(tiny_model, 16, PAGE, torch.device("cpu"))
    assert runner.graphs is None  # CPU: always eager
    graphs = DecodeGraphs(tiny_model, runner.kv_cache, runner.attention, TorchOps(), PAGE, 8, 32, capture=no_capture)
    assert graphs.sizes == sorted(graphs.graphs) == [1, 2, 4, 8]
    assert graphs.block_tables.shape == (8, 8)
    decode = ([1, 1, 1], [[1], [2, 3], [4]], 3)
    assert graphs.can_run(*decode)
    assert not graphs.can_run([1, 1, 5], decode[1], 3)  # a prefill chunk rides along
    assert not graphs.can_run([1] * 9, [[1]] * 9, 9)  # more rows than the largest graph
    assert not graphs.can_run([1, 1, 1], decode[1], 2)  # a row that does not sample
    assert not graphs.can_run([1], [list(range(9))], 1)  # longer than max_model_len


@pytest.fixture
def interpreted_kernels(monkeypatch):
    """Run the Triton kernels on CPU in Triton's interpreter (read when a kernel is defined)."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU, tests/gpu runs the compiled path")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for name in [m for m in sys.modules if m.startswith("pagemesh.kernels.")]:
        importlib.reload(sys.modules[name])


def test_padded_static_buffer_path_matches_the_torch_path(tiny_model, interpreted_kernels):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 11, [3, 1], [200, 100, 50, 25, 12, 6]]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True, logprobs=1) for k in (7, 3, 6, 2, 4)]
    config = EngineConfig(device="cpu", dtype="float32", num_pages=64, page_size=PAGE, enable_prefix_caching=False)
    torch_engine = Engine(config, model=tiny_model)
    expect = torch_engine.generate(prompts, params)

    graph_engine = Engine(config, model=tiny_model)
    runner = graph_engine.runner
    runner.attention, runner.ops = TritonAttentionBackend(), TritonOps()
    runner.graphs = DecodeGraphs(
        tiny_model, runner.kv_cache, runner.attention, runner.ops, PAGE, 8, 64, capture=eager_capture
    )
    got = graph_engine.generate(prompts, params)

    assert sorted(runner.graphs.replays) == [1, 2, 4, 8]  # 5 rows padded to 8, 3 to 4, ...
    for e, g in zip(expect, got):
        assert g.token_ids == e.token_ids
        for a, b in zip(e.logprobs[0], g.logprobs[0]):
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
    # both engines used the same pages; the padding rows wrote nowhere but the null page
    torch.testing.assert_close(runner.kv_cache[:, 1:], torch_engine.runner.kv_cache[:, 1:], atol=1e-5, rtol=1e-5)
    assert torch_engine.runner.kv_cache[:, 0].abs().sum() == 0 < runner.kv_cache[:, 0].abs().sum()
