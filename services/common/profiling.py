"""What the profiler service and the workers agree on: capture ids, bounds, the trace directory.

Kept torch-free so the profiler service and the simulated worker never import torch."""
from __future__ import annotations

import math
import os
import re
from pathlib import Path

# Hard caps on one capture: every event stays in the worker's memory until the capture
# stops, and a CPU trace grows fast (SmolLM2-135M at batch 8: ~1.6 MB per step).
MAX_CAPTURE_SECONDS = 300.0
MAX_CAPTURE_STEPS = 20_000
DEFAULT_CAPTURE_SECONDS = 10.0   # a Start that gives no bound at all

_CAPTURE_ID = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class ProfileRequestError(ValueError):
    """A refused start/stop; `code` is the grpc.StatusCode name to answer with."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


def default_profile_dir(environ: dict[str, str] | os._Environ | None = None) -> str:
    """$MESHLLM_CACHE/profiles, else ~/.cache/meshllm/profiles (call from main() only)."""
    env = os.environ if environ is None else environ
    root = env.get("MESHLLM_CACHE") or str(Path.home() / ".cache" / "meshllm")
    return str(Path(root) / "profiles")


def check_capture_id(capture_id: str) -> str:
    if not _CAPTURE_ID.fullmatch(capture_id or "") or capture_id in (".", ".."):
        raise ProfileRequestError("INVALID_ARGUMENT",
                                  "capture_id must be 1-64 characters of [A-Za-z0-9_.-]")
    return capture_id


def check_bounds(max_steps: int, max_seconds: float) -> tuple[int, float]:
    """Validated (max_steps, max_seconds); 0 means unset, and when both are unset the
    capture lasts DEFAULT_CAPTURE_SECONDS."""
    if max_steps < 0 or max_steps > MAX_CAPTURE_STEPS:
        raise ProfileRequestError("INVALID_ARGUMENT",
                                  f"max_steps must be in [0, {MAX_CAPTURE_STEPS}], got {max_steps}")
    if not (math.isfinite(max_seconds) and 0 <= max_seconds <= MAX_CAPTURE_SECONDS):
        raise ProfileRequestError("INVALID_ARGUMENT",
                                  f"max_seconds must be in [0, {MAX_CAPTURE_SECONDS:.0f}], got {max_seconds}")
    if not max_steps and not max_seconds:
        max_seconds = DEFAULT_CAPTURE_SECONDS
    return max_steps, max_seconds


def resolve_output_dir(output_dir: str, root: str) -> Path:
    """`output_dir` as a real path, refused unless it lies inside `root` (so a control call
    cannot make a worker write anywhere else on its host)."""
    if not root:
        raise ProfileRequestError("FAILED_PRECONDITION", "this worker was started without --profile-dir")
    if not output_dir or not os.path.isabs(output_dir):
        raise ProfileRequestError("INVALID_ARGUMENT", "output_dir must be an absolute path")
    real_root = Path(os.path.realpath(root))
    target = Path(os.path.realpath(output_dir))
    if target != real_root and real_root not in target.parents:
        raise ProfileRequestError("INVALID_ARGUMENT",
                                  f"output_dir must lie inside this worker's profile directory {root}")
    return target
