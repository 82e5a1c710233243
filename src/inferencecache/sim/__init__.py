"""Workloads, the cluster simulator (``inferencecache simulate``) and the demo
(``inferencecache demo``). The routing policies themselves live in :mod:`inferencecache.routing`,
shared with the gateway. See docs/demo.md.
"""
