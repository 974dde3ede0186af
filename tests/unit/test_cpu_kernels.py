"""The C kernels of `pagemesh.kernels.cpu` against the torch code they replace (and the kernels' reference)."""

import os
import subprocess
import sys

import pytest
import torch

import pagemesh.kernels.cpu as ck
from pagemesh.kernels.reference import paged_attention_ref
from pagemesh.kernels.testing import make_paged_batch
from pagemesh.workers.attention.metadata import AttentionMetadata
from pagemesh.workers.engine.attention import write_kv_torch
from pagemesh.workers.model.layers import pack_linear_weights
from pagemesh.workers.model.ops import TorchOps

pytestmark = pytest.mark.skipif(not ck.available(), reason=f"C kernels did not build: {ck.load_error()}")
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 4, 128), (8, 2, 32)])
@pytest.mark.parametrize("page_size", [8, 16])
def test_paged_attention_matches_the_reference(dtype, heads, kv_heads, head_dim, page_size):
    # decodes, a fresh prompt, a chunk continuing earlier pages; unowned slots hold NaN
    query_lens, seq_lens = [1, 1, 1, 7, 5], [9, 33, 16, 7, 29]
    b = make_paged_batch(
        query_lens,
        seq_lens,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        page_size=page_size,
        dtype=dtype,
        device="cpu",
        seed=5,
        poison=True,
    )
    got = ck.paged_attention(b.q, b.kv_layer, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    want = paged_attention_ref(*b.attention_args())
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_paged_attention_reads_q_rows_from_a_strided_view():
    b = make_paged_batch(
        [1, 1, 3],
        [40, 2, 19],
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        page_size=16,
        dtype=torch.float32,
        device="cpu",
        seed=2,
    )
    qkv = torch.cat([b.q.flatten(1), torch.randn(b.q.shape[0], 256)], dim=1)  # q is a strided view
    q = qkv[:, : 6 * 64].view(-1, 6, 64)
    got = ck.paged_attention(q, b.kv_layer, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    torch.testing.assert_close(got, paged_attention_ref(*b.attention_args()), atol=2e-6, rtol=2e-6)


def test_paged_attention_rejects_bad_arguments():
    b = make_paged_batch(
        [1, 1], [5, 9], num_heads=4, num_kv_heads=2, head_dim=32, page_size=8, dtype=torch.float32, device="cpu"
    )
    with pytest.raises(ValueError, match="int32"):
        ck.paged_attention(b.q, b.kv_layer, b.block_tables.long(), b.seq_lens, b.query_start_loc, b.scale)
    with pytest.raises(ValueError, match="query_start_loc"):
        ck.paged_attention(b.q[:1], b.kv_layer, b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    with pytest.raises(TypeError, match="float16"):
        ck.paged_attention(b.q.half(), b.kv_layer.half(), b.block_tables, b.seq_lens, b.query_start_loc, b.scale)
    with pytest.raises(ValueError, match="contiguous"):
        ck.paged_attention(
            b.q.transpose(1, 2).contiguous().transpose(1, 2),
            b.kv_layer,
            b.block_tables,
            b.seq_lens,
            b.query_start_loc,
            b.scale,
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch_ops_and_updates_the_residual_in_place(dtype, with_residual):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(37, 576, generator=gen).to(dtype)
    residual = torch.randn(37, 576, generator=gen).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(576, generator=gen)).to(dtype)
    want_out, want_res = TorchOps().rms_norm(x, residual, weight, 1e-5)
    given = residual.clone() if with_residual else None
    out, res = ck.add_rms_norm(x, given, weight, 1e-5)
    if with_residual:
        assert res.data_ptr() == given.data_ptr()
    torch.testing.assert_close(res, want_res, atol=0, rtol=0)  # x + residual: one rounding, exact
    # bf16: the normed value may land on the other side of a rounding boundary (1 ulp)
    torch.testing.assert_close(out.float(), want_out.float(), **TOL[dtype])
    if dtype == torch.bfloat16:
        assert (out != want_out).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cols", [1536, 100])  # bf16: the 16-lane path, and the scalar one
def test_silu_and_mul_matches_torch_ops(dtype, cols):
    x = (3 * torch.randn(33, 2 * cols, generator=torch.Generator().manual_seed(1))).to(dtype)
    x[0, :8] = torch.tensor([0.0, -0.0, 100.0, -100.0, 88.5, -88.5, 1e-3, -1e-3])  # past exp's clamp, and near 0
    got, want = ck.silu_and_mul(x), TorchOps().silu_and_mul(x)
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    if dtype == torch.bfloat16:
        assert (got != want).float().mean() < 0.01  # off by one bf16 step now and then


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_qkv_views_matches_torch_ops(dtype):
    from pagemesh.workers.model.rope import RotaryEmbedding

    rope = RotaryEmbedding(64, 4096, 10000.0, None)
    tokens, heads, kv_heads = 21, 9, 3
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * 64, generator=torch.Generator().manual_seed(2)).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(3))
    q, k, _ = qkv.split([heads * 64, kv_heads * 64, kv_heads * 64], dim=-1)
    q, k = q.view(tokens, heads, 64), k.view(tokens, kv_heads, 64)
    ops = TorchOps()
    want_q, want_k = ops.rotary(q, k, ops.rope_tables(rope.cos_sin_cache, positions, dtype))
    v_before = qkv[:, (heads + kv_heads) * 64 :].clone()
    got_q, got_k = ck.rotary_(q, k, positions, rope.cos_sin_cache)
    assert got_q.data_ptr() == q.data_ptr()
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0, rtol=0)
    torch.testing.assert_close(got_q, want_q, **tol)
    torch.testing.assert_close(got_k, want_k, **tol)
    assert torch.equal(qkv[:, (heads + kv_heads) * 64 :], v_before)  # v untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_fills_the_same_slots_as_the_torch_path(dtype):
    page_size, kv_heads = 16, 3
    tables = [[4, 9], [2], [7, 1, 5]]
    query_lens, seq_lens = [1, 3, 20], [20, 3, 40]
    md = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, torch.device("cpu"), for_cpu=True)
    qkv = torch.randn(sum(query_lens), 3 * kv_heads * 64).to(dtype)
    _, k, v = qkv.split(kv_heads * 64, dim=-1)
    k, v = k.view(-1, kv_heads, 64), v.view(-1, kv_heads, 64)
    want = torch.zeros(10, 2, page_size, kv_heads, 64, dtype=dtype)
    got = want.clone()
    write_kv_torch(k, v, want, md)
    ck.write_kv(k, v, got, md.slot_mapping)
    assert torch.equal(got, want)


