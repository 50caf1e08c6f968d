"""The chat template is untrusted code (it ships with the checkpoint), so it runs in jinja's immutable sandbox
with bounds on what the sandbox does not bound: time, size and recursion. Any failure is one line.

- **Time**: a trace function on the template's own frames (their code is compiled from "<template>") checks a
  deadline at every line, so nested loops end when the deadline passes; it also counts nested template calls
  (macros calling macros) against a depth limit.
- **Size**: every value the template makes is at most `chars` long, and so is its output. Operations that
  multiply size are estimated *before* they run (`'a' * 3000000000`, `2 ** 10**9`, `s.center(10**9)`, a
  `replace` or `join` whose result would be too long, a format with a huge width); every other operator,
  call and filter result is checked after; a macro's arguments and a namespace's values are checked as they
  are passed or set.

Settings follow Hugging Face's (trim_blocks, lstrip_blocks, loopcontrols, tojson with json.dumps' keywords,
raise_exception), so templates written for transformers render identically.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

from k2trt.errors import K2Error

TEMPLATE_CODE = "<template>"  # the filename jinja compiles template source under


@dataclass(frozen=True)
class TemplateLimits:
    seconds: float = 5.0  # one render (a real chat template takes milliseconds)
    chars: int = 1 << 24  # the longest value (string, list, dict) the template may make, and its output
    depth: int = 64  # nested template calls
    int_bits: int = 1 << 16  # the largest integer it may compute


class TemplateLimit(K2Error):
    """The template went past one of its limits."""


class TemplateFailure(K2Error):
    """The template raised, or asked to raise (raise_exception)."""


_SIZED = (str, list, tuple, dict, set, frozenset, bytes)
_NUMBER = re.compile(r"\d+")


class Bounds:
    def __init__(self, limits: TemplateLimits):
        self.limits = limits

    def fail(self, what: str) -> TemplateLimit:
        return TemplateLimit(f"{what} (the limit is {self.limits.chars:,} characters or items)")

    def value(self, v: Any, what: str = "a value") -> Any:
        if isinstance(v, _SIZED) and len(v) > self.limits.chars:
            raise self.fail(f"{what} of {len(v):,} items")
        if isinstance(v, int) and not isinstance(v, bool) and v.bit_length() > self.limits.int_bits:
            raise TemplateLimit(f"{what}: an integer of {v.bit_length():,} bits "
                                f"(the limit is {self.limits.int_bits:,})")
        return v

    def length(self, n: int, what: str) -> None:
        if n > self.limits.chars:
            raise self.fail(f"{what} would make {n:,} items")

    def arguments(self, args, kwargs, what: str) -> None:
        """Counts and widths passed to a call or filter: none may exceed the size limit."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.limits.chars:
                raise self.fail(f"{what} with argument {a:,}")
            self.value(a, f"an argument of {what}")

    def format_string(self, fmt: str, what: str) -> None:
        """A width or precision in a format ("%0999999999d", "{:>999999999}") is a number in the string."""
        for n in _NUMBER.findall(fmt):
            if len(n) > 12 or int(n) > self.limits.chars:
                raise self.fail(f"{what} with width {n}")

    # ---- size estimates for the operations that multiply size ------------------------------------------
    def binop(self, op: str, left: Any, right: Any) -> None:
        if op == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, _SIZED) and isinstance(n, int):
                self.length(len(seq) * max(n, 0), "repetition")
            elif isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > self.limits.int_bits:
                    raise TemplateLimit("an integer product beyond the limit")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            if abs(left) > 1 and right * left.bit_length() > self.limits.int_bits:
                raise TemplateLimit(f"{left} ** {right}: an integer beyond {self.limits.int_bits:,} bits")
        elif op == "%" and isinstance(left, str):
            self.format_string(left, "a % format")
            self.arguments(right if isinstance(right, tuple) else (right,), {}, "a % format")

    def growth(self, name: str, s: Any, args: tuple, kwargs: dict) -> None:
        """The result size of str methods and filters that can make a much longer string than they get."""
        if not isinstance(s, str):
            return
        arg = lambda i, key, default=None: args[i] if len(args) > i else kwargs.get(key, default)  # noqa: E731
        if name == "replace":
            old, new = arg(0, "old", ""), arg(1, "new", "")
            if isinstance(old, str) and isinstance(new, str):
                hits = len(s) + 1 if not old else s.count(old)
                self.length(len(s) + hits * max(len(new) - len(old), 0), "replace")
        elif name == "indent":
            width = arg(0, "width", 4)
            pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
            self.length(len(s) + (s.count("\n") + 1) * pad, "indent")
        elif name == "expandtabs":
            size = arg(0, "tabsize", 8)
            self.length(len(s) + s.count("\t") * (size if isinstance(size, int) else 0), "expandtabs")
        elif name in ("format", "format_map"):
            self.format_string(s, name)

    def join(self, sep: Any, items: list) -> None:
        if isinstance(sep, str):
            self.length(sum(len(x) for x in items if isinstance(x, str)) + len(sep) * len(items), "join")


