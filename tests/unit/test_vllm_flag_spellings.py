"""The engine's flags in vLLM's spellings, pagemesh's older spellings as aliases (one release),
`--served-model-name` through the launcher to the gateway and the workers, and the one argv
scanner of `pagemesh`'s global flags."""

import argparse
import os

import pytest

from pagemesh.gateway.config import parse_args as parse_gateway
from pagemesh.services import cli, launcher
from pagemesh.workers.engine.config import (
    add_engine_arguments,
    engine_args_to_argv,
    engine_config_from_args,
    human_readable_int,
)
from pagemesh.workers.llm.main import parse as parse_worker

GB = 2**30
RENAMED_ENV = (
    "PAGEMESH_GPU_MEMORY_UTILIZATION",
    "PAGEMESH_GPU_MEMORY_FRACTION",
    "PAGEMESH_ENABLE_PREFIX_CACHING",
    "PAGEMESH_NO_PREFIX_CACHING",
    "PAGEMESH_LONG_PREFILL_TOKEN_THRESHOLD",
    "PAGEMESH_LONG_PREFILL_THRESHOLD",
    "PAGEMESH_KV_CACHE_MEMORY_BYTES",
    "PAGEMESH_KV_CACHE_GB",
    "PAGEMESH_SERVED_MODEL_NAME",
)


@pytest.fixture(autouse=True)
def no_flag_variables(monkeypatch):
    for name in RENAMED_ENV:
        monkeypatch.delenv(name, raising=False)


def engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser


def engine(argv: list[str]):
    return engine_config_from_args(engine_parser().parse_args(argv))


NEW = [
    "--gpu-memory-utilization",
    "0.5",
    "--no-enable-prefix-caching",
    "--long-prefill-token-threshold",
    "100",
    "--kv-cache-memory-bytes",
    "3G",
]
OLD = ["--gpu-memory-fraction", "0.5", "--no-prefix-caching", "--long-prefill-threshold", "100", "--kv-cache-gb", "3"]


def test_old_and_new_spellings_give_the_same_config():
    new, old = engine(NEW), engine(OLD)
    assert new == old
    assert (new.gpu_memory_fraction, new.enable_prefix_caching, new.long_prefill_threshold) == (0.5, False, 100)
    assert new.kv_cache_memory_gb == 3.0  # 3 GiB in bytes
    assert engine(["--kv-cache-memory-bytes", str(3 * GB)]) == engine(["--kv-cache-gb", "3"])
    defaults = engine([])
    assert (defaults.gpu_memory_fraction, defaults.enable_prefix_caching, defaults.kv_cache_memory_gb) == (
        0.9,
        True,
        None,
    )
    assert engine(["--no-enable-prefix-caching", "--enable-prefix-caching"]).enable_prefix_caching is True
    assert engine(["--kv-cache-gb", "0.001"]).kv_cache_memory_gb == 0.001  # a GB budget stays as it was given


