"""The Mirror page and the Organization page in real headless Chromium (Debian's chromium, driven by
Playwright) against a real `llmgw mirror serve` and a real `llmgw server` holding its own copy of the
mirror's token: the Mirror page shows a model the mirror holds; a fetch from a local file server that
holds its answer back shows its bytes and percent and completes, refreshed in place (htmx) without a
reload; a Hugging Face stand-in's repository lists its files and fetches one; /org shows the
organization. Every page fits 390 px; a screenshot of each goes to LLMGW_SCREENSHOTS (or the test's
directory)."""

from __future__ import annotations

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from browsing import ADMIN, NARROW, PASSWORD, WIDE, cli, fits, shot_dir, sign_in
from harness import Gateway, Proc, free_port, llmgw_cmd, wait_http
from test_mirror_e2e import HuggingFace

from llmgw.mirror.api import default_token_file, ensure_token
from llmgw.testing.waiting import until

pytestmark = [pytest.mark.e2e]

BIG = os.urandom(3 << 20)  # 3 MiB


def _gguf(tmp_path: Path, arch: str) -> bytes:
    import gguf as gguf_lib
    import numpy as np

    path = tmp_path / f"{arch}.gguf"
    w = gguf_lib.GGUFWriter(str(path), arch)
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path.read_bytes()


class HeldFile:
    """A local file server whose one file is sent up to its first MiB, then waits for ``release``."""

    def __init__(self, data: bytes) -> None:
        self.release = threading.Event()
        held = self

        class H(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                if self.path != "/big.bin":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data[: 1 << 20])
                self.wfile.flush()
                held.release.wait(120)
                self.wfile.write(data[1 << 20 :])

            def log_message(self, *a):
                pass

        self.srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.srv.server_address[1]}/big.bin"

    def close(self) -> None:
        self.release.set()
        self.srv.shutdown()


