"""vLLM flags that no longer exist, and what replaced them (checked before argparse)."""
from __future__ import annotations

LEGACY_FLAGS: dict[str, str] = {
    "--use-v2-block-manager": "the V2 block manager is the only one (vLLM removed this flag too); drop it",
    "--num-lookahead-slots": "lookahead slots belonged to the V0 engine; speculative decoding settings replace it",
    "--swap-space": "preemption is by recompute; there is no CPU swap space to size",
    "--preemption-mode": "preemption is always by recompute",
    "--disable-async-output-proc": "output processing is always overlapped; use --no-async-scheduling to compare",
    "--engine-use-ray": "engines run as meshllm services; scale with --data-parallel-size",
    "--worker-use-ray": "workers run as meshllm services; use --tensor-parallel-size",
    "--tokenizer-pool-size": "tokenization runs in the tokenizer service; run more tokenizer replicas instead",
    "--tokenizer-pool-type": "tokenization runs in the tokenizer service; run more tokenizer replicas instead",
    "--tokenizer-pool-extra-config": "tokenization runs in the tokenizer service; run more tokenizer replicas instead",
    "--max-seq-len-to-capture": "CUDA graphs are captured for decode batch sizes; the sequence-length cap is gone",
    "--enable-lora-bias": "LoRA is not supported by meshllm yet",
}


def check_legacy_flags(argv: list[str]) -> str | None:
    """A message naming the first removed flag in `argv` and its replacement, or None."""
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag in LEGACY_FLAGS:
            return f"{flag} no longer exists: {LEGACY_FLAGS[flag]}"
    return None
