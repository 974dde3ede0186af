"""`pagemesh <command>`: one entry for every process kind and tool.

pagemesh up          the whole mesh on this machine (gateway, tokenizer, scheduler, workers)
pagemesh gateway     one process of a kind (what compose runs) ...
pagemesh tokenizer
pagemesh scheduler
pagemesh worker --role prefill|decode|mixed
pagemesh diffusion   a diffusion worker (images)
pagemesh encoder     an encoder worker (a multimodal model's images, --encoder N)
pagemesh audio       an audio worker (speech to text with a Whisper model, --audio N)
pagemesh generate    offline: run prompts through one in-process engine and print them
pagemesh bench       load generator for any OpenAI-compatible server
pagemesh experiment  the experiments of the papers (paged-memory, orca, sarathi, ...)
pagemesh simulate    the mesh's scheduling code in virtual time on a cost model (cluster sizing)
pagemesh tokenizer-export DIR   the model's tokenizer as a Hugging Face folder (for load tools)
pagemesh keys DIR    the CurveZMQ keypair of the internal sockets (then --zmq-keys DIR everywhere);
                     --process NAME...: a pair per process and the allow-list (then --zmq-key-name NAME)
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from pagemesh.common.logging import FORMAT_ENV, FORMATS

KEYS_ENV = "PAGEMESH_ZMQ_KEYS"  # common.transport_curve.KEYS_ENV (not imported here: no zmq for every command)
KEY_NAME_ENV = "PAGEMESH_ZMQ_KEY_NAME"  # common.transport_curve.KEY_NAME_ENV

COMMANDS = {
    "up": ("pagemesh.services.launcher", "the whole mesh on this machine"),
    "gateway": ("pagemesh.gateway.main", "the OpenAI-compatible HTTP gateway"),
    "tokenizer": ("pagemesh.services.tokenizer.main", "the tokenizer service"),
    "scheduler": ("pagemesh.services.scheduler.main", "the scheduler (registry, placement)"),
    "worker": ("pagemesh.workers.llm.main", "an LLM worker: --role prefill|decode|mixed"),
    "diffusion": ("pagemesh.workers.diffusion.main", "a diffusion worker: images, batched per denoising step"),
    "encoder": ("pagemesh.workers.encoder.main", "an encoder worker: a multimodal model's vision tower"),
    "audio": ("pagemesh.workers.audio.main", "an audio worker: speech to text with a Whisper model"),
    "generate": ("pagemesh.workers.engine.generate_cli", "offline generation through one engine"),
    "bench": ("pagemesh.bench.loadgen.main", "load any OpenAI-compatible server and report latencies"),
    "experiment": (
        "pagemesh.bench.experiments.main",
        "reproduce a paper's experiment: pagemesh experiment NAME --out DIR",
    ),
    "simulate": ("pagemesh.bench.simulator.main", "the scheduling code on a cost model: cluster sizing, what-ifs"),
    "tokenizer-export": ("pagemesh.services.tokenizer_export", "write the tokenizer as a Hugging Face folder: DIR"),
    "keys": ("pagemesh.services.mesh_keys", "make the CurveZMQ keys of the internal sockets: DIR [--process NAME...]"),
}


def usage() -> str:
    lines = ["usage: pagemesh <command> [flags]   (pagemesh <command> --help for its flags)", ""]
    lines += [f"  {name:<10} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "every command: --log-format console|json (default: console on a terminal, else json)"]
    lines += ["               --zmq-keys DIR  CurveZMQ on every internal socket (`pagemesh keys DIR` makes them)"]
    lines += ["               --zmq-key-name NAME  this process's own pair in DIR (`pagemesh keys DIR --process NAME`)"]
    return "\n".join(lines)


def take_flag(argv: list[str], flag: str) -> tuple[list[str], list[str]]:
    """Every value of `flag X` / `flag=X` in argv, in order, and the rest of argv (a `flag` that
    ends argv, with no value after it, stays in the rest)."""
    values, rest, i = [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
            i += 2
        elif arg.startswith(flag + "="):
            values.append(arg.partition("=")[2])
            i += 1
        else:
            rest.append(arg)
            i += 1
    return values, rest


def take_log_format(argv: list[str]) -> list[str]:
    """`--log-format X` / `--log-format=X`, valid for every command, goes to $PAGEMESH_LOG_FORMAT
    (which the processes `pagemesh up` starts inherit); the rest of argv is returned."""
    values, rest = take_flag(argv, "--log-format")
    for value in values:
        if value not in FORMATS:
            print(f"pagemesh: --log-format must be one of {', '.join(FORMATS)}, got {value!r}", file=sys.stderr)
            raise SystemExit(2)
        os.environ[FORMAT_ENV] = value
    return rest


def take_zmq_keys(argv: list[str]) -> list[str]:
    """`--zmq-keys DIR` / `--zmq-keys=DIR`, valid for every command, goes to $PAGEMESH_ZMQ_KEYS
    (an absolute path: the processes `pagemesh up` starts inherit it), which every socket reads
    (common/transport_curve.py); `--zmq-key-name NAME`, this process's own pair in DIR, to
    $PAGEMESH_ZMQ_KEY_NAME. The keys are checked here, before anything starts (a process whose key
    the folder's allow-list leaves out stops too); the rest of argv is returned."""
    values, rest = take_flag(argv, "--zmq-keys")
    names, rest = take_flag(rest, "--zmq-key-name")
    if values:
        os.environ[KEYS_ENV] = values[-1]
    if names:
        os.environ[KEY_NAME_ENV] = names[-1]
    if rest[:1] == ["keys"]:  # `pagemesh keys` makes them
        return rest
    if os.environ.get(KEY_NAME_ENV) and not os.environ.get(KEYS_ENV):
        print("pagemesh: --zmq-key-name needs --zmq-keys DIR (the folder of its keys)", file=sys.stderr)
        raise SystemExit(2)
    if os.environ.get(KEYS_ENV):
        from pagemesh.common.transport_curve import check_admitted, load_keys  # zmq: only for a process with keys

        os.environ[KEYS_ENV] = os.path.abspath(os.environ[KEYS_ENV])
        try:
            check_admitted(load_keys(os.environ[KEYS_ENV], os.environ.get(KEY_NAME_ENV) or None))
        except ValueError as e:
            print(f"pagemesh: --zmq-keys: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    return rest


def main(argv: list[str] | None = None) -> None:
    argv = take_zmq_keys(take_log_format(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"pagemesh: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    if COMMANDS[name][0].startswith("pagemesh.bench.") and importlib.util.find_spec("pagemesh.bench") is None:
        print(f"pagemesh {name}: runs from a clone of the repository (its bench/ is not in the wheel)", file=sys.stderr)
        raise SystemExit(2)
    module = importlib.import_module(COMMANDS[name][0])
    module.main(rest)


if __name__ == "__main__":
    main()
