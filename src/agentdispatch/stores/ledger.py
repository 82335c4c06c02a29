"""The side-effect ledger writes of many turns in one transaction, by
statement rather than by op: the leases of every begin renewed together,
every ledger row read in one statement and written in another.

Each op is answered as :func:`engine.effect_begin` or :func:`engine.effect_end`
would answer it alone, in order. Ops naming the same (tenant, key) never share
a statement: a batch is cut before the repeat, so a later op sees what the
earlier one wrote.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from .. import workitem as wi
from ..errors import AgentDispatchError, LeaseLost
from ..workitem import Lease
from .base import Effect, LedgerAnswer, LedgerOp
from .engine import Tx, begin_decision

#: Renew leases (one statement) for ``ttl_s``: each lease or why it was refused.
Renew = Callable[[Sequence[Lease], float], list[Lease | LeaseLost]]
#: Called after each settlement with whether it was recorded.
Settled = Callable[[LedgerOp, bool], None]


class LedgerTx(Tx, Protocol):
    """A :class:`Tx` that reads and writes many ledger rows a statement."""

    def effects_read(self, keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], Effect]:
        """The ledger rows of these (tenant, key) pairs that exist (locked
        where the backend locks rows)."""

    def effects_write(self, rows: Sequence[tuple[str, Effect]], now: float) -> None:
        """Upsert (tenant, effect) rows as ``effect_put`` does, one statement."""


def ledger_batch(
    tx: LedgerTx, ops: Sequence[LedgerOp], *, renew: Renew | None = None, settled: Settled | None = None
) -> list[LedgerAnswer]:
    """The answers of ``ops`` (see :meth:`Store.ledger_many`). ``renew``: the
    backend's one-statement renewal for the begins' leases (None: each item
    is loaded, checked and saved, as :func:`engine.effect_begin` does)."""
    out: list[LedgerAnswer] = []
    for part in _parts(ops):
        out.extend(_batch(tx, part, renew, settled))
    return out


def _parts(ops: Sequence[LedgerOp]) -> Iterator[list[LedgerOp]]:
    part: list[LedgerOp] = []
    seen: set[tuple[str, str]] = set()
    for op in ops:
        k = (op.lease.tenant, op.key)
        if k in seen:
            yield part
            part, seen = [], set()
        part.append(op)
        seen.add(k)
    if part:
        yield part


def _renewals(tx: Tx, begins: Sequence[LedgerOp], renew: Renew | None) -> dict[int, LeaseLost]:
    """Renew + fence the lease of every begin; the refused ones by op id."""
    lost: dict[int, LeaseLost] = {}
    if renew is None:
        now = tx.now()
        for op in begins:
            item = tx.load(op.lease.job_id)
            try:
                if item is None:
                    raise LeaseLost(f"job {op.lease.job_id} vanished")
                tx.save(wi.renew(item, op.lease, now, op.ttl_s))
            except LeaseLost as exc:
                lost[id(op)] = exc
        return lost
    by_ttl: dict[float, list[LedgerOp]] = {}
    for op in begins:
        by_ttl.setdefault(op.ttl_s, []).append(op)
    for ttl_s, group in by_ttl.items():
        for op, got in zip(group, renew([op.lease for op in group], ttl_s), strict=True):
            if isinstance(got, LeaseLost):
                lost[id(op)] = got
    return lost


def _batch(tx: LedgerTx, ops: Sequence[LedgerOp], renew: Renew | None, settled: Settled | None) -> list[LedgerAnswer]:
    lost = _renewals(tx, [op for op in ops if op.state is None], renew)
    now = tx.now()
    rows = tx.effects_read(sorted({(op.lease.tenant, op.key) for op in ops if id(op) not in lost}))
    writes: list[tuple[str, Effect]] = []
    out: list[LedgerAnswer] = []
    for op in ops:
        if id(op) in lost:
            out.append(lost[id(op)])
            continue
        row = rows.get((op.lease.tenant, op.key))
        try:
            if op.state is None:
                answer, write = begin_decision(tx, op.lease, op.key, row, op.retry_unknown, now)
                if write is not None:
                    writes.append((op.lease.tenant, write))
                out.append(answer)
            else:
                recorded = _settle(op, row, writes)
                if settled is not None:
                    settled(op, recorded)
                out.append(recorded)
        except AgentDispatchError as exc:
            out.append(exc)
    if writes:
        tx.effects_write(writes, now)
    return out


def _settle(op: LedgerOp, row: Effect | None, writes: list[tuple[str, Effect]]) -> bool:
    """:func:`engine.effect_end`: only this attempt's ``intended`` mark is
    settled; a repeat of the same settlement answers True and writes nothing."""
    lease = op.lease
    assert op.state is not None
    if row is None or (row.job_id, row.epoch) != (lease.job_id, lease.epoch):
        return False
    if row.state == "intended":
        writes.append((lease.tenant, Effect(op.key, lease.job_id, op.state, lease.epoch, op.result)))
        return True
    return row.state == op.state
