"""`pagemesh up`: the whole mesh on one machine.

Starts the scheduler, a tokenizer, the LLM workers, the diffusion and audio workers and the
gateway as separate processes talking over ipc:// sockets in a run folder, waits until each
reports READY, prints the URL, starts again a process that exits (services/supervisor.py: the
mesh stops only when one keeps dying at start), and stops them all on Ctrl-C / SIGTERM. On CUDA
the workers are spread over the visible GPUs (CUDA_VISIBLE_DEVICES): an LLM worker of -tp x -pp
ranks gets that many GPUs of its own, a diffusion or audio worker one; workers that share GPUs
share their memory (`--gpu-memory-utilization` divided among them); too few GPUs for one worker
is an error at start.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pagemesh.common.cli_args import add
from pagemesh.common.cpu_threads import usable_cores
from pagemesh.common.gpus import nvidia_gpu_count, visible_gpu_ids, worker_gpu_groups
from pagemesh.common.logging import COLOR_ENV, FORMAT_ENV, log_colors, log_format
from pagemesh.common.lora import lora_modules
from pagemesh.common.messages import Ready
from pagemesh.common.model_files import model_aliases, resolve_model_path, served_model_name
from pagemesh.common.transport import Pull, ipc_address
from pagemesh.gateway.config import (
    add_auth_arguments,
    add_chat_output_arguments,
    api_keys_from_args,
    auth_args_to_argv,
    chat_output_args_to_argv,
    check_chat_output_arguments,
)
from pagemesh.gateway.media import add_media_arguments, media_args_to_argv, media_policy
from pagemesh.services.log_relay import LogRelay
from pagemesh.services.scheduler.config import add_policy_arguments, policy_args_to_argv
from pagemesh.services.supervisor import Supervisor, drain_in_order
from pagemesh.services.tokenizer.config import CHAT_TEMPLATE_HELP
from pagemesh.workers.audio.main import missing_whisper_files
from pagemesh.workers.diffusion.config import add_diffusion_arguments, diffusion_args_to_argv
from pagemesh.workers.diffusion.pipelines.embedded import STUDENT_NAME
from pagemesh.workers.engine.config import (
    add_engine_arguments,
    engine_args_to_argv,
    kv_cache_gb_from_args,
    served_model_names,
)
from pagemesh.workers.engine.kv_events import kv_events_argv_for_worker

WORKER_COMMANDS = ("worker", "diffusion", "encoder", "audio")  # the processes that are workers (GPUs, draining)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="pagemesh up", description=__doc__)
    add(parser, "--host", "127.0.0.1", help="HTTP listen host of the gateway")
    add(parser, "--port", 8000, type=int, help="HTTP port of the gateway")
    add(parser, "--prefill", None, type=int, help="prefill workers (default 1, or 0 with --mixed)")
    add(parser, "--decode", None, type=int, help="decode workers (default 1, or 0 with --mixed)")
    add(parser, "--mixed", 0, type=int, help="mixed workers (prefill and decode in one engine)")
    add(parser, "--diffusion", 1, type=int, help="diffusion workers (images; 0 for none)")
    add(
        parser,
        "--tokenizers",
        1,
        type=int,
        help="tokenizer replicas; the gateway spreads requests over them, and a stream whose replica dies "
        "goes on through another (or through the same one once it is restarted)",
    )
    add(
        parser,
        "--encoder",
        0,
        type=int,
        help="encoder workers: a multimodal model's vision tower as a pool of its own, pushing image rows to "
        "the prefilling workers (encode/prefill/decode disaggregation; 0: each worker encodes its own images)",
    )
    add(
        parser,
        "--audio",
        0,
        type=int,
        help="audio workers (speech to text, /v1/audio/transcriptions; needs --audio-model)",
    )
    add(parser, "--audio-model", None, help="the audio workers' Whisper model: a Hugging Face folder")
    add(
        parser,
        "--audio-threads",
        None,
        type=int,
        help="torch threads per audio worker (default: as an LLM worker's, --threads-per-worker)",
    )
    add(
        parser,
        "--diffusion-student",
        0,
        type=int,
        help=f"diffusion workers serving the embedded few-step student (requests with model='{STUDENT_NAME}')",
    )
    add(
        parser,
        "--diffusion-threads",
        1,
        type=int,
        help="torch threads per diffusion worker (the embedded model's matmuls are too small to share)",
    )
    add(parser, "--run-dir", None, help="folder for ipc sockets (default: a new temporary folder)")
    add(parser, "--ready-timeout", 300.0, type=float, help="seconds to wait for every process")
    add(
        parser,
        "--threads-per-worker",
        None,
        type=int,
        help="torch threads per worker (default: usable cores / workers); they wait passively "
        "(PAGEMESH_THREAD_POLICY: passive, adaptive, fixed; docs/perf/threads.md)",
    )
    add(parser, "--transfer-timeout", 30.0, type=float)
    add_policy_arguments(parser)
    add_engine_arguments(parser)
    add_diffusion_arguments(parser)
    add_auth_arguments(parser)
    add_chat_output_arguments(parser)
    add_media_arguments(parser)
    add(parser, "--chat-template", None, help=CHAT_TEMPLATE_HELP)
    args = parser.parse_args(argv)
    media_policy(parser, args)  # the gateway's checks, made before anything starts
    args.api_keys = api_keys_from_args(parser, args)
    check_chat_output_arguments(parser, args)
    mixed_only = args.mixed > 0
    args.prefill = args.prefill if args.prefill is not None else (0 if mixed_only else 1)
    args.decode = args.decode if args.decode is not None else (0 if mixed_only else 1)
    if (args.prefill > 0) != (args.decode > 0):
        parser.error("--prefill and --decode go together (or use --mixed)")
    if args.prefill + args.decode + args.mixed + args.diffusion + args.diffusion_student + args.audio == 0:
        parser.error("no workers: give --prefill/--decode, --mixed, --diffusion, --diffusion-student or --audio")
    if args.diffusion < 0 or args.diffusion_student < 0 or args.encoder < 0 or args.audio < 0:
        parser.error("--diffusion, --diffusion-student, --encoder, --audio: must be >= 0")
    if args.tokenizers < 1:
        parser.error("--tokenizers: must be >= 1")
    check_audio_arguments(parser, args)
    try:
        kv_cache_gb_from_args(args)  # both KV budgets through the environment: refused here, not by every worker
    except ValueError as e:
        parser.error(str(e))
    return args


def check_audio_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--audio N needs --audio-model, a folder (made absolute: the workers may start elsewhere)."""
    if args.audio and args.audio_model is None:
        parser.error("--audio: give the Whisper model's folder with --audio-model")
    if args.audio_model is not None:
        if not args.audio:
            parser.error("--audio-model: give the number of audio workers with --audio N")
        if missing := missing_whisper_files(Path(args.audio_model).expanduser()):
            parser.error(f"--audio-model: {args.audio_model} is not a Whisper model folder (no {', '.join(missing)})")
        args.audio_model = str(Path(args.audio_model).expanduser().resolve())
    if args.audio_threads is not None and args.audio_threads < 1:
        parser.error("--audio-threads: must be >= 1")


