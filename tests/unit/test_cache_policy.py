"""The feature-cache policies (workers/diffusion/engine/cache_policy.py, pure): parsing the
"<policy>[:<value>]" spec, each policy's per-row decision step by step, the worker's flags."""

from __future__ import annotations

import argparse

import pytest

from pagemesh.workers.diffusion.config import add_diffusion_arguments, diffusion_args_to_argv, parse_diffusion
from pagemesh.workers.diffusion.engine.cache_policy import (
    COOLDOWN_STEPS,
    WARMUP_STEPS,
    CacheKind,
    CachePolicy,
    CachePolicyError,
    RowState,
    decide,
    parse_cache_policy,
)
from pagemesh.workers.diffusion.engine.config import EngineConfig


@pytest.mark.parametrize(
    "spec, kind, value, canonical",
    [
        (None, CacheKind.NONE, 0.0, "none"),
        ("", CacheKind.NONE, 0.0, "none"),
        ("none", CacheKind.NONE, 0.0, "none"),
        ("interval:4", CacheKind.INTERVAL, 4.0, "interval:4"),
        ("interval", CacheKind.INTERVAL, 3.0, "interval:3"),
        ("FBCache:0.08", CacheKind.FBCACHE, 0.08, "fbcache:0.08"),
        ("fbcache", CacheKind.FBCACHE, 0.08, "fbcache:0.08"),
        ("teacache:0", CacheKind.TEACACHE, 0.0, "teacache:0"),
        (" teacache:0.25 ", CacheKind.TEACACHE, 0.25, "teacache:0.25"),
    ],
)
def test_specs_parse_to_a_policy_and_back(spec, kind, value, canonical):
    policy = parse_cache_policy(spec)
    assert (policy.kind, policy.value, policy.spec) == (kind, value, canonical)
    assert parse_cache_policy(policy.spec) == policy


@pytest.mark.parametrize(
    "spec, says",
    [
        ("deepcache:3", "unknown policy 'deepcache'; policies: none; interval:N"),
        ("none:1", "'none' takes no value"),
        ("interval:0", "interval must be an integer in [1, 1000]"),
        ("interval:2.5", "interval must be an integer in [1, 1000]"),
        ("fbcache:-0.1", "fbcache threshold must be a number in [0, 100]"),
        ("teacache:nan", "teacache threshold must be a number in [0, 100]"),
        ("fbcache:fast", "has no number after ':'"),
    ],
)
def test_a_bad_spec_names_the_policies_or_the_bad_value(spec, says):
    with pytest.raises(CachePolicyError, match="^cache: ") as raised:
        parse_cache_policy(spec)
    assert says in str(raised.value)


def test_the_engine_default_is_checked_when_the_config_is_made():
    assert EngineConfig(cache="fbcache:0.1").cache == "fbcache:0.1"
    with pytest.raises(ValueError, match="unknown policy 'fast'"):
        EngineConfig(cache="fast")
    with pytest.raises(ValueError, match="cache_budget_bytes"):
        EngineConfig(cache_budget_bytes=-1)


def test_what_each_policy_keeps_per_row():
    assert [parse_cache_policy(s).cached_tensors for s in ("none", "interval:2", "fbcache", "teacache")] == [0, 1, 2, 2]
    assert [parse_cache_policy(s).first_cached_block for s in ("interval:2", "fbcache", "teacache")] == [1, 1, 0]


def run(policy: CachePolicy, steps: int, changes: list[float | None]) -> str:
    """The decisions of one row over `steps` steps as 'C' (compute) / 'r' (reuse)."""
    row = RowState()
    out = "".join("C" if decide(policy, row, s, steps, changes[s]) else "r" for s in range(steps))
    assert (row.computed, row.skipped) == (out.count("C"), out.count("r"))
    return out


def test_interval_computes_the_windows_then_every_nth_step():
    assert (WARMUP_STEPS, COOLDOWN_STEPS) == (2, 1)
    assert run(parse_cache_policy("interval:3"), 12, [None] * 12) == "CCrrCrrCrrCC"
    assert run(parse_cache_policy("interval:2"), 8, [None] * 8) == "CCrCrCrC"
    assert run(parse_cache_policy("interval:1"), 8, [None] * 8) == "C" * 8


def test_fbcache_reuses_while_the_change_is_below_the_threshold():
    changes = [None, 0.5, 0.05, 0.09, 0.11, 0.02, float("nan"), 0.01, 0.3]
    assert run(parse_cache_policy("fbcache:0.1"), 9, changes) == "CCrrCrCrC"
    assert run(parse_cache_policy("fbcache:0"), 9, changes) == "C" * 9


def test_teacache_accumulates_the_change_until_it_passes_the_threshold():
    changes = [None, 0.9, 0.1, 0.1, 0.15, 0.05, 0.05, 0.2, 0.1, 0.1]
    # from step 2 the sum: 0.1 r, 0.2 r, 0.35 C (back to 0), 0.05 r, 0.1 r, 0.3 C (back to 0), 0.1 r, last step C
    assert run(parse_cache_policy("teacache:0.3"), 10, changes) == "CCrrCrrCrC"
    assert run(parse_cache_policy("teacache:0"), 10, changes) == "C" * 10


def test_a_row_without_a_cached_residual_computes_whatever_the_signal():
    row = RowState()
    assert decide(parse_cache_policy("fbcache:0.5"), row, 5, 10, 0.0) is True  # nothing to reuse yet
    assert decide(parse_cache_policy("fbcache:0.5"), row, 6, 10, 0.0) is False
    assert decide(CachePolicy(), RowState(), 5, 10, 0.0) is True  # none: always


def test_the_worker_flags_carry_the_default_policy_and_the_budget():
    config = parse_diffusion(["--diffusion-cache", "teacache:0.2", "--diffusion-cache-budget-mb", "8"])
    assert (config.cache, config.cache_budget_mb) == ("teacache:0.2", 8.0)
    assert parse_diffusion([]).cache == "none"
    with pytest.raises(SystemExit):
        parse_diffusion(["--diffusion-cache", "sometimes"])
    parser = argparse.ArgumentParser()
    add_diffusion_arguments(parser)
    argv = diffusion_args_to_argv(parser.parse_args(["--diffusion-cache", "interval:2"]))
    assert argv[argv.index("--diffusion-cache") + 1] == "interval:2" and "--diffusion-cache-budget-mb" in argv
