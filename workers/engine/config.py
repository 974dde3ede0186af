"""Engine configuration (frozen), its command-line flags, and how `auto` choices resolve here.

Imports no torch (torch is imported only to resolve a device or dtype): `pagemesh up` parses
the engine's flags without loading it."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from decimal import Decimal
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

from pagemesh.common.quantization import QUANTIZATION_CHOICES
from pagemesh.workers.engine.kv_events import KVEventsConfig
from pagemesh.workers.engine.kv_offload_config import add_kv_offload_arguments, check_kv_offload_config
from pagemesh.workers.engine.lora_config import add_lora_arguments, check_lora_config, lora_modules
from pagemesh.workers.engine.speculative import SpeculativeConfig

if TYPE_CHECKING:
    import torch

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; kv_quant.py maps them


@dataclass(frozen=True)
class EngineConfig:
    """Limits and choices for one engine (one worker). Defaults suit the embedded model on CPU."""

    model: str | None = None  # GGUF file or HF folder; None = embedded SmolLM2-135M-Instruct
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    page_size: int = 16
    num_pages: int | None = None  # fixes the pool size; else from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # default: 2 GiB on CPU; on a GPU see gpu_memory_fraction
    gpu_memory_fraction: float = 0.9  # of the GPU's memory this worker may hold (weights + KV pool)
    max_model_len: int | None = None  # default: the model's, capped at 8192 (and at a sliding window)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # as vLLM's CPU server; 512 gives smoother ITL under steady arrivals
    max_prefill_chunk: int = 512
    max_num_partial_prefills: int = 4
    enable_prefix_caching: bool = True
    batching: str = "iteration"  # iteration (ORCA) | request (the baseline of the experiments)
    preemption_mode: str = "recompute"  # recompute | swap (to host memory)
    swap_space_gb: float = 1.0  # host memory for swapped pages
    max_long_partial_prefills: int = 1  # long prompts prefilled at once (short ones pass them)
    long_prefill_threshold: int | None = None  # tokens; default 4% of the context length
    seed: int = 0
    cuda_graphs: bool = True  # replay decode-only steps from CUDA graphs (CUDA only)
    tensor_parallel_size: int = 1  # rank processes sharing the model's heads (workers/engine/tensor_parallel.py)
    pipeline_parallel_size: int = 1  # stages of contiguous layers, tp ranks each (workers/engine/pipeline_parallel.py)
    enable_expert_parallel: bool = False  # MoE experts placed whole on the tp ranks, not sharded (workers/model/moe.py)
    max_steps_in_flight: int | None = None  # pipeline steps launched, not yet applied (None: the stages)
    kv_cache_dtype: str = "auto"  # auto (the model's) | fp8_e4m3 | fp8_e5m2 (workers/engine/kv_quant.py)
    quantization: str = "auto"  # auto | none | int8 | gguf: linear weights kept quantized (common/quantization.py)
    speculative_config: SpeculativeConfig | None = None  # n-gram or quantized-draft speculation (speculative.py)
    served_model_name: tuple[str, ...] = ()  # the ids it is served under, the first reported; (): the model's own
    enable_lora: bool = False  # serve LoRA adapters (workers/engine/lora_adapters.py)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, peft folder) loaded at start
    max_loras: int = 1  # adapters in one step (slots on the worker), as vLLM's default
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in host memory once read (default: max_loras)
    # each sequence's numbers independent of what shares its steps: greedy output the same alone,
    # in any batch, with speculation, after a recompute (docs/perf/batch_invariance.md; CPU only)
    batch_invariant: bool = False
    kv_events_config: KVEventsConfig | None = None  # KV cache events, as vLLM's (workers/engine/kv_events.py)
    # evicted prefix pages kept for later hits (workers/engine/kv_offload.py): host memory, then a disk folder
    kv_offload_gb: float = 0.0
    kv_offload_dir: str | None = None
    kv_offload_disk_gb: float = 16.0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype: must be auto or one of {sorted(DTYPES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError("device: must be auto, cpu or cuda")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization: must be one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1) or self.page_size > 128:
            raise ValueError("page_size: must be a power of two up to 128")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError("gpu_memory_fraction: must be in (0, 1]")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_prefill_chunk",
            "max_num_partial_prefills",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        if self.max_steps_in_flight is not None and self.max_steps_in_flight < 1:
            raise ValueError("max_steps_in_flight: must be >= 1")
        spec = self.speculative_config
        if spec is not None and spec.method == "draft_quantized" and self.pipeline_parallel_size > 1:
            # the draft runs whole on rank 0 (with -tp too); its lazy catch-up beside M steps in
            # flight (a pipeline) has not been built or tested
            raise ValueError("speculative_config: draft_quantized needs pipeline_parallel_size 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {list(KV_CACHE_DTYPES)}")
        check_lora_config(self)
        check_kv_offload_config(self)

    @property
    def kv_offload(self) -> bool:
        return self.kv_offload_gb > 0 or self.kv_offload_dir is not None

    def resolve_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if device.type == "cuda" or cpu_has_fast_bf16():
            return torch.bfloat16
        return torch.float32


@lru_cache(maxsize=1)
def cpu_has_fast_bf16() -> bool:
    """AMX or AVX512-BF16, as vLLM's CPU backend decides."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def add_engine_arguments(parser) -> None:
    """The engine's flags (shared by `pagemesh worker` and `pagemesh up`)."""
    from pagemesh.common.cli_args import add

    add(parser, "--model", None, help="GGUF file or HF folder (default: embedded SmolLM2-135M-Instruct)")
    add(
        parser,
        "--tensor-parallel-size",
        1,
        type=int,
        aliases=("-tp",),
        help="rank processes per worker, each with its share of the attention heads and MLP (any role: KV pages "
        "go rank i to rank i; all-reduce in shared memory or gloo on a CPU, NCCL on CUDA)",
    )
    add(
        parser,
        "--pipeline-parallel-size",
        1,
        type=int,
        aliases=("-pp",),
        help="pipeline stages per worker, each with a contiguous range of the layers and -tp ranks (any role: "
        "KV pages go stage j to stage j; activations go stage to stage, the last stage's logits back to rank 0)",
    )
    add(
        parser,
        "--enable-expert-parallel",
        False,
        action="store_true",
        help="with -tp N on a mixture-of-experts model: each rank holds 1/N of the experts whole, instead of a "
        "1/N slice of every expert (attention stays split by heads); one all-reduce after the experts either way",
    )
    add(
        parser,
        "--max-steps-in-flight",
        None,
        type=int,
        help="with -pp M: steps launched before the oldest one's output is applied (default M, one per stage; "
        "1: one step at a time); ignored without pipeline stages",
    )
    add(parser, "--dtype", "auto", choices=["auto", *DTYPES], help="weights, activations and KV dtype")
    add(
        parser,
        "--quantization",
        "auto",
        choices=list(QUANTIZATION_CHOICES),
        help="linear weights kept quantized: gguf (a GGUF's own blocks, Q4_0/Q4_1/Q8_0 as they are, "
        "K-quants converted), int8 (made at load from any weights), none (dense in --dtype); auto = gguf for "
        "a GGUF file unless --dtype names a dtype (then dense in it: --dtype float32 is exact fp32), else none",
    )
    add(parser, "--device", "auto", choices=["auto", "cpu", "cuda"])
    add(parser, "--page-size", 16, type=int, help="tokens per KV page")
    add(
        parser,
        "--kv-cache-dtype",
        "auto",
        choices=list(KV_CACHE_DTYPES),
        help="KV pool storage: auto = the model dtype; fp8 halves a page's bytes (per-head scales)",
    )
    add(parser, "--num-pages", None, type=int, help="KV pool size in pages (overrides --kv-cache-memory-bytes)")
    kv_budget = parser.add_mutually_exclusive_group()  # one budget, in either unit
    add(
        kv_budget,
        "--kv-cache-memory-bytes",
        None,
        type=human_readable_int,
        help="KV pool memory in bytes, as vLLM: 4294967296, 4G (GiB: K M G T are powers of 2) or 4.3g (k m g t: "
        "powers of 10) (default 2G on CPU; on a GPU see --gpu-memory-utilization)",
    )
    add(
        kv_budget,
        "--kv-cache-gb",
        None,
        type=float,
        help="KV pool memory in GiB (pagemesh's older flag, kept for one release: --kv-cache-memory-bytes replaces it)",
    )
    add(
        parser,
        "--gpu-memory-utilization",
        old_env_default("--gpu-memory-fraction", 0.9, float),
        type=float,
        aliases=("--gpu-memory-fraction",),  # pagemesh's older spelling, kept for one release
        help="share of the GPU's memory for this worker's weights and KV pool (`pagemesh up` divides "
        "it among workers sharing a GPU)",
    )
    add(
        parser,
        "--max-model-len",
        None,
        type=int,
        help="context length (default: the model's, at most 8192 and at most its sliding window, if it has one)",
    )
    add(parser, "--max-num-seqs", 64, type=int, help="sequences running at once")
    add(
        parser,
        "--max-num-batched-tokens",
        2048,
        type=int,
        help="token budget of one step (smaller: shorter steps while prompts arrive, smoother ITL)",
    )
    add(parser, "--max-prefill-chunk", 512, type=int, help="largest prompt chunk in one step")
    add(parser, "--max-num-partial-prefills", 4, type=int, help="prompts prefilled at once")
    add_prefix_caching_arguments(parser)
    add(parser, "--seed", 0, type=int, help="seed of unseeded sampling")
    add(parser, "--no-cuda-graphs", False, action="store_true", help="run decode steps eagerly on CUDA")
    add(parser, "--batching", "iteration", choices=["iteration", "request"], help="request = the pre-ORCA baseline")
    add(parser, "--preemption-mode", "recompute", choices=["recompute", "swap"], help="when KV pages run out")
    add(parser, "--swap-space-gb", 1.0, type=float, help="host memory for swapped-out pages")
    add(parser, "--max-long-partial-prefills", 1, type=int, help="long prompts prefilled at once")
    add(
        parser,
        "--speculative-config",
        None,
        help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', \'{"method": "suffix"}\' (suffix decoding over the '
        "prompt and this server's earlier outputs; vLLM's suffix_decoding_* keys), or '{\"method\": "
        '"draft_quantized", "num_speculative_tokens": 4, "quantization": "gguf"}\': the model\'s own 4-bit '
        "(gguf) or int8 weights propose. Each step picks each sequence's draft length from its measured "
        'acceptance and the step\'s measured cost (workers/engine/draft_length.py); "max_decode_rows": N '
        "brings back a fixed cut-off (no speculation in steps with more decode rows)",
    )
    add(
        parser,
        "--long-prefill-token-threshold",
        old_env_default("--long-prefill-threshold", None, int),
        type=int,
        aliases=("--long-prefill-threshold",),  # pagemesh's older spelling, kept for one release
        help="tokens that make a prompt long (default 4%% of the context)",
    )
    add(
        parser,
        "--served-model-name",
        None,
        nargs="+",
        metavar="NAME",
        help="the ids the LLM is served under, as vLLM: the first is the one /v1/models and responses report, "
        "every one is accepted in a request's `model` (default: the model's own id; the embedded model's is "
        "its Hugging Face id)",
    )
    add_lora_arguments(parser)
    add(
        parser,
        "--batch-invariant",
        False,
        action=argparse.BooleanOptionalAction,
        help="each sequence's numbers independent of the batch (as vLLM's VLLM_BATCH_INVARIANT): greedy output "
        "the same alone, in any batch, with speculation and after a migration's recompute; prefill attention "
        "through the decode kernel (CPU only; docs/perf/batch_invariance.md)",
    )
    add(
        parser,
        "--kv-events-config",
        None,
        help='KV cache events on a ZMQ PUB socket, as vLLM: \'{"enable_kv_cache_events": true, "publisher": "zmq", '
        '"endpoint": "tcp://*:5557", "topic": "kv-events"}\' (also replay_endpoint, buffer_steps, hwm); one '
        "socket per worker process: `pagemesh up` gives every LLM worker the same one (docs/deployment.md)",
    )
    add_kv_offload_arguments(parser)


