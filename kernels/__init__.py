"""Triton kernels for the model runner, with torch references in `pagemesh.kernels.reference`.

Public functions (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1):

    paged_attention(q, kv_layer, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len, max_seq_len, *, num_splits=None, config=None) -> out
    write_kv(k, v, kv_layer, slot_mapping) -> None                      (in place)
    rms_norm(x, weight, eps) -> out
    fused_add_rms_norm(x, residual, weight, eps) -> (out, new_residual)  (new tensors)
    rotary_embedding(positions, q, k, cos_sin_cache) -> (q_out, k_out)  (new tensors)
    silu_and_mul(x) -> out

Triton is imported only when one of these is first used, so `import pagemesh.kernels` and
`import pagemesh.kernels.reference` work where triton is missing or broken.
"""

from importlib import import_module

_HOME = {
    "paged_attention": "pagemesh.kernels.attention",
    "write_kv": "pagemesh.kernels.kv_write",
    "rms_norm": "pagemesh.kernels.norm",
    "fused_add_rms_norm": "pagemesh.kernels.norm",
    "rotary_embedding": "pagemesh.kernels.rotary",
    "silu_and_mul": "pagemesh.kernels.activation",
}

__all__ = list(_HOME)


def __getattr__(name: str):
    if name in _HOME:
        return getattr(import_module(_HOME[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