@pytest.mark.skipif(
    not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN has no bf16 matmul on this CPU (no AVX-512): linear weights stay dense",
)
def test_packed_linear_weights_give_the_same_logits():
    from pagemesh.common.model_config import ModelConfig
    from pagemesh.workers.model.llama import LlamaForCausalLM

    cfg = ModelConfig(
        architecture="llama",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.init_random(seed=4)
    x = torch.randn(5, 64).to(torch.bfloat16)
    layer = model.layers[0].mlp.gate_up_proj
    before, head_before = layer(x), torch.nn.functional.linear(x, model.lm_head.weight)
    assert pack_linear_weights(model, amx=ck.amx_available())
    assert layer.packed is not None and layer.weight.numel() == 0
    assert torch.equal(layer(x), before)
    packed = layer.packed
    assert pack_linear_weights(model, amx=ck.amx_available()) and layer.packed is packed  # a second engine on the model
    assert torch.equal(layer(x), before)
    assert torch.equal(
        torch.ops.mkldnn._linear_pointwise(x, model.lm_head.packed.onednn, None, "none", [], ""), head_before
    )
    assert not pack_linear_weights(LlamaForCausalLM(cfg))  # fp32 stays dense
    if ck.amx_available():  # 128 x 64 packs for AMX; the 300-row head does not (300 % 16)
        assert layer.packed.amx is not None and model.lm_head.packed.amx is None
        many = torch.randn(70, 64).to(torch.bfloat16)  # above AMX_MAX_ROWS: the oneDNN copy
        assert torch.equal(
            layer(many), torch.ops.mkldnn._linear_pointwise(many, layer.packed.onednn, None, "none", [], "")
        )


amx = pytest.mark.skipif(not ck.amx_available(), reason="no AMX-BF16 on this CPU")


@amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 40, 64])
@pytest.mark.parametrize("n,k", [(48, 64), (96, 96), (160, 320)])
def test_amx_linear_matches_f_linear(rows, n, k):
    torch.manual_seed(rows * 1000 + n)
    w, b = torch.randn(n, k).to(torch.bfloat16), torch.randn(n).to(torch.bfloat16)
    x = torch.randn(rows, k).to(torch.bfloat16)
    packed = ck.amx_pack(w)
    got, want = ck.amx_linear(x, packed), torch.nn.functional.linear(x, w)
    # fp32 sums in another order than oneDNN's can round a value to the next bf16 now and then
    assert (got != want).float().mean() < 0.01
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ck.amx_linear(x, packed, b), torch.nn.functional.linear(x, w, b), rtol=1e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), x.float() @ w.float().t(), rtol=2e-2, atol=5e-2)


