"""Per-tenant configuration (contract-and-index.md §6.7, §9.4): typed, validated, immutable.

Two decoders produce the same ``IndexConfig``:

- ``load_policy_file`` / ``parse_policy_document``: the ``serve --policy-file`` format (YAML or
  JSON, snake_case, absent field = default). Any unknown field, wrong type or out-of-range value
  raises ``PolicyError`` naming the field path (``policies[1].routing_floor_score``).
- ``decode_policy_body``: the ``POST /policy`` body (camelCase JSON, versions 3-7), decoded like
  the reference: an absent zero-valued field means 0, version-dependent defaults, keys matched
  case-insensitively as Go's encoding/json does. Errors raise ``PolicyDecodeError`` (HTTP 400).

``PolicyTable`` is the resolved, lookup-ready form the index keeps: one ``EffectivePolicy`` per
configured tenant with defaults, clamps and the TTL in µs precomputed, so the hot path does one
dict probe per request.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from inferencecache.config.values import parse_duration
from inferencecache.index.model import PROBE_TENANT

MAX_POLICY_BODY = 1 << 20
"""``POST /policy`` body bound (contract-and-index.md §9.4)."""
POLICY_VERSIONS = range(3, 8)
"""Accepted ``/policy`` body versions."""

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1


class PolicyError(ValueError):
    """Invalid configuration; ``path`` names the offending field (empty for the whole input)."""

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class PolicyDecodeError(PolicyError):
    """Invalid ``/policy`` body (the server answers 400 with this message)."""


@dataclass(frozen=True, slots=True)
class Strategy:
    enable_chain_matching: bool = True
    require_chain: bool = False
    enable_tenant_hot: bool = True


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """One tenant's policy as configured (contract-and-index.md §6.7); ``eviction_ttl`` in seconds,
    <= 0 means the server's ``default_ttl``."""

    eviction_ttl: float = 0.0
    eviction: str = "lru"
    minimum_prefix_tokens: int = 0
    minimum_matched_tokens: int = 64
    routing_floor_score: float = 0.1
    lookup_timeout_ms: int = 0
    affinity_routing: bool = True
    strategy: Strategy = field(default_factory=Strategy)


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """Fairness quota: distinct keys of the tenant across models/schemes/adapters
    (contract-and-index.md §6.5)."""

    max_index_entries: int
    isolation_mode: str = ""


def _frozen(m: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return MappingProxyType(dict(m or {}))


@dataclass(frozen=True, eq=False)
class IndexConfig:
    """The whole per-tenant configuration; replaced atomically as one value."""

    policies: Mapping[str, TenantPolicy] = field(default_factory=dict)
    quotas: Mapping[str, TenantQuota] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policies", _frozen(self.policies))
        object.__setattr__(self, "quotas", _frozen(self.quotas))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, IndexConfig):
            return NotImplemented
        return dict(self.policies) == dict(other.policies) and dict(self.quotas) == dict(
            other.quotas
        )

    __hash__ = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------------------------
# Resolved form