def test_both_kv_budgets_are_an_error(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exited:
        engine_parser().parse_args(["--kv-cache-memory-bytes", "1G", "--kv-cache-gb", "1"])
    assert exited.value.code == 2
    assert "not allowed with argument --kv-cache-memory-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        launcher.parse(["--kv-cache-gb", "1", "--kv-cache-memory-bytes", "1G"])
    # one through the environment, the other as a flag: refused as well, by the launcher and by a worker
    monkeypatch.setenv("PAGEMESH_KV_CACHE_GB", "1")
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes and --kv-cache-gb"):
        engine(["--kv-cache-memory-bytes", "1G"])
    with pytest.raises(SystemExit):
        launcher.parse(["--kv-cache-memory-bytes", "1G"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parse_worker(["--scheduler-address", "tcp://127.0.0.1:1", "--kv-cache-memory-bytes", "1G"])
    assert "give one of them" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, value",
    [
        ("4294967296", 4 * GB),
        ("4G", 4 * GB),
        ("512M", 512 << 20),
        ("4g", 4 * 10**9),
        ("25.6k", 25600),
        ("4.3g", 4_300_000_000),
        ("1T", 1 << 40),
    ],
)
def test_kv_cache_memory_bytes_reads_vllms_suffixes(text, value):
    assert human_readable_int(text) == value


@pytest.mark.parametrize("text", ["1.5G", "4GB", "four", ""])
def test_kv_cache_memory_bytes_refuses_what_vllm_refuses(text):
    with pytest.raises(argparse.ArgumentTypeError):
        human_readable_int(text)


def test_old_environment_variables_still_count(monkeypatch):
    monkeypatch.setenv("PAGEMESH_GPU_MEMORY_FRACTION", "0.4")
    monkeypatch.setenv("PAGEMESH_NO_PREFIX_CACHING", "1")
    monkeypatch.setenv("PAGEMESH_LONG_PREFILL_THRESHOLD", "77")
    config = engine([])
    assert (config.gpu_memory_fraction, config.enable_prefix_caching, config.long_prefill_threshold) == (0.4, False, 77)
    assert engine(["--enable-prefix-caching"]).enable_prefix_caching is True  # a flag beats a variable
    # the new names' variables come first
    monkeypatch.setenv("PAGEMESH_GPU_MEMORY_UTILIZATION", "0.6")
    monkeypatch.setenv("PAGEMESH_ENABLE_PREFIX_CACHING", "true")
    monkeypatch.setenv("PAGEMESH_LONG_PREFILL_TOKEN_THRESHOLD", "88")
    config = engine([])
    assert (config.gpu_memory_fraction, config.enable_prefix_caching, config.long_prefill_threshold) == (0.6, True, 88)


def test_a_child_gets_the_new_spellings_and_parses_them_to_the_same_config():
    for argv in (OLD, NEW, [], ["--served-model-name", "a", "b"]):
        args = engine_parser().parse_args(argv)
        forwarded = engine_args_to_argv(args)
        assert not {"--gpu-memory-fraction", "--no-prefix-caching", "--long-prefill-threshold"} & set(forwarded)
        assert engine(forwarded) == engine_config_from_args(args)


def test_the_prefix_cache_is_forwarded_either_way_whatever_the_childs_environment(monkeypatch):
    assert "--enable-prefix-caching" in engine_args_to_argv(engine_parser().parse_args([]))
    off = engine_args_to_argv(engine_parser().parse_args(["--no-prefix-caching"]))
    assert "--no-enable-prefix-caching" in off
    monkeypatch.setenv("PAGEMESH_NO_PREFIX_CACHING", "1")  # the parent's flag, not the inherited variable
    assert engine(engine_args_to_argv(engine_parser().parse_args(["--enable-prefix-caching"]))).enable_prefix_caching


def test_served_model_name_goes_to_the_gateway_and_every_worker(tmp_path):
    args = launcher.parse(["--mixed", "1", "--diffusion", "0", "--served-model-name", "my-model", "other"])
    argv = dict(launcher.plan(args, str(tmp_path)))
    worker = parse_worker(argv["mixed-0"][1:])
    assert worker.engine.served_model_name == ("my-model", "other")
    gateway = parse_gateway(argv["gateway"][1:])
    assert gateway.model_names == ("my-model", "other")  # only these, as vLLM: not the HF id nor the path
    assert gateway.served_model == "my-model"
    assert "--served-model-name" not in argv["tokenizer"] and "--served-model-name" not in argv["scheduler"]
    assert "model my-model (alias other)" in launcher.ready_line(args, "1 mixed")


def test_without_served_model_name_the_names_are_the_models(tmp_path):
    args = launcher.parse(["--mixed", "1", "--diffusion", "0"])
    argv = dict(launcher.plan(args, str(tmp_path)))
    assert parse_worker(argv["mixed-0"][1:]).engine.served_model_name == ()
    assert "--served-model-name" not in argv["gateway"]
    gateway = parse_gateway(argv["gateway"][1:])
    assert gateway.served_model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "SmolLM2-135M-Instruct" in gateway.model_names
    assert "model HuggingFaceTB/SmolLM2-135M-Instruct (alias SmolLM2-135M-Instruct)" in launcher.ready_line(args, "x")


def test_served_model_name_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGEMESH_SERVED_MODEL_NAME", "env-model second")
    assert engine([]).served_model_name == ("env-model", "second")
    gateway = parse_gateway(["--tokenizer-address", "a", "--scheduler-address", "b", "--reply-address", "c"])
    assert gateway.model_names == ("env-model", "second")
    assert engine(["--served-model-name", "flag-model"]).served_model_name == ("flag-model",)


def test_one_scanner_takes_every_global_flag(monkeypatch):
    argv = ["up", "--log-format", "json", "--port", "1", "--zmq-keys=/a", "--zmq-keys", "/b", "--log-format"]
    assert cli.take_flag(argv, "--zmq-keys") == (
        ["/a", "/b"],
        ["up", "--log-format", "json", "--port", "1", "--log-format"],  # a flag that ends argv stays
    )
    assert cli.take_flag(argv, "--log-format") == (
        ["json"],
        ["up", "--port", "1", "--zmq-keys=/a", "--zmq-keys", "/b", "--log-format"],
    )
    monkeypatch.setenv("PAGEMESH_LOG_FORMAT", "json")  # put back after the test
    assert cli.take_log_format(["x", "--log-format=console", "y"]) == ["x", "y"]
    assert os.environ["PAGEMESH_LOG_FORMAT"] == "console"
    with pytest.raises(SystemExit):
        cli.take_log_format(["--log-format", "yaml", "--log-format", "json"])
