"""Waiting queues for the two scheduling policies: FCFS and priority."""
from __future__ import annotations

import heapq
from collections import deque

from services.scheduler.core.request import Request, RequestStatus


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def __len__(self) -> int:
        return len(self._q)

    def add(self, req: Request) -> None:
        self._q.append(req)

    def requeue(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __iter__(self):
        return iter(self._q)


class PriorityQueue:
    """Lowest `priority` value first, then arrival order (vLLM's convention)."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._members: set[int] = set()   # ids of the Request objects currently queued

    def __len__(self) -> int:
        return len(self._members)

    def add(self, req: Request) -> None:
        heapq.heappush(self._heap, (req.priority, req.arrival_seq, req))
        self._members.add(id(req))

    requeue = add

    def _prune(self) -> None:
        # Entries of removed requests are dropped lazily when they reach the top.
        while self._heap and id(self._heap[0][2]) not in self._members:
            heapq.heappop(self._heap)

    def peek(self) -> Request:
        self._prune()
        return self._heap[0][2]

    def pop(self) -> Request:
        self._prune()
        req = heapq.heappop(self._heap)[2]
        self._members.discard(id(req))
        return req

    def remove(self, req: Request) -> None:
        self._members.discard(id(req))

    def __iter__(self):
        return (r for _, _, r in sorted(self._heap, key=lambda e: e[:2])
                if id(r) in self._members and r.status is RequestStatus.WAITING)


def make_waiting_queue(policy: str):
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r} (fcfs or priority)")
