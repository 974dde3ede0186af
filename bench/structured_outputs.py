"""What structured outputs cost: the two grammar libraries side by side, and the engine's decode
step with and without a constraint.

    python bench/structured_outputs.py libraries [--repeats 3]
    python bench/structured_outputs.py keywords
    python bench/structured_outputs.py engine [--streams 1 32] [--steps 24] [--rounds 5]
                                              [--threads N]

`libraries`: on the default model's vocabulary (49,152 tokens), xgrammar against llguidance:
importing each and building its tokenizer, compiling each of the benchmark's grammars cold (no
cache), and one token mask per token of a valid document, then the masks of 32 such documents
at once (a step of 32 constrained streams). `keywords`: which JSON Schema keywords each library
compiles (a keyword compiled but not enforced answers outside the schema). `engine`: one decode
step of the in-process engine (bf16, greedy) at each stream count, plain (unconstrained) and
under each constraint; with llguidance, the masks filled in the step's critical path and while
the forward pass runs (`GrammarMasks.overlap`, the default). The automaton's rows come from
running this `engine` part on the commit before it was removed (docs/perf/structured_outputs.md).
Steps are timed only while every stream decodes; the modes take turns for `--rounds` rounds and
each figure is the median of its rounds' medians (a round hit by another process's burst counts
once). `--threads`: torch's threads (default: its own).
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import time

import torch

SCHEMAS = {
    "json_object": {"type": "object"},
    "cat (3 properties, enum)": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "color": {"enum": ["black", "white", "ginger"]},
        },
        "required": ["name", "age", "color"],
    },
    "keywords (pattern, minimum, minItems, format)": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "age": {"type": "integer", "minimum": 0, "maximum": 30},
            "owners": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1},
            "born": {"type": "string", "format": "date"},
        },
        "required": ["name", "age", "owners", "born"],
    },
    "tool call (tool_choice required)": {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "get_weather"},
                        "parameters": {
                            "type": "object",
                            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                            "required": ["city"],
                        },
                    },
                    "required": ["name", "parameters"],
                },
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": "search"},
                        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]},
                    },
                    "required": ["name", "parameters"],
                },
            ]
        },
    },
}
DOCUMENTS = {
    "json_object": '{"name": "Tom", "likes": ["fish", "naps"], "age": 4, "indoor": true}',
    "cat (3 properties, enum)": '{"name": "Tom", "age": 4, "color": "ginger"}',
    "keywords (pattern, minimum, minItems, format)": (
        '{"name": "Tom", "age": 4, "owners": ["ann@example.com"], "born": "2021-04-01"}'
    ),
    "tool call (tool_choice required)": '[{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}]',
}
# (kind, spec, a valid output): the other constraints, as the gateway hands them over
OTHERS = {
    "regex (a phone number)": ("regex", r"\+?[0-9]{2,3}( [0-9]{3}){3}", "+33 612 345 678"),
    "choice (yes / no)": ("choice", '["yes", "no"]', "yes"),
    "grammar (EBNF arithmetic)": (
        "grammar",
        'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9]+ | "(" expr ")"',
        "(1+23)-4",
    ),
}
STREAMS = 32


# --------------------------------------------------------------------------- libraries


def bench_libraries(repeats: int) -> None:
    from pagemesh.tests.default_model import tokenizer as default_tokenizer

    tok = default_tokenizer()
    libs = {"xgrammar": _Xgrammar, "llguidance": _Llguidance}
    built = {}
    print(
        "| library | import (ms) | tokenizer set-up (ms) | runtime dependencies it pulls |\n| --- | ---: | ---: | --- |"
    )
    for name, cls in libs.items():
        imported, loaded = _import_alone(name)
        started = time.perf_counter()
        built[name] = cls(importlib.import_module(name), tok)
        setup = time.perf_counter() - started
        print(
            f"| {name} | {1000 * imported:.0f} | {1000 * setup:.0f} | {cls.DEPENDENCIES} (its import loads: {loaded}) |"
        )
    cases = [(name, "json", json.dumps(schema), DOCUMENTS[name]) for name, schema in SCHEMAS.items()]
    cases += [(name, kind, spec, doc) for name, (kind, spec, doc) in OTHERS.items()]
    print(
        "\n| grammar | library | compile, cold (ms) | mask per token: mean (µs) | max (µs) "
        f"| {STREAMS} masks at once (µs) |\n| --- | --- | ---: | ---: | ---: | ---: |"
    )
    for name, kind, spec, document in cases:
        ids = tok.encode(document, add_special_tokens=False)
        for lib, bench in built.items():
            compiles, means, maxes, batches = [], [], [], []
            for _ in range(repeats):
                compile_s, mask_s = bench.walk(kind, spec, ids)
                compiles.append(compile_s)
                means.append(statistics.mean(mask_s))
                maxes.append(max(mask_s))
                batches.append(bench.batch(kind, spec, ids, STREAMS))
            print(
                f"| {name} | {lib} | {1000 * statistics.median(compiles):.2f} | {1e6 * statistics.median(means):.0f} "
                f"| {1e6 * statistics.median(maxes):.0f} | {1e6 * statistics.median(batches):.0f} |"
            )


def _import_alone(name: str) -> tuple[float, str]:
    """Seconds to import `name` in a fresh interpreter, and which of torch / transformers it loads."""
    code = (
        "import sys, time; t = time.perf_counter(); import {0}; t = time.perf_counter() - t; "
        "print(t, ','.join(m for m in ('torch', 'transformers') if m in sys.modules) or 'neither')"
    )
    out = subprocess.run([sys.executable, "-P", "-c", code.format(name)], capture_output=True, text=True, check=True)
    seconds, loaded = out.stdout.split()
    return float(seconds), loaded


class _Llguidance:
    DEPENDENCIES = "none"

    def __init__(self, llg, tok):
        from pagemesh.workers.engine import grammar_masks  # the engine's own fill (its import needs llguidance)

        self.llg, self.fill = llg, grammar_masks
        self.tokenizer = llg.LLTokenizer(
            tok.backend_json(), n_vocab=tok.vocab_size, eos_token=sorted(tok.eos_token_ids)
        )
        self.vocab = tok.vocab_size

    def grammar(self, kind: str, spec: str) -> str:
        return self.llg.grammar_from("json_schema" if kind == "json" else kind, spec)

    def error(self, schema: str) -> str | None:
        matcher = self.llg.LLMatcher(self.tokenizer, self.grammar("json", schema), log_level=0)
        return matcher.get_error() if matcher.is_error() else None

    def walk(self, kind: str, spec: str, ids: list[int]) -> tuple[float, list[float]]:
        started = time.perf_counter()
        matcher = self.llg.LLMatcher(self.tokenizer, self.grammar(kind, spec), log_level=0)
        compile_s = time.perf_counter() - started
        assert not matcher.is_error(), matcher.get_error()
        bitmask = torch.full((1, -(-self.vocab // 32)), -1, dtype=torch.int32)
        times = []
        for token in ids:
            started = time.perf_counter()
            self.fill.fill_row(matcher, bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.consume_token(token), matcher.get_error()
        return compile_s, times

    def batch(self, kind: str, spec: str, ids: list[int], streams: int) -> float:
        """Mean time of one step's masks for `streams` matchers, each at its own point of the walk."""
        template = self.llg.LLMatcher(self.tokenizer, self.grammar(kind, spec), log_level=0)
        matchers = []
        for i in range(streams):
            matcher = template.deep_copy()
            matcher.consume_tokens(ids[: i % len(ids)])
            matchers.append(matcher)
        bitmask = torch.full((streams, -(-self.vocab // 32)), -1, dtype=torch.int32)
        executor = self.llg.LLExecutor()
        started = time.perf_counter()
        for _ in range(5):
            self.fill.fill_rows(executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        return (time.perf_counter() - started) / 5


class _Xgrammar:
    DEPENDENCIES = "torch, transformers, triton, apache-tvm-ffi, pydantic"

    def __init__(self, xgr, tok):
        from tokenizers import Tokenizer as HFTokenizer

        self.xgr = xgr
        vocab = HFTokenizer.from_str(tok.backend_json()).get_vocab(with_added_tokens=True)
        encoded = [""] * tok.vocab_size
        for text, index in vocab.items():
            encoded[index] = text
        self.info = xgr.TokenizerInfo(
            encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_token_ids)
        )
        self.vocab = tok.vocab_size

    def compile(self, kind: str, spec: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if kind == "json":
            return compiler.compile_json_schema(spec)
        if kind == "regex":
            return compiler.compile_regex(spec)
        if kind == "choice":
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in json.loads(spec)))
        return compiler.compile_grammar(spec)

    def error(self, schema: str) -> str | None:
        try:
            self.compile("json", schema)
        except Exception as e:  # noqa: BLE001 (xgrammar raises several kinds)
            return str(e).split("] ", 1)[-1]
        return None

    def walk(self, kind: str, spec: str, ids: list[int]) -> tuple[float, list[float]]:
        started = time.perf_counter()
        compiled = self.compile(kind, spec)
        compile_s = time.perf_counter() - started
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab)
        times = []
        for token in ids:
            started = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - started)
            assert matcher.accept_token(token)
        return compile_s, times

    def batch(self, kind: str, spec: str, ids: list[int], streams: int) -> float:
        compiled = self.compile(kind, spec)
        matchers = []
        for i in range(streams):
            matcher = self.xgr.GrammarMatcher(compiled)
            for token in ids[: i % len(ids)]:
                matcher.accept_token(token)
            matchers.append(matcher)
        bitmask = self.xgr.allocate_token_bitmask(streams, self.vocab)
        batch = self.xgr.BatchGrammarMatcher()
        started = time.perf_counter()
        for _ in range(5):
            batch.batch_fill_next_token_bitmask(matchers, bitmask)
        return (time.perf_counter() - started) / 5


