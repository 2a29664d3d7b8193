"""The scheduler's side of the scheduler <-> worker ZMQ link (DEALER -> worker ROUTER)."""
from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from services.common import pb
from services.common.zmq_curve import CurveClientKeys


class WorkerUnavailable(Exception):
    """The worker did not answer in time; its state must be assumed lost."""


class WorkerClient:
    def __init__(self, address: str, timeout_s: float, curve: CurveClientKeys | None = None) -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.curve = curve
        self._ctx = zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None

    def _connect(self) -> zmq.asyncio.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.curve is not None and self.curve.enabled:
                self.curve.secure(sock)  # before connect: the handshake uses these keys
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

    async def send_plan(self, request: pb.step.WorkerRequest) -> None:
        """Queue a plan; the worker runs plans strictly in order (several may be in flight)."""
        await self._connect().send(request.SerializeToString())

    async def recv_result(self) -> pb.step.StepResult:
        """The result of the oldest plan in flight."""
        try:
            frame = await asyncio.wait_for(self._connect().recv(), self.timeout_s)
        except asyncio.TimeoutError:
            self.reset()
            raise WorkerUnavailable(f"worker at {self.address} did not answer within {self.timeout_s:.0f}s") from None
        reply = pb.step.WorkerReply()
        reply.ParseFromString(frame)
        if not reply.HasField("result"):
            raise WorkerUnavailable("worker answered a plan without a StepResult")
        return reply.result

    def close(self) -> None:
        self.reset()
