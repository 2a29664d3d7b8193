"""The gateway's grpc/ room: the public gRPC API (meshllm.v1.Generation)."""
