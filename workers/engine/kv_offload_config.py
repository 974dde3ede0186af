"""The KV offload tier's flags (workers/engine/kv_offload.py) and their checks. No torch
(`pagemesh up` parses them)."""

from __future__ import annotations


def add_kv_offload_arguments(parser) -> None:
    from pagemesh.common.cli_args import add

    add(
        parser,
        "--kv-offload-gb",
        0.0,
        type=float,
        help="host memory (GiB) for prefix pages evicted from the KV pool: a later prompt with the prefix loads "
        "them back instead of computing them again (as vLLM's --kv-offloading-size; default 0: none)",
    )
    add(
        parser,
        "--kv-offload-dir",
        None,
        help="a local folder where evicted prefix pages go when the host tier is full (or at once, without "
        "--kv-offload-gb); a restarted worker of the same model serves hits from it, each file checked by its "
        "checksum (docs/deployment.md)",
    )
    add(parser, "--kv-offload-disk-gb", 16.0, type=float, help="disk (GiB) --kv-offload-dir may fill")


def check_kv_offload_config(config) -> None:
    """Refuse what the tier cannot serve (`config`: an EngineConfig)."""
    if config.kv_offload_gb < 0 or config.kv_offload_disk_gb <= 0:
        raise ValueError("kv_offload_gb: must be >= 0, and kv_offload_disk_gb > 0")
    if not config.kv_offload:
        return
    if not config.enable_prefix_caching:
        raise ValueError("kv_offload_gb / kv_offload_dir: keep evicted prefix pages, so need prefix caching on")
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        # a page is split over the ranks' pools; the tier copies rank 0's only
        raise ValueError("kv_offload_gb / kv_offload_dir: single-rank workers only (no -tp or -pp above 1)")
