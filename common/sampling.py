"""Per-request sampling parameters, shared by the engine, the wire protocol and the gateway.

Pure Python. `validate()` is the one range check of these fields (it raises ValueError naming the
field). It runs where a SamplingParams comes in from outside: the gateway on a client's body, the
wire decoder on a peer's message, `Engine.add_request` on a library caller's object. Inside a
process nothing checks them again.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, fields

MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP_ITEMS = 16
MAX_STOP_LEN = 256
MAX_TOKENS_LIMIT = (1 << 20) - 1
MAX_LOGIT_BIAS = 1024  # token ids one request may bias
MAX_SCHEMA_LEN = 1 << 16  # characters of a JSON Schema or of any other grammar's spec
MAX_LORA_NAME_LEN = 256  # characters of a LoRA adapter's name
# the grammars of `structured` besides JSON (common/structured_outputs.py turns each into llguidance's)
STRUCTURED_KINDS = ("regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature 0 means greedy. `seed` makes a request's samples reproducible whatever else
    shares its batch. `logprobs` = k returns the top-k log-probabilities of each sampled token
    (None = off). `stop` strings are matched on text by the tokenizer service; the engine itself
    stops on `stop_token_ids`, EOS (unless `ignore_eos`) and `max_tokens`. `logit_bias` pairs
    (token id, bias in [-100, 100]) are added to the logits before sampling, as OpenAI's field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: as many tokens as the context leaves after the prompt (OpenAI chat's default); only
    # the tokenizer knows both lengths, so it resolves None before scheduling
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # sample this many, return the n with the highest cumulative logprob
    use_beam_search: bool = False  # beam width = best_of or n; returns the n best beams
    length_penalty: float = 1.0  # beam score = cumulative logprob / length ** length_penalty
    priority: int = 0  # scheduling priority: lower runs first; FCFS within a priority
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), ids distinct
    prompt_logprobs: int | None = None  # top-k per prompt token (echo with logprobs); never prefix-cached
    json_object: bool = False  # output constrained to one JSON object (response_format json_object)
    json_schema: str | None = None  # output constrained to this JSON Schema (JSON text)
    # output constrained to another grammar: (kind, spec), a kind of STRUCTURED_KINDS; spec: a regex, the
    # JSON text of a list of choices, an EBNF / Lark grammar, the JSON text of a structural tag
    structured: tuple[str, str] | None = None
    speculative: bool = True  # False: never verify drafts for this request (a worker with --speculative-config)
    # the LoRA adapter (by its served name) the request runs under; None: the base model. Not a
    # sampling choice, but it rides here so that every hop carries it (docs/design.md: departures)
    lora: str | None = None

    @property
    def constrained(self) -> bool:
        """Structured output: the output is held to a grammar (a JSON object, a schema, `structured`)."""
        return self.constraint_field is not None

    @property
    def constraint_field(self) -> str | None:
        """The field that holds the output to a grammar (None: unconstrained)."""
        if self.json_object:
            return "json_object"
        if self.json_schema is not None:
            return "json_schema"
        return "structured" if self.structured is not None else None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request (best_of or beam width, else n)."""
        return self.best_of or self.n

    @property
    def streams(self) -> bool:
        """Whether tokens can be sent as they come: not when the n outputs are chosen at the end."""
        return not self.use_beam_search and self.num_sequences == self.n

    def validate(self) -> SamplingParams:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", f"must be an integer in [1, {MAX_N}]")
        _check(_num(self.temperature) and 0.0 <= self.temperature <= 100.0, "temperature", "must be in [0, 100]")
        _check(_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]")
        _check(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 1), "top_k", "must be -1 (off) or >= 1"
        )
        _check(_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]")
        _check(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            "must be a non-negative 63-bit integer",
        )
        _check(
            _num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            "must be in (0, 10]",
        )
        _check(
            _num(self.presence_penalty) and -2.0 <= self.presence_penalty <= 2.0,
            "presence_penalty",
            "must be in [-2, 2]",
        )
        _check(
            _num(self.frequency_penalty) and -2.0 <= self.frequency_penalty <= 2.0,
            "frequency_penalty",
            "must be in [-2, 2]",
        )
        _check(
            self.max_tokens is None or (_int(self.max_tokens) and 1 <= self.max_tokens <= MAX_TOKENS_LIMIT),
            "max_tokens",
            f"must be an integer in [1, {MAX_TOKENS_LIMIT}]",
        )
        _check(
            _int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or MAX_TOKENS_LIMIT),
            "min_tokens",
            "must be in [0, max_tokens]",
        )
        _check(
            len(self.stop_token_ids) <= MAX_STOP_ITEMS
            and all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            f"must be at most {MAX_STOP_ITEMS} non-negative token ids",
        )
        _check(
            len(self.stop) <= MAX_STOP_ITEMS
            and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in self.stop),
            "stop",
            f"must be at most {MAX_STOP_ITEMS} non-empty strings of at most {MAX_STOP_LEN} characters",
        )
        _check(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        _check(
            self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
            "logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        _check(
            self.best_of is None or (isinstance(self.best_of, int) and self.n <= self.best_of <= MAX_N),
            "best_of",
            f"must be an integer in [n, {MAX_N}]",
        )
        _check(isinstance(self.use_beam_search, bool), "use_beam_search", "must be a boolean")
        _check(
            _num(self.length_penalty) and -10.0 <= self.length_penalty <= 10.0, "length_penalty", "must be in [-10, 10]"
        )
        _check(
            isinstance(self.priority, int) and not isinstance(self.priority, bool) and -(2**31) < self.priority < 2**31,
            "priority",
            "must be a 32-bit integer",
        )
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS
            and all(
                isinstance(pair, tuple)
                and len(pair) == 2
                and isinstance(pair[0], int)
                and not isinstance(pair[0], bool)
                and pair[0] >= 0
                and _num(pair[1])
                and -100.0 <= pair[1] <= 100.0
                for pair in self.logit_bias
            ),
            "logit_bias",
            f"must map at most {MAX_LOGIT_BIAS} token ids to numbers in [-100, 100]",
        )
        _check(
            len({pair[0] for pair in self.logit_bias}) == len(self.logit_bias),
            "logit_bias",
            "token ids must be distinct",
        )
        _check(isinstance(self.json_object, bool), "json_object", "must be a boolean")
        _check(isinstance(self.speculative, bool), "speculative", "must be a boolean")
        _check(
            self.lora is None or (isinstance(self.lora, str) and 0 < len(self.lora) <= MAX_LORA_NAME_LEN),
            "lora",
            f"must be an adapter's name of at most {MAX_LORA_NAME_LEN} characters",
        )
        _check(
            self.json_schema is None or (isinstance(self.json_schema, str) and len(self.json_schema) <= MAX_SCHEMA_LEN),
            "json_schema",
            f"must be JSON text of at most {MAX_SCHEMA_LEN} characters",
        )
        _check(
            self.structured is None
            or (
                isinstance(self.structured, tuple)
                and len(self.structured) == 2
                and self.structured[0] in STRUCTURED_KINDS
                and isinstance(self.structured[1], str)
                and len(self.structured[1]) <= MAX_SCHEMA_LEN
            ),
            "structured",
            f"must be (kind, spec): a kind of {', '.join(STRUCTURED_KINDS)} and a spec of at most "
            f"{MAX_SCHEMA_LEN} characters",
        )
        _check(
            self.json_object + (self.json_schema is not None) + (self.structured is not None) <= 1,
            "structured" if self.structured is not None else "json_schema",
            "only one of json_object, json_schema and structured",
        )
        constraint = self.constraint_field
        _check(not (constraint and self.use_beam_search), constraint, "cannot be combined with use_beam_search")
        _check(
            not (constraint and self.ignore_eos),
            constraint,
            "cannot be combined with ignore_eos: the end of the grammar ends the output",
        )
        _check(
            self.prompt_logprobs is None
            or (
                isinstance(self.prompt_logprobs, int)
                and not isinstance(self.prompt_logprobs, bool)
                and 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
            ),
            "prompt_logprobs",
            f"must be in [0, {MAX_TOP_LOGPROBS}]",
        )
        return self

    def to_dict(self) -> dict:
        out = {f.name: (list(v) if isinstance(v := getattr(self, f.name), tuple) else v) for f in fields(self)}
        out["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return out

    @classmethod
    def from_dict(cls, data: dict) -> SamplingParams:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown sampling field(s): {sorted(unknown)}")
        values = dict(data)
        for name in ("stop_token_ids", "stop"):
            if name in values:
                if not isinstance(values[name], (list, tuple)):
                    raise ValueError(f"{name}: must be a list")
                values[name] = tuple(values[name])
        if isinstance(values.get("structured"), list):
            values["structured"] = tuple(values["structured"])
        if "logit_bias" in values:
            pairs = values["logit_bias"]
            if not isinstance(pairs, (list, tuple)) or not all(isinstance(x, (list, tuple)) for x in pairs):
                raise ValueError("logit_bias: must be a list of [token id, bias] pairs")
            values["logit_bias"] = tuple(tuple(x) for x in pairs)
        return cls(**values).validate()


def _int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _num(x) -> bool:
    """A number, not NaN, and not subnormal: a worker's torch flushes subnormals to zero, so there
    5e-324 compares equal to 0 and a value the gateway let through would fail the worker's own
    decode check (the message dropped, the request waiting for nothing)."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or x != x:
        return False
    return isinstance(x, int) or x == 0.0 or abs(x) >= sys.float_info.min


def _check(ok: bool, name: str, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {why}")
