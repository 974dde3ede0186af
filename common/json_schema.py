"""A JSON Schema as an automaton, for `response_format: {"type": "json_schema"}` (a subset).

`compile_schema(schema)` returns a `SchemaGrammar` with the interface of `json_grammar` (INITIAL,
step, run, is_complete, MAX_DEPTH, TEXT_MODES), so `json_mode.JsonMasks` builds its token masks
the same way. Every output it accepts is valid against the schema; it may accept less than the
schema allows. What is supported:

- `type`: object, array, string, integer, number, boolean, null, or a list of them;
- objects: `properties` in their declared order (optional ones may be left out, `required` ones
  may not); no other keys. An object without `properties` is any JSON object;
- arrays: `items` (any JSON value without it);
- strings: `enum` / `const` of strings;
- `anyOf` / `oneOf` of alternatives that start differently (e.g. a type or null, as Pydantic
  writes Optional fields); `$ref` into `$defs` / `definitions` (not recursive);
- annotations (`title`, `description`, `default`, `examples`, `$schema`, `$id`, ...) are ignored.

Keywords it cannot guarantee (`pattern`, `minLength`, `minimum`, `minItems`, `format`, `allOf`,
...) raise SchemaError, so a request is refused rather than answered outside its schema.

State = (mode, stack, detail) as in json_grammar. A stack frame is "{" or "[" for containers of
free JSON, or (node, next property) for a schema object / (node, 0) for a schema array.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pagemesh.common import json_grammar as g

ANY = -1  # node id of a free JSON value
KEYLIT = "keylit"  # a declared key: detail (candidates ((prop index, '"name"'), ...), characters matched)
ENUMLIT = "enumlit"  # an enum string: detail (candidate literals, characters matched)
FIRST = "first"  # after '[': a value of the array's items, or ']'
MAX_NODES = 4096  # schema parts a schema may have (each definition counted once)

ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$schema",
    "$id",
    "$comment",
    "deprecated",
    "readOnly",
    "writeOnly",
    "$defs",
    "definitions",
    "additionalProperties",
}
STARTS = {
    "object": "{",
    "array": "[",
    "string": '"',
    "integer": "-0123456789",
    "number": "-0123456789",
    "boolean": "tf",
    "null": "n",
    "any": None,
}


class SchemaError(ValueError):
    """A schema this automaton cannot enforce."""


@dataclass
class Node:
    kind: str  # object | array | string | integer | number | boolean | null | anyof | anyobject
    props: list[tuple[str, int, bool]] = field(default_factory=list)  # object: (name, node, required)
    items: int = ANY  # array
    enum: tuple[str, ...] | None = None  # string: the JSON literals allowed, quotes included
    alternatives: list[int] = field(default_factory=list)  # anyof


class SchemaGrammar:
    MAX_DEPTH = g.MAX_DEPTH
    TEXT_MODES = frozenset({g.STRING, KEYLIT, ENUMLIT})

    def __init__(self, nodes: list[Node], root: int):
        self.nodes = nodes
        self.INITIAL = (g.VALUE, (), root)

    @staticmethod
    def is_complete(state) -> bool:
        return state[0] == g.DONE

    def run(self, state, text: str):
        for ch in text:
            if state is None:
                return None
            state = self.step(state, ch)
        return state

    def step(self, state, ch: str):
        mode, stack, d = state
        if mode == g.STRING:
            return self._string(stack, d, ch)
        if mode == ENUMLIT:
            cands, k = d
            matched = tuple(c for c in cands if c[k] == ch)
            if not matched:
                return None
            if any(len(c) == k + 1 for c in matched):  # literals end in '"': only one can end here
                return self._after_value(stack)
            return (ENUMLIT, stack, (matched, k + 1))
        if mode == KEYLIT:
            cands, k = d
            matched = tuple(c for c in cands if c[1][k] == ch)
            if not matched:
                return None
            for index, literal in matched:
                if len(literal) == k + 1:
                    node, _ = stack[-1]
                    return (g.COLON, stack[:-1] + ((node, index + 1),), self.nodes[node].props[index][1])
            return (KEYLIT, stack, (matched, k + 1))
        if mode == g.NUMBER:
            number, integer = d
            nxt = _number(number, ch, integer)
            if nxt is not None:
                return (g.NUMBER, stack, (nxt, integer))
            if number not in g.NUMBER_ENDS:
                return None
            return self.step(self._after_value(stack), ch)
        if mode == g.LITERAL:
            if ch != d[0]:
                return None
            return (g.LITERAL, stack, d[1:]) if len(d) > 1 else self._after_value(stack)
        if ch in g.WHITESPACE:
            return state
        if mode == g.DONE:
            return None
        if mode == g.VALUE:
            return self._value(stack, d, ch)
        if mode == FIRST:
            if ch == "]":
                return self._after_value(stack[:-1])
            top = stack[-1]
            return self._value(stack, ANY if top == "[" else self.nodes[top[0]].items, ch)
        if mode == g.COLON:
            return (g.VALUE, stack, d) if ch == ":" else None
        top = stack[-1]
        if mode in (g.KEY, g.KEY_OR_CLOSE):
            if top == "{":
                if ch == '"':
                    return (g.STRING, stack, (True, ""))
                return self._after_value(stack[:-1]) if ch == "}" and mode == g.KEY_OR_CLOSE else None
            node, nxt = top
            if ch == '"':
                cands = self._next_keys(node, nxt)
                return (KEYLIT, stack, (cands, 1)) if cands else None
            if ch == "}" and mode == g.KEY_OR_CLOSE and self._may_close(node, nxt):
                return self._after_value(stack[:-1])
            return None
        # AFTER a value inside a container
        if top in ("{", "["):
            if ch == ",":
                return (g.KEY, stack, None) if top == "{" else (g.VALUE, stack, ANY)
            return self._after_value(stack[:-1]) if ch == ("}" if top == "{" else "]") else None
        node, nxt = top
        if self.nodes[node].kind == "array":
            if ch == ",":
                return (g.VALUE, stack, self.nodes[node].items)
            return self._after_value(stack[:-1]) if ch == "]" else None
        if ch == ",":
            return (g.KEY, stack, None) if self._next_keys(node, nxt) else None
        return self._after_value(stack[:-1]) if ch == "}" and self._may_close(node, nxt) else None

    # ---- parts

    def _value(self, stack: tuple, node_id: int, ch: str):
        if node_id == ANY:
            return self._any_value(stack, ch)
        node = self.nodes[node_id]
        kind = node.kind
        if kind == "anyof":
            for alt in node.alternatives:  # they start differently: at most one takes `ch`
                state = self._value(stack, alt, ch)
                if state is not None:
                    return state
            return None
        if kind in ("object", "anyobject", "array") and len(stack) >= self.MAX_DEPTH:
            return None
        if kind == "object":
            return (g.KEY_OR_CLOSE, stack + ((node_id, 0),), None) if ch == "{" else None
        if kind == "anyobject":
            return (g.KEY_OR_CLOSE, stack + ("{",), None) if ch == "{" else None
        if kind == "array":
            return (FIRST, stack + ((node_id, 0),), None) if ch == "[" else None
        if kind == "string":
            if ch != '"':
                return None
            return (ENUMLIT, stack, (node.enum, 1)) if node.enum is not None else (g.STRING, stack, (False, ""))
        if kind in ("integer", "number"):
            integer = kind == "integer"
            if ch == "-":
                return (g.NUMBER, stack, ("minus", integer))
            if ch in g.DIGITS:
                return (g.NUMBER, stack, ("zero" if ch == "0" else "int", integer))
            return None
        if kind == "boolean":
            return (g.LITERAL, stack, g.LITERALS[ch]) if ch in "tf" else None
        if kind == "null":
            return (g.LITERAL, stack, "ull") if ch == "n" else None
        raise AssertionError(kind)

    def _any_value(self, stack: tuple, ch: str):
        if ch in "{[" and len(stack) >= self.MAX_DEPTH:
            return None
        if ch == "{":
            return (g.KEY_OR_CLOSE, stack + ("{",), None)
        if ch == "[":
            return (FIRST, stack + ("[",), None)
        if ch == '"':
            return (g.STRING, stack, (False, ""))
        if ch == "-":
            return (g.NUMBER, stack, ("minus", False))
        if ch in g.DIGITS:
            return (g.NUMBER, stack, ("zero" if ch == "0" else "int", False))
        if ch in g.LITERALS:
            return (g.LITERAL, stack, g.LITERALS[ch])
        return None

    def _string(self, stack: tuple, detail: tuple, ch: str):
        state = g._string(stack, detail, ch)
        if state is None:
            return None
        if state[0] == g.COLON:  # the end of a free object's key: any value follows
            return (g.COLON, stack, ANY)
        if state[0] in (g.AFTER, g.DONE):
            return self._after_value(stack)
        return state

    def _next_keys(self, node_id: int, nxt: int) -> tuple:
        """The keys that may come next: the next properties up to the first required one."""
        cands = []
        for index in range(nxt, len(self.nodes[node_id].props)):
            name, _, required = self.nodes[node_id].props[index]
            cands.append((index, json.dumps(name, ensure_ascii=False)))
            if required:
                break
        return tuple(cands)

    def _may_close(self, node_id: int, nxt: int) -> bool:
        return not any(required for _, _, required in self.nodes[node_id].props[nxt:])

    @staticmethod
    def _after_value(stack: tuple):
        return (g.AFTER, stack, None) if stack else (g.DONE, (), None)


def _number(state: str, ch: str, integer: bool) -> str | None:
    if integer and (ch == "." or ch in "eE"):
        return None
    return g._number(state, ch)


# --------------------------------------------------------------------------- compiling


def compile_schema(schema: object) -> SchemaGrammar:
    """The automaton of a JSON Schema whose root is an object; SchemaError if unsupported."""
    if not isinstance(schema, dict):
        raise SchemaError("the schema must be a JSON object")
    compiler = _Compiler(schema)
    root = compiler.node(schema, (), 0)
    if root == ANY or compiler.nodes[root].kind not in ("object", "anyobject"):
        raise SchemaError('the schema\'s root must be an object ("type": "object")')
    if _height(compiler.nodes, root, {}) > g.MAX_DEPTH:
        raise SchemaError(f"nesting deeper than {g.MAX_DEPTH}")
    return SchemaGrammar(compiler.nodes, root)


def _height(nodes: list[Node], node_id: int, memo: dict[int, int]) -> int:
    """Containers nested in a value of this node, itself included (definitions are shared)."""
    if node_id == ANY:
        return 1
    if node_id not in memo:
        node = nodes[node_id]
        below = [n for _, n, _ in node.props] + ([node.items] if node.kind == "array" else []) + node.alternatives
        own = 1 if node.kind in ("object", "anyobject", "array") else 0
        memo[node_id] = own + max((_height(nodes, n, memo) for n in below), default=0)
    return memo[node_id]


def literals(grammar: SchemaGrammar) -> list[str]:
    """Every property name and enum string the automaton writes as a fixed literal (unquoted)."""
    out = []
    for node in grammar.nodes:
        out += [name for name, _, _ in node.props]
        out += [json.loads(literal) for literal in node.enum or ()]
    return out


SIBLINGS = {  # the keywords that may stand beside each structural one (annotations aside)
    "$ref": set(),
    "anyOf": set(),
    "oneOf": set(),
    "enum": {"type"},
    "const": {"type"},
}


class _Compiler:
    def __init__(self, root: dict):
        self.defs: dict[str, dict] = {}
        for where in ("definitions", "$defs"):
            table = root.get(where, {})
            if not isinstance(table, dict):
                raise SchemaError(f"{where}: must be an object")
            self.defs.update({f"#/{where}/{_escape(name)}": sub for name, sub in table.items()})
        self.nodes: list[Node] = []
        self.compiled: dict[str, int] = {}  # a definition is compiled once, then shared
        self.budget = MAX_NODES  # schema parts visited: bounds the work on any input

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1

    def node(self, schema: object, refs: tuple[str, ...], depth: int) -> int:
        self.budget -= 1
        if self.budget < 0:
            raise SchemaError(f"more than {MAX_NODES} schema parts")
        if depth > g.MAX_DEPTH:
            raise SchemaError(f"nesting deeper than {g.MAX_DEPTH}")
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object, got {json.dumps(schema)[:60]}")
        for keyword, allowed in SIBLINGS.items():
            if keyword in schema:
                extra = set(schema) - ANNOTATIONS - allowed - {keyword}
                if extra:
                    raise SchemaError(f"{keyword} beside {', '.join(sorted(extra))} is not supported")
        if "$ref" in schema:
            return self.ref(schema["$ref"], refs, depth)
        unknown = (
            set(schema) - ANNOTATIONS - {"type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf"}
        )
        if unknown:
            raise SchemaError(f"unsupported keyword(s): {', '.join(sorted(unknown))}")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.any_of([self.node(sub, refs, depth) for sub in _list(schema[key], key)], key)
        if "enum" in schema or "const" in schema:
            return self.enum(schema)
        kind = schema.get("type")
        if kind is None:
            if set(schema) - ANNOTATIONS:
                raise SchemaError(f"{', '.join(sorted(set(schema) - ANNOTATIONS))} without a type is not supported")
            return ANY
        if isinstance(kind, list):
            return self.any_of([self.node({**schema, "type": k}, refs, depth) for k in kind], "type")
        if kind == "object":
            return self.object(schema, refs, depth)
        if "properties" in schema or "required" in schema:
            raise SchemaError(f"properties / required on type {kind!r}")
        if kind == "array":
            items = schema.get("items", {})
            if items is False:
                raise SchemaError("items: false is not supported")
            return self.add(Node("array", items=self.node(items, refs, depth + 1)))
        if "items" in schema:
            raise SchemaError(f"items on type {kind!r}")
        if kind in ("string", "integer", "number", "boolean", "null"):
            return self.add(Node(kind))
        raise SchemaError(f"type {kind!r} is not supported")

    def ref(self, ref: object, refs: tuple[str, ...], depth: int) -> int:
        if not isinstance(ref, str) or ref not in self.defs:
            raise SchemaError(f"$ref {ref!r}: only references to a $defs / definitions entry are supported")
        if ref in refs:
            raise SchemaError(f"$ref {ref!r}: recursive schemas are not supported")
        if ref not in self.compiled:
            self.compiled[ref] = self.node(self.defs[ref], refs + (ref,), depth)
        return self.compiled[ref]

    def enum(self, schema: dict) -> int:
        values = _list(schema["enum"], "enum") if "enum" in schema else [schema["const"]]
        if not values or not all(v is None or isinstance(v, str) for v in values):
            raise SchemaError("enum / const: only strings (and null) are supported")
        kinds = {"null" if v is None else "string" for v in values}
        declared = schema.get("type")
        if declared is not None and not kinds <= set(declared if isinstance(declared, list) else [declared]):
            raise SchemaError(f"enum / const: values of type {sorted(kinds)} under type {declared!r}")
        strings = [v for v in values if v is not None]
        for text in strings:
            if any(0xD800 <= ord(c) <= 0xDFFF for c in text):
                raise SchemaError("enum / const: a string with a lone surrogate")
        node = (
            self.add(Node("string", enum=tuple(dict.fromkeys(json.dumps(v, ensure_ascii=False) for v in strings))))
            if strings
            else None
        )
        null = self.add(Node("null")) if "null" in kinds else None
        return self.any_of([n for n in (node, null) if n is not None], "enum")

    def object(self, schema: dict, refs: tuple[str, ...], depth: int) -> int:
        extra = schema.get("additionalProperties")
        if extra not in (None, False, True, {}):
            raise SchemaError("additionalProperties: only true or false")
        properties = schema.get("properties")
        if properties is None:
            if schema.get("required") or extra is False:
                raise SchemaError("an object with required keys or no additional properties needs properties")
            return self.add(Node("anyobject"))
        if not isinstance(properties, dict):
            raise SchemaError("properties: must be an object")
        required = _list(schema.get("required", []), "required")
        if not all(isinstance(name, str) for name in required):
            raise SchemaError("required: must be a list of property names")
        if set(required) - set(properties):
            raise SchemaError(f"required: {sorted(set(required) - set(properties))} not among the properties")
        for name in properties:
            if any(0xD800 <= ord(c) <= 0xDFFF for c in name):
                raise SchemaError("properties: a name with a lone surrogate")
        props = [(name, self.node(sub, refs, depth + 1), name in required) for name, sub in properties.items()]
        return self.add(Node("object", props=props))

    def any_of(self, alternatives: list[int], key: str) -> int:
        if not alternatives:
            raise SchemaError(f"{key}: no alternative")
        if len(alternatives) == 1:
            return alternatives[0]
        if ANY in alternatives:
            raise SchemaError(f"{key}: an unconstrained alternative is not supported")
        seen: set[str] = set()
        flat: list[int] = []
        for alt in alternatives:
            flat += self.nodes[alt].alternatives if self.nodes[alt].kind == "anyof" else [alt]
        for alt in flat:
            kind = self.nodes[alt].kind
            starts = set(STARTS.get("object" if kind == "anyobject" else kind) or "")
            if starts & seen:
                raise SchemaError(f"{key}: alternatives must start differently (e.g. a type and null)")
            seen |= starts
        return self.add(Node("anyof", alternatives=flat))


def _escape(name: str) -> str:
    """A definition's name as a JSON Pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


def _list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise SchemaError(f"{name}: must be a list")
    return value
