"""Diffusion worker configuration: the shell's, the model folder, the step batcher's limits.
Torch-free, so `pagemesh up` can declare these flags without loading torch."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagemesh.common.cli_args import add
from pagemesh.workers.diffusion.engine.cache_policy import POLICIES_HELP, CachePolicyError, parse_cache_policy
from pagemesh.workers.shell.config import ShellConfig, add_shell_arguments, shell_config_from_args

BATCHING = ("step", "request", "serial")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class DiffusionWorkerConfig:
    shell: ShellConfig
    model: str | None = None  # a diffusers folder; None: the embedded digits model
    served_model_name: str | None = None  # default: the folder's name
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    batching: str = "step"  # step | request | serial
    max_running: int = 16  # requests denoised together
    max_batch_rows: int = 64  # rows per model forward (classifier-free guidance doubles a request's)
    max_waiting: int = 64  # requests queued in the worker beyond the running ones
    request_wait: float = 0.05  # request-level batching: seconds a batch gathers before it starts
    threads: int | None = None  # torch CPU threads
    cache: str = "none"  # the feature-cache policy of requests that ask for none
    cache_budget_mb: float = 256.0  # what the running requests' feature caches may hold together

    def __post_init__(self) -> None:
        if self.batching not in BATCHING:
            raise ValueError(f"batching: must be one of {', '.join(BATCHING)}")
        if self.device not in DEVICES:
            raise ValueError(f"device: must be one of {', '.join(DEVICES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: must be one of {', '.join(DTYPES)}")
        if self.max_running < 1 or self.max_batch_rows < 2 or self.max_waiting < 0:
            raise ValueError("max_running >= 1, max_batch_rows >= 2 and max_waiting >= 0 are needed")
        if self.request_wait < 0:
            raise ValueError("request_wait: must be >= 0")
        if self.cache_budget_mb < 0:
            raise ValueError("cache_budget_mb: must be >= 0")
        try:
            parse_cache_policy(self.cache)
        except CachePolicyError as e:
            raise ValueError(f"--diffusion-{e}") from None


def add_diffusion_arguments(parser: argparse.ArgumentParser) -> None:
    """The diffusion worker's own flags (`pagemesh up` passes them through to its workers)."""
    add(parser, "--diffusion-model", None, help="a diffusers folder (default: the embedded digits model)")
    add(parser, "--diffusion-served-model-name", None, help="the id the image model is served under")
    add(parser, "--diffusion-device", "auto", choices=DEVICES)
    add(parser, "--diffusion-dtype", "auto", choices=DTYPES)
    add(parser, "--diffusion-batching", "step", choices=BATCHING, help="step-level (default), request-level or serial")
    add(parser, "--diffusion-max-running", 16, type=int, help="requests denoised together")
    add(parser, "--diffusion-max-batch-rows", 64, type=int, help="rows per model forward (CFG doubles a request's)")
    add(parser, "--diffusion-max-waiting", 64, type=int, help="requests queued in the worker beyond those running")
    add(parser, "--diffusion-request-wait", 0.05, type=float, help="request-level batching: seconds a batch gathers")
    add(parser, "--diffusion-cache", "none", help=f"the feature cache of requests that ask for none: {POLICIES_HELP}")
    add(parser, "--diffusion-cache-budget-mb", 256.0, type=float, help="MiB the running requests' caches may hold")


DIFFUSION_FLAGS = (
    "diffusion_model",
    "diffusion_served_model_name",
    "diffusion_device",
    "diffusion_dtype",
    "diffusion_batching",
    "diffusion_max_running",
    "diffusion_max_batch_rows",
    "diffusion_max_waiting",
    "diffusion_request_wait",
    "diffusion_cache",
    "diffusion_cache_budget_mb",
)


def diffusion_args_to_argv(args: argparse.Namespace) -> list[str]:
    """The same flags, as a command line for a child process."""
    argv: list[str] = []
    for name in DIFFUSION_FLAGS:
        value = getattr(args, name)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def parse_diffusion(argv: list[str]) -> DiffusionWorkerConfig:
    parser = argparse.ArgumentParser(prog="pagemesh diffusion", description="One diffusion worker serving the mesh.")
    add_shell_arguments(parser)
    add_diffusion_arguments(parser)
    add(parser, "--threads", None, type=int, help="torch CPU threads (default: all cores)")
    args = parser.parse_args(argv)
    try:
        return DiffusionWorkerConfig(
            shell=shell_config_from_args(args, "diffusion"),
            model=args.diffusion_model or None,  # "" (an unset compose variable): the embedded model
            served_model_name=args.diffusion_served_model_name or None,
            device=args.diffusion_device,
            dtype=args.diffusion_dtype,
            batching=args.diffusion_batching,
            max_running=args.diffusion_max_running,
            max_batch_rows=args.diffusion_max_batch_rows,
            max_waiting=args.diffusion_max_waiting,
            request_wait=args.diffusion_request_wait,
            threads=args.threads,
            cache=args.diffusion_cache,
            cache_budget_mb=args.diffusion_cache_budget_mb,
        )
    except ValueError as e:
        parser.error(str(e))
