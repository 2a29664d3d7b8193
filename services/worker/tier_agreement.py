"""How the ranks of a tensor-parallel worker agree on which KV tier jobs ended (docs/kv_tiers.md).

Every rank fetches (kvstore or a direct hand-off) and saves its own shard of the same blocks, on
its own background threads, so the same job ends at different times on different ranks, with
different counts (one rank's shard may be missing from the store). A block may count as loaded
only if EVERY rank loaded its shard of it: otherwise the ranks' KV differs and so do their
forwards. So a job's result is reported only once every rank's copy of it ended, with the
smallest count:

1. rank 0 proposes the jobs that ended on it and were not agreed yet (`propose`); the proposal
   travels with the next WorkerRequest it fans out (tp_ranks.TpLink), so every rank sees it at
   the same point of the same request;
2. each rank answers, per proposed job, its own count or -1 where the job has not ended there
   (`local_counts`); the answers meet in one all-reduce (MIN) over the ranks' gloo group;
3. a job whose minimum is >= 0 ended everywhere: it is reported with that minimum (`settle`) and
   forgotten on every rank; the others are proposed again with a later request.

Loads are matched across ranks by request id (the scheduler runs at most one fetch per request:
it stays LOADING until the fetch is reported), saves by request id and block count in the order
they ended (several save batches of one request may be in flight). Pure values: no torch, no
collectives (TpLink runs the all-reduce)."""
from __future__ import annotations

from collections.abc import Callable

from services.worker.plan import LoadResult, SaveResult

NOT_ENDED = -1


def _take_match(pending: list, key) -> object | None:
    """Remove and return the first pending result with this key (FIFO), or None."""
    for i, r in enumerate(pending):
        if _key(r) == key:
            return pending.pop(i)
    return None


def _key(r: LoadResult | SaveResult) -> tuple:
    return (r.request_id,) if isinstance(r, LoadResult) else (r.request_id, r.num_blocks)


def _count(r: LoadResult | SaveResult) -> int:
    return r.num_loaded if isinstance(r, LoadResult) else r.num_saved


class RankAgreement:
    """One rank's side. `take_local` drains the results its own tiers produced since the last call
    (kv_tiers.KvTiers: fetch results, save results); only agreed ones leave through take_*."""

    def __init__(self, take_local: Callable[[], tuple[list[LoadResult], list[SaveResult]]]) -> None:
        self._take_local = take_local
        self._loads: list[LoadResult] = []    # ended here, not agreed yet (oldest first)
        self._saves: list[SaveResult] = []
        self._agreed_loads: list[LoadResult] = []
        self._agreed_saves: list[SaveResult] = []

    def _pull(self) -> None:
        loads, saves = self._take_local()
        self._loads.extend(loads)
        self._saves.extend(saves)

    @property
    def pending(self) -> bool:
        """Jobs that ended here and wait for the other ranks."""
        return bool(self._loads or self._saves)

    @property
    def has_agreed(self) -> bool:
        return bool(self._agreed_loads or self._agreed_saves)

    # ---- rank 0 ----------------------------------------------------------------------------
    def propose(self) -> tuple[list[LoadResult], list[SaveResult]]:
        """Rank 0: every job that ended here and is not agreed yet (they stay pending until settled)."""
        self._pull()
        return list(self._loads), list(self._saves)

    # ---- every rank ------------------------------------------------------------------------
    def local_counts(self, loads: list[LoadResult], saves: list[SaveResult]) -> list[int]:
        """This rank's count for each proposed job (loads, then saves), NOT_ENDED where it has not
        ended here. Rank 0's own proposal answers with its own counts."""
        self._pull()
        out = []
        for proposed, pending in ((loads, self._loads), (saves, self._saves)):
            taken = []   # a key proposed twice (two saves of one request) matches two results
            for p in proposed:
                r = _take_match(pending, _key(p))
                taken.append(r)
                out.append(NOT_ENDED if r is None else _count(r))
            # Put them back in order: settle() removes those that were agreed.
            pending[:0] = [r for r in taken if r is not None]
        return out

    def settle(self, loads: list[LoadResult], saves: list[SaveResult], mins: list[int]) -> None:
        """The all-reduced minimum of every rank's local_counts: jobs that ended everywhere are
        reported with the count every rank reached, and forgotten here."""
        if len(mins) != len(loads) + len(saves):
            raise ValueError(f"{len(mins)} agreed counts for {len(loads) + len(saves)} proposed jobs")
        for p, n in zip(loads, mins[:len(loads)]):
            if n >= 0 and _take_match(self._loads, _key(p)) is not None:
                # Bytes are this rank's shard's, scaled to the blocks every rank holds.
                per_block = p.bytes // p.num_loaded if p.num_loaded else 0
                self._agreed_loads.append(LoadResult(p.request_id, n, p.num_requested, per_block * n,
                                                     p.duration_ns))
        for p, n in zip(saves, mins[len(loads):]):
            if n >= 0 and _take_match(self._saves, _key(p)) is not None:
                self._agreed_saves.append(SaveResult(p.request_id, p.num_blocks, n))

    def take_loads(self) -> list[LoadResult]:
        out, self._agreed_loads = self._agreed_loads, []
        return out

    def take_saves(self) -> list[SaveResult]:
        out, self._agreed_saves = self._agreed_saves, []
        return out

    def forget_loads(self) -> None:
        """A new scheduler (hello, on every rank at once): its fetches were drained and dropped.
        Saves are kept: those still in flight end later on every rank and are agreed as usual."""
        self._pull()
        self._loads.clear()
        self._agreed_loads.clear()
