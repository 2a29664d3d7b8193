"""The embedder service: a BERT-style encoder (all-MiniLM-L6-v2 by default) serving
meshllm.v1.Embedder for the gateway's /v1/embeddings and gRPC Embed."""