def _bounded_namespace(bounds: Bounds):
    from jinja2.utils import Namespace

    class BoundedNamespace(Namespace):
        """`namespace()`: a value set in a loop (`{% set ns.s = ns.s ~ ns.s %}`) is checked as it is set."""

        def __setitem__(self, name: str, value: Any) -> None:
            super().__setitem__(name, bounds.value(value, f"namespace value {name!r}"))

    return BoundedNamespace


def _wrap_filter(bounds: Bounds, name: str, fn: Callable) -> Callable:
    from jinja2.utils import _PassArg

    lead = 0 if _PassArg.from_obj(fn) is None else 1  # jinja passes its context or environment first

    @functools.wraps(fn)  # keeps jinja's pass_context / pass_eval_context marks
    def bounded(*args, **kwargs):
        head, plain = args[:lead], args[lead:]
        bounds.arguments(plain, kwargs, f"filter {name}")
        if plain and name == "join":
            items = list(plain[0])
            bounds.join(plain[1] if len(plain) > 1 else kwargs.get("d", ""), items)
            args = (*head, items, *plain[1:])
        elif plain:
            bounds.growth(name, plain[0], tuple(plain[1:]), kwargs)
        return bounds.value(fn(*args, **kwargs), f"filter {name}")

    return bounded


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Templates written for HF call tojson with json.dumps' keywords, which jinja's own filter lacks.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise TemplateFailure(f"chat template: {message}")


def _environment(bounds: Bounds):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        # jinja then also leaves these operators out of its compile-time constant folding
        intercepted_binops = frozenset(["*", "**", "+", "%", "//", "/", "-"])

        def call_binop(self, context, operator, left, right):
            bounds.binop(operator, left, right)
            return bounds.value(super().call_binop(context, operator, left, right), f"an {operator!r} result")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 — jinja's own signature
            what = getattr(__obj, "__name__", type(__obj).__name__)
            plain = {k: v for k, v in kwargs.items() if k not in ("_loop_vars", "_block_vars")}
            bounds.arguments(args, plain, f"call {what}()")
            owner = getattr(__obj, "__self__", None)
            if what == "join" and isinstance(owner, str) and args:
                items = list(args[0])
                bounds.join(owner, items)
                args = (items, *args[1:])
            else:
                bounds.growth(what, owner, args, plain)
            return bounds.value(super().call(__context, __obj, *args, **kwargs), f"call {what}()")

        def wrap_str_format(self, value):
            fmt = super().wrap_str_format(value)
            if fmt is not None:
                bounds.format_string(value.__self__, value.__name__)
            return fmt

    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.filters = {name: _wrap_filter(bounds, name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)  # a text generator no chat template needs: lipsum(10**9) is 10**9 paragraphs
    env.globals["namespace"] = _bounded_namespace(bounds)
    env.globals["raise_exception"] = _raise_exception
    return env


class _Watch:
    """sys.settrace on the template's own frames: a deadline checked at every line, nested calls counted, and
    the arguments of each call (a macro's) checked for size."""

    def __init__(self, bounds: Bounds):
        self.bounds, self.depth = bounds, 0
        self.deadline = time.monotonic() + bounds.limits.seconds

    def _check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"ran for more than {self.bounds.limits.seconds:g} s")

    def call(self, frame, event, arg):
        if frame.f_code.co_filename != TEMPLATE_CODE:
            return None
        self.depth += 1  # a generator's resume is a call too, balanced by the return at its next yield
        if self.depth > self.bounds.limits.depth:
            raise TemplateLimit(f"template calls nested more than {self.bounds.limits.depth} deep")
        for name, value in frame.f_locals.items():
            self.bounds.value(value, f"argument {name.removeprefix('l_1_')!r}")
        self._check_time()
        return self.local

    def local(self, frame, event, arg):
        if event == "line":
            self._check_time()
        elif event == "return":
            self.depth -= 1
        return self.local


class ChatTemplate:
    """A compiled template that renders within its limits. `source` is the template text; `where` names it in
    messages."""

    def __init__(self, source: str, where: str, limits: TemplateLimits = TemplateLimits()):
        self.where, self.bounds = where, Bounds(limits)
        if len(source) > limits.chars:
            raise TemplateLimit(f"{where}: the template itself is {len(source):,} characters")
        try:
            self._template = _environment(self.bounds).from_string(source)
        except Exception as e:  # noqa: BLE001 — compiling untrusted code may fail in any way
            raise K2Error(f"{where}: bad chat template: {_one_line(e)}") from None

    def render(self, **context: Any) -> str:
        watch = _Watch(self.bounds)
        previous = sys.gettrace()
        out, size = [], 0
        sys.settrace(watch.call)
        try:
            for chunk in self._template.generate(**context):
                size += len(chunk)
                if size > self.bounds.limits.chars:
                    raise self.bounds.fail(f"output of more than {size:,} characters")
                out.append(chunk)
        except (TemplateLimit, TemplateFailure) as e:
            raise type(e)(f"{self.where}: {e}") from None
        except Exception as e:  # noqa: BLE001 — the template is untrusted code: every failure is one line
            raise TemplateFailure(f"{self.where}: chat template failed: {_one_line(e)}") from None
        finally:
            sys.settrace(previous)
        return "".join(out)


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__
