"""The committed contract: stubs regenerate byte-identically; the descriptor equals the spec.

The expected tables below are typed in from contract-and-index.md §2.2-§2.4, independently of the
``.proto`` and the generated code, so a drift in either is caught (contract-and-index.md §10 item
1).
"""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor as d
from google.protobuf import descriptor_pb2

from inferencecache.v1alpha1 import inferencecache_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = ROOT / "proto"
PROTO_FILE = "inferencecache/v1alpha1/inferencecache.proto"
STUB_DIR = ROOT / "src" / "inferencecache" / "v1alpha1"
GENERATED = ("inferencecache_pb2.py", "inferencecache_pb2.pyi", "inferencecache_pb2_grpc.py")

PACKAGE = "inferencecache.v1alpha1"
SERVICE = "InferenceCache"

# contract-and-index.md §2.2: name -> (input, output, client streaming, server streaming)
RPCS = {
    "RenderTemplate": ("RenderTemplateRequest", "RenderTemplateResponse", False, False),
    "LookupRoute": ("LookupRouteRequest", "LookupRouteResponse", False, False),
    "LookupPDRoute": ("LookupPDRouteRequest", "LookupPDRouteResponse", False, False),
    "GetCacheState": ("GetCacheStateRequest", "GetCacheStateResponse", False, False),
    "ReportCacheState": ("CacheStateUpdate", "Ack", True, False),
    "PublishEvent": ("CacheEvent", "Ack", False, False),
    "StreamCacheEvents": ("StreamEventsRequest", "CacheEvent", False, True),
    "StreamMetrics": ("StreamMetricsRequest", "Metric", False, True),
}

# contract-and-index.md §2.3: message -> [(number, name, type)], type as written in the spec table.
MESSAGES: dict[str, list[tuple[int, str, str]]] = {
    "RenderTemplateRequest": [
        (1, "template_ref", "string"),
        (2, "variables", "map<string,string>"),
        (3, "tenant_id", "string"),
    ],
    "RenderTemplateResponse": [
        (1, "rendered_prompt", "bytes"),
        (2, "stable_prefix_hash", "bytes"),
        (3, "tenant_namespace", "bytes"),
        (4, "reason_code", "string"),
        (5, "template_revision", "string"),
    ],
    "SLO": [(1, "ttft_ms", "int32"), (2, "tbt_ms", "int32")],
    "LookupRouteRequest": [
        (1, "model_id", "string"),
        (2, "tenant_id", "string"),
        (3, "prefix_hash", "bytes"),
        (4, "prefix_token_count", "int32"),
        (5, "hash_scheme", "string"),
        (6, "slo", "SLO"),
        (7, "block_hashes", "repeated bytes"),
        (8, "block_token_counts", "repeated int32"),
        (9, "token_ids", "repeated uint32"),
        (10, "prompt_text", "string"),
        (11, "adapter_id", "string"),
    ],
    "ReplicaScore": [
        (1, "replica_id", "string"),
        (2, "score", "float"),
        (3, "matched_tokens", "int32"),
        (4, "estimated_cache_hit_prob", "float"),
        (5, "tier", "CacheTier"),
    ],
    "LookupRouteResponse": [
        (1, "replica_scores", "repeated ReplicaScore"),
        (2, "reason_code", "string"),
        (3, "lookup_latency_us", "int64"),
        (4, "token_ids", "repeated uint32"),
        (5, "adapter_id", "string"),
    ],
    "LookupPDRouteRequest": [
        (1, "model_id", "string"),
        (2, "tenant_id", "string"),
        (3, "prefix_hash", "bytes"),
        (4, "prefix_token_count", "int32"),
        (5, "pd_topology_ref", "string"),
    ],
    "LookupPDRouteResponse": [
        (1, "prefill_replica_id", "string"),
        (2, "decode_replica_id", "string"),
        (3, "transport_hint", "string"),
        (4, "reason_code", "string"),
    ],
    "PrefixEntry": [
        (1, "prefix_hash", "bytes"),
        (2, "token_count", "int32"),
        (3, "block_hashes", "repeated bytes"),
        (4, "block_token_counts", "repeated int32"),
        (5, "tier", "CacheTier"),
        (6, "adapter_id", "string"),
    ],
    "ReplicaStats": [
        (1, "replica_id", "string"),
        (2, "cache_memory_bytes", "int64"),
        (3, "hit_rate", "float"),
        (4, "pressure", "float"),
        (5, "client_version", "string"),
        (6, "t2_hit_tokens", "int64"),
        (7, "t2_query_tokens", "int64"),
    ],
    "CacheStateUpdate": [
        (1, "replica_id", "string"),
        (2, "model_id", "string"),
        (3, "tenant_id", "string"),
        (4, "hash_scheme", "string"),
        (5, "timestamp_us", "int64"),
        (6, "prefixes", "repeated PrefixEntry"),
        (7, "stats", "ReplicaStats"),
        (8, "adapter_id", "string"),
    ],
    "CacheSummary": [(1, "total_prefixes", "int64"), (2, "hot_prefixes", "int64")],
    "GetCacheStateRequest": [(1, "model_id", "string"), (2, "tenant_id", "string")],
    "GetCacheStateResponse": [
        (1, "replicas", "repeated ReplicaStats"),
        (2, "summary", "CacheSummary"),
    ],
    "CacheEvent": [
        (1, "type", "CacheEvent.Type"),
        (2, "replica_id", "string"),
        (3, "model_id", "string"),
        (4, "tenant_id", "string"),
        (5, "prefix_hash", "bytes"),
        (6, "timestamp_us", "int64"),
        (7, "adapter_id", "string"),
    ],
    "StreamEventsRequest": [
        (1, "model_id", "string"),
        (2, "tenant_id", "string"),
        (3, "types", "repeated CacheEvent.Type"),
    ],
    "StreamMetricsRequest": [(1, "names", "repeated string")],
    "Metric": [
        (1, "name", "string"),
        (2, "type", "string"),
        (3, "labels", "map<string,string>"),
        (4, "value", "double"),
        (5, "timestamp_us", "int64"),
    ],
    "Ack": [(1, "accepted", "bool"), (2, "reason_code", "string")],
}

