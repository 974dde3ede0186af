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

from common import json_grammar as g

ANY = -1  # node id of a free JSON value
KEYLIT = "keylit"  # a declared key: detail (candidates ((prop index, '"name"'), ...), characters matched)
ENUMLIT = "enumlit"  # an enum string: detail (candidate literals, characters matched)
FIRST = "first"  # after '[': a value of the array's items, or ']'
MAX_NODES = 4096

ANNOTATIONS = {"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
               "readOnly", "writeOnly", "$defs", "definitions", "additionalProperties"}
STARTS = {"object": "{", "array": "[", "string": '"', "integer": "-0123456789", "number": "-0123456789",
          "boolean": "tf", "null": "n", "any": None}


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
    nodes: list[Node] = []
    root = _Compiler(schema, nodes).node(schema, ())
    if nodes[root].kind not in ("object", "anyobject"):
        raise SchemaError("the schema's root must be an object")
    return SchemaGrammar(nodes, root)


class _Compiler:
    def __init__(self, root: dict, nodes: list[Node]):
        self.defs = {**root.get("definitions", {}), **root.get("$defs", {})}
        self.nodes = nodes

    def add(self, node: Node) -> int:
        if len(self.nodes) >= MAX_NODES:
            raise SchemaError(f"more than {MAX_NODES} schema nodes")
        self.nodes.append(node)
        return len(self.nodes) - 1

    def node(self, schema: object, refs: tuple[str, ...]) -> int:
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise SchemaError(f"a schema must be an object, got {json.dumps(schema)[:60]}")
        if "$ref" in schema:
            ref = schema["$ref"]
            name = ref.rsplit("/", 1)[-1] if isinstance(ref, str) else None
            if not isinstance(ref, str) or not ref.startswith(("#/$defs/", "#/definitions/")) or name not in self.defs:
                raise SchemaError(f"$ref {ref!r}: only references into $defs / definitions are supported")
            if name in refs:
                raise SchemaError(f"$ref {ref!r}: recursive schemas are not supported")
            return self.node(self.defs[name], refs + (name,))
        unknown = set(schema) - ANNOTATIONS - {"type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf"}
        if unknown:
            raise SchemaError(f"unsupported keyword(s): {', '.join(sorted(unknown))}")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                return self.any_of([self.node(s, refs) for s in _list(schema[key], key)])
        if "enum" in schema or "const" in schema:
            values = _list(schema["enum"], "enum") if "enum" in schema else [schema["const"]]
            strings = [v for v in values if isinstance(v, str)]
            others = [v for v in values if not isinstance(v, str)]
            if any(v is not None for v in others) or not values:
                raise SchemaError("enum / const: only strings (and null) are supported")
            node = self.add(Node("string", enum=tuple(json.dumps(v, ensure_ascii=False) for v in strings))) if strings else None
            null = self.add(Node("null")) if others else None
            return self.any_of([n for n in (node, null) if n is not None])
        kind = schema.get("type")
        if isinstance(kind, list):
            return self.any_of([self.node({**schema, "type": k}, refs) for k in kind])
        if kind == "object":
            return self.object(schema, refs)
        if kind == "array":
            return self.add(Node("array", items=self.node(schema.get("items", {}), refs)))
        if kind in ("string", "integer", "number", "boolean", "null"):
            return self.add(Node(kind))
        if kind is None:
            return ANY
        raise SchemaError(f"type {kind!r} is not supported")

    def object(self, schema: dict, refs: tuple[str, ...]) -> int:
        if schema.get("additionalProperties") not in (None, False, True, {}):
            raise SchemaError("additionalProperties: only true or false")
        properties = schema.get("properties")
        if properties is None:
            return self.add(Node("anyobject"))
        if not isinstance(properties, dict):
            raise SchemaError("properties: must be an object")
        required = set(_list(schema.get("required", []), "required"))
        if required - set(properties):
            raise SchemaError(f"required: {sorted(required - set(properties))} not among the properties")
        props = [(name, self.node(sub, refs), name in required) for name, sub in properties.items()]
        return self.add(Node("object", props=props))

    def any_of(self, alternatives: list[int]) -> int:
        if len(alternatives) == 1:
            return alternatives[0]
        if ANY in alternatives:
            raise SchemaError("anyOf / oneOf: an unconstrained alternative is not supported")
        seen: set[str] = set()
        flat: list[int] = []
        for alt in alternatives:
            flat += self.nodes[alt].alternatives if self.nodes[alt].kind == "anyof" else [alt]
        for alt in flat:
            kind = self.nodes[alt].kind
            starts = set(STARTS.get("object" if kind == "anyobject" else kind) or "")
            if starts & seen:
                raise SchemaError("anyOf / oneOf: alternatives must start differently (e.g. a type and null)")
            seen |= starts
        return self.add(Node("anyof", alternatives=flat))


def _list(value: object, name: str) -> list:
    if not isinstance(value, list):
        raise SchemaError(f"{name}: must be a list")
    return value