ENGINE_FLAGS = (
    "model",
    "dtype",
    "device",
    "page_size",
    "num_pages",
    "kv_cache_memory_bytes",
    "kv_cache_gb",
    "gpu_memory_utilization",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "max_prefill_chunk",
    "max_num_partial_prefills",
    "enable_prefix_caching",
    "seed",
    "no_cuda_graphs",
    "batching",
    "preemption_mode",
    "swap_space_gb",
    "max_long_partial_prefills",
    "long_prefill_token_threshold",
    "tensor_parallel_size",
    "pipeline_parallel_size",
    "enable_expert_parallel",
    "kv_cache_dtype",
    "quantization",
    "speculative_config",
    "max_steps_in_flight",
    "served_model_name",
    "enable_lora",
    "lora_modules",
    "max_loras",
    "max_lora_rank",
    "max_cpu_loras",
    "batch_invariant",
    "kv_events_config",
    "kv_offload_gb",
    "kv_offload_dir",
    "kv_offload_disk_gb",
)


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        page_size=args.page_size,
        num_pages=args.num_pages,
        kv_cache_memory_gb=kv_cache_gb_from_args(args),
        gpu_memory_fraction=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_prefill_chunk=args.max_prefill_chunk,
        max_num_partial_prefills=args.max_num_partial_prefills,
        enable_prefix_caching=args.enable_prefix_caching,
        seed=args.seed,
        cuda_graphs=not args.no_cuda_graphs,
        batching=args.batching,
        preemption_mode=args.preemption_mode,
        swap_space_gb=args.swap_space_gb,
        max_long_partial_prefills=args.max_long_partial_prefills,
        long_prefill_threshold=args.long_prefill_token_threshold,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        speculative_config=SpeculativeConfig.from_json(args.speculative_config),
        max_steps_in_flight=args.max_steps_in_flight,
        served_model_name=served_model_names(args.served_model_name),
        enable_lora=args.enable_lora,
        lora_modules=lora_modules(args.lora_modules),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        max_cpu_loras=args.max_cpu_loras,
        batch_invariant=args.batch_invariant,
        kv_events_config=KVEventsConfig.from_json(args.kv_events_config),
        kv_offload_gb=args.kv_offload_gb,
        kv_offload_dir=args.kv_offload_dir,
        kv_offload_disk_gb=args.kv_offload_disk_gb,
    )