@dataclass(frozen=True, slots=True)
class EffectivePolicy:
    """A tenant's policy with every default and clamp applied (what lookups and eviction read)."""

    ttl_us: int
    lfu: bool
    algorithm: str  # "lru" | "lfu" (metric label)
    minimum_prefix_tokens: int
    minimum_matched_tokens: int  # >= 0; 0 = G1 off
    routing_floor_score: float  # >= 0; 0 = G2 off
    lookup_timeout_ms: int  # <= 0 = no deadline
    affinity_routing: bool
    enable_chain_matching: bool
    require_chain: bool
    enable_tenant_hot: bool
    quota: int | None  # >= 0, None = unbounded
    # Derived: a chain request needs none of the contract-and-index.md §5.1 steps 2-8 decisions
    # beyond its own shape (no policy deadline, no require_chain, no minimum_prefix_tokens;
    # Router.lookup).
    plain_chain: bool = field(init=False, default=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        plain = (
            self.enable_chain_matching
            and not self.require_chain
            and self.lookup_timeout_ms <= 0
            and self.minimum_prefix_tokens <= 0
        )
        object.__setattr__(self, "plain_chain", plain)


def _effective(p: TenantPolicy, quota: int | None, default_ttl_us: int) -> EffectivePolicy:
    ttl = p.eviction_ttl
    ttl_us = max(1, round(ttl * 1_000_000)) if ttl > 0 and math.isfinite(ttl) else default_ttl_us
    lfu = p.eviction.lower() == "lfu"
    floor = p.routing_floor_score
    return EffectivePolicy(
        ttl_us=ttl_us,
        lfu=lfu,
        algorithm="lfu" if lfu else "lru",
        minimum_prefix_tokens=p.minimum_prefix_tokens,
        minimum_matched_tokens=max(0, p.minimum_matched_tokens),
        routing_floor_score=floor if floor > 0 and math.isfinite(floor) else 0.0,
        lookup_timeout_ms=p.lookup_timeout_ms,
        affinity_routing=p.affinity_routing,
        enable_chain_matching=p.strategy.enable_chain_matching,
        require_chain=p.strategy.require_chain,
        enable_tenant_hot=p.strategy.enable_tenant_hot,
        quota=None if quota is None else max(0, quota),
    )


class _ByTenant(dict[str, "EffectivePolicy"]):
    """tenant -> policy; a missing tenant reads as the default (not inserted), so ``m[t]`` is
    one C-level lookup for configured tenants (``PolicyTable.get`` is a Python call)."""

    __slots__ = ("default",)

    def __init__(self, items: dict[str, EffectivePolicy], default: EffectivePolicy) -> None:
        super().__init__(items)
        self.default = default

    def __missing__(self, tenant: str) -> EffectivePolicy:
        return self.default


class PolicyTable:
    """tenant -> ``EffectivePolicy`` (defaults for unknown tenants) plus the quota list.
    ``by_tenant[t]`` equals ``get(t)`` (the lookup path reads it)."""

    __slots__ = ("_by_tenant", "by_tenant", "config", "default", "quotas")

    def __init__(self, config: IndexConfig, default_ttl_us: int) -> None:
        self.config = config
        self.default = _effective(TenantPolicy(), None, default_ttl_us)
        quotas: dict[str, int] = {}
        for tenant, q in config.quotas.items():
            # the probe tenant is quota-exempt (contract-and-index.md §2.5)
            if tenant and tenant != PROBE_TENANT:
                quotas[tenant] = max(0, q.max_index_entries)
        self.quotas: Mapping[str, int] = quotas
        by_tenant: dict[str, EffectivePolicy] = {}
        for tenant in set(config.policies) | set(quotas):
            pol = config.policies.get(tenant, TenantPolicy())
            by_tenant[tenant] = _effective(pol, quotas.get(tenant), default_ttl_us)
        self._by_tenant = by_tenant
        self.by_tenant: Mapping[str, EffectivePolicy] = _ByTenant(by_tenant, self.default)

    def get(self, tenant: str) -> EffectivePolicy:
        return self._by_tenant.get(tenant, self.default)


# ---------------------------------------------------------------------------------------------
# Config file (contract-and-index.md §6.7): snake_case, absent = default, strict types and ranges


_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (type(None), "null"),
    (bool, "bool"),  # before int: a bool is an int
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "list"),
    (dict, "mapping"),
)


def _type_name(v: object) -> str:
    for cls, name in _TYPE_NAMES:
        if isinstance(v, cls):
            return name
    return type(v).__name__


class _Fields:
    """Strict reader of one mapping: every access names its path; leftovers are unknown."""

    def __init__(self, v: object, path: str, err: type[PolicyError]) -> None:
        if not isinstance(v, dict):
            raise err(path, f"must be a mapping, got {_type_name(v)}")
        for k in v:
            if not isinstance(k, str):
                raise err(path, f"field names must be strings, got {k!r}")
        self.d: dict[str, Any] = v
        self.path = path
        self.err = err

    def sub(self, name: str) -> str:
        return f"{self.path}.{name}" if self.path else name

    def check_unknown(self, allowed: set[str]) -> None:
        for k in self.d:
            if k not in allowed:
                raise self.err(self.sub(k), "unknown field")


