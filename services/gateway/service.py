"""The request lifecycle shared by the HTTP and gRPC APIs: model check, the sampling rules
that need no prompt (check_sampling), tokenization, the rules that need it and max_tokens
resolved (start_n, once per request), admission, submission."""
from __future__ import annotations

import asyncio
from collections.abc import Sequence

from services.common import pb
from services.common import structured
from services.common.sampling_rules import SamplingRuleError
from services.gateway.guard.admission import Admission
from services.gateway.config import GatewayConfig
from services.gateway.embeddings import Embeddings
from services.gateway.clients.request_handle import RequestHandle
from services.gateway.clients.engine_pool import EnginePool
from services.gateway.errors import ApiError, invalid
from services.common.sampling_rules import Limits, RequestOptions
from services.gateway.guard.sampling import check_request, engine_limits, fit_to_prompt
from services.gateway.clients.tokenizer_pool import TokenizerPool

# An output constraint this big is validated on a thread: a ~57 KB JSON schema takes ~17 ms of
# llguidance (which releases the GIL), a typical one (< 1 KB) ~0.4 ms, less than a thread hop.
STRUCTURED_INLINE_BYTES = 8 * 1024


def _constraint_bytes(so: "pb.common.StructuredOutput") -> int:
    kind = structured.kind_of(so)
    if kind == "choice":
        return sum(len(c) for c in so.choice.choices)
    return len(getattr(so, kind)) if kind in ("json_schema", "regex", "grammar") else 0


class Gateway:
    def __init__(self, config: GatewayConfig, tokenizer: TokenizerPool,
                 engine: EnginePool, embeddings: Embeddings | None = None) -> None:
        self.config, self.tokenizer, self.engine = config, tokenizer, engine
        # /v1/embeddings and gRPC Embed; without an embedder they answer 404.
        self.embeddings = embeddings or Embeddings(None, config.served_model_name)
        self.tokenizer_ready = False  # kept up to date by main's readiness monitor
        self.admission = Admission(config.max_inflight_requests, config.max_inflight_tokens)

    @property
    def ready(self) -> bool:
        return self.tokenizer_ready and self.engine.connected and self.engine.info is not None

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.info.max_model_len if self.engine.info is not None else 0

    def limits(self) -> Limits:
        return engine_limits(self.engine.info, self.config)

    async def check_sampling(self, sampling: "pb.common.SamplingParams", options: RequestOptions,
                             structured_param: str = structured.PARAM) -> None:
        """The sampling rules that need no prompt, once per request and before it is
        tokenized (no tokenizer work for a request that will be refused); then the output
        constraint, if any, by the grammar engine (its refusals name `structured_param`: the
        field the client wrote it in)."""
        check_request(sampling, options, self.limits())
        if not sampling.HasField("structured"):
            return
        so = sampling.structured
        try:
            if _constraint_bytes(so) <= STRUCTURED_INLINE_BYTES:
                structured.check(so)
            else:
                await asyncio.to_thread(structured.check, so)
        except SamplingRuleError as err:
            raise invalid(err.message, structured_param) from None

    def check_model(self, model: str | None) -> None:
        if model and model != self.config.served_model_name:
            raise ApiError("not_found", f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    async def tokenize_text(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not text:
            raise ApiError("invalid_argument", "the prompt is empty", param="prompt")
        return await self.tokenizer.encode(text, add_special_tokens)

    async def tokenize_chat(self, messages: Sequence["pb.common.ChatMessage"],
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, *, tools_json: str = "",
                            chat_template_kwargs_json: str = "") -> list[int]:
        if not messages:
            raise ApiError("invalid_argument", "messages must not be empty", param="messages")
        return await self.tokenizer.apply_chat_template(
            messages, add_generation_prompt, continue_final_message, tools_json=tools_json,
            chat_template_kwargs_json=chat_template_kwargs_json)

    def start_n(self, request_id: str, prompt_ids: Sequence[int],
                sampling: "pb.common.SamplingParams", n: int, *, prompt_param: str = "prompt",
                cache_salt: str = "", priority: int = 0) -> list[RequestHandle]:
        """n independent engine requests `<id>-<i>` (just `<id>` when n == 1). `sampling`, `n`,
        `cache_salt` and `priority` have passed check_sampling; the rules that need the prompt
        run here, once for all n choices, and resolve max_tokens. A seeded request gives
        choice i the seed seed+i: distinct choices, reproducible as a set."""
        fitted = fit_to_prompt(sampling, prompt_ids, self.limits(), prompt_param)
        if n == 1:
            return [self._submit(request_id, prompt_ids, fitted, cache_salt, priority)]
        handles: list[RequestHandle] = []
        try:
            for i in range(n):
                sp = pb.common.SamplingParams()
                sp.CopyFrom(fitted)
                if fitted.HasField("seed"):
                    sp.seed = (fitted.seed + i + 2 ** 63) % 2 ** 64 - 2 ** 63
                handles.append(self._submit(f"{request_id}-{i}", prompt_ids, sp, cache_salt,
                                            priority))
        except BaseException:
            for handle in handles:
                handle.abort()
            raise
        return handles

    def _submit(self, request_id: str, prompt_ids: Sequence[int],
                sampling: "pb.common.SamplingParams", cache_salt: str,
                priority: int) -> RequestHandle:
        """Admit one choice (its prompt + max_tokens against the in-flight budget) and send
        it; `sampling` is the rulebook's result and is not checked again."""
        tokens = len(prompt_ids) + sampling.max_tokens
        self.admission.check(1, tokens)
        handle = self.engine.submit(request_id, list(prompt_ids), sampling,
                                    cache_salt=cache_salt, priority=priority)
        self.admission.hold(request_id, tokens, lambda: not handle.finished)
        return handle