def plan(args: argparse.Namespace, run_dir: str) -> list[tuple[str, list[str]]]:
    """(name, pagemesh argv) for every process, in start order."""
    ready = ipc_address(run_dir, "ready")
    sched = ipc_address(run_dir, "scheduler")
    # the first replica is "tokenizer" (as when there is one), the others "tokenizer-1", ...
    tokenizers = ["tokenizer", *(f"tokenizer-{i}" for i in range(1, args.tokenizers))]
    model = ["--model", args.model] if args.model else []
    served = served_model_names(args.served_model_name)  # the workers get them among the engine's flags
    # the scheduler has --drain-timeout among its policy flags: the others get it here
    common = ["--ready-address", ready]
    drain = ["--drain-timeout", str(args.drain_timeout)]
    engine = engine_args_to_argv(args)
    workers = max(1, args.prefill + args.decode + args.mixed)  # LLM workers share the cores
    # each worker's threads (how they wait, and whether the count adapts: common/cpu_threads.py)
    threads = args.threads_per_worker or max(1, usable_cores() // workers)
    # what the mesh serves: /ready (and the launcher's ready line) waits for each kind's pool, so a
    # diffusion worker that registers first does not make an LLM mesh look ready
    counts = {
        "llm": args.prefill + args.decode + args.mixed,
        "diffusion": args.diffusion + args.diffusion_student,
        "audio": args.audio,
    }
    serves = ",".join(kind for kind, n in counts.items() if n)
    modules = lora_modules(args.lora_modules)  # the scheduler keeps the mesh's adapters (the workers load them too)
    loras = ["--lora-modules", *(f"{name}={path}" for name, path in modules)] if modules else []
    procs = [
        (
            "scheduler",
            ["scheduler", "--address", sched, *policy_args_to_argv(args), "--serves", serves, *loras, *common],
        ),
    ]
    for i, name in enumerate(tokenizers):
        procs.append(
            (
                name,
                [
                    "tokenizer",
                    "--address",
                    ipc_address(run_dir, name),
                    "--output-address",
                    ipc_address(run_dir, f"{name}-out"),
                    "--scheduler-address",
                    sched,
                    "--name",
                    f"tokenizer-{i}",
                    *model,
                    *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
                    *(["--chat-template", args.chat_template] if args.chat_template else []),
                    *common,
                    *drain,
                ],
            )
        )
    llm_workers = 0  # each LLM worker's ordinal: its KV events socket (if any) is its own
    for role, count in (("prefill", args.prefill), ("decode", args.decode), ("mixed", args.mixed)):
        for i in range(count):
            name = f"{role}-{i}"
            worker_engine, llm_workers = kv_events_argv_for_worker(engine, llm_workers), llm_workers + 1
            kv = ["--kv-address", ipc_address(run_dir, f"kv-{name}")] if role == "decode" else []
            if args.encoder and role != "decode":  # the prompt's workers take the encoder pool's image rows
                kv += ["--embeds-address", ipc_address(run_dir, f"embeds-{name}")]
            procs.append(
                (
                    name,
                    [
                        "worker",
                        "--role",
                        role,
                        "--worker-id",
                        name,
                        "--scheduler-address",
                        sched,
                        "--threads",
                        str(threads),
                        "--transfer-timeout",
                        str(args.transfer_timeout),
                        *kv,
                        *worker_engine,
                        *common,
                        *drain,
                    ],
                )
            )
    # The student's workers take every diffusion flag but the model: they serve the embedded
    # student under its own name, so the scheduler sends them the requests that name it.
    student = argparse.Namespace(**{**vars(args), "diffusion_model": STUDENT_NAME, "diffusion_served_model_name": None})
    pools = [("diffusion", args.diffusion, args), ("diffusion-student", args.diffusion_student, student)]
    for prefix, count, flags in pools:
        for i in range(count):
            name = f"{prefix}-{i}"
            procs.append(
                (
                    name,
                    [
                        "diffusion",
                        "--worker-id",
                        name,
                        "--scheduler-address",
                        sched,
                        "--threads",
                        str(args.diffusion_threads),
                        *diffusion_args_to_argv(flags),
                        *common,
                        *drain,
                    ],
                )
            )
    for i in range(args.encoder):
        name = f"encoder-{i}"
        dtype = ["--dtype", args.dtype] if args.dtype else []
        encoder = ["encoder", "--worker-id", name, "--scheduler-address", sched, "--threads", str(threads)]
        procs.append((name, [*encoder, *model, *dtype, *common, *drain]))
    for i in range(args.audio):
        name = f"audio-{i}"
        audio_threads = str(args.audio_threads or threads)
        audio = ["audio", "--worker-id", name, "--scheduler-address", sched, "--threads", audio_threads]
        procs.append((name, [*audio, "--model", args.audio_model, *common, *drain]))
    procs.append(
        (
            "gateway",
            [
                "gateway",
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--tokenizer-address",
                ",".join(ipc_address(run_dir, name) for name in tokenizers),
                "--scheduler-address",
                sched,
                "--reply-address",
                ipc_address(run_dir, "gateway-0"),
                "--name",
                "gateway-0",
                *model,
                *(["--served-model-name", *served] if served else []),
                *(["--enable-lora"] if args.enable_lora else []),
                *auth_args_to_argv(args, args.api_keys, Path(run_dir) / "api-keys"),
                *chat_output_args_to_argv(args),
                *media_args_to_argv(args),
                *(["--max-model-len", str(args.max_model_len)] if args.max_model_len else []),
                *common,
                *drain,
            ],
        )
    )
    return procs


def visible_gpus(device: str) -> list[str]:
    """The GPUs this process may use when the workers run on CUDA, else none."""
    if device == "cpu":
        return []
    return visible_gpu_ids(os.environ.get("CUDA_VISIBLE_DEVICES"), nvidia_gpu_count())


def on_gpus(
    args: argparse.Namespace, procs: list[tuple[str, list[str]]]
) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, environment overrides) per process: an LLM worker on CUDA sees its own group
    of -tp x -pp GPUs (common/gpus.py; its ranks take one each), a diffusion worker one GPU, and
    a worker's argv ends with its share of its GPUs' memory when other LLM workers share them.
    ValueError when fewer GPUs are visible than one worker's ranks."""
    workers = [name for name, argv in procs if argv[0] in WORKER_COMMANDS]
    llm = {name for name, argv in procs if argv[0] == "worker"}
    tp, pp = (args.tensor_parallel_size, args.pipeline_parallel_size) if llm else (1, 1)
    placement = worker_gpu_groups(workers, visible_gpus(args.device), tp, pp, one_gpu=set(workers) - llm)
    # the memory fraction is the LLM workers' KV budget: it is divided among those on a group (a
    # diffusion worker's weights and activations come on top; lower the fraction for a big one)
    llm_sharing = Counter(gpus for name, gpus in placement.items() if name in llm)
    out = []
    for name, argv in procs:
        env: dict[str, str] = {}
        if name in placement:
            gpus = placement[name]
            env = {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}
            sharing = llm_sharing[gpus]
            if sharing > 1 and name in llm:  # argparse keeps the last value
                argv = [*argv, "--gpu-memory-utilization", f"{args.gpu_memory_utilization / sharing:.4f}"]
        out.append((name, argv, env))
    return out


