"""meshllm worker: model weights and the paged KV cache on one device; StepPlan -> StepResult.

  models/      our own torch Llama-family model (config.json + safetensors), loader
  attention.py reference paged attention (KV write, batched decode, chunked prefill)
  sampling.py  greedy / temperature / top-k / top-p / min-p, penalties, logit bias, seeds, logprobs
  runner.py    ModelRunner: per-request state, plan validation, forward + sampling
  server.py    ZMQ ROUTER loop on an engine thread + grpc.health.v1 ("worker")
  bench.py     worker-only decode throughput (python -m services.worker.bench --model DIR)
"""
