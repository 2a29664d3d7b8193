"""meshllm.v1.Supervisor over gRPC: the replica set, its changes, drain and undrain."""
from __future__ import annotations

import grpc

from services.common import pb
from services.supervisor.runner import Supervisor


class SupervisorServicer(pb.supervisor_grpc.SupervisorServicer):
    def __init__(self, sup: Supervisor) -> None:
        self.sup = sup

    async def ListReplicas(self, request, context):
        return self.sup.replica_set(request.kind)

    async def WatchReplicas(self, request, context):
        """The whole set now, then again after every change (a watcher never merges diffs)."""
        version = -1
        while not context.done():
            if self.sup.version != version:
                version = self.sup.version
                yield self.sup.replica_set(request.kind)
            await self.sup.wait_change(version)

    async def Drain(self, request, context):
        return await self.sup.set_draining(await self._find(request, context), True)

    async def Undrain(self, request, context):
        return await self.sup.set_draining(await self._find(request, context), False)

    async def _find(self, request, context):
        r = self.sup.find(request.replica_id)
        if r is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no replica {request.replica_id!r}")
        return r
