"""Benchmarks (``python bench/run.py``). A package so mypy sees ``bench.index`` and
``bench.fingerprint`` as modules distinct from ``inferencecache.index``/``.fingerprint``; every
script still runs as a file (each puts the repository root on ``sys.path`` itself)."""
