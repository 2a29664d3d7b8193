"""The KV tier's namespace of one engine rank (docs/kvstore.md): everything that makes its KV bytes
comparable with another engine's, so that only engines whose blocks are interchangeable share them.

    ns = engine_namespace(model_dir, served_model_name, dtype="bfloat16", kv_cache_dtype="bfloat16",
                          block_size=16, num_layers=32, tp_size=1, tp_rank=0,
                          block_bytes=2 << 20, layout="L2BHD")

The weights fingerprint reads no weights in bulk: it hashes config.json, every safetensors file's
name, size and header (names, dtypes, shapes, offsets) and the first 4 KiB of every tensor, so two
checkpoints of one architecture (a fine-tune, a merged adapter) differ as soon as any tensor's
first bytes do, at a cost of a few MB of reads for an 8B model."""
from __future__ import annotations

import hashlib
import json
import os
import struct

from services.common.kv_blocks import check_namespace, kv_pb2

_SAMPLE_BYTES = 4096
_MAX_HEADER_BYTES = 100 << 20   # safetensors' own bound


def weights_fingerprint(model_dir: str) -> str:
    """A hex digest of the checkpoint in `model_dir` (see the module docstring)."""
    h = hashlib.blake2b(digest_size=16, person=b"meshllm-weights1")
    config = os.path.join(model_dir, "config.json")
    if os.path.isfile(config):
        with open(config, "rb") as f:
            h.update(b"config.json\0" + f.read())
    files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no .safetensors files to fingerprint")
    for name in files:
        path = os.path.join(model_dir, name)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            (header_len,) = struct.unpack("<Q", f.read(8))
            if not 0 < header_len <= min(_MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"{path}: not a safetensors file")
            header = f.read(header_len)
            h.update(f"{name}\0{size}\0".encode() + header)
            tensors = json.loads(header)
            starts = sorted(v["data_offsets"][0] for k, v in tensors.items() if k != "__metadata__")
            for start in starts:
                f.seek(8 + header_len + start)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


def engine_namespace(model_dir: str, model_id: str, *, dtype: str, kv_cache_dtype: str, block_size: int,
                     num_layers: int, tp_size: int, tp_rank: int, block_bytes: int, layout: str,
                     fingerprint: str | None = None) -> "kv_pb2.KvNamespace":
    """The validated namespace of one engine rank (ValueError if it cannot name comparable bytes).
    `fingerprint`: a precomputed weights_fingerprint(model_dir), e.g. shared by a rank's callers."""
    ns = kv_pb2.KvNamespace(model_id=model_id, weights_fingerprint=fingerprint or weights_fingerprint(model_dir),
                            dtype=dtype, kv_cache_dtype=kv_cache_dtype, block_size=block_size,
                            num_layers=num_layers, tp_size=tp_size, tp_rank=tp_rank, block_bytes=block_bytes,
                            layout=layout)
    check_namespace(ns)
    return ns
