"""Which engine replica gets a request: least outstanding tokens, with prefix affinity.

A pure state machine (no I/O, no clocks, no threads): the engine pool passes in the
replicas that may take work right now with their loads, and gets back a replica id.

The rule, in order:
1. Candidates are the replicas the pool calls routable (READY, stream connected) minus the
   ones this request already failed on. None left: no replica (the caller answers 503).
2. The least-loaded candidate has the fewest outstanding tokens: for every request in flight
   there, prompt tokens + max_tokens - tokens already generated. Ties go to the replica that
   was sent the fewest requests so far (so sequential traffic alternates), then to the id.
3. Prefix affinity: the prompt's first full KV blocks (up to `max_affinity_blocks`) are
   hashed block by block, each hash chained on the one before, as the scheduler's prefix
   cache keys them. The longest of those hashes that the affinity table maps to a candidate
   names the affine replica: the one most recently sent that prefix, so its blocks are
   likely still cached there. It wins unless it is much busier than the least-loaded one:
   load(affine) > busy_ratio * load(least) + busy_slack_tokens.
4. Every prefix hash of the prompt then maps to the chosen replica (the table is an LRU of
   at most `max_entries` hashes), so a prefix that overflowed to a second replica is found
   there next time too.
A prompt shorter than one block has no affinity and goes to the least-loaded replica.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    replica_id: str
    outstanding_tokens: int   # prompt + max_tokens - generated, summed over requests in flight


@dataclass(frozen=True)
class RouteDecision:
    replica_id: str
    reason: str               # "affinity" | "least_loaded" | "affinity_busy" (affine too busy)


@dataclass
class RouterConfig:
    block_size: int = 16
    max_affinity_blocks: int = 8       # hash at most this many leading blocks
    busy_ratio: float = 1.5
    busy_slack_tokens: int = 2048
    max_entries: int = 65536           # bounds the affinity table

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_affinity_blocks < 1 or self.max_entries < 1:
            raise ValueError("router block size, affinity blocks and table size must be positive")
        if self.busy_ratio < 1 or self.busy_slack_tokens < 0:
            raise ValueError("router busy_ratio must be >= 1 and busy_slack_tokens >= 0")


class Router:
    def __init__(self, config: RouterConfig | None = None) -> None:
        self.config = config or RouterConfig()
        self._affinity: OrderedDict[int, str] = OrderedDict()  # prefix hash -> replica id
        self._routed: dict[str, int] = {}                     # replica id -> requests sent

    def prefix_hashes(self, prompt_ids: Sequence[int]) -> list[int]:
        """One chained hash per leading full block, shortest prefix first."""
        bs = self.config.block_size
        n_blocks = min(len(prompt_ids) // bs, self.config.max_affinity_blocks)
        hashes, h = [], 0
        for b in range(n_blocks):
            h = hash((h, tuple(prompt_ids[b * bs:(b + 1) * bs])))
            hashes.append(h)
        return hashes

    def choose(self, replicas: Sequence[ReplicaLoad], prompt_ids: Sequence[int],
               exclude: Iterable[str] = ()) -> RouteDecision | None:
        excluded = set(exclude)
        loads = {r.replica_id: r.outstanding_tokens for r in replicas
                 if r.replica_id not in excluded}
        if not loads:
            return None
        routed = self._routed
        least = min(loads, key=lambda rid: (loads[rid], routed.get(rid, 0), rid))
        hashes = self.prefix_hashes(prompt_ids)
        affine = next((self._affinity[h] for h in reversed(hashes)
                       if self._affinity.get(h) in loads), None)
        if affine is None:
            decision = RouteDecision(least, "least_loaded")
        elif loads[affine] <= self.config.busy_ratio * loads[least] + self.config.busy_slack_tokens:
            decision = RouteDecision(affine, "affinity")
        else:
            decision = RouteDecision(least, "affinity_busy")
        self._record(hashes, decision.replica_id)
        routed[decision.replica_id] = routed.get(decision.replica_id, 0) + 1
        return decision

    def forget_replica(self, replica_id: str) -> None:
        """The replica restarted or left: its cache is gone, so is its affinity."""
        self._routed.pop(replica_id, None)
        stale = [h for h, rid in self._affinity.items() if rid == replica_id]
        for h in stale:
            del self._affinity[h]

    @property
    def num_affinity_entries(self) -> int:
        return len(self._affinity)

    def _record(self, hashes: list[int], replica_id: str) -> None:
        table = self._affinity
        for h in hashes:
            table[h] = replica_id
            table.move_to_end(h)
        while len(table) > self.config.max_entries:
            table.popitem(last=False)
