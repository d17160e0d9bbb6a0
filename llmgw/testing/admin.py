"""The admin API's credential for tests that run a Server in their own process."""

from __future__ import annotations


def admin_headers(server) -> dict[str, str]:
    """Headers carrying the admin token the server made at its first start (data_dir/admin-token)."""
    return {"Authorization": f"Bearer {server.admin_token_file.read_text().strip()}"}