# Additive fields of this project (docs/decisions.md): not in the spec tables above, numbered
# after every spec field of their message, so every v1alpha1 field keeps its meaning.
ADDITIVE: dict[str, list[tuple[int, str, str]]] = {
    "CacheEvent": [(8, "prefix_hashes", "repeated bytes")],
}

# contract-and-index.md §2.4
ENUMS = {
    "CacheTier": [
        ("CACHE_TIER_UNSPECIFIED", 0),
        ("CACHE_TIER_T1", 1),
        ("CACHE_TIER_T2", 2),
        ("CACHE_TIER_T3", 3),
    ],
    "CacheEvent.Type": [
        ("TYPE_UNSPECIFIED", 0),
        ("PREFIX_ADDED", 1),
        ("PREFIX_EVICTED", 2),
        ("REPLICA_UPDATED", 3),
        ("ALL_CLEARED", 4),
    ],
}

_SCALARS = {
    d.FieldDescriptor.TYPE_STRING: "string",
    d.FieldDescriptor.TYPE_BYTES: "bytes",
    d.FieldDescriptor.TYPE_INT32: "int32",
    d.FieldDescriptor.TYPE_INT64: "int64",
    d.FieldDescriptor.TYPE_UINT32: "uint32",
    d.FieldDescriptor.TYPE_FLOAT: "float",
    d.FieldDescriptor.TYPE_DOUBLE: "double",
    d.FieldDescriptor.TYPE_BOOL: "bool",
}


def _relative(full_name: str) -> str:
    assert full_name.startswith(PACKAGE + ".")
    return full_name[len(PACKAGE) + 1 :]


def _spec_type(f: d.FieldDescriptor) -> str:
    """Render a field descriptor the way the spec table writes its type."""
    if f.message_type is not None and f.message_type.GetOptions().map_entry:
        k, v = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
        return f"map<{_SCALARS[k.type]},{_SCALARS[v.type]}>"
    if f.type == d.FieldDescriptor.TYPE_MESSAGE:
        base = _relative(f.message_type.full_name)
    elif f.type == d.FieldDescriptor.TYPE_ENUM:
        base = _relative(f.enum_type.full_name)
    else:
        base = _SCALARS[f.type]
    return f"repeated {base}" if f.is_repeated else base


def test_c10_01_stubs_regenerate_without_diff(tmp_path: Path) -> None:
    """``grpc_tools.protoc -I proto`` into a temp dir gives exactly the committed stubs."""
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={tmp_path}",
        f"--pyi_out={tmp_path}",
        f"--grpc_python_out={tmp_path}",
        str(PROTO_ROOT / PROTO_FILE),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "inferencecache" / "v1alpha1"
    produced = sorted(p.name for p in out.iterdir())
    assert produced == sorted(GENERATED)
    for name in GENERATED:
        assert filecmp.cmp(out / name, STUB_DIR / name, shallow=False), f"{name} differs"


