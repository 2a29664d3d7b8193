"""The scheduler's side of the scheduler <-> worker ZMQ link (DEALER -> worker ROUTER)."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from services.common import pb


class WorkerUnavailable(Exception):
    """The worker did not answer in time; its state must be assumed lost."""


class WorkerClient:
    def __init__(self, address: str, timeout_s: float) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None

    def _connect(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(self.address)
            self._sock = sock
        return self._sock

    def reset(self) -> None:
        """Drop the socket so a late reply to a timed-out request can never be mistaken for a new one."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _call(self, request: pb.step.WorkerRequest, timeout_s: float) -> pb.step.WorkerReply:
        sock = self._connect()
        await sock.send(request.SerializeToString())
        try:
            frame = await asyncio.wait_for(sock.recv(), timeout_s)
        except asyncio.TimeoutError:
            self.reset()
            raise WorkerUnavailable(f"worker at {self.address} did not answer within {timeout_s:.0f}s") from None
        reply = pb.step.WorkerReply()
        reply.ParseFromString(frame)
        return reply

    async def hello(self, block_size: int, timeout_s: float = 5.0) -> pb.step.WorkerInfo:
        reply = await self._call(pb.step.WorkerRequest(hello=pb.step.WorkerHello(block_size=block_size)), timeout_s)
        if not reply.HasField("info"):
            raise WorkerUnavailable("worker answered hello without WorkerInfo")
        return reply.info

    async def step(self, request: pb.step.WorkerRequest) -> pb.step.StepResult:
        reply = await self._call(request, self.timeout_s)
        if not reply.HasField("result"):
            raise WorkerUnavailable("worker answered a plan without a StepResult")
        return reply.result

    def close(self) -> None:
        self.reset()
