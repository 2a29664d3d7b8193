"""The worker's StepProfiler on a CUDA device: a capture with the default activities records
both the `meshllm.step` ranges and the CUDA kernels the steps launched."""
from __future__ import annotations

import json
import time

import torch

from services.common import pb
from services.worker.profiling import STEP_RANGE, StepProfiler

C = pb.control


def test_gpu_capture_records_steps_and_cuda_kernels(tmp_path):
    prof = StepProfiler(str(tmp_path), "cuda")
    req = C.StartProfileRequest(capture_id="gpu1", output_dir=str(tmp_path / "gpu1"))
    req.bounds.max_steps = 5
    started = prof.request_start(req)
    assert list(started.activities) == [C.PROFILE_ACTIVITY_CPU, C.PROFILE_ACTIVITY_CUDA]
    x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)

    def step():
        y = torch.relu(x @ x)
        torch.cuda.synchronize()   # a worker step ends by reading the sampled ids back
        return y

    deadline = time.monotonic() + 120
    while prof.snapshot().state not in (C.CAPTURE_STATE_DONE, C.CAPTURE_STATE_FAILED):
        assert time.monotonic() < deadline, prof.snapshot()
        prof.run_step(step)
        time.sleep(0.005)
    done = prof.snapshot()
    assert done.state == C.CAPTURE_STATE_DONE, done.error
    assert done.steps_captured == 5 and done.stop_reason == "max_steps"
    with open(done.trace_path) as f:
        events = json.load(f)["traceEvents"]
    steps = [e for e in events if e.get("name") == STEP_RANGE]
    # Each step range appears on the CPU timeline and, projected, on the GPU's.
    assert sum(e.get("cat") == "user_annotation" for e in steps) == 5
    assert sum(e.get("cat") == "gpu_user_annotation" for e in steps) == 5
    kernels = [e for e in events if e.get("cat") == "kernel"]
    assert len(kernels) >= 5, sorted({e.get("cat") for e in events})