@amx
def test_amx_linear_takes_no_rows_and_strided_rows():
    w = torch.randn(64, 64).to(torch.bfloat16)
    packed = ck.amx_pack(w)
    assert ck.amx_linear(torch.empty(0, 64, dtype=torch.bfloat16), packed).shape == (
        0,
        64,
    )  # a step that samples nothing
    x = torch.randn(3, 128).to(torch.bfloat16)[:, :64]  # a view: rows 128 values apart
    torch.testing.assert_close(ck.amx_linear(x, packed), torch.nn.functional.linear(x, w), rtol=1e-2, atol=1e-2)


@amx
def test_amx_linear_can_write_the_widened_bf16_values():
    w, x = torch.randn(96, 64).to(torch.bfloat16), torch.randn(9, 64).to(torch.bfloat16)
    packed = ck.amx_pack(w)
    wide = ck.amx_linear(x, packed, out_dtype=torch.float32)
    assert wide.dtype == torch.float32 and torch.equal(wide, ck.amx_linear(x, packed).float())
    with pytest.raises(ValueError):
        ck.amx_linear(x, packed, out_dtype=torch.float16)


def test_argmax_rows_is_the_first_maximum_as_torch_max():
    x = torch.randn(33, 1000, generator=torch.Generator().manual_seed(2))
    x[1, :] = 0.5  # all equal: the first
    x[2, 17] = x[2, 900] = 1e9  # a tie of maxima: the first
    x[3, 40] = float("nan")  # NaN wins, as in torch.max
    x[4, 999] = float("nan")  # in the tail after the 16-lane part
    x[5, :] = float("-inf")
    x[6, 3] = float("inf")
    want = x.max(dim=-1).indices
    assert torch.equal(ck.argmax_rows(x), want)
    assert torch.equal(ck.argmax_rows(x[:, :7]), x[:, :7].max(dim=-1).indices)  # short strided rows: no 16-lane part
    wide = torch.randn(4, 49152)
    assert torch.equal(ck.argmax_rows(wide), wide.max(dim=-1).indices)
    with pytest.raises(ValueError):
        ck.argmax_rows(x.to(torch.bfloat16))


@amx
def test_amx_linear_rejects_bad_arguments():
    w = torch.randn(32, 64).to(torch.bfloat16)
    with pytest.raises(ValueError):
        ck.amx_pack(torch.randn(30, 64).to(torch.bfloat16))  # N % 16
    with pytest.raises(ValueError):
        ck.amx_pack(w.float())
    packed = ck.amx_pack(w)
    with pytest.raises(ValueError):
        ck.amx_linear(torch.randn(4, 32).to(torch.bfloat16), packed)  # K mismatch
    with pytest.raises(ValueError):
        ck.amx_linear(torch.randn(4, 64).to(torch.bfloat16), packed, torch.zeros(31, dtype=torch.bfloat16))


def test_malloc_keeps_freed_activations_for_reuse():
    from pagemesh.kernels.cpu.memory import keep_freed_memory_for_reuse

    assert keep_freed_memory_for_reuse()  # glibc accepted every setting
    assert keep_freed_memory_for_reuse()  # and a second call is a no-op


