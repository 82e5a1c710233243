"""Fake and simulated engines that speak the real wire formats.

``publisher`` (PUB + seq + replay buffer + replay ROUTER), ``cache`` (an engine-side prefix
cache with stable engine hashes and LRU eviction), ``metrics`` (vLLM-named metrics and the
``/metrics`` page), ``engine`` (the three together), ``workload`` (what ``--mode`` fixed,
random and script publish), ``settings`` and ``command`` (``inferencecache fake-engine``).
"""
