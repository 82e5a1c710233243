"""Prometheus plumbing every component shares (each keeps its own registry and metric names).

``LazyChildren`` binds label children on first use and caches them: ``labels()`` costs ~2.7 µs a
call, a cached child's ``inc()`` a fraction of that. ``metrics_response`` is every ``/metrics``
page (server, gateway, subscriber, fake and simulated engines); ``publish_info`` the
``<component>_info`` series that ``inferencecache doctor`` and the dashboard read.
``FallbackCollector`` exports ``accelerators.FALLBACKS``: the calls compiled code handed back
to Python.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Info, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from inferencecache import accelerators


class FallbackCollector(Collector):
    """``<name>_total{site}``: calls a compiled accelerator declined so Python did the work
    (read from ``accelerators.FALLBACKS`` at each scrape; every site known so far appears)."""

    def __init__(self, name: str) -> None:
        self._name = name

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            self._name,
            "Calls compiled code handed back to Python (an input it does not mirror exactly), "
            "by site.",
            labels=["site"],
        )
        for site, n in sorted(accelerators.FALLBACKS.items()):
            family.add_metric([site], n)
        yield family


class LazyChildren:
    """Label children of one metric, bound on first use and cached (series appear lazily)."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """``registry`` in the Prometheus text exposition format (a blocking call: it renders every
    series; run it off the loop where the registry is large)."""
    body = generate_latest(registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def publish_info(
    registry: CollectorRegistry, name: str, doc: str, labels: Mapping[str, object]
) -> None:
    """``<name>_info{version, ...} 1``: the build and the settings that must agree across
    components (block size, hash scheme, ...), so ``doctor`` and dashboards can compare them."""
    from inferencecache import __version__

    values = {"version": __version__, **{k: str(v) for k, v in labels.items()}}
    Info(name, doc, registry=registry).info(values)