def test_c10_01_file_identity_and_package() -> None:
    fd = pb.DESCRIPTOR
    assert fd.name == PROTO_FILE
    assert fd.package == PACKAGE
    proto = descriptor_pb2.FileDescriptorProto()
    fd.CopyToProto(proto)
    assert proto.syntax == "proto3"
    assert list(fd.services_by_name) == [SERVICE]


def test_c10_01_service_methods_and_streaming_shapes() -> None:
    svc = pb.DESCRIPTOR.services_by_name[SERVICE]
    assert svc.full_name == f"{PACKAGE}.{SERVICE}"
    got = {
        m.name: (
            _relative(m.input_type.full_name),
            _relative(m.output_type.full_name),
            m.client_streaming,
            m.server_streaming,
        )
        for m in svc.methods
    }
    assert got == RPCS
    assert [m.name for m in svc.methods] == list(RPCS)  # declaration order, too


def test_c10_01_every_message_field() -> None:
    top = {
        name
        for name, m in pb.DESCRIPTOR.message_types_by_name.items()
        if not m.GetOptions().map_entry
    }
    assert top == set(MESSAGES)
    for name, fields in MESSAGES.items():
        msg = pb.DESCRIPTOR.message_types_by_name[name]
        got = [(f.number, f.name, _spec_type(f)) for f in msg.fields]
        assert sorted(got) == sorted(fields + ADDITIVE.get(name, [])), name
        # proto3 plain fields: no explicit presence beyond message-typed fields
        for f in msg.fields:
            if f.type != d.FieldDescriptor.TYPE_MESSAGE:
                assert not f.has_presence, f"{name}.{f.name} must not be optional"


def test_c10_01_repeated_numerics_are_packed() -> None:
    """contract-and-index.md §2.3: repeated numerics use proto3's default packed encoding."""
    req = pb.LookupRouteRequest(block_token_counts=[16, 16], token_ids=[1, 2, 3])
    wire = req.SerializeToString()
    assert b"\x42\x02\x10\x10" in wire  # field 8, wire type 2, 2 bytes
    assert b"\x4a\x03\x01\x02\x03" in wire  # field 9 packed


@pytest.mark.parametrize("enum_name", sorted(ENUMS))
def test_c10_01_enums(enum_name: str) -> None:
    if "." in enum_name:
        outer, inner = enum_name.split(".")
        enum = pb.DESCRIPTOR.message_types_by_name[outer].enum_types_by_name[inner]
    else:
        enum = pb.DESCRIPTOR.enum_types_by_name[enum_name]
    assert [(v.name, v.number) for v in enum.values] == ENUMS[enum_name]


def test_c10_01_only_the_spec_enums_exist() -> None:
    nested = {
        f"{m.name}.{e.name}"
        for m in pb.DESCRIPTOR.message_types_by_name.values()
        for e in m.enum_types
    }
    assert set(pb.DESCRIPTOR.enum_types_by_name) | nested == set(ENUMS)


def test_additive_fields_only_extend_their_messages() -> None:
    """An additive field never reuses or renumbers a spec field (contract-and-index.md §2.1:
    additive)."""
    for name, extra in ADDITIVE.items():
        spec_numbers = {n for n, _, _ in MESSAGES[name]}
        spec_names = {f for _, f, _ in MESSAGES[name]}
        for number, field, _ in extra:
            assert number > max(spec_numbers), (name, field)
            assert field not in spec_names, (name, field)


def test_batched_eviction_field_is_ignored_by_a_v1alpha1_reader() -> None:
    """A reader built from the spec tables alone (no field 8) still sees ``prefix_hash``."""
    from google.protobuf import descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    for m in proto.message_type:
        if m.name == "CacheEvent":
            keep = [f for f in m.field if f.name != "prefix_hashes"]
            del m.field[:]
            m.field.extend(keep)
    pool = descriptor_pool.DescriptorPool()  # its own pool: same names, no clash
    pool.Add(proto)
    old_cls = message_factory.GetMessageClass(
        pool.FindMessageTypeByName(f"{PACKAGE}.CacheEvent"))
    new = pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED, replica_id="r", prefix_hash=b"a" * 8,
                        prefix_hashes=[b"b" * 8, b"c" * 8])
    old = old_cls.FromString(new.SerializeToString())
    assert (old.type, old.replica_id, old.prefix_hash) == (2, "r", b"a" * 8)
    assert not hasattr(old, "prefix_hashes")
