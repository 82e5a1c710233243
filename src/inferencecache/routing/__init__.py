"""Routing policies shared by the reference gateway (real sockets) and the simulator (simulated
time): the same decision code runs in both, so the demo and ``simulate`` compare like with like."""

from inferencecache.routing.approximate import ApproximatePolicy
from inferencecache.routing.basic import RandomPolicy, RoundRobinPolicy
from inferencecache.routing.cache_aware import CacheAwarePolicy
from inferencecache.routing.model import Decision, Hint, RouteInput, RoutingPolicy
from inferencecache.routing.oracle import OraclePolicy
from inferencecache.routing.registry import POLICY_NAMES, make_policy, parse_params

__all__ = [
    "POLICY_NAMES",
    "ApproximatePolicy",
    "CacheAwarePolicy",
    "Decision",
    "Hint",
    "OraclePolicy",
    "RandomPolicy",
    "RoundRobinPolicy",
    "RouteInput",
    "RoutingPolicy",
    "make_policy",
    "parse_params",
]