KEYWORDS = {  # one schema per keyword; each library either compiles it or refuses it
    "pattern": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
    "format: email": {"type": "string", "format": "email"},
    "format: date-time": {"type": "string", "format": "date-time"},
    "format: phone (unknown)": {"type": "string", "format": "phone"},
    "minLength / maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "minimum / maximum": {"type": "integer", "minimum": 0, "maximum": 30},
    "multipleOf": {"type": "integer", "multipleOf": 5},
    "minItems / maxItems": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4},
    "prefixItems": {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "contains": {"type": "array", "contains": {"type": "integer"}},
    "additionalProperties (schema)": {"type": "object", "additionalProperties": {"type": "integer"}},
    "propertyNames": {"type": "object", "propertyNames": {"pattern": "^a"}},
    "minProperties": {"type": "object", "minProperties": 1},
    "dependentRequired": {"type": "object", "dependentRequired": {"a": ["b"]}},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"required": ["a"]}]},
    "anyOf": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "oneOf (overlapping)": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
    "not": {"not": {"type": "string"}},
    "if / then": {"if": {"type": "integer"}, "then": {"minimum": 1}},
    "$ref (recursive)": {
        "$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
        "$ref": "#/$defs/n",
    },
}


def bench_keywords() -> None:
    import warnings

    from pagemesh.tests.default_model import tokenizer as default_tokenizer

    tok = default_tokenizer()
    libs = {"xgrammar": _Xgrammar(importlib.import_module("xgrammar"), tok)}
    libs["llguidance"] = _Llguidance(importlib.import_module("llguidance"), tok)
    print("| keyword | xgrammar | llguidance |\n| --- | --- | --- |")
    for name, schema in KEYWORDS.items():
        cells = []
        for bench in libs.values():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                error = bench.error(json.dumps(schema))
            if error is None and caught:
                error = f"compiled, warning: {caught[0].message}"
            cells.append("compiles" if error is None else " ".join(error.split())[:70].replace("|", "/"))
        print(f"| {name} | {' | '.join(cells)} |")


