"""`meshllm bench`: load-test an OpenAI-compatible or meshllm gRPC endpoint (like `vllm bench serve`)."""
