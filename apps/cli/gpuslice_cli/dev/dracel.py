"""The part of CEL that device selectors written for gpuslice use, for the local stack.

kube-scheduler evaluates a DeviceClass's and a request's selectors with full CEL.
The local stack cannot run CEL, so :func:`compile_selector` accepts this subset
and refuses anything else (:class:`UnsupportedSelector`, naming the expression
and where it stopped) rather than guess:

- ``device.driver``; ``device.attributes["<domain>"].<name>`` or
  ``device.attributes["<domain>"]["<name>"]`` (an attribute the device lists
  without a domain is in its driver's); ``has(<attribute>)``;
- string, integer and boolean literals, and lists of them;
- ``==``, ``!=``, ``in [...]``, and ``<``, ``<=``, ``>``, ``>=`` between integers;
- on strings: ``lowerAscii()``, ``upperAscii()``, ``contains(s)``, ``startsWith(s)``,
  ``endsWith(s)``, ``matches(re)`` (a search, as CEL's);
- ``!``, ``&&``, ``||`` and parentheses.

As in CEL, reading an attribute a device does not have, or comparing values of
different types, is an error (:class:`SelectorError`), which ``&&`` and ``||``
absorb when the other side decides the answer; an error that decides it aborts
the allocation, as kube-scheduler's does.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

Value = str | int | bool | list[Any]
Device = Mapping[str, Any]  # a resource.k8s.io/v1 Device with its driver under "driver"
Evaluate = Callable[[Device], Value]


class UnsupportedSelector(ValueError):
    """An expression outside the subset this evaluator supports."""


class SelectorError(ValueError):
    """An expression failed on a device (a missing attribute, a type mismatch)."""


_TOKEN = re.compile(
    r"""\s*(?:
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
    |(?P<int>-?[0-9]+)(?![0-9.eEuU])
    |(?P<ident>[A-Za-z_][A-Za-z0-9_]*)
    |(?P<op>==|!=|<=|>=|&&|\|\||[<>!()\[\].,])
    )""",
    re.VERBOSE,
)
_ESCAPES = {"n": "\n", "t": "\t", "\\": "\\", '"': '"', "'": "'"}
_STRING_METHODS = {"lowerAscii", "upperAscii", "contains", "startsWith", "endsWith", "matches"}
_MAX_LENGTH = 4096


@dataclass
class _Token:
    kind: str
    text: str
    at: int


def _tokens(expression: str) -> list[_Token]:
    out: list[_Token] = []
    at = 0
    while at < len(expression):
        if expression[at:].strip() == "":
            break
        match = _TOKEN.match(expression, at)
        if match is None or match.lastgroup is None:
            raise UnsupportedSelector(
                f"CEL selector {expression!r}: unsupported text at {at}: "
                f"{expression[at : at + 20]!r}"
            )
        out.append(
            _Token(match.lastgroup, match.group(match.lastgroup), match.start(match.lastgroup))
        )
        at = match.end()
    out.append(_Token("end", "", len(expression)))
    return out


def _unquote(text: str) -> str:
    body, out, i = text[1:-1], [], 0
    while i < len(body):
        if body[i] == "\\":
            if i + 1 >= len(body) or body[i + 1] not in _ESCAPES:
                raise UnsupportedSelector(f"unsupported escape in string literal {text}")
            out.append(_ESCAPES[body[i + 1]])
            i += 2
        else:
            out.append(body[i])
            i += 1
    return "".join(out)


class _Parser:
    def __init__(self, expression: str) -> None:
        self.expression = expression
        self.tokens = _tokens(expression)
        self.i = 0

    def refuse(self, what: str) -> UnsupportedSelector:
        token = self.tokens[self.i]
        near = token.text or "the end"
        return UnsupportedSelector(
            f"CEL selector {self.expression!r}: {what} at {token.at} (near {near!r}); "
            "the local stack evaluates only device.driver, device.attributes, literals, "
            "== != in < <= > >=, ! && ||, has() and lowerAscii/upperAscii/contains/"
            "startsWith/endsWith/matches"
        )

    def peek(self, text: str) -> bool:
        token = self.tokens[self.i]
        return token.kind in ("op", "ident") and token.text == text

    def take(self, text: str) -> None:
        if not self.peek(text):
            raise self.refuse(f"expected {text!r}")
        self.i += 1

    def parse(self) -> Evaluate:
        node = self.or_()
        if self.tokens[self.i].kind != "end":
            raise self.refuse("unsupported syntax")
        return node

    def or_(self) -> Evaluate:
        node = self.and_()
        while self.peek("||"):
            self.i += 1
            node = _logic(node, self.and_(), stop=True)
        return node

    def and_(self) -> Evaluate:
        node = self.unary()
        while self.peek("&&"):
            self.i += 1
            node = _logic(node, self.unary(), stop=False)
        return node

    def unary(self) -> Evaluate:
        if self.peek("!"):
            self.i += 1
            inner = self.unary()
            return lambda d: not _bool(inner(d))
        return self.comparison()

    def comparison(self) -> Evaluate:
        left = self.operand()
        token = self.tokens[self.i]
        if token.kind == "ident" and token.text == "in":
            self.i += 1
            right = self.operand()
            return lambda d: _member(left(d), right(d))
        if token.kind == "op" and token.text in ("==", "!=", "<", "<=", ">", ">="):
            self.i += 1
            right = self.operand()
            return _compare(token.text, left, right)
        return left

    def operand(self) -> Evaluate:
        node = self.primary()
        while self.peek("."):
            self.i += 1
            token = self.tokens[self.i]
            if token.kind != "ident" or token.text not in _STRING_METHODS:
                raise self.refuse("unsupported member or method")
            self.i += 1
            node = self.method(token.text, node)
        if self.peek("["):
            raise self.refuse("unsupported index")
        return node

    def method(self, name: str, target: Evaluate) -> Evaluate:
        self.take("(")
        if name in ("lowerAscii", "upperAscii"):
            self.take(")")
            lower = name == "lowerAscii"
            return lambda d: _str(target(d)).lower() if lower else _str(target(d)).upper()
        argument = self.or_()
        self.take(")")
        if name == "matches":
            return _matches(target, argument)
        check = {
            "contains": str.__contains__,
            "startsWith": str.startswith,
            "endsWith": str.endswith,
        }[name]
        return lambda d: check(_str(target(d)), _str(argument(d)))

    def primary(self) -> Evaluate:
        token = self.tokens[self.i]
        if token.kind == "string":
            self.i += 1
            text = _unquote(token.text)
            return lambda d: text
        if token.kind == "int":
            self.i += 1
            number = int(token.text)
            return lambda d: number
        if token.kind == "ident" and token.text in ("true", "false"):
            self.i += 1
            flag = token.text == "true"
            return lambda d: flag
        if self.peek("("):
            self.i += 1
            node = self.or_()
            self.take(")")
            return node
        if self.peek("["):
            return self.list_()
        if self.peek("has"):
            self.i += 1
            self.take("(")
            domain, name = self.attribute()
            self.take(")")
            return lambda d: _attribute(d, domain, name, missing_ok=True) is not None
        if self.peek("device"):
            return self.device()
        raise self.refuse("unsupported term")

    def list_(self) -> Evaluate:
        self.take("[")
        items: list[Evaluate] = []
        while not self.peek("]"):
            items.append(self.or_())
            if not self.peek("]"):
                self.take(",")
        self.take("]")
        return lambda d: [item(d) for item in items]

    def device(self) -> Evaluate:
        save = self.i
        self.take("device")
        self.take(".")
        if self.peek("driver"):
            self.i += 1
            return lambda d: _str(d.get("driver"))
        self.i = save
        domain, name = self.attribute()
        return lambda d: _present(_attribute(d, domain, name))

    def attribute(self) -> tuple[str, str]:
        self.take("device")
        self.take(".")
        self.take("attributes")
        self.take("[")
        domain = self.string()
        self.take("]")
        if self.peek("."):
            self.i += 1
            token = self.tokens[self.i]
            if token.kind != "ident" or token.text in _STRING_METHODS:
                raise self.refuse("expected an attribute name")
            self.i += 1
            return domain, token.text
        self.take("[")
        name = self.string()
        self.take("]")
        return domain, name

    def string(self) -> str:
        token = self.tokens[self.i]
        if token.kind != "string":
            raise self.refuse("expected a string literal")
        self.i += 1
        return _unquote(token.text)


def _logic(left: Evaluate, right: Evaluate, *, stop: bool) -> Evaluate:
    """CEL's ``||`` (``stop`` True) or ``&&``: ``stop`` on either side decides, even
    beside an error; otherwise an error stands."""

    def evaluate(device: Device) -> Value:
        error: SelectorError | None = None
        for side in (left, right):
            try:
                if _bool(side(device)) is stop:
                    return stop
            except SelectorError as exc:
                error = error or exc
        if error is not None:
            raise error
        return not stop

    return evaluate


def _compare(op: str, left: Evaluate, right: Evaluate) -> Evaluate:
    def evaluate(device: Device) -> Value:
        a, b = left(device), right(device)
        if type(a) is not type(b):
            raise SelectorError(f"no such overload: {type(a).__name__} {op} {type(b).__name__}")
        if op == "==":
            return a == b
        if op == "!=":
            return a != b
        if not isinstance(a, int) or isinstance(a, bool) or not isinstance(b, int):
            raise SelectorError(f"no such overload: {type(a).__name__} {op} {type(b).__name__}")
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[op]

    return evaluate


def _member(value: Value, items: Value) -> bool:
    if not isinstance(items, list):
        raise SelectorError("'in' needs a list on its right")
    return any(type(value) is type(item) and value == item for item in items)


def _matches(target: Evaluate, pattern: Evaluate) -> Evaluate:
    compiled: dict[str, re.Pattern[str]] = {}

    def evaluate(device: Device) -> Value:
        text = _str(pattern(device))
        if text not in compiled:
            try:
                compiled[text] = re.compile(text)
            except re.error as exc:
                raise SelectorError(f"bad regular expression {text!r}: {exc}") from None
        return compiled[text].search(_str(target(device))) is not None

    return evaluate


def _attribute(device: Device, domain: str, name: str, *, missing_ok: bool = False) -> Value | None:
    attributes = device.get("attributes") or {}
    raw = attributes.get(f"{domain}/{name}")
    if raw is None and device.get("driver") == domain:
        raw = attributes.get(name)
    if raw is None:
        if missing_ok:
            return None
        raise SelectorError(f"device {device.get('name')!r} has no attribute {domain}/{name}")
    if not isinstance(raw, Mapping) or len(raw) != 1:
        raise SelectorError(f"attribute {domain}/{name} is not one typed value: {raw!r}")
    ((kind, value),) = raw.items()
    if kind in ("string", "version") and isinstance(value, str):
        return value
    if kind == "int" and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind == "bool" and isinstance(value, bool):
        return value
    raise SelectorError(f"attribute {domain}/{name} has an unsupported value {raw!r}")


def _present(value: Value | None) -> Value:
    if value is None:  # not reached: _attribute raises unless missing_ok
        raise SelectorError("attribute missing")
    return value


def _bool(value: Value) -> bool:
    if not isinstance(value, bool):
        raise SelectorError(f"expected a boolean, got {type(value).__name__}")
    return value


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise SelectorError(f"expected a string, got {type(value).__name__}")
    return value


def compile_selector(expression: object) -> Callable[[Device], bool]:
    """The selector as a test of one device (its ``driver`` key set); raises
    :class:`UnsupportedSelector` for an expression outside the subset. The test
    raises :class:`SelectorError` where CEL fails at run time."""
    if not isinstance(expression, str) or not expression.strip():
        raise UnsupportedSelector(f"CEL selector must be a non-empty string, got {expression!r}")
    if len(expression) > _MAX_LENGTH:
        raise UnsupportedSelector(f"CEL selector is longer than {_MAX_LENGTH} characters")
    evaluate = _Parser(expression).parse()
    return lambda device: _bool(evaluate(device))
