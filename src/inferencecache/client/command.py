"""``inferencecache lookup``: one LookupRoute call, printed as JSON.

Input is exactly one of ``--tokens``, ``--token-file`` or ``--text``. Token ids are sent as
``token_ids`` (the server fingerprints them with its ``--block-size``) unless ``--client-chain``
is given, in which case the chain is computed here with ``--block-size`` and sent as
``block_hashes`` + ``block_token_counts``, the way a gateway does it. ``--text`` is sent as
``prompt_text`` (the server tokenizes it with the model's chat template).
"""

from __future__ import annotations

import http.client
import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import click
import grpc
from google.protobuf import json_format

from inferencecache.channels import (
    ChannelSecurity,
    auth_token_file_setting,
    security_of,
    tls_ca_file_setting,
    tls_cert_file_setting,
    tls_key_file_setting,
)
from inferencecache.config import (
    CONTEXT,
    DURATION,
    GO_BOOL,
    HOST_PORT,
    HostPort,
    command_options,
    setting,
)
from inferencecache.server.settings import DEFAULT_GRPC_ADDRESS
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

MAX_TOKENS = 1_048_576
_SPLIT = re.compile(r"[\s,]+")


@dataclass(frozen=True)
class LookupSettings:
    model_id: str = setting(help="Model id of the lookup.", required=True)
    server: HostPort = setting(  # noqa: RUF009 (HostPort is frozen)
        DEFAULT_GRPC_ADDRESS, param=HOST_PORT, help="Server gRPC address."
    )
    lookup_url: str = setting(
        "",
        help="Ask over the server's HTTP lookup listener instead of gRPC (serve "
        "--lookup-http-address), e.g. http://127.0.0.1:8081: the cheaper path.",
        metavar="URL",
    )
    tenant_id: str = setting("default", help="Tenant id (the engines' pod namespace).")
    hash_scheme: str = setting("vllm", help="Hash scheme of the chain.")
    adapter_id: str = setting("", help="LoRA adapter partition; empty = base model.")
    tokens: str | None = setting(None, help="Token ids, comma separated: 1,2,3.", metavar="IDS")
    token_file: str | None = setting(
        None,
        help="File of token ids (comma/whitespace separated, or a JSON array).",
        metavar="PATH",
    )
    text: str | None = setting(
        None, help="Prompt text, tokenized by the server with the model's chat template."
    )
    client_chain: bool = setting(
        False,
        param=GO_BOOL,
        help="Fingerprint the tokens here and send block_hashes + "
        "block_token_counts instead of token_ids.",
    )
    block_size: int = setting(
        16, help="Tokens per block for --client-chain and --pd-topology (as the engines)."
    )
    pd_topology: str = setting(
        "",
        help="Ask LookupPDRoute in this topology of the server's --pd-topology-file instead: "
        "the tokens' last block hash as prefix_hash (gRPC only).",
        metavar="NAME",
    )
    timeout: float = setting(2.0, param=DURATION, help="RPC deadline.")
    auth_token_file: str = auth_token_file_setting()
    tls_ca_file: str = tls_ca_file_setting()
    tls_cert_file: str = tls_cert_file_setting()
    tls_key_file: str = tls_key_file_setting()

    def __post_init__(self) -> None:
        ChannelSecurity.of(self).check_flags()
        given = [
            flag
            for flag, value in (
                ("--tokens", self.tokens),
                ("--token-file", self.token_file),
                ("--text", self.text),
            )
            if value is not None
        ]
        if len(given) != 1:
            which = " and ".join(given) if given else "none"
            raise ValueError(f"give exactly one of --tokens, --token-file, --text (got {which})")
        if self.client_chain and self.text is not None:
            raise ValueError("--client-chain needs --tokens or --token-file")
        if self.pd_topology and (self.text is not None or self.lookup_url):
            raise ValueError("--pd-topology needs --tokens or --token-file, over gRPC")
        if (self.client_chain or self.pd_topology) and self.block_size <= 0:
            raise ValueError(f"--block-size must be > 0, got {self.block_size}")
        if self.timeout <= 0:
            raise ValueError("--timeout must be > 0")
        if self.lookup_url:
            url = urlsplit(self.lookup_url)
            if url.scheme != "http" or not url.hostname or url.path not in ("", "/"):
                raise ValueError(f"--lookup-url {self.lookup_url!r}: give http://HOST:PORT")


