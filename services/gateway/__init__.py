"""The gateway: OpenAI-compatible HTTP API and the public gRPC API over the mesh."""
