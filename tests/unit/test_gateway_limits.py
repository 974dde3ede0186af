"""The pure parts of the gateway's admission: API keys, per-key limits (clock driven by hand), the
flags that configure them, and the runner's JSON error pages."""

from __future__ import annotations

import pytest
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong

from pagemesh.gateway.auth import ANONYMOUS, ApiKeys, key_problem, read_key_file
from pagemesh.gateway.config import parse_args
from pagemesh.gateway.errors import ApiError
from pagemesh.gateway.http_server import _error_for
from pagemesh.gateway.limits import KeyLimits, RateLimited, estimate_prompt_tokens

ADDRESSES = [
    "--tokenizer-address",
    "ipc:///tmp/t",
    "--scheduler-address",
    "ipc:///tmp/s",
    "--reply-address",
    "ipc:///tmp/r",
]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---- keys


def test_keys_accept_each_configured_key_and_refuse_the_rest_with_a_401():
    keys = ApiKeys(("alpha", "beta"))
    assert keys.check("Bearer alpha") == "alpha"
    assert keys.check("bearer   beta ") == "beta"
    for header in (None, "", "Bearer", "Bearer ", "Basic alpha", "alpha"):
        with pytest.raises(ApiError) as info:
            keys.check(header)
        assert (info.value.status, info.value.code) == (401, "invalid_api_key")
        assert "didn't provide" in info.value.message
    for wrong in ("Bearer alph", "Bearer alphaa", "Bearer ALPHA", "Bearer " + "x" * 10_000):
        with pytest.raises(ApiError) as info:
            keys.check(wrong)
        assert info.value.status == 401 and info.value.message == "Incorrect API key provided."
        assert info.value.headers == {"WWW-Authenticate": "Bearer"}


def test_no_keys_means_open_as_one_anonymous_key():
    keys = ApiKeys(())
    assert not keys.enabled
    assert keys.check(None) == ANONYMOUS and keys.check("Bearer anything") == ANONYMOUS


