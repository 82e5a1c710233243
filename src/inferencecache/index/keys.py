"""Interning of strings to small dense ints, with reuse of ids that nothing refers to any more.

Stores index holds by replica *int* (a compiled store keeps per-hold replica ids in a few bytes
and may use them as bit positions), so replica ids must stay small and dense even when replica
names churn (Kubernetes pods come and go with fresh names). Each id carries a reference count
kept by the index (one per ``serving`` entry and one per stats row); an id whose count is 0 at
the end of an index operation is freed and handed out again, lowest first.

Partitions ``(tenant, model, hash_scheme, adapter)`` get ids from an ``IdPool`` the same way.
"""

from __future__ import annotations

import heapq


class IdPool:
    """Dense non-negative ints: ``take`` returns the lowest free id, ``give`` returns one."""

    __slots__ = ("_free", "_next")

    def __init__(self) -> None:
        self._free: list[int] = []
        self._next = 0

    def take(self) -> int:
        if self._free:
            return heapq.heappop(self._free)
        n = self._next
        self._next = n + 1
        return n

    def give(self, ident: int) -> None:
        heapq.heappush(self._free, ident)

    def in_use(self) -> int:
        return self._next - len(self._free)


class Interner:
    """name <-> id with reference counts; unreferenced ids are freed by ``collect``."""

    __slots__ = ("_ids", "_names", "_pending", "_pool", "_refs", "generation")

    def __init__(self) -> None:
        self.generation = 0
        """Bumped whenever a name gets or loses an id (caches of name -> id check it)."""
        self._ids: dict[str, int] = {}
        self._names: list[str | None] = []
        self._refs: list[int] = []
        self._pool = IdPool()
        self._pending: list[int] = []

    def get(self, name: str) -> int | None:
        """The id of ``name`` if interned (never creates one; lookups use this)."""
        return self._ids.get(name)

    def intern(self, name: str) -> int:
        """The id of ``name``, creating it with reference count 0 (freed by ``collect`` unless
        referenced by then)."""
        ident = self._ids.get(name)
        if ident is not None:
            return ident
        ident = self._pool.take()
        self.generation += 1
        if ident == len(self._names):
            self._names.append(name)
            self._refs.append(0)
        else:
            self._names[ident] = name
            self._refs[ident] = 0
        self._ids[name] = ident
        self._pending.append(ident)
        return ident

    def name(self, ident: int) -> str:
        name = self._names[ident]
        if name is None:
            raise KeyError(ident)
        return name

    @property
    def names(self) -> list[str | None]:
        """id -> name (None for a free id); read-only use on hot paths."""
        return self._names

    def ref(self, ident: int) -> None:
        self._refs[ident] += 1

    def unref(self, ident: int) -> None:
        refs = self._refs[ident] - 1
        self._refs[ident] = refs
        if refs == 0:
            self._pending.append(ident)

    @property
    def pending(self) -> bool:
        """Whether ``collect`` has ids to look at."""
        return bool(self._pending)

    def refs(self, ident: int) -> int:
        return self._refs[ident]

    def collect(self) -> None:
        """Free every id whose reference count is 0 (called at the end of an operation)."""
        pending = self._pending
        if not pending:
            return
        self._pending = []
        for ident in pending:
            name = self._names[ident]
            if name is not None and self._refs[ident] == 0:
                self.generation += 1
                del self._ids[name]
                self._names[ident] = None
                self._pool.give(ident)

    def __len__(self) -> int:
        return len(self._ids)

    def items(self) -> list[tuple[str, int]]:
        return list(self._ids.items())
