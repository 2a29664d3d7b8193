"""meshllm worker: model weights and the paged KV cache on one device; StepPlan -> StepResult.

  main.py      flags -> WorkerConfig; picks the runner (real model, simulated, or a TP rank > 0)
  engine.py    the engine thread (ZMQ ROUTER, step pipelining, metrics, tracing) + serve()
  wire.py      step.proto <-> the worker's values (plan.py); the only protobuf the steps see
  load.py      the real model: weights -> ModelRunner on the engine thread, profiler, TP ranks
  runner.py    ModelRunner: per-request state, plan validation, forward + sampling
  gpu_exec.py  CUDA: persistent input buffers, Triton forward, decode CUDA graphs
  sampling.py  greedy / temperature / top-k / top-p / min-p, penalties, logit bias, seeds, logprobs
  simulated.py SimulatedRunner: the step contract without a model (no torch)
  tp.py, tp_ranks.py  tensor parallel: sharding; the ranks' processes and request fan-out
  models/      our own torch Llama-family model (config.json + safetensors), loader
  attention.py reference paged attention (KV write, batched decode, chunked prefill)
  bench.py     worker-only decode throughput (python -m services.worker.bench --model DIR)
"""
