"""The pages on the client port against a real in-process server and a fake engine: signing up, in and
out, the session/API split, CSRF, and the chat page's path through the gateway as the person."""

from __future__ import annotations

import html
import re
from contextlib import asynccontextmanager

import httpx
import orjson
import pytest
from conftest import PG_ADMIN, pg_exec

from llmgw.config.server import parse_server_config
from llmgw.server.app import Server
from llmgw.server.pages.markdown import render_markdown
from llmgw.testing.fake_engine import FakeEngine
from llmgw.testing.ports import free_port as _port

PASSWORD = "correct horse battery"


@asynccontextmanager
async def running(tmp_path, **config):
    """A real server in this process with one fake engine serving "m"; ``config`` adds to server.yaml."""
    engine = await FakeEngine(model="m", tokens=6).start()
    cfg = {
        "listen": f"127.0.0.1:{_port()}",
        "admin_listen": f"127.0.0.1:{_port()}",
        "metrics_listen": None,
        "agent_listen": f"127.0.0.1:{_port()}",
        "agent_tls": None,
        "data_dir": str(tmp_path),
        "models": [{"name": "m", "endpoints": [{"url": engine.url, "engine": "llamacpp"}]}],
        **config,
    }
    srv = Server(parse_server_config(cfg))
    await srv.start()
    try:
        yield srv, engine
    finally:
        await srv.stop()
        await engine.stop()


@pytest.fixture
async def served(tmp_path):
    async with running(
        tmp_path,
        auth={"store": str(tmp_path / "gw.db"), "signup_open": True},
        landing={"contact": "ops@example.com"},
    ) as got:
        yield got


def base(srv: Server) -> str:
    return f"http://127.0.0.1:{srv.config.listen.port}"


def form_token(page: str) -> str:
    m = re.search(r'name="csrf" value="([^"]+)"', page)
    assert m, page
    return m.group(1)


async def sign_in(http: httpx.AsyncClient, email: str, password: str = PASSWORD) -> httpx.Response:
    page = (await http.get("/login")).text
    return await http.post("/login", data={"csrf": form_token(page), "email": email, "password": password})


async def active_person(srv: Server, email: str = "ann@example.com"):
    return await srv.store.create_user(email, PASSWORD)


async def test_the_landing_page_shows_the_address_clients_see_through_a_proxy_and_how_to_get_access(served):
    srv, _ = served
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        r = await http.get("/", headers={"X-Forwarded-Host": "llm.example.com", "X-Forwarded-Proto": "https"})
    assert r.status_code == 200 and "https://llm.example.com/v1" in r.text and "ops@example.com" in r.text
    assert "'self'" in r.headers["Content-Security-Policy"] and r.headers["X-Frame-Options"] == "DENY"


async def test_a_sign_up_waits_for_approval_and_then_signs_in_with_a_hardened_cookie(served):
    srv, _ = served
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        page = (await http.get("/signup")).text
        r = await http.post(
            "/signup",
            data={"csrf": form_token(page), "email": "bob@example.com", "password": PASSWORD, "password2": PASSWORD},
        )
        assert r.status_code == 200 and "waits for approval" in r.text
        r = await sign_in(http, "bob@example.com")
        assert r.status_code == 401 and "approved" in r.text and "llmgw_session" not in http.cookies
        user = next(u for u in (await srv.store.tree(people=True)).users.values() if u.email == "bob@example.com")
        await srv.store.approve(user.id)
        r = await sign_in(http, "bob@example.com")
        assert r.status_code == 303
        cookie = r.headers["set-cookie"]
        assert "llmgw_session=" in cookie and "HttpOnly" in cookie and "SameSite=Lax" in cookie
        assert "Secure" not in cookie
        chat = await http.get("/chat")
        assert chat.status_code == 200 and 'aria-current="page"' in chat.text and "Sign out" in chat.text
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        page = await http.get("/login", headers={"X-Forwarded-Proto": "https"})
        r = await http.post(
            "/login",
            data={"csrf": form_token(page.text), "email": "bob@example.com", "password": PASSWORD},
            headers={"X-Forwarded-Proto": "https"},
        )
        assert "Secure" in r.headers["set-cookie"]


