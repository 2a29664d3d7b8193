"""Structured outputs: a request's StructuredOutput (common.proto) as an llguidance grammar, and
the checks that bound it. Shared by the gateway, which validates a constraint before the request
goes anywhere (a bad one is a 400), and the worker, which compiles the same grammar into a
matcher per request. Pure apart from llguidance (a Rust core; imported on first use)."""
from __future__ import annotations

import json
from functools import lru_cache

from services.common.json_limits import json_depth_exceeds
from services.common.sampling_rules import SamplingRuleError

MAX_CONSTRAINT_BYTES = 64 * 1024     # schema / regex / grammar text, and all choices together
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 32                # nesting of the JSON Schema document itself
PARAM = "structured_outputs"
_ANY_OBJECT = '{"type": "object"}'
# Whitespace between JSON tokens: enough for pretty-printing (newline + indentation), never an
# endless run: with unbounded whitespace a model can wander into spaces and newlines until
# max_tokens (small and random-weight models do). A schema's own "x-guidance" options override it.
_JSON_STYLE = {"whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,16}"}

def kind_of(so) -> str:
    """"json_schema" | "json_object" | "regex" | "choice" | "grammar" (a set StructuredOutput)."""
    return so.WhichOneof("kind")


def check_shape(so) -> None:
    """The bounds that need no grammar engine: sizes, counts, JSON nesting. SamplingRuleError."""
    kind = kind_of(so)
    if kind is None:
        raise SamplingRuleError("structured output is set but names no constraint", PARAM)
    if kind == "json_object":
        if not so.json_object:
            raise SamplingRuleError("json_object must be true when it is the constraint", PARAM)
        return
    if kind == "choice":
        choices = list(so.choice.choices)
        if not 1 <= len(choices) <= MAX_CHOICES:
            raise SamplingRuleError(f"choice needs 1 to {MAX_CHOICES} strings, got {len(choices)}", PARAM)
        if any(not c for c in choices):
            raise SamplingRuleError("choice strings must not be empty", PARAM)
        size = sum(len(c.encode()) for c in choices)
    else:
        text = getattr(so, kind)
        if not text.strip():
            raise SamplingRuleError(f"the {kind} constraint is empty", PARAM)
        size = len(text.encode())
    if size > MAX_CONSTRAINT_BYTES:
        raise SamplingRuleError(f"the {kind} constraint is {size} bytes; at most {MAX_CONSTRAINT_BYTES} "
                                "are allowed", PARAM)
    if kind == "json_schema":
        if json_depth_exceeds(so.json_schema.encode(), MAX_SCHEMA_DEPTH):
            raise SamplingRuleError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels", PARAM)
        try:
            schema = json.loads(so.json_schema)
        except ValueError as exc:
            raise SamplingRuleError(f"the JSON schema is not valid JSON: {exc}", PARAM) from None
        if not isinstance(schema, (dict, bool)):
            raise SamplingRuleError("the JSON schema must be a JSON object (or true / false)", PARAM)


def grammar_of(so) -> str:
    """The llguidance grammar text of a StructuredOutput that passed check_shape."""
    from llguidance import LLMatcher, grammar_from
    kind = kind_of(so)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(so.json_schema, defaults=_JSON_STYLE)
    if kind == "json_object":
        return LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_STYLE)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return grammar_from("choice", json.dumps(list(so.choice.choices)))
    return grammar_from("grammar", so.grammar)   # Lark, or GBNF converted to Lark


def parser_limits():
    """Bounds on the grammar engine's work, the same when the gateway validates and when the worker
    compiles: a grammar past them is refused, never left to stall (about 20 ms of lexer fuel
    to build, 14 ms per token mask at most)."""
    from llguidance import LLParserLimits
    return LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000, step_max_items=50_000,
                          max_lexer_states=100_000, max_grammar_size=200_000)


NO_OUTPUT = "the grammar admits no output (e.g. a $ref cycle that never reaches a value)"


class _ByteTokens:
    """A 256-byte vocabulary plus EOS: enough for llguidance to compute a real first mask."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@lru_cache(maxsize=1)
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper
    return LLTokenizer(TokenizerWrapper(_ByteTokens()))


@lru_cache(maxsize=512)
def _validate_grammar(grammar: str) -> str:
    """The engine's verdict, then a probe: the first mask over a byte vocabulary (about 1 ms),
    which catches what validation alone passes but no model could ever emit (a schema that is
    only a $ref cycle): such a grammar would end every request at once with an empty output."""
    import numpy as np
    from llguidance import LLMatcher
    from llguidance.numpy import fill_next_token_bitmask
    error = LLMatcher.validate_grammar(grammar, None, limits=parser_limits())
    if error:
        return error
    m = LLMatcher(_byte_tokenizer(), grammar, limits=parser_limits())
    if not m.is_error():
        fill_next_token_bitmask(m, np.zeros((1, 9), dtype=np.int32), 0)   # 257 tokens: 9 words
    return NO_OUTPUT if m.is_error() else ""


def check(so) -> None:
    """check_shape, then the grammar engine's own verdict (syntax, unsupported schema keywords,
    size limits): SamplingRuleError with its message. Verdicts of recent grammars are cached."""
    check_shape(so)
    try:
        grammar = grammar_of(so)
    except ValueError as exc:
        raise SamplingRuleError(f"invalid {kind_of(so)} constraint: {exc}", PARAM) from None
    error = _validate_grammar(grammar)
    if error:
        first = error.strip().splitlines()[0] if error.strip() else error
        raise SamplingRuleError(f"invalid {kind_of(so)} constraint: {first[:300]}", PARAM)
