"""The kvevent-subscriber: engine KV events (ZeroMQ) → fingerprints → the server (gRPC).

Modules, one job each: ``settings`` (flags), ``intake`` (SUB socket, frames, sequence, monitor),
``sequence``, ``replay`` (DEALER), ``processor`` (decode → mapper), ``mapping`` (block →
fingerprint state), ``lora``, ``tiers``, ``forwarder`` (batching, ordered RPCs, backoff,
resync), ``resync`` (connectivity watcher), ``client`` (gRPC), ``messages``, ``stats``,
``metrics``, ``http``, ``app`` (wiring, shutdown), ``command`` (CLI).
"""