# --------------------------------------------------------------------------- engine


def engine_modes() -> dict[str, tuple[dict, bool | None]]:
    """mode -> (SamplingParams fields, overlap: None where it does not apply)."""
    from pagemesh.common.sampling import SamplingParams

    cat = json.dumps(SCHEMAS["cat (3 properties, enum)"])
    modes: dict[str, tuple[dict, bool | None]] = {"plain": ({"ignore_eos": True}, None)}
    if "structured" not in {f for f in SamplingParams.__dataclass_fields__}:  # the hand-written automaton
        modes["json_object (automaton)"] = ({"json_object": True}, None)
        modes["json_schema cat (automaton)"] = ({"json_schema": cat}, None)
        return modes
    rich = json.dumps(SCHEMAS["keywords (pattern, minimum, minItems, format)"])
    for overlap in (False, True):
        where = "overlapped" if overlap else "critical path"
        modes[f"json_object ({where})"] = ({"json_object": True}, overlap)
        modes[f"json_schema cat ({where})"] = ({"json_schema": cat}, overlap)
        modes[f"json_schema keywords ({where})"] = ({"json_schema": rich}, overlap)
    return modes


ASKS = [
    "Describe a {} as a JSON object with a name, an age, a colour and a long list of facts.",
    "Give me a JSON object about a {}: its name, age, colour and ten of its habits.",
]
ANIMALS = ["cat", "dog", "fox", "owl", "horse", "goat", "crow", "seal"]


