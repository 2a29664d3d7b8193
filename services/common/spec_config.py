"""`--speculative-config`: vLLM's JSON (method, num_speculative_tokens, prompt_lookup_min/max,
model, ...) checked once at start-up, so a bad configuration fails with a clear message before
any engine runs. Shared by the launcher (which refuses it), the scheduler (which budgets draft
tokens) and the worker (which proposes and verifies them). Pure: json and dataclasses only.

Methods: "ngram" (prompt lookup: the longest recent n-gram of the request that occurred before,
prompt_lookup_min..prompt_lookup_max tokens long, proposes what followed it), "suffix" (the most
frequent continuation of the longest earlier match of the request's context, over its own
tokens plus a bounded cache of recent outputs) and "draft_model" (a
smaller model with the same tokenizer, run by the same worker). `dynamic_k`, a table
[[min_batch, max_batch, K], ...], overrides the cost model's choice of K per batch size."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "suffix", "draft_model")
MAX_SPEC_TOKENS = 16
_KNOWN = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
          "dynamic_k", "suffix_max_depth", "suffix_min_prob", "suffix_cache_outputs", "disable_by_batch_size"}


class SpecConfigError(ValueError):
    """A speculative configuration that cannot run; the message says what and why."""


@dataclass(frozen=True, slots=True)
class SpecConfig:
    method: str
    num_speculative_tokens: int                    # the most draft tokens per request per step
    prompt_lookup_min: int = 2                     # ngram: shortest n-gram to match
    prompt_lookup_max: int = 5                     # ngram: longest n-gram to match
    model: str | None = None                       # draft_model: its directory
    dynamic_k: tuple[tuple[int, int, int], ...] = ()   # [(min_batch, max_batch, K)]: overrides the cost model
    suffix_max_depth: int = 8                      # suffix: the longest context matched
    suffix_min_prob: float = 0.1                   # suffix: stop a draft where the path's frequency drops below
    suffix_cache_outputs: int = 256                # suffix: recent finished outputs kept for all requests
    disable_by_batch_size: int = 0                 # > 0: no speculation at or above this batch (vLLM's knob)

    def fixed_k(self, batch_size: int) -> int | None:
        """K from the dynamic_k table (or the batch-size cut-off) for this batch; None: ask the cost model."""
        if self.disable_by_batch_size and batch_size >= self.disable_by_batch_size:
            return 0
        for lo, hi, k in self.dynamic_k:
            if lo <= batch_size <= hi:
                return k
        return None


def _int(cfg: dict, key: str, default: int, lo: int, hi: int) -> int:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise SpecConfigError(f"speculative-config: {key} must be an integer in [{lo}, {hi}], got {value!r}")
    return value


def _dynamic_k(value, k_max: int) -> tuple[tuple[int, int, int], ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(row, list) and len(row) == 3 for row in value):
        raise SpecConfigError("speculative-config: dynamic_k must be a list of [min_batch, max_batch, K] rows")
    rows = []
    for lo, hi, k in value:
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (lo, hi, k)):
            raise SpecConfigError("speculative-config: dynamic_k entries must be integers")
        if not 1 <= lo <= hi or not 0 <= k <= k_max:
            raise SpecConfigError(f"speculative-config: dynamic_k row {[lo, hi, k]} needs 1 <= min_batch <= "
                                  f"max_batch and 0 <= K <= num_speculative_tokens ({k_max})")
        rows.append((lo, hi, k))
    rows.sort()
    for (_, hi, _), (lo, _, _) in zip(rows, rows[1:]):
        if lo <= hi:
            raise SpecConfigError("speculative-config: dynamic_k rows overlap")
    return tuple(rows)


def parse_spec_config(text: str | dict | None) -> SpecConfig | None:
    """The flag's JSON (or an already-decoded dict) -> SpecConfig; None/empty: speculation off."""
    if text is None or text == "" or text == {}:
        return None
    if isinstance(text, str):
        try:
            cfg = json.loads(text)
        except ValueError as exc:
            raise SpecConfigError(f"speculative-config is not valid JSON: {exc}") from None
    else:
        cfg = text
    if not isinstance(cfg, dict):
        raise SpecConfigError("speculative-config must be a JSON object")
    unknown = sorted(set(cfg) - _KNOWN)
    if unknown:
        raise SpecConfigError(f"speculative-config: unknown field(s) {', '.join(unknown)}; "
                              f"known: {', '.join(sorted(_KNOWN))}")
    method = cfg.get("method")
    if method not in METHODS:
        raise SpecConfigError(f"speculative-config: method must be one of {', '.join(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in cfg:
        raise SpecConfigError("speculative-config: num_speculative_tokens is required")
    k = _int(cfg, "num_speculative_tokens", 0, 1, MAX_SPEC_TOKENS)
    lo = _int(cfg, "prompt_lookup_min", 2, 1, 64)
    hi = _int(cfg, "prompt_lookup_max", max(5, lo), 1, 64)
    if lo > hi:
        raise SpecConfigError(f"speculative-config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
    min_prob = cfg.get("suffix_min_prob", 0.1)
    if isinstance(min_prob, bool) or not isinstance(min_prob, (int, float)) or not 0 <= min_prob <= 1:
        raise SpecConfigError(f"speculative-config: suffix_min_prob must be a number in [0, 1], got {min_prob!r}")
    model = cfg.get("model")
    if method == "draft_model":
        if not isinstance(model, str) or not model:
            raise SpecConfigError("speculative-config: method draft_model needs model (the draft model's directory)")
        if not os.path.isdir(model):
            raise SpecConfigError(f"speculative-config: draft model directory {model} does not exist")
    elif model is not None:
        raise SpecConfigError(f"speculative-config: model is only for method draft_model, not {method}")
    return SpecConfig(method=method, num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                      model=model, dynamic_k=_dynamic_k(cfg.get("dynamic_k"), k),
                      suffix_max_depth=_int(cfg, "suffix_max_depth", 8, 1, 64),
                      suffix_min_prob=float(min_prob),
                      suffix_cache_outputs=_int(cfg, "suffix_cache_outputs", 256, 0, 100_000),
                      disable_by_batch_size=_int(cfg, "disable_by_batch_size", 0, 0, 1 << 20))


def check_draft_tokenizer(target_dir: str, draft_dir: str) -> None:
    """The draft model must share the target's tokenizer: the same vocabulary, token for token
    (compared on tokenizer.json's model.vocab and added tokens), else SpecConfigError."""
    def vocab(d: str) -> tuple[dict, list]:
        path = os.path.join(d, "tokenizer.json")
        try:
            with open(path, encoding="utf-8") as f:
                tok = json.load(f)
        except (OSError, ValueError) as exc:
            raise SpecConfigError(f"speculative-config: cannot read {path}: {exc}") from None
        added = sorted((a.get("id"), a.get("content")) for a in tok.get("added_tokens", []))
        return tok.get("model", {}).get("vocab", {}), added
    t_vocab, t_added = vocab(target_dir)
    d_vocab, d_added = vocab(draft_dir)
    if t_vocab != d_vocab or t_added != d_added:
        raise SpecConfigError(f"speculative-config: the draft model {draft_dir} does not share the target's "
                              f"tokenizer ({len(d_vocab)} vs {len(t_vocab)} tokens, or different ids)")


def _config_json(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise SpecConfigError(f"speculative-config: cannot read {path}: {exc}") from None
    return cfg.get("text_config", cfg) if isinstance(cfg, dict) else {}


def check_draft_model(target_dir: str, draft_dir: str) -> None:
    """The draft model shares the target's tokenizer and its vocabulary fits in the target's
    (embedding rows may be padded differently; ids past the target's would be proposals it
    cannot verify), else SpecConfigError."""
    check_draft_tokenizer(target_dir, draft_dir)
    t_vocab, d_vocab = _config_json(target_dir).get("vocab_size"), _config_json(draft_dir).get("vocab_size")
    if not isinstance(d_vocab, int) or not isinstance(t_vocab, int) or d_vocab > t_vocab:
        raise SpecConfigError(f"speculative-config: the draft model {draft_dir} has a vocabulary of {d_vocab} ids, "
                              f"the target {t_vocab}: the draft's must fit inside the target's")


def check_served(text: str | None, tensor_parallel_size: int = 1, model_dir: str | None = None) -> SpecConfig | None:
    """parse_spec_config plus what this release serves (a draft model must match the target; with
    tensor parallel rank 0 proposes for every rank, and a draft model runs whole on rank 0).
    SpecConfigError (a ValueError) says what is not served."""
    cfg = parse_spec_config(text)
    if cfg is None:
        return None
    if cfg.method == "draft_model" and model_dir:
        check_draft_model(model_dir, cfg.model)
    return cfg
