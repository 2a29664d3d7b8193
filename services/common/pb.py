"""One import point for the generated protobuf and gRPC modules."""
import services  # noqa: F401  (puts the generated code on sys.path)

from meshllm.v1 import common_pb2 as common  # noqa: E402
from meshllm.v1 import control_pb2 as control  # noqa: E402
from meshllm.v1 import control_pb2_grpc as control_grpc  # noqa: E402
from meshllm.v1 import embed_pb2 as embed  # noqa: E402
from meshllm.v1 import embed_pb2_grpc as embed_grpc  # noqa: E402
from meshllm.v1 import engine_pb2 as engine  # noqa: E402
from meshllm.v1 import engine_pb2_grpc as engine_grpc  # noqa: E402
from meshllm.v1 import generation_pb2 as generation  # noqa: E402
from meshllm.v1 import generation_pb2_grpc as generation_grpc  # noqa: E402
from meshllm.v1 import health_pb2 as health  # noqa: E402
from meshllm.v1 import health_pb2_grpc as health_grpc  # noqa: E402
from meshllm.v1 import step_pb2 as step  # noqa: E402
from meshllm.v1 import supervisor_pb2 as supervisor  # noqa: E402
from meshllm.v1 import supervisor_pb2_grpc as supervisor_grpc  # noqa: E402
from meshllm.v1 import tokenizer_pb2 as tokenizer  # noqa: E402
from meshllm.v1 import tokenizer_pb2_grpc as tokenizer_grpc  # noqa: E402

__all__ = ["common", "control", "control_grpc", "embed", "embed_grpc", "engine", "engine_grpc", "generation", "generation_grpc", "health",
           "health_grpc", "step", "supervisor", "supervisor_grpc", "tokenizer", "tokenizer_grpc"]