def step_times(engine, prompts: list[list[int]], fields: dict, steps: int) -> list[float]:
    """Seconds of each decode step while every one of the prompts' streams decodes."""
    from pagemesh.common.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=steps + 8, **fields)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    while any(not s.output_token_ids for r in engine.requests.values() for s in r.seqs):  # the prefills
        engine.step()
    times = []
    for _ in range(steps):
        running = sum(not s.finished for r in engine.requests.values() for s in r.seqs)
        started = time.perf_counter()
        engine.step()
        if running == len(prompts):
            times.append(time.perf_counter() - started)
    for request_id in list(engine.requests):
        engine.abort(request_id)
    return times


def bench_engine(streams: list[int], steps: int, rounds: int) -> None:
    from pagemesh.workers.engine.config import EngineConfig
    from pagemesh.workers.engine.engine import Engine

    engine = Engine(
        EngineConfig(dtype="bfloat16", num_pages=2048, max_num_seqs=max(streams), enable_prefix_caching=False)
    )
    tok = engine.tokenizer
    modes = engine_modes()
    print("\n| streams | mode | decode step (ms) | against plain (ms) | first round, mean (ms) | steps timed |")
    print("| ---: | --- | ---: | ---: | ---: | ---: |")
    for n in streams:
        prompts = [
            tok.encode_chat([{"role": "user", "content": ASKS[i % 2].format(ANIMALS[i % len(ANIMALS)]) + f" ({i})"}])
            for i in range(n)
        ]
        medians: dict[str, list[float]] = {mode: [] for mode in modes}
        first: dict[str, float] = {}
        counts: dict[str, int] = dict.fromkeys(modes, 0)
        for round_ in range(rounds + 1):  # round 0: cold (the first compile, a new state's masks, kernels)
            for mode, (fields, overlap) in modes.items():
                if overlap is not None:
                    engine.grammar_masks.overlap = overlap
                times = step_times(engine, prompts, fields, steps)
                if not times:
                    continue
                if round_ == 0:
                    first[mode] = statistics.mean(times)
                else:
                    medians[mode].append(statistics.median(times))
                    counts[mode] += len(times)
        plain = statistics.median(medians["plain"])
        for mode in modes:
            if not medians[mode]:
                print(f"| {n} | {mode} | - | - | - | 0 |")
                continue
            step = statistics.median(medians[mode])
            cold = f"{1000 * first[mode]:.1f}" if mode in first else "-"
            print(f"| {n} | {mode} | {1000 * step:.1f} | {1000 * (step - plain):+.1f} | {cold} | {counts[mode]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["libraries", "keywords", "engine"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, STREAMS])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    opts = parser.parse_args()
    if opts.threads:
        import torch

        torch.set_num_threads(opts.threads)
    if opts.part == "libraries":
        bench_libraries(opts.repeats)
    elif opts.part == "keywords":
        bench_keywords()
    else:
        bench_engine(opts.streams, opts.steps, opts.rounds)


if __name__ == "__main__":
    main()