class Mesh:
    """The child processes of one `pagemesh up`."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.logs = LogRelay()
        self.run_dir = args.run_dir or tempfile.mkdtemp(prefix="pagemesh-")
        self.owns_run_dir = args.run_dir is None  # a folder we made goes when the mesh stops
        os.makedirs(self.run_dir, exist_ok=True)
        self.children: dict[str, subprocess.Popen] = {}
        # the children write into pipes, not our terminal: they take our log format and colour with them
        log_env = {FORMAT_ENV: log_format(), COLOR_ENV: str(int(log_colors()))}
        self.supervisor = Supervisor(self.children, relay=self.logs, env=log_env)

    async def start(self) -> None:
        """Start every child; return once each reported READY (a child that dies meanwhile is
        started again, as the supervisor decides)."""
        for name, argv, env in on_gpus(self.args, plan(self.args, self.run_dir)):
            self.supervisor.spawn(name, argv, env)
        deadline = time.monotonic() + self.args.ready_timeout
        await self._supervise(until=lambda: self.supervisor.ready >= set(self.children), deadline=deadline)

    async def watch(self) -> None:
        """Start again every child that exits; returns only by raising (KeepsDying)."""
        await self._supervise(until=lambda: False, deadline=float("inf"))

    async def _supervise(self, until, deadline: float) -> None:
        with Pull(ipc_address(self.run_dir, "ready")) as ready:
            while not until():
                for line in self.supervisor.check(time.monotonic()):
                    print(f"pagemesh up: {line}", file=sys.stderr, flush=True)
                try:
                    msg = await asyncio.wait_for(ready.recv(), timeout=0.5)
                except TimeoutError:
                    if time.monotonic() > deadline:
                        waiting = sorted(set(self.children) - self.supervisor.ready)
                        raise RuntimeError(f"not ready after {self.args.ready_timeout:.0f}s: {waiting}") from None
                    continue
                if isinstance(msg, Ready):
                    self.supervisor.mark_ready(msg.name if msg.name in self.children else msg.service)

    async def drain(self, hurry: asyncio.Event) -> None:
        """SIGTERM's orderly stop: the gateway stops admitting and finishes what is in flight
        first, then the workers finish what they hold (each within --drain-timeout). The
        tokenizer and the scheduler then have nothing left for anyone: `stop()` ends them."""
        kinds = {name: argv[0] for name, argv in plan(self.args, self.run_dir)}
        gateways = [n for n, k in kinds.items() if k == "gateway"]
        workers = [n for n, k in kinds.items() if k in WORKER_COMMANDS]
        await drain_in_order(self.children, [gateways, workers], self.args.drain_timeout, hurry)

    def stop(self) -> None:
        """At once: SIGINT to every child still running (SIGKILL after 10 s). A child not ready
        yet gets SIGTERM instead: it may not handle signals yet, and SIGTERM ends it quietly
        where SIGINT would print a KeyboardInterrupt traceback."""
        for name, proc in self.children.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT if name in self.supervisor.ready else signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.children.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.logs.drain(timeout=2.0)
        if self.owns_run_dir:  # the ipc sockets' folder: nothing may be left in the temp dir
            shutil.rmtree(self.run_dir, ignore_errors=True)


def ready_line(args: argparse.Namespace, workers: str) -> str:
    """The one line `pagemesh up` prints once every process reported READY."""
    model = resolve_model_path(args.model)
    # the names a request may give: --served-model-name's (the first reported), else the model's id and aliases
    name, *aliases = served_model_names(args.served_model_name) or (served_model_name(model), *model_aliases(model))
    names = " (alias " + ", ".join(aliases) + ")" if aliases else ""
    url = f"http://{args.host}:{args.port}/v1"
    return f"pagemesh is up: {url}  model {name}{names}  workers: {workers}  (Ctrl-C stops)"


def main(argv: list[str]) -> None:
    args = parse(argv)
    mesh = Mesh(args)
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()  # the first signal
    hurry = asyncio.Event()  # SIGINT, or a second SIGTERM: no drain
    drain = [False]

    def on_signal(sig: signal.Signals) -> None:
        if stop.is_set() or sig == signal.SIGINT:
            hurry.set()
        drain[0] = sig == signal.SIGTERM and not hurry.is_set()
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    async def lifetime() -> int:
        starting = asyncio.ensure_future(mesh.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([starting, stopped], return_when=asyncio.FIRST_COMPLETED)
        if stopped.done():
            starting.cancel()
            await asyncio.gather(starting, return_exceptions=True)
            return 0
        if starting.exception() is not None:  # a process failed to start, or too few GPUs
            stopped.cancel()
            await asyncio.gather(stopped, return_exceptions=True)
            starting.result()
        llm = f"{args.prefill} prefill + {args.decode} decode" if args.prefill else f"{args.mixed} mixed"
        parts = [llm] if args.prefill or args.mixed else []
        parts += [f"{args.diffusion} diffusion"] if args.diffusion else []
        parts += [f"{args.diffusion_student} {STUDENT_NAME}"] if args.diffusion_student else []
        parts += [f"{args.audio} audio"] if args.audio else []
        workers = " + ".join(parts)
        print(ready_line(args, workers), flush=True)
        watching = asyncio.ensure_future(mesh.watch())
        try:
            await asyncio.wait([watching, stopped], return_when=asyncio.FIRST_COMPLETED)
            if watching.done():
                watching.result()  # raises if a process keeps dying at start
        finally:  # the task still waiting is ended, not left pending when the loop closes
            for task in (watching, stopped):
                task.cancel()
            await asyncio.gather(watching, stopped, return_exceptions=True)
        if drain[0]:  # SIGTERM: in order, each part finishing what it holds
            await mesh.drain(hurry)
        return 0

    code, failure = 1, None
    try:
        code = loop.run_until_complete(lifetime())
    except (RuntimeError, ValueError) as e:  # ValueError: a flag the machine cannot honour (too few GPUs)
        failure = e
    finally:
        mesh.stop()
        loop.close()
    if failure is not None:  # last, after what the stopped children said
        print(f"pagemesh up: {failure}", file=sys.stderr, flush=True)
    raise SystemExit(code)
