"""A Jinja sandbox for chat templates that bounds render time and memory.

Chat templates are code shipped with model weights (untrusted), run over client text.
The sandbox (jinja2's ImmutableSandboxedEnvironment, as transformers uses) blocks
attribute escapes; this module adds the limits it lacks:

- a per-render deadline checked on every `for` iteration (each loop's iterable is
  wrapped at parse time, so silent nested loops are caught too), on every sandboxed
  call (macro recursion) and on every filter;
- `range()` capped to `max_range` items;
- `*`, `**`, `+`, `%` and `~` refuse results over `max_chars` (string/list bombs)
  and huge integers; integer arguments over `max_chars` to calls and filters are
  refused (`"a".ljust(10**9)`, `"x"|center(10**9)`, `tojson(indent=10**9)`).

The deadline lives in a thread-local, so one compiled template serves many threads.
"""
from __future__ import annotations

import functools
import json
import re
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer


class ChatTemplateError(ValueError):
    """The template or the messages cannot be rendered (bad input: INVALID_ARGUMENT)."""


class RenderLimitError(ChatTemplateError):
    """Rendering exceeded a time or size limit."""


@dataclass(frozen=True)
class RenderLimits:
    max_chars: int = 1_000_000      # rendered output and any intermediate string/list
    max_render_s: float = 2.0
    max_range: int = 100_000
    max_int_bits: int = 4096

    def __post_init__(self) -> None:
        if self.max_chars <= 0 or self.max_render_s <= 0 or self.max_range <= 0:
            raise ValueError(f"render limits must be positive: {self}")


class _RenderState(threading.local):
    deadline: float | None = None


_state = _RenderState()


class RenderDeadline:
    """Context manager that arms the deadline for renders on this thread."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __enter__(self) -> "RenderDeadline":
        _state.deadline = time.monotonic() + self.seconds
        return self

    def __exit__(self, *exc: object) -> None:
        _state.deadline = None


def check_deadline() -> None:
    deadline = _state.deadline
    if deadline is not None and time.monotonic() > deadline:
        raise RenderLimitError("chat template render took too long")


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


# %-format width/precision such as "%0999999999d" or "{:>999999999}".
_FORMAT_NUMBER = re.compile(r"\d{7,}")


class _GuardLoops(NodeTransformer):
    """Rewrites `for x in ITER` to `for x in environment.guard_iterable(ITER)` and
    `a ~ b` to `environment.guard_size(a ~ b)`."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = _env_call("guard_iterable", node.iter, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _env_call("guard_size", node, node.lineno)


def _env_call(method: str, arg: nodes.Expr, lineno: int) -> nodes.Call:
    # EnvironmentAttribute compiles to `environment.<method>`: templates cannot shadow it.
    return nodes.Call(nodes.EnvironmentAttribute(method), [arg], [], None, None, lineno=lineno)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant mask marker) as a no-op."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):
        return caller()


class _TemplateDict:
    # Like transformers: `dict(...)` without handing templates the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Like transformers: namespaces refuse underscore names (no route to CPython internals).
    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (Jinja's signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore attributes on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' tojson: no HTML escaping, optional indent/separators.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    if not isinstance(fmt, str) or len(fmt) > 256:
        raise RenderLimitError("strftime_now format must be a string of at most 256 chars")
    return datetime.now().strftime(fmt)


class GuardedEnvironment(ImmutableSandboxedEnvironment):
    """ImmutableSandboxedEnvironment with transformers' chat-template globals and limits."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, limits: RenderLimits) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.limits = limits
        self.filters["tojson"] = _tojson
        self.filters = {name: self._guard_filter(f) for name, f in self.filters.items()}
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["dict"] = _TemplateDict()
        self.globals["namespace"] = _TemplateNamespace
        self.globals["range"] = self._range

    # -- parse-time rewrite -------------------------------------------------------
    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        return _GuardLoops().visit(super()._parse(source, name, filename))

    # -- hooks the rewritten template and the sandbox call --------------------------
    def guard_iterable(self, iterable: Any):
        check_deadline()
        for item in iterable:
            check_deadline()
            yield item

    def guard_size(self, value: Any) -> Any:
        check_deadline()
        if _sized(value) > self.limits.max_chars:
            raise RenderLimitError(f"chat template built a value over {self.limits.max_chars} chars")
        return value

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (Jinja's signature)
        check_deadline()
        __self._check_int_args(args, kwargs)
        # The sandbox hands templates `str.format` wrapped; look through the wrapper.
        target = getattr(__obj, "__wrapped__", __obj)
        if getattr(target, "__name__", "") in ("format", "format_map") \
                and isinstance(getattr(target, "__self__", None), str):
            __self._check_format(target.__self__)
        return __self.guard_size(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        check_deadline()
        limit = self.limits.max_chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _sized(seq) and isinstance(n, int) and _sized(seq) * n > limit:
                    raise RenderLimitError(f"chat template built a value over {limit} chars")
        elif operator == "+":
            if _sized(left) + _sized(right) > limit:
                raise RenderLimitError(f"chat template built a value over {limit} chars")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                    and right * abs(left).bit_length() > self.limits.max_int_bits:
                raise RenderLimitError("chat template computed a huge integer")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, int) and result.bit_length() > self.limits.max_int_bits:
            raise RenderLimitError("chat template computed a huge integer")
        return self.guard_size(result)

    # -- helpers --------------------------------------------------------------------
    def _range(self, *args: int) -> range:
        rng = range(*args)
        if len(rng) > self.limits.max_range:
            raise RenderLimitError(f"range() over {self.limits.max_range} items in chat template")
        return rng

    def _check_int_args(self, args: tuple, kwargs: dict) -> None:
        for value in (*args, *kwargs.values()):
            if isinstance(value, int) and abs(value) > self.limits.max_chars:
                raise RenderLimitError("chat template passed a huge number to a function")

    def _check_format(self, fmt: str) -> None:
        if _FORMAT_NUMBER.search(fmt):
            raise RenderLimitError("chat template used a huge format width")

    def _guard_filter(self, func):
        # The filtered value (after a context/eval-context/environment argument, if the
        # filter takes one) may be any number; the filter's own arguments may not be huge.
        skip = 2 if getattr(func, "jinja_pass_arg", None) is not None else 1

        @functools.wraps(func)  # keeps jinja_pass_arg (pass_context etc.)
        def guarded(*args, **kwargs):
            check_deadline()
            self._check_int_args(args[skip:], kwargs)
            return self.guard_size(func(*args, **kwargs))
        return guarded
