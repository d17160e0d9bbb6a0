"""The administrator's pages in real headless Chromium against a real `llmgw server` control plane and a
real agent (mutual TLS) that installs llama.cpp from a local release server and runs the tiny model in a
real llama-server: the Cluster page shows the node and the replica and refreshes in place, the node page
and its logs render (the agent's log, the engine's output, following), People approves a sign-up, and a
person who is not an administrator is refused. Every page fits 390 px; a screenshot of each is written
to LLMGW_SCREENSHOTS (or the test's directory)."""

from __future__ import annotations

import httpx
import pytest
from browsing import NARROW, PASSWORD, cli, fits, shot_dir, sign_in
from harness import (
    Gateway,
    Prometheus,
    free_port,
    kill_engines,
    release_files,
    serve_files,
    start_agent,
    wait_until,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # an agent installs llama.cpp and serves a replica

TAG = "b9999"


def test_an_administrator_sees_the_cluster_a_node_and_its_logs_and_approves_a_sign_up_in_chromium(
    browser, llama_server_bin, tiny_model, tmp_path
):
    pki = tmp_path / "pki"
    cli("ctl", "cert", "init-ca", "--dir", str(pki))
    cli("ctl", "cert", "issue-server", "127.0.0.1", "localhost", "--dir", str(pki))
    cli("ctl", "cert", "issue-client", "node-a", "--dir", str(pki))
    files, stop_files = serve_files(
        {**release_files(llama_server_bin, TAG), "/models/tiny.gguf": tiny_model.read_bytes()}
    )
    agent_port, metrics_port = free_port(), free_port()
    prom = Prometheus(tmp_path, [f"127.0.0.1:{metrics_port}"]).wait_ready()
    gw = Gateway(
        tmp_path,
        models=[
            {
                "name": "tiny",
                "description": "the tiny test model",
                "source": files + "/models/tiny.gguf",
                "scaling": {"min": 1},
                "profiles": [{"engine": "llamacpp", "args": ["--ctx-size", "256"], "startup_timeout": "120s"}],
            }
        ],
        agent_listen=f"127.0.0.1:{agent_port}",
        agent_tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "server.pem"), "key": str(pki / "server-key.pem")},
        control={"enabled": True, "unreachable_after": "3s", "lost_after": "10s", "interval": "500ms"},
        engines={"llamacpp": TAG, "release_url": files},
        auth={"signup_open": True},
        metrics_listen=f"127.0.0.1:{metrics_port}",
        monitoring={"prometheus": prom.url},
    )
    agent = start_agent(tmp_path, "node-a", agent_port, pki, supervisor={"health_interval": "250ms"})
    procs = [gw, agent, prom]
    engine_pids: list[int] = []

    def replicas() -> list[dict]:
        try:
            return httpx.get(gw.admin + "/api/v1/replicas", headers=gw.admin_auth, timeout=10).json()["replicas"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    try:
        gw.wait_up(ready=False)
        ready = wait_until(
            lambda: [r for r in replicas() if r["state"] == "ready"], 180, "a ready replica of tiny on node-a", procs
        )
        replica = ready[0]
        shard = replica["shards"][0]["shard_id"]
        engine_pids += [s["pid"] for s in replica["shards"] if s.get("pid")]
        # A 15-minute chart takes a point every 7.5 s: twelve scrapes a second apart make a line of two.
        wait_until(
            lambda: (
                prom.samples('llmgw_replicas{state="ready"} > 0') >= 12
                and prom.samples('llmgw_node_cpu_utilization_percent{node="node-a"}') >= 12
            ),
            90,
            "Prometheus to hold twelve scrapes of the ready replica and node-a's CPU",
            procs,
        )
        cli("users", "create", "root@example.com", "--password", PASSWORD, "--config", str(gw.config))
        cli("users", "promote", "root@example.com", "--config", str(gw.config))
        shots = shot_dir(tmp_path)
        context = browser.new_context(viewport=NARROW)
        page = context.new_page()

        # Someone signs up; the administrator approves them on People below.
        page.goto(gw.url + "/signup")
        page.fill("input[name=email]", "dana@example.com")
        page.fill("input[name=password]", PASSWORD)
        page.fill("input[name=password2]", PASSWORD)
        page.click("main button[type=submit]")
        page.wait_for_selector("text=waits for approval")

        sign_in(page, gw.url, "root@example.com")
        page.goto(gw.url + "/admin")
        assert page.get_attribute("nav a[href='/admin']", "aria-current") == "page"
        nodes = page.locator("#h-nodes + .table-box")
        assert "node-a" in nodes.inner_text() and "llamacpp" in nodes.inner_text()
        models = page.inner_text("#h-models ~ .table-box")
        assert replica["id"] in models and "ready" in models and "the tiny test model" in models
        assert "dana@example.com" in page.inner_text("#h-people ~ ul")
        # The history, read back from the real Prometheus: four panels, the replicas drawn as a line.
        page.click("section[aria-labelledby=h-history] a:has-text('the last 15 minutes')")
        page.wait_for_url(gw.url + "/admin?window=15m")
        history = page.locator("section[aria-labelledby=h-history]")
        assert history.locator("figure.h-chart").count() == 4
        replicas_chart = history.locator("figure.h-chart:has(figcaption:text-is('Replicas'))")
        assert replicas_chart.locator("polyline.h-line").count() >= 1
        assert "ready" in replicas_chart.locator("polyline title").all_text_contents()
        page.click("section[aria-labelledby=h-history] a:has-text('the last day')")
        page.wait_for_url(gw.url + "/admin?window=1d")
        assert page.locator("section[aria-labelledby=h-history] strong[aria-current]").inner_text() == "the last day"
        assert fits(page)
        page.screenshot(path=str(shots / "admin-cluster.png"), full_page=True)
        page.goto(gw.url + "/admin")
        # It refreshes in place: htmx asks for the fragment and swaps it, the page stays.
        with page.expect_response(
            lambda r: r.url == gw.url + "/admin" and r.request.headers.get("hx-request") == "true", timeout=20_000
        ) as refreshed:
            pass
        assert refreshed.value.status == 200
        page.wait_for_selector("#cluster")
        assert page.url == gw.url + "/admin" and "node-a" in page.inner_text("#cluster")

        # The node page, then its logs: the agent's own, the engine's, following.
        page.click("#cluster a[href='/admin/nodes/node-a']")
        page.wait_for_url(gw.url + "/admin/nodes/node-a")
        text = page.inner_text("main")
        assert "Node node-a" in text and "llamacpp" in text and shard in text and "no GPU" in text
        page.goto(gw.url + "/admin/nodes/node-a?window=15m")
        cpu = page.locator("section[aria-labelledby=h-history] figure.h-chart:has(figcaption:text-is('CPU'))")
        assert cpu.locator("polyline.h-line").count() >= 1
        page.goto(gw.url + "/admin/nodes/node-a")
        assert fits(page)
        page.screenshot(path=str(shots / "admin-node.png"), full_page=True)
        page.click("main a[href='/admin/nodes/node-a/logs']")
        page.wait_for_selector("#log")
        assert "connected to the control plane" in page.inner_text("#log")
        assert fits(page)
        page.screenshot(path=str(shots / "admin-node-logs.png"), full_page=True)
        page.click(f".pills a:has-text('{shard}')")
        page.wait_for_url(lambda u: f"source={shard}" in u)
        page.check("input[name=follow]")
        page.click("form.admin-inline button[type=submit]")
        page.wait_for_url(lambda u: "follow=1" in u)
        assert page.inner_text("#log").strip()  # llama-server's own output
        with page.expect_response(lambda r: "follow=1" in r.url and r.request.headers.get("hx-request") == "true"):
            pass
        assert fits(page)
        page.screenshot(path=str(shots / "admin-shard-logs.png"), full_page=True)

        # People: approve the sign-up on their own.
        page.click("nav a[href='/admin/users']")
        page.wait_for_url(gw.url + "/admin/users")
        assert page.get_attribute("nav a[href='/admin/users']", "aria-current") == "page"
        # An organization, a team in it and a project in the team, through the page's own forms.
        for fold, name in (("+ organization", "Acme"), ("+ team", "platform"), ("+ project", "gateway")):
            if not page.locator(f"details[open] > summary:has-text('{fold}')").count():
                page.click(f"summary:has-text('{fold}')")
            form = page.locator(f"details[open]:has(> summary:has-text('{fold}')) form")
            form.locator("input[name=name]").fill(name)
            form.locator("button[type=submit]").click()
            page.wait_for_selector(f"p.done:has-text('{name}')")
        page.select_option("#pending select[name=project]", label="Acme/platform/gateway")
        assert fits(page)
        page.screenshot(path=str(shots / "admin-people.png"), full_page=True)
        page.click("#pending button:has-text('Approve')")
        page.wait_for_selector("text=Approved dana@example.com into Acme/platform/gateway.")
        page.click("summary:has-text('gateway')")
        assert "dana@example.com" in page.inner_text("details.admin-project")
        assert fits(page)
        page.screenshot(path=str(shots / "admin-people-tree.png"), full_page=True)
        assert "No sign-up waits for approval." in page.inner_text("#pending")
        assert fits(page)

        # Dana can sign in now, and is refused the administrator's pages.
        other = browser.new_context(viewport=NARROW).new_page()
        sign_in(other, gw.url, "dana@example.com")
        assert other.locator("nav a[href='/admin']").count() == 0
        for path in ("/admin", "/admin/nodes/node-a", "/admin/nodes/node-a/logs", "/admin/users"):
            resp = other.goto(gw.url + path)
            assert resp.status == 403 and "for administrators" in other.inner_text("main"), path
        assert fits(other)
        other.screenshot(path=str(shots / "admin-refused.png"), full_page=True)
    finally:
        for p in (agent, gw, prom):
            if p.alive():
                p.stop()
        kill_engines(engine_pids)
        stop_files()
