"""The KV offload tier with the real engine (the embedded model, fp32): a prefix evicted from a
tiny pool comes back from host memory and from disk with the tokens of a run that computed it, a
restarted engine serves hits from the disk tier its predecessor filled, and a damaged file is
computed again. The flags reach the engine from `pagemesh worker`'s and `pagemesh up`'s parsers."""

from __future__ import annotations

import argparse

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.workers.engine.config import (
    EngineConfig,
    add_engine_arguments,
    engine_args_to_argv,
    engine_config_from_args,
)
from pagemesh.workers.engine.engine import Engine

PAGE = 16
# 7 usable pages: a 68-token prompt takes 5 (4 full, published), so two other prompts evict all of it
POOL = dict(dtype="float32", page_size=PAGE, num_pages=8, max_model_len=96)
A = [(1000 + 37 * i) % 20000 for i in range(68)]
OTHERS = [[(15000 + 7 * i) % 20000 for i in range(68)], [(3000 + 19 * i) % 20000 for i in range(68)]]


def run(engine: Engine, rid: str, prompt: list[int]) -> tuple[list[int], int]:
    """One greedy request to its end: its tokens and its prefix-cached prompt tokens."""
    engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    tokens: list[int] = []
    cached = None
    while engine.has_unfinished():
        for out in engine.step():
            cached = out.num_cached_tokens if cached is None else cached
            tokens += out.outputs[0].new_token_ids
    engine.blocks.check_invariants([])  # every page back in the pool
    return tokens, cached


def evict_a(engine: Engine) -> None:
    for i, other in enumerate(OTHERS):
        assert run(engine, f"other-{i}", other)[1] == 0


def assert_a_comes_from_disk(config: EngineConfig, reference: list[int]) -> None:
    """A new engine on `config`'s folder gets A's 4 full pages from disk and A's tokens."""
    restarted = Engine(config)
    try:
        assert run(restarted, "a", A) == (reference, 4 * PAGE)
        assert restarted.blocks.offload.stats.disk_hits == 4
    finally:
        restarted.close()


@pytest.fixture(scope="module")
def reference():
    """A's tokens computed from scratch (no prefix cache)."""
    engine = Engine(EngineConfig(**POOL, enable_prefix_caching=False))
    try:
        return run(engine, "a", A)[0]
    finally:
        engine.close()


def test_an_evicted_prefix_comes_back_from_host_memory(reference):
    engine = Engine(EngineConfig(**POOL, kv_offload_gb=0.01))
    try:
        assert run(engine, "a", A) == (reference, 0)
        evict_a(engine)
        assert run(engine, "a-again", A) == (reference, 4 * PAGE)  # 4 pages loaded, not computed
        stats = engine.blocks.offload.stats
        assert stats.host_hits == 4 and stats.disk_hits == 0 and engine.blocks.offload_hits == 4
    finally:
        engine.close()


def test_without_the_tier_the_same_prefix_is_computed_again(reference):
    engine = Engine(EngineConfig(**POOL))
    try:
        run(engine, "a", A)
        evict_a(engine)
        assert run(engine, "a-again", A) == (reference, 0)
    finally:
        engine.close()


def test_a_restarted_engine_serves_hits_from_the_disk_tier_and_recomputes_a_damaged_page(tmp_path, reference):
    config = EngineConfig(**POOL, kv_offload_dir=str(tmp_path))  # no host tier: evicted pages go to disk
    first = Engine(config)
    try:
        run(first, "a", A)
        evict_a(first)
        assert first.blocks.offload.stats.spilled >= 4
    finally:
        first.close()
    (folder,) = tmp_path.iterdir()  # the engine's fingerprint names it
    assert len(list(folder.glob("*.kvpage"))) >= 4

    assert_a_comes_from_disk(config, reference)

    third = Engine(config)
    try:
        disk = third.blocks.offload.disk
        from pagemesh.common.page_hash import prefix_page_hashes

        damaged = disk.path(prefix_page_hashes(A, PAGE)[2])
        blob = bytearray(damaged.read_bytes())
        blob[-1] ^= 0x01
        damaged.write_bytes(bytes(blob))
        assert run(third, "a", A) == (reference, 2 * PAGE)  # pages 0 and 1 from disk, the rest computed
        assert third.blocks.offload.stats.rejected == 1 and not damaged.exists()
    finally:
        third.close()


def test_an_engine_closed_on_purpose_leaves_its_pool_s_prefixes_on_disk(tmp_path, reference):
    config = EngineConfig(**POOL, kv_offload_gb=0.01, kv_offload_dir=str(tmp_path))
    first = Engine(config)
    try:
        run(first, "a", A)  # its pages stay in the pool: nothing is evicted
        assert first.blocks.offload.stats.offloaded == 0
    finally:
        first.close()  # as a worker's clean exit does
    assert_a_comes_from_disk(config, reference)


def test_a_different_dtype_never_reads_the_other_engines_pages(tmp_path, reference):
    first = Engine(EngineConfig(**POOL, kv_offload_dir=str(tmp_path)))
    try:
        run(first, "a", A)
        evict_a(first)
    finally:
        first.close()
    other = Engine(EngineConfig(**{**POOL, "dtype": "bfloat16"}, kv_offload_dir=str(tmp_path)))
    try:
        assert run(other, "a", A)[1] == 0
        assert len(list(tmp_path.iterdir())) == 2  # a folder per fingerprint
    finally:
        other.close()


def test_the_flags_reach_the_engine_config_and_a_child_worker(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    argv = ["--kv-offload-gb", "2.5", "--kv-offload-dir", str(tmp_path), "--kv-offload-disk-gb", "3"]
    args = parser.parse_args(argv)
    config = engine_config_from_args(args)
    assert (config.kv_offload_gb, config.kv_offload_dir, config.kv_offload_disk_gb) == (2.5, str(tmp_path), 3.0)
    child = engine_config_from_args(parser.parse_args(engine_args_to_argv(args)))  # as `pagemesh up` starts it
    assert (child.kv_offload_gb, child.kv_offload_dir, child.kv_offload_disk_gb) == (2.5, str(tmp_path), 3.0)


@pytest.mark.slow
def test_pagemesh_up_gives_every_llm_worker_the_tier(tmp_path):
    """`pagemesh up --mixed 1 --kv-offload-dir`: the prefix a client's earlier request left comes
    back from disk after other prompts pushed it out of the worker's pool (usage.cached_tokens),
    and the text is the one the cold request got."""
    import openai

    from pagemesh.bench.local_mesh import HANG_S, running_mesh
    from pagemesh.common.model_files import DEFAULT_MODEL_NAME

    flags = ("--prefill", "0", "--decode", "0", "--mixed", "1", "--dtype", "float32", "--num-pages", "8")
    with running_mesh(*flags, "--max-model-len", "96", "--kv-offload-dir", str(tmp_path)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=HANG_S)

        def complete(prompt: list[int]) -> tuple[str, int]:
            r = client.completions.create(
                model=DEFAULT_MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens

        cold, cached = complete(A)
        assert cached == 0
        for other in OTHERS:
            complete(other)
        assert complete(A) == (cold, 4 * PAGE)
    assert len(list(tmp_path.glob("*/*.kvpage"))) >= 4
