"""text <-> token ids for one HF-format model dir, with HF `tokenizers` (no transformers).

Reads `tokenizer.json` (required), `tokenizer_config.json` (chat_template, special tokens,
add_bos_token), `chat_template.jinja` (transformers v5 writes the template there),
`generation_config.json` (eos ids, int or list) and `config.json` (context length).
Pure: no gRPC, no threads; the server wraps it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import tokenizers

from services.tokenizer.chat_template import (ChatTemplate, ChatTemplateError, MessageLimits,
                                              RenderLimits)

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_INT32_MAX = 2**31 - 1
# tokenizer_config.json fields that are not shown by tokenizer_config(): local file paths (as
# vLLM drops them) and the template (shown on its own).
_HIDDEN_CONFIG_KEYS = ("vocab_file", "merges_file", "tokenizer_file", "chat_template")


class TokenizerLoadError(RuntimeError):
    """The model dir cannot be served (missing or malformed files)."""


@dataclass(frozen=True)
class TokenizerInfo:
    vocab_size: int
    bos_token_id: int                 # -1 if none
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    model_max_length: int             # 0 if unknown


class TokenizerCore:
    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: ChatTemplate | None,
                 special_tokens: dict[str, str], eos_token_ids: Sequence[int],
                 model_max_length: int, add_bos_token: bool | None = None,
                 tokenizer_config: dict[str, Any] | None = None) -> None:
        # Padding/truncation in tokenizer.json (e.g. MiniLM's 512) would silently cut prompts;
        # length limits are the gateway's job, with a clear error.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens = dict(special_tokens)
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        bos = special_tokens.get("bos_token")
        bos_id = tokenizer.token_to_id(bos) if bos else None
        self.bos_token_id = -1 if bos_id is None else bos_id
        self.eos_token_ids = tuple(eos_token_ids)
        self.model_max_length = model_max_length
        self._config_file = dict(tokenizer_config or {})   # tokenizer_config.json as read
        self._prepend_bos, self._strip_bos = self._bos_fixups(add_bos_token)

    # -- loading ------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, *, chat_template_path: str | Path | None = None,
                 render_limits: RenderLimits = RenderLimits(),
                 message_limits: MessageLimits = MessageLimits()) -> "TokenizerCore":
        root = Path(path)
        tokenizer_file = root / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{tokenizer_file} not found")
        try:
            tokenizer = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as e:
            raise TokenizerLoadError(f"cannot load {tokenizer_file}: {e}") from None
        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")

        special = {}
        for key in _SPECIAL_TOKEN_KEYS:
            value = _token_content(tok_cfg.get(key))
            if value is not None:
                special[key] = value

        source = _template_source(root, tok_cfg, chat_template_path)
        template = None
        if source is not None:
            try:
                template = ChatTemplate(source, special, render_limits, message_limits)
            except ChatTemplateError as e:
                raise TokenizerLoadError(str(e)) from None

        eos_ids: list[int] = []
        eos_tok = special.get("eos_token")
        if eos_tok is not None and tokenizer.token_to_id(eos_tok) is not None:
            eos_ids.append(tokenizer.token_to_id(eos_tok))
        for cfg in (gen_cfg, model_cfg):
            for token_id in _as_int_list(cfg.get("eos_token_id")):
                if token_id not in eos_ids:
                    eos_ids.append(token_id)
            if eos_ids:  # config.json only when nothing else named an eos
                break

        add_bos = tok_cfg.get("add_bos_token")
        return cls(tokenizer, chat_template=template, special_tokens=special,
                   eos_token_ids=eos_ids, model_max_length=_context_length(model_cfg, tok_cfg),
                   add_bos_token=add_bos if isinstance(add_bos, bool) else None,
                   tokenizer_config=tok_cfg)

    # -- requests -------------------------------------------------------------------------
    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids per text. Releases the GIL inside `tokenizers` (safe to run in a thread)."""
        if not texts:
            return []
        encodings = self.tokenizer.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
        results = [e.ids for e in encodings]
        if add_special_tokens and self._prepend_bos:
            results = [ids if ids[:1] == [self.bos_token_id] else [self.bos_token_id, *ids]
                       for ids in results]
        elif add_special_tokens and self._strip_bos:
            results = [ids[1:] if ids[:1] == [self.bos_token_id] else ids for ids in results]
        return results

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                            continue_final_message: bool = False,
                            tools: list[dict[str, Any]] | None = None,
                            extra: dict[str, Any] | None = None) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(
                "this model has no chat template; start the tokenizer with --chat-template FILE")
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         tools=tools, extra=extra)

    def token_strings(self, ids: Sequence[int]) -> dict[int, str]:
        """decode([id]) per id, as vLLM shows logprob tokens (a lone byte of a multi-byte
        character decodes to U+FFFD)."""
        vocab = self.vocab_size
        return {i: self.tokenizer.decode([i], skip_special_tokens=False)
                for i in dict.fromkeys(ids) if 0 <= i < vocab}

    def ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary's string of each id (transformers' convert_ids_to_tokens: byte-level
        pieces such as "Ġis" or "ĠðŁ", never U+FFFD); ids must be in the vocabulary."""
        return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def tokenizer_config(self) -> tuple[str, str, dict[str, Any]]:
        """(tokenizer class, chat template source, tokenizer_config.json without file paths)
        for vLLM's /tokenizer_info. The class is the one transformers' AutoTokenizer loads for
        this directory: tokenizer.json makes it the "Fast" variant of the named class."""
        config = {k: v for k, v in self._config_file.items() if k not in _HIDDEN_CONFIG_KEYS}
        if "added_tokens_decoder" not in config:   # transformers fills it in from tokenizer.json
            config["added_tokens_decoder"] = {
                str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized,
                         "rstrip": t.rstrip, "single_word": t.single_word, "special": t.special}
                for i, t in sorted(self.tokenizer.get_added_tokens_decoder().items())}
        named = config.get("tokenizer_class")
        if isinstance(named, str) and named:
            cls = named if named.endswith("Fast") else f"{named}Fast"
        else:
            cls = "PreTrainedTokenizerFast"
        template = self.chat_template.source if self.chat_template is not None else ""
        return cls, template, config

    def info(self) -> TokenizerInfo:
        return TokenizerInfo(vocab_size=self.vocab_size, bos_token_id=self.bos_token_id,
                             eos_token_ids=self.eos_token_ids,
                             has_chat_template=self.chat_template is not None,
                             model_max_length=self.model_max_length)

    # -- helpers ----------------------------------------------------------------------------
    def _bos_fixups(self, add_bos_token: bool | None) -> tuple[bool, bool]:
        """tokenizer_config's add_bos_token overrides tokenizer.json's post-processor, as
        transformers' Llama tokenizers do: (prepend bos, strip bos)."""
        if add_bos_token is None or self.bos_token_id < 0:
            return False, False
        with_special = self.tokenizer.encode("a", add_special_tokens=True).ids
        adds_bos = with_special[:1] == [self.bos_token_id]
        return (add_bos_token and not adds_bos), (not add_bos_token and adds_bos)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} is not a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    # tokenizer_config stores special tokens as strings or as serialized AddedToken dicts.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _template_source(root: Path, tok_cfg: dict[str, Any],
                     override: str | Path | None) -> str | None:
    if override is not None:
        try:
            return Path(override).read_text(encoding="utf-8")
        except OSError as e:
            raise TokenizerLoadError(f"cannot read chat template {override}: {e}") from None
    source = tok_cfg.get("chat_template")
    if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source.strip():
        return source
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return None


def _as_int_list(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _context_length(model_cfg: dict[str, Any], tok_cfg: dict[str, Any]) -> int:
    for key in _CONTEXT_KEYS:
        value = model_cfg.get(key)
        if isinstance(value, int) and 0 < value <= _INT32_MAX:
            return value
    value = tok_cfg.get("model_max_length")
    # transformers writes 1e30 for "unbounded"
    if isinstance(value, (int, float)) and 0 < value <= _INT32_MAX:
        return int(value)
    return 0
