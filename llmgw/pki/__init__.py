"""The fleet's private certificate authority and TLS contexts."""

from llmgw.pki.ca import (
    CA_CERT,
    CA_KEY,
    DEFAULT_PKI_DIR,
    Issued,
    PKIError,
    common_name,
    init_ca,
    issue_client,
    issue_server,
    load_ca,
    load_cert,
    load_pair,
    parse_san,
    san_names,
    validate_node_id,
    verify_issued_by,
)
from llmgw.pki.tls import check_claim, client_context, peer_node_id, server_context

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "DEFAULT_PKI_DIR",
    "Issued",
    "PKIError",
    "check_claim",
    "client_context",
    "common_name",
    "init_ca",
    "issue_client",
    "issue_server",
    "load_ca",
    "load_cert",
    "load_pair",
    "parse_san",
    "peer_node_id",
    "san_names",
    "server_context",
    "validate_node_id",
    "verify_issued_by",
]