def test_key_file_and_key_rules(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    assert read_key_file(path) == ["alpha", "beta"]
    assert key_problem("sk-abc_123") is None
    assert key_problem("") and key_problem("a b") and key_problem("é") and key_problem("x" * 513)


def test_flags_and_environment_give_the_keys(tmp_path, monkeypatch):
    monkeypatch.delenv("PAGEMESH_API_KEY", raising=False)
    assert parse_args(ADDRESSES).api_keys == ()
    path = tmp_path / "keys"
    path.write_text("gamma\nalpha\n")
    config = parse_args([*ADDRESSES, "--api-key", "alpha", "--api-key", "beta", "--api-key-file", str(path)])
    assert config.api_keys == ("alpha", "beta", "gamma")
    assert "alpha" not in repr(config)  # keys never reach a log line through the config
    monkeypatch.setenv("PAGEMESH_API_KEY", "from-env")
    assert parse_args(ADDRESSES).api_keys == ("from-env",)
    assert parse_args([*ADDRESSES, "--api-key", "flag"]).api_keys == ("flag",)  # a flag wins over the variable
    monkeypatch.setenv("PAGEMESH_MAX_TOKENS_PER_MINUTE_PER_KEY", "5000")
    config = parse_args([*ADDRESSES, "--max-concurrent-requests-per-key", "3", "--metrics-require-key"])
    assert (config.max_concurrent_requests_per_key, config.max_tokens_per_minute_per_key) == (3, 5000)
    assert config.metrics_require_key


@pytest.mark.parametrize(
    "flags",
    [
        ["--api-key", "has space"],
        ["--api-key-file", "/nonexistent/keys"],
        ["--metrics-require-key"],
        ["--max-concurrent-requests-per-key", "0"],
        ["--max-tokens-per-minute-per-key", "-5"],
        ["--max-header-bytes", "100"],
    ],
)
def test_bad_auth_flags_stop_the_gateway_at_start(flags, monkeypatch, capsys):
    monkeypatch.delenv("PAGEMESH_API_KEY", raising=False)
    with pytest.raises(SystemExit):
        parse_args([*ADDRESSES, *flags])
    assert "has space" not in capsys.readouterr().err  # a bad key is never echoed


# ---- limits


def test_concurrency_limit_is_per_key_and_frees_on_finish():
    limits = KeyLimits(max_concurrent=2, clock=Clock())
    first, _second = limits.admit("a", 5), limits.admit("a", 5)
    with pytest.raises(RateLimited) as info:
        limits.admit("a", 5)
    assert (info.value.status, info.value.type, info.value.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert info.value.headers == {"Retry-After": "1"} and "2 requests in flight" in info.value.message
    limits.admit("b", 5)  # another key has its own slots
    first.finish(10)
    first.finish(10)  # a second finish changes nothing
    assert limits.in_flight("a") == 1
    limits.admit("a", 5)


def test_token_bucket_charges_the_estimate_then_reconciles_and_refills():
    clock = Clock()
    limits = KeyLimits(tokens_per_minute=600, clock=clock)  # 10 tokens a second
    a = limits.admit("k", 100)
    assert limits.level("k") == 500
    a.finish(250)  # used more than estimated: the difference is charged
    assert limits.level("k") == 350
    b = limits.admit("k", 100)
    b.finish(0)  # failed before any output: the estimate comes back
    assert limits.level("k") == 350
    clock.now += 10
    assert limits.level("k") == 450
    clock.now += 3600
    assert limits.level("k") == 600  # never above the capacity
    limits.admit("k", 10).finish(0)
    assert limits.level("k") == 600


def test_a_key_in_debt_waits_until_the_bucket_refills():
    clock = Clock()
    limits = KeyLimits(tokens_per_minute=60, clock=clock)  # 1 token a second
    limits.admit("k", 10).finish(100)  # level 60 - 100 = -40
    with pytest.raises(RateLimited) as info:
        limits.admit("k", 1)
    assert info.value.headers["Retry-After"] == "41" and "60 tokens per minute" in info.value.message
    limits.admit("other", 1)  # other keys are not held back
    clock.now += 40
    with pytest.raises(RateLimited) as info:  # level 0: still empty
        limits.admit("k", 1)
    assert info.value.headers["Retry-After"] == "1"
    clock.now += 1
    limits.admit("k", 1)
    assert limits.admit("k", None).estimate == 0  # images: no token check even when empty


def test_both_limits_refuse_without_charging():
    clock = Clock()
    limits = KeyLimits(max_concurrent=1, tokens_per_minute=100, clock=clock)
    held = limits.admit("k", 30)
    with pytest.raises(RateLimited):
        limits.admit("k", 30)
    assert limits.level("k") == 70 and limits.in_flight("k") == 1
    held.finish(30)
    assert limits.in_flight("k") == 0


def test_prompt_estimate_counts_token_ids_exactly_and_text_at_four_characters_a_token():
    assert estimate_prompt_tokens((("abcdefgh", None), (None, [1, 2, 3])), None) == 5
    assert estimate_prompt_tokens((), [{"role": "user", "content": "abcde"}]) == 2


# ---- the runner's error pages (aiohttp's parser errors, before any handler)


def test_parser_errors_become_openai_errors():
    error = _error_for(400, LineTooLong(b"X-Big: aaa", 8190))
    assert (error.status, error.code) == (431, "request_header_fields_too_large") and "8190 bytes" in error.message
    assert _error_for(400, BadHttpMessage("Too many headers received")).status == 431
    error = _error_for(400, BadHttpMessage("Invalid method"))
    assert (error.status, error.type, error.code) == (400, "invalid_request_error", "bad_request")
    assert _error_for(500, RuntimeError("boom")).body()["error"]["message"] == "internal server error"


# ---- pagemesh up and compose hand the keys to the gateway


def test_pagemesh_up_passes_keys_through_a_private_file_and_the_limits_as_flags(tmp_path, monkeypatch):
    from pagemesh.services.launcher import parse, plan

    monkeypatch.delenv("PAGEMESH_API_KEY", raising=False)
    args_limits = ["--max-concurrent-requests-per-key", "2", "--max-tokens-per-minute-per-key", "900"]
    args = parse(["--mixed", "1", "--diffusion", "0", "--api-key", "alpha", "--api-key", "beta", *args_limits])
    argv = dict(plan(args, str(tmp_path)))["gateway"]
    assert "alpha" not in argv and "beta" not in argv  # nothing on a command line others can list
    key_file = tmp_path / "api-keys"
    assert argv[argv.index("--api-key-file") + 1] == str(key_file)
    assert read_key_file(key_file) == ["alpha", "beta"] and key_file.stat().st_mode & 0o077 == 0
    config = parse_args(argv[argv.index("--host") :])
    assert config.api_keys == ("alpha", "beta")
    assert (config.max_concurrent_requests_per_key, config.max_tokens_per_minute_per_key) == (2, 900)
    open_argv = dict(plan(parse(["--mixed", "1", "--diffusion", "0"]), str(tmp_path / "open")))["gateway"]
    assert "--api-key-file" not in open_argv


def test_compose_hands_the_key_variables_to_the_gateway_and_empty_means_open(monkeypatch):
    from pagemesh.tests.unit.test_compose import COMPOSE, argv_of

    gateway = COMPOSE["services"]["gateway"]
    assert {"PAGEMESH_API_KEY", "PAGEMESH_API_KEY_FILE", "PAGEMESH_SCHEDULER_ADDRESS"} <= set(gateway["environment"])
    monkeypatch.setenv("PAGEMESH_SCHEDULER_ADDRESS", gateway["environment"]["PAGEMESH_SCHEDULER_ADDRESS"])
    # compose fills an unset ${VAR:-} with "": the gateway must then start open
    monkeypatch.setenv("PAGEMESH_API_KEY", "")
    monkeypatch.setenv("PAGEMESH_API_KEY_FILE", "")
    assert parse_args(argv_of(gateway)[1:]).api_keys == ()
    monkeypatch.setenv("PAGEMESH_API_KEY", "sk-compose")
    assert parse_args(argv_of(gateway)[1:]).api_keys == ("sk-compose",)
