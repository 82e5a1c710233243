"""The P/D handoff bodies of the gateway (docs/gateway.md, vLLM's kv_transfer_params)."""

from __future__ import annotations

import json

from inferencecache.gateway.pd import PREFILL_KV_PARAMS, decode_body, prefill_body


def test_prefill_body_asks_for_one_token_without_streaming() -> None:
    data = {"model": "m", "prompt": [1, 2], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0.3}  # fmt: skip
    got = json.loads(prefill_body(data))
    assert got == {"model": "m", "prompt": [1, 2], "max_tokens": 1, "stream": False,
                   "temperature": 0.3, "kv_transfer_params": PREFILL_KV_PARAMS}  # fmt: skip
    assert data["max_tokens"] == 50 and "stream_options" in data  # the original is untouched
    chat = json.loads(prefill_body({"model": "m", "messages": [], "max_completion_tokens": 9}))
    assert (chat["max_completion_tokens"], chat["max_tokens"]) == (1, 1)


def test_decode_body_is_the_original_plus_the_prefills_params() -> None:
    data = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}
    kv = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [3]}
    assert json.loads(decode_body(data, kv)) == {**data, "kv_transfer_params": kv}
