"""The pages' static files: htmx is the release npm published, and every file is served under a name
that carries its content's hash."""

from __future__ import annotations

import base64
import hashlib
import io
import tarfile
from pathlib import Path

from llmgw.server.pages.assets import STATIC_DIR, Assets

REPO = Path(__file__).resolve().parents[2]
TARBALL = REPO / "vendor" / "htmx.org-2.0.11.tgz"
# `npm view htmx.org@2.0.11 dist.integrity`: the registry's hash of the package tarball.
NPM_INTEGRITY = "sha512-Thx/WtpeOQqSrqBCw/A1cwGJGg4UrVa3+sW0GmrM3p4gJgO89ecH4qtbnyzDDWFvBTqjnIMCgELTNt636dtamA=="


def test_the_vendored_htmx_tarball_is_the_one_npm_publishes_under_its_integrity_hash():
    digest = base64.b64encode(hashlib.sha512(TARBALL.read_bytes()).digest()).decode()
    assert f"sha512-{digest}" == NPM_INTEGRITY


def test_the_served_htmx_is_exactly_the_minified_file_in_that_tarball():
    with tarfile.open(fileobj=io.BytesIO(TARBALL.read_bytes())) as tf:
        member = tf.extractfile("package/dist/htmx.min.js")
        assert member is not None
        assert (STATIC_DIR / "htmx.min.js").read_bytes() == member.read()


KATEX = REPO / "vendor" / "katex-0.19.1.tgz"
# `npm view katex@0.19.1 dist.integrity`.
KATEX_INTEGRITY = "sha512-jG8uKntjSEcm2EpQOh0XturpPuuC9r3Sq5HLHdsFdWZT27E672SF19QEi+of0/YeOy15lDgRhKvr5614uRrEfA=="


def test_the_vendored_katex_tarball_is_the_one_npm_publishes_and_the_served_file_is_its_own():
    data = KATEX.read_bytes()
    assert "sha512-" + base64.b64encode(hashlib.sha512(data).digest()).decode() == KATEX_INTEGRITY
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        member = tf.extractfile("package/dist/katex.min.js")
        assert member is not None
        assert (STATIC_DIR / "katex.min.js").read_bytes() == member.read()


def test_a_static_name_carries_its_content_hash_so_a_change_renames_it(tmp_path):
    (tmp_path / "style.css").write_text("body{}")
    first = Assets(tmp_path).url("style.css")
    (tmp_path / "style.css").write_text("body{color:red}")
    second = Assets(tmp_path).url("style.css")
    assert first.startswith("/static/style.") and first.endswith(".css") and first != second


async def test_static_files_are_cached_for_good_and_unknown_names_are_not_found():
    from aiohttp import web
    from aiohttp.test_utils import TestClient, TestServer

    assets = Assets()
    app = web.Application()
    assets.add_routes(app)
    async with TestClient(TestServer(app)) as client:
        r = await client.get(assets.url("style.css"))
        assert r.status == 200 and "immutable" in r.headers["Cache-Control"]
        assert r.headers["Content-Type"].startswith("text/css")
        assert (await client.get("/static/style.css")).status == 404  # only the hashed name
        assert (await client.get("/static/..%2Fassets.py")).status == 404