def test_disabling_the_kernels_falls_back_to_torch():
    code = (
        "import torch; from pagemesh.workers.engine.backend import select_backend; "
        "b = select_backend(torch.device('cpu'), torch.float32); "
        "print(type(b.ops).__name__, type(b.attention).__name__)"
    )
    env = dict(os.environ, PAGEMESH_CPU_KERNELS="0")
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "cpu_kernels_unavailable (disabled by PAGEMESH_CPU_KERNELS=0)" in done.stderr
    assert done.stdout.split() == ["TorchOps", "TorchAttentionBackend"]
    env["PAGEMESH_CPU_KERNELS"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["CpuKernelOps", "CpuKernelAttentionBackend"]


def test_the_build_is_cached_per_source_and_cpu(tmp_path, monkeypatch):
    from pagemesh.kernels.cpu import build

    monkeypatch.setenv("PAGEMESH_CACHE_DIR", str(tmp_path))
    first = build.library_path()
    assert first.parent == tmp_path / "kernels" and first.exists()
    mtime = first.stat().st_mtime_ns
    assert build.library_path() == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    with pytest.raises(build.BuildError):
        build.library_path()


def test_a_library_that_does_not_build_is_tried_once(tmp_path, monkeypatch):
    from pagemesh.kernels.cpu import build

    monkeypatch.setenv("PAGEMESH_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PAGEMESH_CPU_KERNELS", "1")
    source = tmp_path / "broken.c"
    source.write_text("this is not C\n")
    library = build.Library(source, {})
    assert library.load() is None and "building broken.c failed" in library.error
    source.write_text("void pm_nothing(void) {}\n")  # a fixed source is not picked up: the failure is kept
    assert library.load() is None and "building broken.c failed" in library.error
    fresh = build.Library(source, {"pm_nothing": []})
    assert fresh.load() is not None and fresh.error is None
    assert fresh.load().pm_nothing.restype is None


def test_lora_add_matches_each_rows_own_adapter_in_both_dtypes():
    """kernels/cpu/lora.c: row r adds (x[r] a_s^T) b_s of its slot s (-1: nothing), in place."""
    gen = torch.Generator().manual_seed(0)
    slots_n, width, fan_in, fan_out, rows = 3, 24, 40, 56, 7
    slots = torch.tensor([2, -1, 0, 2, 1, -1, 0])
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        a = torch.randn(slots_n * width, fan_in, generator=gen).to(dtype)
        b = torch.randn(slots_n * width, fan_out, generator=gen).to(dtype)
        x = torch.randn(rows, fan_in, generator=gen).to(dtype)
        y = torch.randn(rows, fan_out, generator=gen).to(dtype)
        expected = y.float().clone()
        for r, s in enumerate(slots.tolist()):
            if s >= 0:
                rows_s = slice(s * width, (s + 1) * width)
                expected[r] += (x[r].float() @ a[rows_s].float().T) @ b[rows_s].float()
        out = ck.lora_add_(y.clone(), x, a, b, slots, width)
        torch.testing.assert_close(out.float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
        assert torch.equal(out[1], y[1]) and torch.equal(out[5], y[5])  # base rows untouched
    with pytest.raises(ValueError, match="a slot beyond"):
        ck.lora_add_(y.clone(), x, a, b, torch.full((rows,), slots_n), width)


def test_lora_add_reads_a_fused_linears_parts_in_their_own_columns():
    """A fused q/k/v adapter: slot rows in parts of rank r, part p's B non-zero only in its own
    columns; with `part_cols` the kernel reads only those and gives the whole product."""
    gen = torch.Generator().manual_seed(1)
    rank, parts, fan_in, slots_n = 4, [12, 6, 6], 20, 2
    width, fan_out = rank * len(parts), sum(parts)
    cols = torch.tensor([0, 12, 18, 24])
    a = torch.randn(slots_n * width, fan_in, generator=gen)
    b = torch.zeros(slots_n * width, fan_out)
    for s in range(slots_n):
        for p in range(len(parts)):
            rows = slice(s * width + p * rank, s * width + (p + 1) * rank)
            b[rows, cols[p] : cols[p + 1]] = torch.randn(rank, parts[p], generator=gen)
    x, y = torch.randn(5, fan_in, generator=gen), torch.randn(5, fan_out, generator=gen)
    slots = torch.tensor([1, 0, -1, 1, 0])
    whole = ck.lora_add_(y.clone(), x, a, b, slots, width)
    by_part = ck.lora_add_grouped_(y.clone(), x, a, b, ck.lora_segments(slots), width, cols)
    torch.testing.assert_close(by_part, whole, rtol=1e-5, atol=1e-5)
