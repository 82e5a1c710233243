"""Type stub of the compiled PREFIX_MATCH scoring step (``_rank.c``); twin: ``ranking.PyRanker``."""

from collections.abc import Sequence
from typing import Any, final

from inferencecache.index.model import ReplicaScore
from inferencecache.index.state import StatsRow

@final
class Ranker:
    """``Ranker(score_type)``: score_type must be a plain ``__slots__`` record of exactly the
    ``ReplicaScore`` fields deriving from object (its ``__init__`` is not called)."""

    def __init__(self, score_type: type[ReplicaScore]) -> None: ...
    def rank(
        self,
        rows: Sequence[tuple[int, ...]],
        chain: bool,
        names: Sequence[str | None],
        now_us: int,
        ttl_us: int,
        total: int,
        stats: dict[int, StatsRow] | None,
        pressure_weight: float,
        slo: float,
        min_matched: int,
        want_credit: bool,
    ) -> tuple[int, list[ReplicaScore], list[tuple[int, int]] | None] | None:
        """Ranked scores as ``ranking.PyRanker.rank``; None = run the twin instead."""

def packed_seed(packed: bytes, /) -> bytes:
    """The §5.9 affinity seed of a packed chain (twin: ``ranking._seed_of_packed``)."""

@final
class Record:
    """``Record(cls, fields)(*values)``: a ``cls`` instance with ``fields`` set positionally,
    without running ``cls.__init__`` (cls: a plain ``__slots__`` record of exactly ``fields``)."""

    def __init__(self, cls: type, fields: tuple[str, ...]) -> None: ...
    def __call__(self, *values: Any) -> Any: ...