def parse_token_list(text: str, source: str) -> list[int]:
    """Comma/whitespace separated ids, or a JSON array; every id in 0..2**32-1."""
    from inferencecache.fingerprint import MAX_U32  # lazily, like the chain below

    stripped = text.strip()
    items: list[object]
    if stripped.startswith("["):
        try:
            loaded = json.loads(stripped)
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed token list in {source}: {e.msg}") from None
        if not isinstance(loaded, list):
            raise ValueError(f"malformed token list in {source}: not an array")
        items = loaded
    else:
        items = [p for p in _SPLIT.split(stripped) if p]
    if not items:
        raise ValueError(f"empty token list in {source}")
    if len(items) > MAX_TOKENS:
        raise ValueError(f"too many tokens in {source}: {len(items)} > {MAX_TOKENS}")
    out: list[int] = []
    for i, item in enumerate(items):
        value: int | None = None
        if isinstance(item, str) and item.isascii() and item.isdigit():
            value = int(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            value = item
        if value is None or not 0 <= value <= MAX_U32:
            raise ValueError(
                f"malformed token list in {source}: item {i} ({item!r}) is not a token id "
                "in 0..4294967295"
            )
        out.append(value)
    return out


def read_tokens(settings: LookupSettings) -> list[int]:
    """The ids of ``--tokens`` or ``--token-file``."""
    if settings.tokens is not None:
        return parse_token_list(settings.tokens, "--tokens")
    assert settings.token_file is not None
    try:
        content = Path(settings.token_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise ValueError(f"cannot read --token-file {settings.token_file!r}: {reason}") from e
    return parse_token_list(content, f"--token-file {settings.token_file!r}")


def build_pd_request(settings: LookupSettings) -> pb.LookupPDRouteRequest:
    """LookupPDRoute for the tokens: their chain's last block hash names the whole prefix."""
    from inferencecache import fingerprint

    hashes, counts = fingerprint.chain(read_tokens(settings), settings.block_size)
    return pb.LookupPDRouteRequest(
        model_id=settings.model_id,
        tenant_id=settings.tenant_id,
        prefix_hash=hashes[-1] if hashes else b"",
        prefix_token_count=sum(counts),
        pd_topology_ref=settings.pd_topology,
    )


def build_request(settings: LookupSettings) -> pb.LookupRouteRequest:
    req = pb.LookupRouteRequest(
        model_id=settings.model_id,
        tenant_id=settings.tenant_id,
        hash_scheme=settings.hash_scheme,
        adapter_id=settings.adapter_id,
    )
    if settings.text is not None:
        req.prompt_text = settings.text
        return req
    tokens = read_tokens(settings)
    if settings.client_chain:
        from inferencecache import fingerprint

        hashes, counts = fingerprint.chain(tokens, settings.block_size)
        req.block_hashes.extend(hashes)
        req.block_token_counts.extend(counts)
    else:
        req.token_ids.extend(tokens)
    return req


def to_json(resp: pb.LookupRouteResponse | pb.LookupPDRouteResponse) -> str:
    text: str = json_format.MessageToJson(
        resp,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        indent=2,
    )
    return text


def _over_http(settings: LookupSettings, req: pb.LookupRouteRequest) -> pb.LookupRouteResponse:
    """``POST /v1/lookup`` with the request's protobuf bytes (one keep-alive-free call)."""
    url = urlsplit(settings.lookup_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port or 80,
                                      timeout=settings.timeout)  # fmt: skip
    headers = {"Content-Type": "application/x-protobuf"}
    auth = ChannelSecurity.of(settings).authorization()
    if auth is not None:
        headers["Authorization"] = auth
    try:
        conn.request("POST", "/v1/lookup", req.SerializeToString(), headers)
        r = conn.getresponse()
        raw = r.read()
    except TimeoutError:
        raise click.ClickException(
            f"server {settings.lookup_url} did not answer within the {settings.timeout:g}s "
            "timeout"
        ) from None
    except OSError as e:
        reason = e.strerror or str(e)
        raise click.ClickException(f"server {settings.lookup_url} unreachable: {reason}") from None
    finally:
        conn.close()
    if r.status != 200:
        raise click.ClickException(f"LookupRoute failed: HTTP {r.status}: {raw[:200]!r}")
    resp: pb.LookupRouteResponse = pb.LookupRouteResponse.FromString(raw)
    return resp


@click.command("lookup", context_settings=CONTEXT)
@command_options(LookupSettings)
def lookup(settings: LookupSettings) -> int:
    """Ask a server for a routing hint and print the LookupRouteResponse (with
    --pd-topology: the LookupPDRouteResponse) as JSON."""
    security_of(settings)  # the credential and TLS files, read once: exit 2 when unusable
    try:
        req = build_pd_request(settings) if settings.pd_topology else build_request(settings)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    method = "LookupPDRoute" if settings.pd_topology else "LookupRoute"
    if settings.lookup_url:
        assert isinstance(req, pb.LookupRouteRequest)
        click.echo(to_json(_over_http(settings, req)))
        return 0
    target = str(settings.server)
    security = ChannelSecurity.of(settings)
    with security.channel(target) as channel:
        stub = pb_grpc.InferenceCacheStub(channel)  # type: ignore[no-untyped-call]
        try:
            resp = getattr(stub, method)(req, timeout=settings.timeout,
                                         metadata=security.metadata())
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            details = " ".join(str(e.details() if hasattr(e, "details") else e).split())
            if code == grpc.StatusCode.UNAVAILABLE:
                raise click.ClickException(f"server {target} unreachable: {details}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise click.ClickException(
                    f"server {target} did not answer within the {settings.timeout:g}s timeout"
                ) from None
            name = code.name if code is not None else "UNKNOWN"
            raise click.ClickException(f"{method} failed: {name}: {details}") from None
    click.echo(to_json(resp))
    return 0
