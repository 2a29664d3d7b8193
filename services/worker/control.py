"""WorkerControl (control.proto) on the worker's gRPC port: profiling commands.

The real worker hands them to its StepProfiler (services/worker/profiling.py). The simulated
worker has no model and no torch, so it has nothing worth profiling: it serves the same
service but answers StartProfile with FAILED_PRECONDITION (and an IDLE status otherwise),
so a capture aimed at it fails with a clear reason instead of hanging."""
from __future__ import annotations

import grpc

from services.common import pb
from services.common.profiling import ProfileRequestError

SERVICE_NAME = "meshllm.v1.WorkerControl"


class WorkerControlServicer(pb.control_grpc.WorkerControlServicer):
    def __init__(self, profiler=None, refusal: str = "") -> None:
        """`profiler`: a StepProfiler; None with `refusal`: every StartProfile is refused."""
        self._profiler = profiler
        self._refusal = refusal
        # Direct KV hand-offs (kv_export.py): rank -> KvExport (LookupError: no such rank), set
        # once the runner holds an exported cache (a tensor-parallel worker's rank 0 answers for all).
        self.kv_export = None

    async def ExportKv(self, request, context):
        describe = self.kv_export
        if describe is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this worker exports no KV cache (start it with --kv-export)")
        try:
            return describe(request.tp_rank)
        except LookupError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    async def StartProfile(self, request, context):
        if self._profiler is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, self._refusal)
        try:
            return self._profiler.request_start(request)
        except ProfileRequestError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    async def StopProfile(self, request, context):
        if self._profiler is None:
            return pb.control.WorkerProfileStatus(state=pb.control.CAPTURE_STATE_IDLE, device="simulated")
        try:
            return self._profiler.request_stop(request.capture_id)
        except ProfileRequestError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))

    async def ProfileStatus(self, request, context):
        if self._profiler is None:
            return pb.control.WorkerProfileStatus(state=pb.control.CAPTURE_STATE_IDLE, device="simulated")
        return self._profiler.snapshot()


def add_to_server(server: grpc.aio.Server, servicer: WorkerControlServicer) -> None:
    pb.control_grpc.add_WorkerControlServicer_to_server(servicer, server)