def _as_int(v: object, path: str, err: type[PolicyError], minimum: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise err(path, f"must be an integer, got {_type_name(v)}")
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise err(path, "out of range (64-bit integer)")
    if minimum is not None and v < minimum:
        raise err(path, f"must be >= {minimum} (got {v})")
    return v


def _as_float(v: object, path: str, err: type[PolicyError], minimum: float | None = None) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise err(path, f"must be a number, got {_type_name(v)}")
    f = float(v)
    if not math.isfinite(f):
        raise err(path, "must be finite")
    if minimum is not None and f < minimum:
        raise err(path, f"must be >= {minimum:g} (got {f:g})")
    return f


def _as_bool(v: object, path: str, err: type[PolicyError]) -> bool:
    if not isinstance(v, bool):
        raise err(path, f"must be true or false, got {_type_name(v)}")
    return v


def _as_str(v: object, path: str, err: type[PolicyError]) -> str:
    if not isinstance(v, str):
        raise err(path, f"must be a string, got {_type_name(v)}")
    return v


def _as_list(v: object, path: str, err: type[PolicyError]) -> list[Any]:
    if v is None:
        return []
    if not isinstance(v, list):
        raise err(path, f"must be a list, got {_type_name(v)}")
    return v


def _as_duration(v: object, path: str) -> float:
    if isinstance(v, str):
        try:
            seconds = parse_duration(v)
        except ValueError as e:
            raise PolicyError(path, str(e)) from None
    elif isinstance(v, int | float) and not isinstance(v, bool) and v == 0:
        seconds = 0.0
    else:
        raise PolicyError(path, f"must be a duration such as 30m, got {_type_name(v)}")
    if seconds < 0:
        raise PolicyError(path, f"must be >= 0 (got {v})")
    return seconds


_FILE_TOP = {"policies", "tenants"}
_FILE_POLICY = {
    "tenant_id",
    "eviction_ttl",
    "eviction",
    "minimum_prefix_tokens",
    "minimum_matched_tokens",
    "routing_floor_score",
    "lookup_timeout_ms",
    "affinity_routing",
    "strategy",
}
_FILE_STRATEGY = {"enable_chain_matching", "require_chain", "enable_tenant_hot"}
_FILE_TENANT = {"tenant_id", "max_index_entries", "isolation_mode"}


def _file_policy(v: object, path: str) -> tuple[str, TenantPolicy]:
    f = _Fields(v, path, PolicyError)
    f.check_unknown(_FILE_POLICY)
    d = f.d
    if "tenant_id" not in d:
        raise PolicyError(f.sub("tenant_id"), "required field missing")
    tenant = _as_str(d["tenant_id"], f.sub("tenant_id"), PolicyError)
    dflt = TenantPolicy()
    kw: dict[str, Any] = {}
    if "eviction_ttl" in d:
        kw["eviction_ttl"] = _as_duration(d["eviction_ttl"], f.sub("eviction_ttl"))
    if "eviction" in d:
        ev = _as_str(d["eviction"], f.sub("eviction"), PolicyError)
        if ev.lower() not in ("lru", "lfu"):
            raise PolicyError(f.sub("eviction"), f"must be lru or lfu (got {ev!r})")
        kw["eviction"] = ev.lower()
    for name in ("minimum_prefix_tokens", "minimum_matched_tokens"):
        if name in d:
            kw[name] = _as_int(d[name], f.sub(name), PolicyError, minimum=0)
    if "routing_floor_score" in d:
        kw["routing_floor_score"] = _as_float(
            d["routing_floor_score"], f.sub("routing_floor_score"), PolicyError, minimum=0.0
        )
    if "lookup_timeout_ms" in d:
        kw["lookup_timeout_ms"] = _as_int(
            d["lookup_timeout_ms"], f.sub("lookup_timeout_ms"), PolicyError
        )
    if "affinity_routing" in d:
        kw["affinity_routing"] = _as_bool(
            d["affinity_routing"], f.sub("affinity_routing"), PolicyError
        )
    strategy = dflt.strategy
    if "strategy" in d and d["strategy"] is not None:
        s = _Fields(d["strategy"], f.sub("strategy"), PolicyError)
        s.check_unknown(_FILE_STRATEGY)
        skw = {k: _as_bool(val, s.sub(k), PolicyError) for k, val in s.d.items()}
        strategy = Strategy(**skw)
        if strategy.require_chain and not strategy.enable_chain_matching:
            raise PolicyError(
                s.sub("require_chain"), "requires strategy.enable_chain_matching to be true"
            )
    kw["strategy"] = strategy
    return tenant, TenantPolicy(**kw)


def _file_quota(v: object, path: str) -> tuple[str, TenantQuota]:
    f = _Fields(v, path, PolicyError)
    f.check_unknown(_FILE_TENANT)
    d = f.d
    for required in ("tenant_id", "max_index_entries"):
        if required not in d:
            raise PolicyError(f.sub(required), "required field missing")
    tenant = _as_str(d["tenant_id"], f.sub("tenant_id"), PolicyError)
    mx = _as_int(d["max_index_entries"], f.sub("max_index_entries"), PolicyError)
    mode = ""
    if "isolation_mode" in d and d["isolation_mode"] is not None:
        mode = _as_str(d["isolation_mode"], f.sub("isolation_mode"), PolicyError)
    return tenant, TenantQuota(max_index_entries=mx, isolation_mode=mode)


def parse_policy_document(doc: object) -> IndexConfig:
    """Validate a parsed config-file document (see module doc); ``None`` = empty config."""
    if doc is None:
        return IndexConfig()
    top = _Fields(doc, "", PolicyError)
    top.check_unknown(_FILE_TOP)
    policies: dict[str, TenantPolicy] = {}
    quotas: dict[str, TenantQuota] = {}
    for i, item in enumerate(_as_list(top.d.get("policies"), "policies", PolicyError)):
        path = f"policies[{i}]"
        tenant, pol = _file_policy(item, path)
        if not tenant:
            continue  # empty tenant ids are ignored (contract-and-index.md §6.7, §9.4)
        if tenant in policies:
            raise PolicyError(f"{path}.tenant_id", f"duplicate tenant {tenant!r}")
        policies[tenant] = pol
    for i, item in enumerate(_as_list(top.d.get("tenants"), "tenants", PolicyError)):
        path = f"tenants[{i}]"
        tenant, quota = _file_quota(item, path)
        if not tenant:
            continue
        if tenant in quotas:
            raise PolicyError(f"{path}.tenant_id", f"duplicate tenant {tenant!r}")
        quotas[tenant] = quota
    return IndexConfig(policies=policies, quotas=quotas)


def load_policy_file(path: str | Path) -> IndexConfig:
    """Read ``--policy-file``: JSON when the name ends in ``.json``, else YAML."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError("", f"cannot read policy file {str(p)!r}: {e}") from None
    try:
        if p.suffix.lower() == ".json":
            doc = json.loads(text, parse_constant=_reject_constant)
        else:
            doc = yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        one_line = " ".join(str(e).split())
        raise PolicyError("", f"policy file {str(p)!r} is not valid: {one_line}") from None
    return parse_policy_document(doc)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"invalid JSON constant {name}")


# ---------------------------------------------------------------------------------------------
# POST /policy body (contract-and-index.md §9.4): camelCase, versioned, zero-omitting controller


_BODY_TOP = ("version", "policies", "tenants")
_BODY_POLICY = (
    "namespace",
    "evictionTTL",
    "minimumPrefixTokens",
    "minimumMatchedTokens",
    "routingFloorScore",
    "lookupTimeoutMs",
    "affinityRouting",
    "eviction",
    "strategy",
)
_BODY_STRATEGY = ("enableChainMatching", "requireChain", "enableTenantHot")
_BODY_TENANT = ("tenantID", "maxIndexEntries", "isolationMode")


def _go_fields(v: object, path: str, names: tuple[str, ...]) -> dict[str, Any]:
    """Map a JSON object onto struct field names like Go's encoding/json with
    DisallowUnknownFields: exact name first, else a case-insensitive match; the last duplicate
    wins; ``null`` leaves the field at its zero value (absent here)."""
    if not isinstance(v, dict):
        raise PolicyDecodeError(path, f"must be an object, got {_type_name(v)}")
    exact = set(names)
    folded = {n.lower(): n for n in names}
    out: dict[str, Any] = {}
    for k, val in v.items():
        name = k if k in exact else folded.get(k.lower())
        if name is None:
            raise PolicyDecodeError(f"{path}.{k}" if path else k, "unknown field")
        if val is None:
            out.pop(name, None)
        else:
            out[name] = val
    return out


def decode_policy_body(body: bytes) -> IndexConfig:
    """Decode a ``POST /policy`` body into a whole new configuration (replace-on-write)."""
    if len(body) > MAX_POLICY_BODY:
        raise PolicyDecodeError("", f"body exceeds {MAX_POLICY_BODY} bytes")
    try:
        doc = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise PolicyDecodeError("", f"invalid JSON: {e}") from None
    top = _go_fields(doc, "", _BODY_TOP)
    err = PolicyDecodeError
    version = _as_int(top.get("version", 0), "version", err)
    if version not in POLICY_VERSIONS:
        raise PolicyDecodeError(
            "version",
            f"unsupported version {version} (want {POLICY_VERSIONS[0]}-{POLICY_VERSIONS[-1]})",
        )
    dflt = TenantPolicy()
    policies: dict[str, TenantPolicy] = {}
    for i, item in enumerate(_as_list(top.get("policies"), "policies", err)):
        path = f"policies[{i}]"
        d = _go_fields(item, path, _BODY_POLICY)
        ns = _as_str(d.get("namespace", ""), f"{path}.namespace", err)
        ttl_ns = _as_int(d.get("evictionTTL", 0), f"{path}.evictionTTL", err)
        min_prefix = _as_int(d.get("minimumPrefixTokens", 0), f"{path}.minimumPrefixTokens", err)
        min_matched = _as_int(d.get("minimumMatchedTokens", 0), f"{path}.minimumMatchedTokens", err)
        if version < 4 and min_matched == 0:
            min_matched = dflt.minimum_matched_tokens
        floor = dflt.routing_floor_score
        if "routingFloorScore" in d:
            floor = _as_float(d["routingFloorScore"], f"{path}.routingFloorScore", err)
            if version < 5:
                floor = dflt.routing_floor_score
        timeout = _as_int(d.get("lookupTimeoutMs", 0), f"{path}.lookupTimeoutMs", err)
        affinity = dflt.affinity_routing
        if "affinityRouting" in d:
            affinity = _as_bool(d["affinityRouting"], f"{path}.affinityRouting", err)
            if version < 7:
                affinity = True
        eviction = _as_str(d.get("eviction", ""), f"{path}.eviction", err)
        strategy = dflt.strategy
        if "strategy" in d:
            s = _go_fields(d["strategy"], f"{path}.strategy", _BODY_STRATEGY)
            vals = {k: _as_bool(val, f"{path}.strategy.{k}", err) for k, val in s.items()}
            if version >= 6:
                strategy = Strategy(
                    enable_chain_matching=vals.get("enableChainMatching", True),
                    require_chain=vals.get("requireChain", False),
                    enable_tenant_hot=vals.get("enableTenantHot", True),
                )
        if not ns:
            continue
        policies[ns] = TenantPolicy(
            eviction_ttl=ttl_ns / 1e9 if ttl_ns > 0 else 0.0,
            eviction="lfu" if eviction.lower() == "lfu" else "lru",
            minimum_prefix_tokens=min_prefix,
            minimum_matched_tokens=min_matched,
            routing_floor_score=floor,
            lookup_timeout_ms=timeout,
            affinity_routing=affinity,
            strategy=strategy,
        )
    quotas: dict[str, TenantQuota] = {}
    for i, item in enumerate(_as_list(top.get("tenants"), "tenants", err)):
        path = f"tenants[{i}]"
        d = _go_fields(item, path, _BODY_TENANT)
        tenant = _as_str(d.get("tenantID", ""), f"{path}.tenantID", err)
        mx = _as_int(d.get("maxIndexEntries", 0), f"{path}.maxIndexEntries", err)
        mode = _as_str(d.get("isolationMode", ""), f"{path}.isolationMode", err)
        if tenant:
            quotas[tenant] = TenantQuota(max_index_entries=mx, isolation_mode=mode)
    return IndexConfig(policies=policies, quotas=quotas)
