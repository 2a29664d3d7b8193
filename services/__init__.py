"""meshllm services. Importing this package makes the generated protobuf modules
(`meshllm.v1.*_pb2`, written by scripts/gen_protos.py into services/common/gen/)
importable."""
import pathlib as _pathlib
import sys as _sys

_GEN = str(_pathlib.Path(__file__).resolve().parent / "common" / "gen")
if _GEN not in _sys.path:
    _sys.path.insert(0, _GEN)