def engine_args_to_argv(args) -> list[str]:
    """The same engine flags, as a command line for a child process (in their vLLM spellings)."""
    argv: list[str] = []
    for name in ENGINE_FLAGS:
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if name in ("enable_prefix_caching", "batch_invariant"):  # said either way, whatever the child's environment
            argv.append(flag if value else "--no-" + flag[2:])
        elif name == "served_model_name":
            argv += [flag, *served_model_names(value)] if value else []
        elif name == "lora_modules":
            argv += [flag, *(f"{n}={p}" for n, p in lora_modules(value))] if value else []
        elif isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def served_model_names(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """--served-model-name's names: a flag's list, or $PAGEMESH_SERVED_MODEL_NAME's space-separated
    names (an environment variable is one string); () when none are given."""
    names = value.split() if isinstance(value, str) else (value or ())
    return tuple(dict.fromkeys(names))


def kv_cache_gb_from_args(args) -> float | None:
    """The KV budget in GiB, from --kv-cache-memory-bytes or --kv-cache-gb (one of them: the flags
    exclude each other, and this refuses both through their environment variables); None: neither."""
    if args.kv_cache_memory_bytes is not None and args.kv_cache_gb is not None:
        raise ValueError("--kv-cache-memory-bytes and --kv-cache-gb: give one of them (both set the KV budget)")
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes / 2**30
    return args.kv_cache_gb


def human_readable_int(text: str) -> int:
    """An integer as vLLM reads its large ones: plain digits, or a number with a suffix, lowercase
    for powers of 10 (k m g t: '25.6k' = 25600, '4g' = 4 * 10**9) or uppercase for powers of 2
    (K M G T: '4G' = 4 * 2**30; whole numbers only)."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r} (e.g. 4294967296, 4G or 4.3g)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(Decimal(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: K M G T (powers of 2) take whole numbers (or {text.lower()})")
    return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)


def old_env_default(old_flag: str, default, kind):
    """The default of a flag renamed to vLLM's spelling from `old_flag`: the old flag's environment
    variable when set (it keeps working for one release, as the old flag does), else `default`. The
    new name's variable still comes first (`cli_args.add` reads it)."""
    from pagemesh.common.cli_args import env_name

    raw = os.environ.get(env_name(old_flag))
    if raw is None:
        return default
    return _env_true(raw) if kind is bool else kind(raw)


def _env_true(raw: str) -> bool:
    return raw.lower() in ("1", "true", "yes", "on")  # as common/cli_args.py reads a store_true flag's variable


def add_prefix_caching_arguments(parser) -> None:
    """--enable-prefix-caching / --no-enable-prefix-caching (vLLM's), and pagemesh's older
    --no-prefix-caching (kept for one release). The default, on, comes from
    $PAGEMESH_ENABLE_PREFIX_CACHING, else from the older $PAGEMESH_NO_PREFIX_CACHING."""
    from pagemesh.common.cli_args import env_name

    raw = os.environ.get(env_name("--enable-prefix-caching"))
    default = _env_true(raw) if raw is not None else not old_env_default("--no-prefix-caching", False, bool)
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=default,
        help="the prefix cache, on by default: requests share the KV pages of a common prompt prefix "
        f"[env {env_name('--enable-prefix-caching')}]",
    )
    parser.add_argument(
        "--no-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        help="the older spelling of --no-enable-prefix-caching (kept for one release)",
    )
