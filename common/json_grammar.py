r"""JSON as a character-level pushdown automaton, for `response_format: {"type": "json_object"}`.

Pure Python. A state is an immutable tuple, so a sequence's state is copied by assignment (forks)
and states can key a cache of token masks (`workers/engine/json_mode.py`):

    (mode, stack, detail)

`stack` is the open containers as a string of "{" and "[", innermost last. `mode` is what may
come next; `detail` refines it (inside a string: whether it is a key and the escape progress;
in a number: how far it got; in a literal: the characters still to come).

`step(state, ch)` returns the next state or None when `ch` cannot continue valid JSON. The
document is one object ("json_object"), nested at most MAX_DEPTH deep; whitespace is allowed
wherever JSON allows it, and after the object closes only whitespace may follow (`is_complete` is
then true). Characters beyond
ASCII are only valid inside strings, which also covers tokens that end inside a UTF-8 sequence
(their text holds U+FFFD). `\u` escapes of surrogates (D800-DFFF) are refused: many parsers
reject a lone one, and characters outside the BMP can be written as they are.
"""

from __future__ import annotations

# modes
START = "start"  # before the top-level object
VALUE = "value"  # a value must come (after ':' or ',' in an array)
VALUE_OR_CLOSE = "value|]"  # after '['
KEY = "key"  # a key must come (after ',' in an object)
KEY_OR_CLOSE = "key|}"  # after '{'
COLON = "colon"  # after a key
AFTER = "after"  # after a value inside a container: ',' or the closing bracket
STRING = "string"  # detail: (is_key, escape) with escape "" | "\\" | "u0".."u3"
NUMBER = "number"  # detail: one of NUMBER_STATES
LITERAL = "literal"  # detail: the characters still to come
DONE = "done"  # the top-level object is closed

WHITESPACE = " \t\n\r"
ESCAPES = '"\\/bfnrt'
HEX = "0123456789abcdefABCDEF"
DIGITS = "0123456789"
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
MAX_DEPTH = 64  # open containers at most: deeper JSON fails to load in common parsers
# number states that may end the number: after "0", digits, fraction digits, exponent digits
NUMBER_ENDS = {"zero", "int", "frac", "exp"}

State = tuple

INITIAL: State = (START, "", None)
TEXT_MODES = frozenset({STRING})  # modes in which whitespace is text, not padding


def is_complete(state: State) -> bool:
    return state[0] == DONE


def step(state: State, ch: str) -> State | None:
    mode, stack, detail = state
    if mode == STRING:
        return _string(stack, detail, ch)
    if mode == NUMBER:
        nxt = _number(detail, ch)
        if nxt is not None:
            return (NUMBER, stack, nxt)
        if detail not in NUMBER_ENDS:
            return None
        return step(_after_value(stack), ch)  # the number ended: `ch` continues after it
    if mode == LITERAL:
        if ch != detail[0]:
            return None
        return (LITERAL, stack, detail[1:]) if len(detail) > 1 else _after_value(stack)
    if ch in WHITESPACE:
        return state
    if mode == START:
        return (KEY_OR_CLOSE, "{", None) if ch == "{" else None
    if mode == DONE:
        return None
    if mode in (KEY, KEY_OR_CLOSE):
        if ch == '"':
            return (STRING, stack, (True, ""))
        if ch == "}" and mode == KEY_OR_CLOSE:
            return _close(stack)
        return None
    if mode == COLON:
        return (VALUE, stack, None) if ch == ":" else None
    if mode == AFTER:
        if ch == ",":
            return (KEY, stack, None) if stack[-1] == "{" else (VALUE, stack, None)
        if ch == ("}" if stack[-1] == "{" else "]"):
            return _close(stack)
        return None
    # VALUE, VALUE_OR_CLOSE
    if ch == "]" and mode == VALUE_OR_CLOSE:
        return _close(stack)
    return _value_start(stack, ch)


def _value_start(stack: str, ch: str) -> State | None:
    if ch == '"':
        return (STRING, stack, (False, ""))
    if ch in "{[" and len(stack) >= MAX_DEPTH:
        return None
    if ch == "{":
        return (KEY_OR_CLOSE, stack + "{", None)
    if ch == "[":
        return (VALUE_OR_CLOSE, stack + "[", None)
    if ch == "-":
        return (NUMBER, stack, "minus")
    if ch == "0":
        return (NUMBER, stack, "zero")
    if ch in DIGITS:
        return (NUMBER, stack, "int")
    if ch in LITERALS:
        return (LITERAL, stack, LITERALS[ch])
    return None


def _string(stack: str, detail: tuple, ch: str) -> State | None:
    is_key, escape = detail
    if escape == "":
        if ch == '"':
            return (COLON, stack, None) if is_key else _after_value(stack)
        if ch == "\\":
            return (STRING, stack, (is_key, "\\"))
        return None if ord(ch) < 0x20 else (STRING, stack, detail)
    if escape == "\\":
        if ch in ESCAPES:
            return (STRING, stack, (is_key, ""))
        return (STRING, stack, (is_key, "u0")) if ch == "u" else None
    if ch not in HEX:  # "\uXXXX": escape is "u<hex digits so far>", "u1d" after a first "d"
        return None
    if escape == "u1d" and ch not in "01234567":  # \uD800-\uDFFF: a surrogate, which many parsers refuse
        return None
    if escape == "u0" and ch in "dD":
        return (STRING, stack, (is_key, "u1d"))
    done = int(escape[1]) + 1
    return (STRING, stack, (is_key, "" if done == 4 else f"u{done}"))


def _number(detail: str, ch: str) -> str | None:
    """The next number state within the number, or None if `ch` does not extend it."""
    if detail == "minus":
        return "zero" if ch == "0" else "int" if ch in DIGITS else None
    if detail in ("zero", "int"):
        if ch in DIGITS:
            return "int" if detail == "int" else None
        return "dot" if ch == "." else "e" if ch in "eE" else None
    if detail in ("dot", "frac"):
        if ch in DIGITS:
            return "frac"
        return "e" if ch in "eE" and detail == "frac" else None
    if detail == "e":
        return "esign" if ch in "+-" else "exp" if ch in DIGITS else None
    if detail in ("esign", "exp"):
        return "exp" if ch in DIGITS else None
    return None


def _after_value(stack: str) -> State:
    return (AFTER, stack, None) if stack else (DONE, "", None)


def _close(stack: str) -> State:
    return _after_value(stack[:-1])


def run(state: State | None, text: str) -> State | None:
    """`step` over every character of `text`; None as soon as one is refused."""
    for ch in text:
        if state is None:
            return None
        state = step(state, ch)
    return state
