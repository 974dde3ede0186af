"""The prefill→decode handoff goes through the engine's own API (issue 34): the worker's handoff
modules name no block manager, runner or follower ranks, only the Engine methods made for it,
and those methods' page lifecycle leaves the pool as it found it: export → release on the
prefill engine, pin → import → decode → finish (or pin → free) on the decode engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pagemesh.common.sampling import SamplingParams
from pagemesh.tests.llm_tiny import tiny_llama

ROOT = Path(__file__).resolve().parents[2]
HANDOFF_MODULES = sorted((ROOT / "workers/llm").glob("handoff*.py"))
# what the handoff may ask of an engine: its handoff API, nothing of what the engine is made of
ENGINE_API = {
    "take_prefilled",
    "export_prefilled",
    "release_prefilled",
    "keep_prefilled",
    "resend_prefilled",
    "kv_layout",
    "pin_prefix_pages",
    "import_pages",
    "free_pages",
}
ENGINE_MODULES = {"pagemesh.workers.engine.engine", "pagemesh.workers.engine.kv_handoff"}
# what an engine is made of: named by no handoff module, through `engine.` or any other way
INTERNALS = {"blocks", "runner", "followers", "scheduler", "kv_cache", "rank_kv_scales", "handoff", "handoff_pages"}
PAGE = 4
PARAMS = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def engine_uses(path: Path) -> list[tuple[int, str]]:
    """(line, attribute) of every `engine.X` and `self.engine.X` in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Attribute):
            continue
        owner = node.value
        if (isinstance(owner, ast.Name) and owner.id == "engine") or (
            isinstance(owner, ast.Attribute) and owner.attr == "engine"
        ):
            found.append((node.lineno, node.attr))
    return found


def engine_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    modules = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    modules |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {m for m in modules if m.startswith("pagemesh.workers.engine")}


def test_the_handoff_modules_use_only_the_engines_handoff_api():
    from pagemesh.workers.engine.engine import Engine

    assert {p.name for p in HANDOFF_MODULES} >= {"handoff.py", "handoff_in.py", "handoff_out.py"}
    assert not (ROOT / "workers/llm/kv_pages.py").exists()  # merged into the side that uses it
    for path in HANDOFF_MODULES:
        outside = [(line, attr) for line, attr in engine_uses(path) if attr not in ENGINE_API]
        assert not outside, f"{path.name} reaches into the engine: {outside}"
        tree = ast.parse(path.read_text(), str(path))
        inside = [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in INTERNALS]
        assert not inside, f"{path.name} names engine internals: {inside}"
        assert engine_imports(path) <= ENGINE_MODULES, f"{path.name} imports engine internals"
    for name in ENGINE_API:
        assert hasattr(Engine, name) and not name.startswith("_"), name
        assert getattr(Engine, name).__doc__, f"Engine.{name} states no contract"


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(seed=5)


def make_engine(model, prefix_caching=True):
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    config = EngineConfig(
        dtype="float32",
        device="cpu",
        page_size=PAGE,
        num_pages=48,
        max_model_len=256,
        enable_prefix_caching=prefix_caching,
        cuda_graphs=False,
    )
    return Engine(config, model=model)


def all_free(engine) -> None:
    """Nothing holds a page: the bookkeeping is sound and every page can be allocated."""
    engine.blocks.check_invariants(live_tables=[])
    assert engine.blocks.num_free_pages == engine.blocks.num_usable_pages


def hand_off(p_engine, d_engine, rid, prompt, skip_pages):
    """The engine API calls of one handoff, as the prefill and decode sides make them (no wire).
    Returns the tokens the decode engine produced, the first one included."""
    pinned = d_engine.pin_prefix_pages(prompt, skip_pages)
    assert len(pinned) == skip_pages
    p_engine.add_request(rid, prompt, PARAMS, prefill_only=True)
    while p_engine.take_prefilled(rid) is None:
        p_engine.step()
    export = p_engine.export_prefilled(rid, skip_pages)
    total = -(-len(prompt) // PAGE)
    assert (export.skip_pages, export.num_pages, export.tp_size) == (skip_pages, total, 1)
    [rank] = export.ranks
    assert rank.layers == range(2) and rank.pages.shape == (2, total - skip_pages, 2, PAGE, 2, 16)
    assert rank.pages.device.type == "cpu" and rank.kv_scales is None
    p_engine.release_prefilled(rid)
    all_free(p_engine)
    d_engine.import_pages(rid, prompt, PARAMS, export.first_token_ids, [list(rank.pages.unbind(0))], [[]], pinned)
    tokens = list(export.first_token_ids)
    while d_engine.has_unfinished():
        for out in d_engine.step():
            tokens += out.outputs[0].new_token_ids if out.outputs else []
    return tokens


def test_export_import_round_trip_decodes_as_one_engine_and_frees_every_page(tiny_model):
    shared = [(11 * i) % 250 + 1 for i in range(12)]  # 3 full pages
    first, second = shared + [7, 8, 9], shared + [3, 2]
    expected = [r.token_ids[0] for r in make_engine(tiny_model, False).generate([first, second], PARAMS)]
    p_engine, d_engine = make_engine(tiny_model), make_engine(tiny_model)
    assert d_engine.kv_layout.pool_shape == tuple(d_engine.runner.kv_cache.shape)
    assert (d_engine.kv_layout.num_layers, d_engine.kv_layout.rank_layers) == (2, [range(2)])

    assert hand_off(p_engine, d_engine, "r1", first, skip_pages=0) == expected[0]
    all_free(p_engine)
    all_free(d_engine)
    # the decode engine holds the shared prefix now: only the rest travels
    assert hand_off(p_engine, d_engine, "r2", second, skip_pages=3) == expected[1]
    all_free(p_engine)
    all_free(d_engine)


def test_pinned_pages_are_held_until_freed(tiny_model):
    d_engine = make_engine(tiny_model)
    prompt = [(5 * i) % 250 + 1 for i in range(10)]
    d_engine.generate([prompt], PARAMS)  # its 2 full prompt pages stay cached
    pinned = d_engine.pin_prefix_pages(prompt, 1)
    assert len(pinned) == 1  # what was asked for: the other cached page is not held
    d_engine.blocks.check_invariants(live_tables=[list(pinned)])
    d_engine.free_pages(pinned)
    assert pinned == []
    all_free(d_engine)
