"""meshllm worker: model weights and the paged KV cache on one device; StepPlan -> StepResult."""