def test_the_mirror_page_shows_a_held_model_and_a_fetch_arriving_in_place_in_chromium(browser, tmp_path):
    tiny = _gguf(tmp_path, "llama")
    hf = HuggingFace({"acme/Tiny-GGUF": {"tiny-q4_k_m.gguf": tiny, "mmproj-tiny-f16.gguf": tiny}}, gated=set())
    source = HeldFile(BIG)
    mirror_dir = tmp_path / "models"
    (mirror_dir / "tiny" / "v1").mkdir(parents=True)
    (mirror_dir / "tiny" / "v1" / "tiny.gguf").write_bytes(tiny)  # held: copied in by hand
    token_file = default_token_file(mirror_dir)
    ensure_token(token_file)  # as `llmgw mirror init` makes it, before either starts
    wport, aport = free_port(), free_port()
    base = f"http://127.0.0.1:{wport}"
    mirror = Proc(
        llmgw_cmd(
            "mirror",
            "--dir",
            str(mirror_dir),
            "serve",
            "--listen",
            f"127.0.0.1:{wport}",
            "--api-listen",
            f"127.0.0.1:{aport}",
            "--base",
            base,
            "--allow-local-sources",  # the held file's server is on loopback
        ),
        tmp_path / "mirror.log",
        env={**os.environ, "HF_ENDPOINT": hf.url, "PYTHONUNBUFFERED": "1"},
    )
    gw = Gateway(
        tmp_path,
        models=[],
        agent_listen=f"127.0.0.1:{free_port()}",
        agent_tls=None,
        control={"enabled": True},
        mirror={"api": f"http://127.0.0.1:{aport}", "token_file": str(token_file), "registry": hf.url},
    )
    procs = [mirror, gw]
    try:
        wait_http(f"http://127.0.0.1:{aport}/v1/health", mirror.proc, 30, mirror.log)
        gw.wait_up(ready=False)
        cli("users", "create", ADMIN, "--password", PASSWORD, "--name", "Root", config=gw.config)
        cli("users", "promote", ADMIN, config=gw.config)
        cli("org", "add", "org", "Acme", config=gw.config)
        cli("org", "add", "team", "platform", "--in", "Acme", config=gw.config)
        cli("org", "add", "project", "gateway", "--in", "Acme/platform", config=gw.config)
        shots = shot_dir(tmp_path)
        page = browser.new_page(viewport=WIDE)
        sign_in(page, gw.url, ADMIN, "/admin/mirror")
        assert page.get_attribute("nav a[href='/admin/mirror']", "aria-current") == "page"
        held = page.locator("#v-tiny-v1")
        assert "tiny.gguf" in held.inner_text() and "present" in held.inner_text()
        assert f"{base}/tiny/v1/tiny.gguf" in held.inner_text()
        page.screenshot(path=str(shots / "mirror-wide.png"), full_page=True)

        # A fetch from the local source: its bytes and percent while the source holds back.
        form = page.locator("form.m-fetch")
        form.locator("input[name=source]").fill(source.url)
        form.locator("input[name=model]").fill("big")
        form.locator("input[name=version]").fill("v1")
        form.get_by_role("button", name="Fetch").click()
        page.wait_for_url(lambda u: "said=fetching" in u)
        page.get_by_text("Fetching big/v1").wait_for()
        arriving = page.locator("#downloads li.m-fetching", has_text="big/v1/big.bin")
        arriving.get_by_text("1.0 MiB of 3.0 MiB (33%)").wait_for(timeout=20_000)
        assert arriving.locator("progress").get_attribute("value") == "33.3"
        assert page.get_attribute("#mirror-live", "hx-trigger") == "every 5s, refresh"
        page.screenshot(path=str(shots / "mirror-fetching.png"), full_page=True)
        page.set_viewport_size(NARROW)
        assert fits(page)
        page.screenshot(path=str(shots / "mirror-fetching-narrow.png"), full_page=True)
        page.set_viewport_size(WIDE)

        # Released, it completes; the page learns it by refreshing its live part in place, not by a reload.
        page.evaluate("window.llmgwMark = 1")
        source.release.set()
        page.locator("#v-big-v1", has_text="present").wait_for(timeout=30_000)
        assert page.evaluate("window.llmgwMark") == 1
        assert page.get_attribute("#mirror-live", "hx-trigger") is None  # nothing left to follow
        assert "Nothing is downloading." in page.inner_text("#downloads")
        assert (mirror_dir / "big" / "v1" / "big.bin").read_bytes() == BIG
        page.screenshot(path=str(shots / "mirror-fetched.png"), full_page=True)

        # A repository on the Hugging Face stand-in (mirror.registry): its files, and one fetched from there.
        page.goto(gw.url + "/admin/mirror/repo?repo=acme/Tiny-GGUF")
        row = page.locator("tr.m-repo-file", has_text="tiny-q4_k_m.gguf")
        assert "Q4_K_M" in row.inner_text()
        assert "not a model on its own" in page.locator("tr.m-repo-file", has_text="mmproj").inner_text()
        page.screenshot(path=str(shots / "mirror-repo.png"), full_page=True)
        row.get_by_role("button", name="Fetch").click()
        page.wait_for_url(lambda u: "said=fetching" in u)
        until(
            lambda: any(p.name == "tiny-q4_k_m.gguf" for p in (mirror_dir / "tiny").rglob("*.gguf")),
            30,
            "the file fetched from the repository page to arrive",
            procs,
        )

        # Every page at 390 px: the Mirror page, a repository, the organization.
        page.set_viewport_size(NARROW)
        for path, name in (
            ("/admin/mirror", "mirror"),
            ("/admin/mirror/repo?repo=acme/Tiny-GGUF", "mirror-repo"),
            ("/org", "org"),
        ):
            page.goto(gw.url + path)
            assert fits(page), path
            page.screenshot(path=str(shots / f"{name}-narrow.png"), full_page=True)
        assert "<h1>Acme</h1>" in page.content() and "platform" in page.inner_text("main")
        page.goto(gw.url + "/admin/mirror")
        page.locator("#v-tiny-v1 summary", has_text="Serve").click()
        assert fits(page)
        page.screenshot(path=str(shots / "mirror-serve-narrow.png"), full_page=True)
    finally:
        source.close()
        for p in reversed(procs):
            if p.alive():
                p.stop()
        hf.close()