async def test_forms_without_their_token_or_from_another_site_are_refused(served):
    srv, _ = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await http.get("/login")
        r = await http.post("/login", data={"email": "ann@example.com", "password": PASSWORD})
        assert r.status_code == 403 and "security token" in r.text
        page = (await http.get("/login")).text
        r = await http.post(
            "/login",
            data={"csrf": form_token(page), "email": "ann@example.com", "password": PASSWORD},
            headers={"Origin": "https://evil.example"},
        )
        assert r.status_code == 403 and "another site" in r.text
        assert (await sign_in(http, "ann@example.com")).status_code == 303
        r = await http.post("/logout", data={})  # the menu's sign-out needs the session's token too
        assert r.status_code == 403
        r = await http.post("/chat/send", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 403


async def test_a_session_opens_no_api_route_and_an_api_key_opens_no_page(served):
    srv, _ = served
    await active_person(srv)
    key, _ = await srv.store.create_key("client")
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        assert (await http.get("/v1/models")).status_code == 401
        r = await http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}]})
        assert r.status_code == 401
    async with httpx.AsyncClient(base_url=base(srv), headers={"Authorization": f"Bearer {key}"}) as http:
        r = await http.get("/chat")
        assert r.status_code == 303 and r.headers["location"] == "/login?next=/chat"


async def test_signing_out_or_being_suspended_ends_the_session(served):
    srv, _ = served
    ann = await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/chat")).text
        r = await http.post("/logout", data={"csrf": form_token(page)})
        assert r.status_code == 303
        http.cookies.clear()
        # The old cookie, kept by someone, opens nothing any more.
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        kept = http.cookies["llmgw_session"]
        assert (await http.get("/chat")).status_code == 200
        await srv.store.set_user_state(ann.id, "suspended")
        assert (await http.get("/chat")).status_code == 303
    async with httpx.AsyncClient(base_url=base(srv), cookies={"llmgw_session": kept}) as http:
        assert (await http.get("/chat")).status_code == 303


async def test_sign_in_attempts_are_limited_per_account(served):
    srv, _ = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        codes = [(await sign_in(http, "ann@example.com", "wrong password!")).status_code for _ in range(6)]
        assert codes[:5] == [401] * 5 and codes[5] == 429
        r = await sign_in(http, "ann@example.com")  # even the right password waits out the window
        assert r.status_code == 429 and "llmgw_session" not in http.cookies
        wait = int(r.headers["Retry-After"])
        assert 290 < wait <= 300 and f"Too many sign-in attempts; try again in {wait} seconds." in r.text


async def test_signing_in_costs_its_owner_nothing_and_an_empty_form_is_not_an_attempt(served):
    srv, _ = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        for _ in range(4):
            assert (await sign_in(http, "ann@example.com", "wrong password!")).status_code == 401
        for _ in range(3):  # signing in (and out) again and again: none of it counts
            assert (await sign_in(http, "ann@example.com")).status_code == 303
            http.cookies.delete("llmgw_session")
        r = await sign_in(http, "ann@example.com", "")
        assert r.status_code == 400 and "Give your email and your password." in r.text
        assert await srv.store.attempts_counted("account:ann@example.com", 300) == 4
        assert (await sign_in(http, "ann@example.com", "wrong password!")).status_code == 401  # the fifth
        assert (await sign_in(http, "ann@example.com")).status_code == 429


