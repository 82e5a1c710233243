"""Type stub of the compiled PREFIX_MATCH scoring step (``_rank.c``); Python reference:
``ranking.PyRanker``."""

from collections.abc import Sequence
from typing import final

from inferencecache.index.ranking import Ranked, RankSettings
from inferencecache.index.state import StatsRow

@final
class Ranker:
    """``Ranker(names, settings)``: one policy's scoring step (``settings`` read once)."""

    def __init__(self, names: Sequence[str | None], settings: RankSettings) -> None: ...
    def bind(
        self, now_us: int, total: int, stats: dict[int, StatsRow] | None, ttft_ms: int, /
    ) -> BoundRanker: ...

@final
class BoundRanker:
    """A ``Ranker`` bound to one lookup."""

    def rank(self, rows: Sequence[tuple[int, ...]], chain: bool, /) -> Ranked | None:
        """Ranked scores as ``ranking.PyBoundRanker.rank``; None = run the reference."""

def packed_seed(packed: bytes, /) -> bytes:
    """The contract-and-index.md §5.9 affinity seed of a packed chain (twin:
    ``ranking._seed_of_packed``)."""
