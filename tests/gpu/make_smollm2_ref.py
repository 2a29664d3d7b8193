"""Write tests/gpu/data/smollm2_greedy_ref.json: prompts (token ids) and the fp32 CPU reference's
greedy continuations with top-2 logprobs. Run on the CPU machine:
  .venv/bin/python -m tests.gpu.make_smollm2_ref
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer

from services.models import prepare_model
from services.worker.models import load_model
from services.worker.runner import ModelRunner
from services.worker.wire import ProtoRunner
from tests.gpu.greedy_driver import greedy_with_top2

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "def fibonacci(n):",
    "Explain why the sky is blue.", "Once upon a time, in a small village,",
    "List three uses of a paperclip:", "The quick brown fox", "What is 17 times 23?",
    "Translate to French: I like apples.", "The mitochondria is", "import numpy as np\n",
    "Give me a recipe for pancakes.", "In 1969, the first humans", "Summarize the plot of Hamlet.",
    "The best way to learn programming is", "Q: What is the boiling point of water?\nA:",
]
MAX_NEW = 32
OUT = Path(__file__).parent / "data" / "smollm2_greedy_ref.json"


def main() -> None:
    model_dir = prepare_model("smollm2")
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    torch.set_num_threads(2)
    model = load_model(model_dir, "cpu", torch.float32, max_model_len=512)
    runner = ModelRunner(model, model_name="ref", kv_cache_bytes=0, num_kv_blocks=128, block_size=16)
    runner.hello(16)
    toks, top2 = greedy_with_top2(ProtoRunner(runner), prompts, MAX_NEW)
    OUT.write_text(json.dumps({"model": "SmolLM2-135M-Instruct (Q4_1 GGUF -> fp32)", "device": "cpu float32",
                               "max_new": MAX_NEW, "prompts": prompts, "tokens": toks, "top2": top2}))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
