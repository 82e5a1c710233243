"""JSON schemas for the Prometheus Operator objects under deploy/observability and the
cert-manager objects of deploy/overlays/tls.

kubernetes-validate ships the schemas of Kubernetes' own kinds only. These cover the fields of
``monitoring.coreos.com/v1`` ServiceMonitor, PodMonitor and PrometheusRule that this project uses,
with the CRDs' types and duration pattern, and reject any other field (a typo in a manifest is
silently ignored by a real cluster, so it must fail here). The PrometheusRule's rules themselves
are checked by ``promtool``.
"""

from __future__ import annotations

from typing import Any

DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
)

_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                   "labels": _STR_MAP, "annotations": _STR_MAP},
    "additionalProperties": False,
}  # fmt: skip
_SELECTOR = {
    "type": "object",
    "properties": {
        "matchLabels": _STR_MAP,
        "matchExpressions": {"type": "array", "items": {
            "type": "object", "required": ["key", "operator"],
            "properties": {"key": {"type": "string"}, "operator": {"type": "string"},
                           "values": {"type": "array", "items": {"type": "string"}}},
            "additionalProperties": False}},
    },
    "additionalProperties": False,
}  # fmt: skip
_ENDPOINT_FIELDS = {
    "port": {"type": "string"},
    "path": {"type": "string"},
    "scheme": {"enum": ["http", "https"]},
    "interval": {"type": "string", "pattern": DURATION},
    "scrapeTimeout": {"type": "string", "pattern": DURATION},
    "honorLabels": {"type": "boolean"},
}


def _object(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": _METADATA,
            "spec": spec,
        },
        "additionalProperties": False,
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _object("ServiceMonitor", {
        "type": "object",
        "required": ["selector", "endpoints"],
        "properties": {
            "selector": _SELECTOR,
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "properties": _ENDPOINT_FIELDS, "additionalProperties": False}},
        },
        "additionalProperties": False,
    }),
    "PodMonitor": _object("PodMonitor", {
        "type": "object",
        "required": ["selector", "podMetricsEndpoints"],
        "properties": {
            "selector": _SELECTOR,
            "namespaceSelector": {"type": "object"},
            "jobLabel": {"type": "string"},
            "podMetricsEndpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "properties": _ENDPOINT_FIELDS, "additionalProperties": False}},
        },
        "additionalProperties": False,
    }),
    "PrometheusRule": _object("PrometheusRule", {
        "type": "object",
        "required": ["groups"],
        "properties": {"groups": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["name", "rules"],
            "properties": {
                "name": {"type": "string", "minLength": 1},
                "interval": {"type": "string", "pattern": DURATION},
                "rules": {"type": "array", "items": {
                    "type": "object",
                    "required": ["expr"],
                    "properties": {
                        "record": {"type": "string"}, "alert": {"type": "string"},
                        "expr": {"type": "string"},
                        "for": {"type": "string", "pattern": DURATION},
                        "labels": _STR_MAP, "annotations": _STR_MAP,
                    },
                    "oneOf": [{"required": ["record"]}, {"required": ["alert"]}],
                    "additionalProperties": False}},
            },
            "additionalProperties": False}}},
        "additionalProperties": False,
    }),
}  # fmt: skip


def _cert_manager(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    out = _object(kind, spec)
    out["properties"]["apiVersion"] = {"const": "cert-manager.io/v1"}
    return out


_ISSUER_REF = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "kind": {"enum": ["Issuer", "ClusterIssuer"]},
                   "group": {"type": "string"}},
    "additionalProperties": False,
}  # fmt: skip
_USAGES = ["signing", "digital signature", "content commitment", "key encipherment",
           "key agreement", "data encipherment", "cert sign", "crl sign", "encipher only",
           "decipher only", "any", "server auth", "client auth", "code signing",
           "email protection", "s/mime", "ipsec end system", "ipsec tunnel", "ipsec user",
           "timestamping", "ocsp signing", "microsoft sgc", "netscape sgc"]  # fmt: skip
_GO_DURATION = r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$"

# cert-manager.io/v1 Issuer and Certificate: the fields this project uses, with the CRDs'
# types and enums; anything else fails.
SCHEMAS["Issuer"] = _cert_manager("Issuer", {
    "type": "object",
    "properties": {
        "selfSigned": {"type": "object", "additionalProperties": False},
        "ca": {"type": "object", "required": ["secretName"],
               "properties": {"secretName": {"type": "string"}}, "additionalProperties": False},
    },
    "minProperties": 1,
    "maxProperties": 1,
    "additionalProperties": False,
})  # fmt: skip
SCHEMAS["Certificate"] = _cert_manager("Certificate", {
    "type": "object",
    "required": ["secretName", "issuerRef"],
    "properties": {
        "secretName": {"type": "string"},
        "commonName": {"type": "string", "maxLength": 64},
        "dnsNames": {"type": "array", "items": {"type": "string"}},
        "isCA": {"type": "boolean"},
        "duration": {"type": "string", "pattern": _GO_DURATION},
        "renewBefore": {"type": "string", "pattern": _GO_DURATION},
        "privateKey": {"type": "object", "properties": {
            "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
            "size": {"type": "integer"},
            "rotationPolicy": {"enum": ["Never", "Always"]},
            "encoding": {"enum": ["PKCS1", "PKCS8"]}}, "additionalProperties": False},
        "usages": {"type": "array", "items": {"enum": _USAGES}},
        "issuerRef": _ISSUER_REF,
    },
    "additionalProperties": False,
})  # fmt: skip
