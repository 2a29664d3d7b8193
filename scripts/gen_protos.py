"""Generate Python code for protos/meshllm/v1/*.proto into services/common/gen/.

The generated files are build output (git-ignored) and never edited by hand;
tests/unit/test_protos_fresh.py fails when they are older than their .proto sources.
"""
from __future__ import annotations

import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"
OUT = ROOT / "services" / "common" / "gen"


def generate(out: pathlib.Path = OUT) -> list[pathlib.Path]:
    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "meshllm" / "v1").glob("*.proto"))
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    include = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out}",
            f"--grpc_python_out={out}", f"--pyi_out={out}", *protos]
    rc = protoc.main(args)
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")
    return sorted(out.rglob("*_pb2*.py"))


if __name__ == "__main__":
    files = generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    print(f"generated {len(files)} files")
