"""LoRA adapter identity (engine-events-and-subscriber.md §5).

The adapter partitions the index, never the hash. A ``lora_id`` is a per-replica load-order
integer, so it only names an adapter through the operator's ``--lora-adapter-names`` table; a
``lora_name`` (vLLM ≥ 0.14, SGLang ≥ 0.5.22) is global and trusted by default. Anything that
cannot be named is dropped (fail-closed): putting it under ``""`` would alias the base model.
"""

from __future__ import annotations

import logging

from inferencecache.config.values import is_go_int, parse_go_int

log = logging.getLogger("inferencecache.subscriber")


def parse_adapter_names(text: str) -> dict[int, str]:
    """Parse ``"1=sql-lora,2=chat-lora"``; raises ``ValueError`` naming the bad item.

    Items are comma-separated ``id=name``, trimmed; empty items are skipped; an item splits at
    its first ``=``. The id is an optional sign and ASCII digits within int64 (``int()`` alone
    would also take ``1_0`` and non-ASCII digits).
    """
    out: dict[int, str] = {}
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        key, sep, name = item.partition("=")
        if not sep:
            raise ValueError(f"item {item!r} is not id=name")
        key, name = key.strip(), name.strip()
        if not is_go_int(key):
            raise ValueError(f"item {item!r}: id {key!r} is not an integer")
        try:
            lora_id = parse_go_int(key)
        except ValueError:
            raise ValueError(f"item {item!r}: id {key!r} is out of int64 range") from None
        if not name:
            raise ValueError(f"item {item!r} has an empty name")
        if lora_id in out:
            raise ValueError(f"duplicate id {lora_id}")
        out[lora_id] = name
    return out


class LoraResolver:
    """Resolve an event's adapter; warns once per unresolvable id (or name) per process."""

    def __init__(self, names: dict[int, str], trust_lora_name: bool = True) -> None:
        self._names = dict(names)
        self._trust = trust_lora_name
        self._warned_ids: set[int] = set()
        self._warned_names: set[str] = set()

    def resolve(self, lora_id: int | None, lora_name: str | None) -> str | None:
        """The adapter id to index under, or ``None`` to drop the BlockStored
        (engine-events-and-subscriber.md §5 order)."""
        if lora_id is None and not lora_name:
            return ""
        if lora_id is not None:
            mapped = self._names.get(lora_id)
            if mapped is not None:
                return mapped
        if lora_name and self._trust:
            return lora_name
        if lora_id is not None:
            if lora_id not in self._warned_ids:
                self._warned_ids.add(lora_id)
                log.warning(
                    "dropping BlockStored for an unmapped LoRA id (add it to "
                    "--lora-adapter-names); further drops for this id are not logged",
                    extra={"lora_id": lora_id, "lora_name": lora_name},
                )
        elif lora_name is not None and lora_name not in self._warned_names:
            self._warned_names.add(lora_name)
            log.warning(
                "dropping BlockStored for a LoRA name without an id (--trust-lora-name=false); "
                "further drops for this name are not logged",
                extra={"lora_name": lora_name},
            )
        return None
