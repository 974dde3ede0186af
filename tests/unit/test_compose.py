"""compose.yaml runs the same topology as `pagemesh up` (no Docker engine here: we parse it)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import yaml

from pagemesh.common.model_files import resolve_model_path
from pagemesh.services.launcher import parse, plan

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def argv_of(service: dict) -> list[str]:
    """The pagemesh argv a service runs, with the shell's $(hostname) filled in."""
    command = service["command"]
    if command[:2] == ["sh", "-c"]:
        line = command[2].replace("$$(hostname)", "container1")
        command = shlex.split(line.removeprefix("exec "))
    assert command[0] == "pagemesh"
    return command[1:]


def kind_of(argv: list[str]) -> str:
    return f"worker:{argv[argv.index('--role') + 1]}" if argv[0] == "worker" else argv[0]


def test_services_are_the_process_kinds_of_pagemesh_up():
    args = parse([])  # `pagemesh up` with its defaults
    launched = {kind_of(argv) for _, argv in plan(args, "/tmp/pm")}
    composed = {kind_of(argv_of(s)) for s in SERVICES.values() if not s.get("profiles")}
    assert composed == launched == {"scheduler", "tokenizer", "worker:prefill", "worker:decode", "diffusion", "gateway"}
    # a multimodal model's encoder pool: a service of its own behind a profile, as `pagemesh up --encoder N`
    with_encoders = {kind_of(argv) for _, argv in plan(parse(["--model", "digits-vlm", "--encoder", "1"]), "/tmp/pm")}
    assert with_encoders - launched == {"encoder"} == {kind_of(argv_of(SERVICES["encoder"]))}
    assert SERVICES["encoder"]["profiles"] == ["multimodal"]


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_each_command_parses_with_its_process_flags(name, monkeypatch):
    service = SERVICES[name]
    for key, value in service.get("environment", {}).items():
        if value is not None and not str(value).startswith("${"):
            monkeypatch.setenv(key, str(value))
    argv = argv_of(service)
    if argv[0] == "scheduler":
        from pagemesh.services.scheduler.main import parse

        assert parse(argv[1:]).address == "tcp://scheduler:5557"
    elif argv[0] == "tokenizer":
        from pagemesh.services.tokenizer.config import parse_args

        cfg = parse_args(argv[1:])
        assert cfg.scheduler_address == "tcp://scheduler:5557" and cfg.address == "tcp://tokenizer:5560"
    elif argv[0] == "gateway":
        from pagemesh.gateway.config import parse_args

        cfg = parse_args(argv[1:])
        assert cfg.scheduler_address == "tcp://scheduler:5557" and cfg.tokenizer_address == "tcp://tokenizer:5560"
        assert cfg.port == 8000
    elif argv[0] == "encoder":
        from pagemesh.workers.encoder.main import parse as parse_encoder

        monkeypatch.setenv("PAGEMESH_MODEL", str(resolve_model_path("digits-vlm")))
        args = parse_encoder(argv[1:])
        assert args.scheduler_address == "tcp://scheduler:5557" and args.worker_id.endswith("container1")
    elif argv[0] == "diffusion":
        from pagemesh.workers.diffusion.config import parse_diffusion

        cfg = parse_diffusion(argv[1:])
        assert cfg.shell.scheduler_address == "tcp://scheduler:5557"
        assert cfg.shell.worker_id.endswith("container1")
    else:
        from pagemesh.workers.llm.main import parse

        cfg = parse(argv[1:])
        assert cfg.shell.scheduler_address == "tcp://scheduler:5557"
        assert cfg.shell.worker_id.endswith("container1")  # unique per replica: pools scale
        if cfg.role == "decode":
            assert cfg.kv_advertise == "tcp://container1:5600"
        if cfg.role == "prefill":
            assert cfg.embeds_address == "tcp://container1:5610"


def test_only_the_gateway_is_published_and_zmq_stays_internal():
    assert COMPOSE["networks"]["mesh"]["internal"] is True
    for name, service in SERVICES.items():
        assert "mesh" in service["networks"]
        assert ("ports" in service) == (name == "gateway")
    health = SERVICES["gateway"]["healthcheck"]["test"]
    assert any("/ready" in part for part in health)


def test_the_images_it_builds_exist():
    dockerfile = SERVICES["gateway"]["build"]["dockerfile"]
    assert (ROOT / dockerfile.split(":-")[1].rstrip("}")).exists()
    assert (ROOT / "docker" / "Dockerfile.cuda").exists()


def _launched_serves() -> str:
    """The kinds `pagemesh up` (its defaults) tells its scheduler to serve: /ready waits for each."""
    [scheduler] = [argv for _, argv in plan(parse([]), "/tmp/pm") if argv[0] == "scheduler"]
    return scheduler[scheduler.index("--serves") + 1]


def test_the_scheduler_serves_what_pagemesh_up_serves_so_ready_means_the_same():
    serves = SERVICES["scheduler"]["environment"]["PAGEMESH_SERVES"]
    assert serves == "${PAGEMESH_SERVES:-" + _launched_serves() + "}" and _launched_serves() == "llm,diffusion"
    health = SERVICES["gateway"]["healthcheck"]["test"]
    assert "http://127.0.0.1:8000/ready" in health[-1]


def test_the_gateway_advertises_its_reply_socket_on_the_mesh_network_only():
    """On two networks, `gateway` resolves to either address; the tokenizer and workers reach only
    the mesh one: the reply address names an alias that exists on the mesh network alone."""
    argv = argv_of(SERVICES["gateway"])
    host = argv[argv.index("--reply-address") + 1].removeprefix("tcp://").rsplit(":", 1)[0]
    networks = SERVICES["gateway"]["networks"]
    assert host in networks["mesh"]["aliases"]
    assert all(host not in (n or {}).get("aliases", []) for name, n in networks.items() if name != "mesh")
    assert COMPOSE["networks"]["mesh"]["internal"] is True


def test_images_build_from_the_base_image_argument():
    build = COMPOSE["x-pagemesh"]["build"]
    assert build["args"]["BASE_IMAGE"] == "${PAGEMESH_BASE_IMAGE:-python:3.11-slim}"
    for dockerfile in ("Dockerfile.cpu", "Dockerfile.cuda"):
        lines = (ROOT / "docker" / dockerfile).read_text().splitlines()
        assert "ARG BASE_IMAGE=python:3.11-slim" in lines
        assert any(line.startswith("FROM ${BASE_IMAGE}") for line in lines)
        assert "pip install --require-hashes --no-deps -r /tmp/requirements" in "\n".join(lines)