async def test_a_sign_in_while_the_store_cannot_be_reached_is_refused_with_a_clear_page(tmp_path, pg_database):
    name = pg_database.rsplit("/", 1)[1] + "_pages"
    await pg_exec(PG_ADMIN, f'CREATE DATABASE "{name}"')
    try:
        async with running(tmp_path, auth={"store": pg_database.rsplit("/", 1)[0] + "/" + name}) as (srv, _):
            await active_person(srv)
            async with httpx.AsyncClient(base_url=base(srv)) as http:
                page = (await http.get("/login")).text
                await pg_exec(PG_ADMIN, f'DROP DATABASE "{name}" WITH (FORCE)')
                r = await http.post(
                    "/login", data={"csrf": form_token(page), "email": "ann@example.com", "password": PASSWORD}
                )
        assert r.status_code == 503 and "llmgw_session" not in http.cookies
        assert "the account store cannot be reached, so no password was checked" in r.text
    finally:
        await pg_exec(PG_ADMIN, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_a_chat_turn_streams_through_the_gateway_as_the_person_with_the_temperature_held(served):
    srv, engine = served
    ann = await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/chat")).text
        csrf = re.search(r'name="llmgw-csrf" content="([^"]+)"', page).group(1)
        assert '<option value="m"' in page
        r = await http.post(
            "/chat/send",
            json={
                "model": "m",
                "temperature": 9,
                "system": "be brief",
                "messages": [{"role": "user", "content": "hi"}],
            },
            headers={"X-CSRF-Token": csrf},
        )
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [
            orjson.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:") and "[DONE]" not in line
        ]
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
        assert any(e.get("usage") for e in events)
        sent = engine.requests[-1].body
        assert sent["temperature"] == 2.0 and sent["stream"] is True and sent["messages"][0]["role"] == "system"
        r = await http.post(
            "/chat/send",
            json={"model": "m", "project": "prj-nope", "messages": [{"role": "user", "content": "hi"}]},
            headers={"X-CSRF-Token": csrf},
        )
        assert r.status_code == 403 and "project" in r.json()["error"]["message"]
    assert ann.id  # the usage row is recorded as session:<id> (tested in the accounting tests)


async def test_without_script_a_chat_turn_is_a_form_answered_whole_with_the_conversation_carried_on(served):
    srv, engine = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/chat")).text
        assert '<form class="chat-form" id="chat" method="post" action="/chat"' in page
        csrf = form_token(page)
        first = await http.post(
            "/chat",
            data={"csrf": csrf, "model": "m", "temperature": "9", "system": "be brief", "message": "hi <b>there</b>"},
        )
        assert first.status_code == 200
        sent = engine.requests[-1].body
        assert sent["stream"] is False and sent["temperature"] == 2.0 and sent["messages"][0]["role"] == "system"
        # The question is shown escaped, the reply rendered, its figures under it; the next form carries both.
        assert "hi &lt;b&gt;there&lt;/b&gt;" in first.text and '<div class="reply"><p>' in first.text
        assert re.search(r'<div class="figures">\d+ tokens · [\d.]+ tokens/s · total ', first.text)
        history = html.unescape(re.search(r'name="history" value="([^"]*)"', first.text).group(1))
        turns = orjson.loads(history)
        assert [t["role"] for t in turns] == ["user", "assistant"] and turns[0]["content"] == "hi <b>there</b>"
        assert '<textarea id="system" name="system" form="chat" rows="3">be brief</textarea>' in first.text
        second = await http.post(
            "/chat", data={"csrf": form_token(first.text), "model": "m", "message": "and again", "history": history}
        )
        assert second.status_code == 200
        assert [m["role"] for m in engine.requests[-1].body["messages"]] == ["user", "assistant", "user"]
        assert second.text.count('<div class="turn ') == 4
        # Refusals are said on the page and change nothing: an unreadable conversation, no message, no token.
        bad = await http.post("/chat", data={"csrf": csrf, "model": "m", "message": "x", "history": "[{"})
        assert bad.status_code == 400 and "could not be read" in bad.text
        empty = await http.post("/chat", data={"csrf": csrf, "model": "m", "message": " "})
        assert empty.status_code == 400 and "Write a message first." in empty.text
        asked = len(engine.requests)
        forged = await http.post("/chat", data={"model": "m", "message": "x"})
        assert forged.status_code == 403 and len(engine.requests) == asked


def test_maths_is_set_aside_for_katex_outside_code_while_prices_stay_prose():
    html = render_markdown("It costs $5 and $10. Euler: $e^{i\\pi}+1=0$, and $$x<y$$.\n\n`$z$`\n\n$$\n\\int_0^1 x\n$$")
    assert "It costs $5 and $10." in html
    assert '<span class="math inline">e^{i\\pi}+1=0</span>' in html
    assert '<span class="math display">x&lt;y</span>' in html  # display maths inside a line stays inline HTML
    assert "<code>$z$</code>" in html
    assert '<div class="math display">\\int_0^1 x</div>' in html
    assert "<script>" not in render_markdown("$</span><script>alert(1)</script>$")


def test_a_reply_is_rendered_as_markdown_without_raw_html_or_dangerous_links():
    html = render_markdown(
        "**bold** <script>alert(1)</script> [a](javascript:alert(1)) [b](https://ok.example) "
        "![pic](data:image/png;base64,xx) <img src=x onerror=alert(1)>"
    )
    assert "<strong>bold</strong>" in html and "<script>" not in html and "<img" not in html
    assert 'href="javascript' not in html and 'href="data:' not in html
    assert 'href="https://ok.example" rel="noopener noreferrer nofollow"' in html
