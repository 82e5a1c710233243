"""``inferencecache doctor``: one-line verdicts on a deployment (reachable, healthy, versions,
block size and hash scheme agreement, events flowing, LoRA names, the probe tenant).

``gather`` reads what the operator pointed it at, ``checks`` turns that into verdicts, and
``command`` prints them; exit 0 only when nothing failed.
"""
