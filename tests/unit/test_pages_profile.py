"""The account page (/profile) against a real in-process server and a fake engine: keys made there work with the
openai SDK and stop when revoked, only the person's own keys can be revoked, a secret is shown once, a password
change signs the other sessions out and rotates the CSRF token, own use and budget bars; and the open
/setup/<tool> script, run for real with sh in a temporary HOME."""

from __future__ import annotations

import html
import os
import re
import subprocess
import tomllib
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from llmgw.server.app import Server
from llmgw.server.pages.setup_scripts import BEGIN, END, script
from llmgw.testing.waiting import async_until
from tests.unit import test_pages
from tests.unit.test_pages import PASSWORD, active_person, base, form_token, running, sign_in

served = test_pages.served  # the in-process server with a fake engine, as the other pages' tests have it

NEW_PASSWORD = "a quite different one"
SECRET = re.compile(r"llmgw-[A-Za-z0-9_-]{40}")


@pytest.fixture
async def priced(tmp_path):
    """As test_pages' server, with the model priced, so a turn costs something and budgets bind."""
    async with running(
        tmp_path,
        auth={
            "store": str(tmp_path / "gw.db"),
            "pricing": {"m": {"prompt_per_1k": 10.0, "completion_per_1k": 20.0}},
        },
        usage={"flush_interval": 0.05},
    ) as got:
        yield got


async def _post(http: httpx.AsyncClient, **fields: str) -> httpx.Response:
    page = (await http.get("/profile")).text
    return await http.post("/profile", data={"csrf": form_token(page), **fields})


def _new_key(page: str) -> str:
    m = re.search(r'id="(?:new-key|editor-key)">([^<]+)<', page)
    assert m, page
    return m.group(1)


def _sdk(srv: Server, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base(srv) + "/v1", api_key=key, max_retries=0)


async def _answers(srv: Server, key: str) -> bool:
    async with _sdk(srv, key) as client:
        reply = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
    return bool(reply.choices[0].message.content)


async def _refused(srv: Server, key: str) -> bool:
    try:
        await _answers(srv, key)
    except openai.AuthenticationError:
        return True
    return False


# -- keys -------------------------------------------------------------------------------------------------


async def test_a_key_made_on_the_account_page_works_with_the_openai_sdk_until_it_is_revoked(served):
    srv, _ = served
    ann = await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        r = await _post(http, do="create", name="laptop", project="", expires="30")
        assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store"
        key = _new_key(r.text)
        assert SECRET.fullmatch(key)
        # The key cache takes new keys up within a second or so.
        await async_until(
            lambda: _answers(srv, key), 15, "the new key to be served", ignore=(openai.AuthenticationError,)
        )
        (rec,) = [k for k in await srv.store.list_keys() if k.user_id == ann.id]
        assert rec.name == "laptop" and rec.project_id is None and rec.expires_at is not None
        r = await _post(http, do="revoke", key=rec.id)
        assert r.status_code == 200 and "revoked" in r.text and f'data-key="{rec.id}"' not in r.text
    await async_until(lambda: _refused(srv, key), 15, "the revoked key to be refused")


async def test_a_new_secret_is_on_the_page_that_made_it_and_never_again(served):
    srv, _ = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        made = await _post(http, do="create", name="ci", project="")
        key = _new_key(made.text)
        again = await http.get("/profile")
        assert again.status_code == 200 and again.headers["Cache-Control"] == "no-store"
        assert key not in again.text and not SECRET.search(again.text)
        assert key[:14] + "…" in again.text and "ci" in again.text  # listed by its prefix only


async def test_someone_elses_key_or_an_operators_cannot_be_revoked_from_the_account_page(served):
    srv, _ = served
    await active_person(srv)
    bob = await active_person(srv, "bob@example.com")
    bobs = await srv.store.issue_key("bob's", owner=bob.id)
    _, operators = await srv.store.create_key("ops")
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/profile")).text
        assert bobs.key.id not in page and bobs.key.prefix not in page
        for key_id in (bobs.key.id, operators.id, bobs.key.prefix):
            r = await _post(http, do="revoke", key=key_id)
            assert r.status_code == 404 and "nothing changed" in r.text, key_id
    assert all(k.revoked_at is None for k in await srv.store.list_keys())
    await async_until(lambda: _answers(srv, bobs.secret), 15, "bob's key to work", ignore=(openai.AuthenticationError,))


async def test_a_key_can_spend_only_against_a_project_the_person_belongs_to(served):
    srv, _ = served
    ann = await active_person(srv)
    await srv.store.add_org("Acme")
    await srv.store.add_team("platform", "Acme")
    mine = await srv.store.add_project("gateway", "Acme/platform")
    other = await srv.store.add_project("billing", "Acme/platform")
    await srv.store.join(ann.id, "project", mine.id)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/profile")).text
        assert "Acme/platform/gateway" in page and "Acme/platform/billing" not in page
        r = await _post(http, do="create", name="in gw", project=mine.id)
        assert r.status_code == 200 and "Acme/platform/gateway" in r.text
        r = await _post(http, do="create", name="not mine", project=other.id)
        assert r.status_code == 400 and "cannot spend against" in r.text and not SECRET.search(r.text)
    keys = [k for k in await srv.store.list_keys() if k.user_id == ann.id]
    assert [(k.name, k.project_id) for k in keys] == [("in gw", mine.id)]


# -- password ------------------------------------------------------------------------------------------------


async def test_a_password_change_signs_out_other_sessions_and_only_the_new_csrf_token_works(served):
    srv, _ = served
    await active_person(srv)
    async with (
        httpx.AsyncClient(base_url=base(srv)) as here,
        httpx.AsyncClient(base_url=base(srv)) as elsewhere,
    ):
        await sign_in(here, "ann@example.com")
        await sign_in(elsewhere, "ann@example.com")
        assert (await elsewhere.get("/profile")).status_code == 200
        old = form_token((await here.get("/profile")).text)
        r = await here.post(
            "/profile",
            data={
                "csrf": old,
                "do": "password",
                "current": "not it at all",
                "password": NEW_PASSWORD,
                "password2": NEW_PASSWORD,
            },
        )
        assert r.status_code == 400 and "current password" in r.text
        r = await here.post(
            "/profile",
            data={"csrf": old, "do": "password", "current": PASSWORD, "password": "short", "password2": "short"},
        )
        assert r.status_code == 400 and "at least 10" in r.text
        r = await here.post(
            "/profile",
            data={
                "csrf": old,
                "do": "password",
                "current": PASSWORD,
                "password": NEW_PASSWORD,
                "password2": NEW_PASSWORD,
            },
        )
        assert r.status_code == 200 and "password is changed" in r.text and "1 other session" in r.text
        tokens = set(re.findall(r'name="csrf" value="([^"]+)"', r.text))
        (new,) = tokens  # every form on the page, the menu's sign-out form too, carries the one new token
        assert new != old and 'action="/logout"' in r.text
        # The other browser is signed out; this one goes on, with the new token only.
        assert (await elsewhere.get("/profile")).status_code == 303
        r = await here.post("/profile", data={"csrf": old, "do": "create", "name": "x", "project": ""})
        assert r.status_code == 403 and "security token" in r.text
        r = await here.post("/profile", data={"csrf": new, "do": "create", "name": "x", "project": ""})
        assert r.status_code == 200 and SECRET.search(r.text)
    async with httpx.AsyncClient(base_url=base(srv)) as fresh:
        assert (await sign_in(fresh, "ann@example.com")).status_code == 401
        assert (await sign_in(fresh, "ann@example.com", NEW_PASSWORD)).status_code == 303


async def test_current_passwords_given_on_the_profile_count_as_sign_in_attempts_and_a_right_one_costs_nothing(served):
    srv, _ = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        csrf = form_token((await http.get("/profile")).text)

        async def change(current: str) -> httpx.Response:
            fields = {"csrf": csrf, "do": "password", "current": current, "password": "short", "password2": "short"}
            return await http.post("/profile", data=fields)

        # A right current password (the new one is refused) is withdrawn: it uses up nothing.
        assert "at least 10" in (await change(PASSWORD)).text
        assert [(await change("not it at all")).status_code for _ in range(5)] == [400] * 5
        r = await change(PASSWORD)  # the account's five are used: even the right one waits
        assert r.status_code == 429 and 290 < int(r.headers["Retry-After"]) <= 300
        assert f"Too many wrong passwords; try again in {r.headers['Retry-After']} seconds." in r.text
        assert await srv.store.attempts_counted("account:ann@example.com", 300) == 5


# -- own use and budgets ----------------------------------------------------------------------------------------


async def _chat_turn(http: httpx.AsyncClient, project: str = "") -> None:
    page = (await http.get("/chat")).text
    csrf = re.search(r'name="llmgw-csrf" content="([^"]+)"', page).group(1)
    r = await http.post(
        "/chat/send",
        json={"model": "m", "project": project, "messages": [{"role": "user", "content": "hi"}]},
        headers={"X-CSRF-Token": csrf},
    )
    assert r.status_code == 200 and "usage" in r.text


def _figure(page: str, name: str) -> str:
    m = re.search(rf'id="use-{name}">([^<]*)<', page)
    assert m, page
    return m.group(1)


async def test_own_use_shows_a_chat_turns_requests_tokens_and_spend(priced):
    srv, _ = priced
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/profile")).text
        assert _figure(page, "requests") == "0" and "No budget applies to you" in page
        await _chat_turn(http)

        async def shown() -> str | None:
            text = (await http.get("/profile")).text
            return text if _figure(text, "requests") == "1" else None

        page = await async_until(shown, 15, "the chat turn's usage on the account page")
    tokens = int(_figure(page, "tokens").replace(",", ""))
    assert tokens > 6  # the reply's six and the prompt's
    assert re.search(r"<td>\d{4}-\d\d-\d\d</td><td class=\"num\">1</td>", page)


async def test_a_budget_bar_appears_for_each_budget_that_applies_and_fills_with_spend(priced):
    srv, _ = priced
    ann = await active_person(srv)
    await srv.store.add_org("Acme")
    await srv.store.add_team("platform", "Acme")
    proj = await srv.store.add_project("gateway", "Acme/platform")
    await srv.store.join(ann.id, "project", proj.id)
    await srv.store.set_limits("user", ann.id, budget_micros=50_000_000)
    await srv.store.set_limits("project", proj.id, budget_micros=2_000_000, period="day")
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        page = (await http.get("/profile")).text
        assert page.count('class="budget budget-ok"') == 2
        assert f'data-pool="user:{ann.id}"' in page and f'data-pool="project:{proj.id}"' in page
        assert "shared with everyone who spends there" in page and "Your own budget" in page
        assert "0.00 of 50.00 this month" in page and "0.00 of 2.00 today" in page
        await _chat_turn(http, proj.id)

        async def filled() -> str | None:
            text = (await http.get("/profile")).text
            bar = re.search(rf'data-pool="project:{proj.id}".*?</li>', text, re.S)
            # The bar reads the limits' running spend, the figure the usage rows, written a moment later.
            return text if bar and "0.00 of 2.00" not in bar.group(0) and float(_figure(text, "spend")) > 0 else None

        page = await async_until(filled, 15, "the turn's cost in the project's budget bar and in own use")
    spent = float(re.search(r"([\d.]+) of 2\.00 today", page).group(1))
    assert spent > 0 and float(_figure(page, "spend")) == spent  # the one turn, in own use and in the bar
    expected = "spent" if spent >= 2 else "amber" if spent >= 1.6 else "ok"
    assert re.search(rf'class="budget budget-{expected}" data-pool="project:{proj.id}"', page)
    assert re.search(r'<meter min="0" max="2000000" low="1600000" high="1999999" optimum="0" value="\d+"', page)


# -- connect your editor and the setup script ------------------------------------------------------------------


def _run(script: str, home: Path, key: str | None) -> subprocess.CompletedProcess:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home)}
    if key is not None:
        env["LLMGW_API_KEY"] = key
    return subprocess.run(["sh"], input=script, env=env, capture_output=True, text=True, timeout=60)


def _files(home: Path) -> dict[str, str]:
    return {str(p.relative_to(home)): p.read_text() for p in sorted(home.rglob("*")) if p.is_file()}


async def _script(srv: Server, tool: str, model: str = "m") -> str:
    async with httpx.AsyncClient(base_url=base(srv)) as http:  # no session: curl fetches it
        r = await http.get(f"/setup/{tool}", params={"model": model})
    assert r.status_code == 200 and r.headers["Cache-Control"] == "no-store", r.text
    assert r.text.startswith("#!/bin/sh") and not SECRET.search(r.text)  # no key in it
    return r.text


async def test_the_continue_script_writes_its_own_assistant_once_keeping_whatever_else_the_file_holds(served, tmp_path):
    srv, _ = served
    script = await _script(srv, "continue")
    key = "llmgw-" + "A" * 40
    home = tmp_path / "home"
    home.mkdir()
    assistant = home / ".continue" / "assistants" / "llmgw.yaml"
    for _ in range(2):  # idempotent: one block, and the second run changes nothing
        r = _run(script, home, key)
        assert r.returncode == 0, r.stderr
    assert "already up to date" in r.stderr
    assert list(_files(home)) == [".continue/assistants/llmgw.yaml"]  # no backup of a file it did not change
    assert assistant.stat().st_mode & 0o777 == 0o600  # it holds the key
    text = assistant.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1
    conf = yaml.safe_load(text)
    (model,) = conf["models"]
    assert conf["schema"] == "v1" and model["provider"] == "openai" and model["model"] == "m"
    assert model["apiBase"] == base(srv) + "/v1" and model["apiKey"] == key and "chat" in model["roles"]

    # A file holding more than the block: the rest stays, the old file is kept beside it.
    assistant.write_text("# my notes\nrules:\n  - Be brief.\n")
    r = _run(script, home, "llmgw-" + "B" * 40)
    assert r.returncode == 0, r.stderr
    conf = yaml.safe_load(assistant.read_text())
    assert conf["rules"] == ["Be brief."] and conf["models"][0]["apiKey"] == "llmgw-" + "B" * 40
    assert assistant.read_text().startswith("# my notes\nrules:\n  - Be brief.\n")
    (bak,) = assistant.parent.glob("llmgw.yaml.bak-*")
    assert bak.read_text() == "# my notes\nrules:\n  - Be brief.\n"


async def test_the_codex_script_adds_a_provider_and_a_profile_and_leaves_the_rest_of_config_toml(served, tmp_path):
    srv, _ = served
    script = await _script(srv, "codex")
    home = tmp_path / "home"
    codex = home / ".codex"
    codex.mkdir(parents=True)
    mine = 'model = "gpt-5"\napproval_policy = "on-request"\n\n[mcp_servers.docs]\ncommand = "docs-server"'
    (codex / "config.toml").write_text(mine)
    for _ in range(2):
        r = _run(script, home, "llmgw-" + "C" * 40)
        assert r.returncode == 0, r.stderr
    text = (codex / "config.toml").read_text()
    assert text.startswith(mine) and text.count(BEGIN) == 1
    assert "llmgw-" not in text  # Codex reads the key from LLMGW_API_KEY; nothing is written
    conf = tomllib.loads(text)
    assert conf["model"] == "gpt-5" and conf["mcp_servers"] == {"docs": {"command": "docs-server"}}
    assert conf["model_providers"]["llmgw"] == {
        "name": "llmgw at " + base(srv).split("://")[1],
        "base_url": base(srv) + "/v1",
        "env_key": "LLMGW_API_KEY",
        "wire_api": "responses",
    }
    assert tomllib.loads((codex / "llmgw.config.toml").read_text()) == {"model_provider": "llmgw", "model": "m"}
    (bak,) = codex.glob("config.toml.bak-*")  # one backup: the second run found nothing to change
    assert bak.read_text() == mine


def test_a_later_run_for_another_model_replaces_the_block_where_it_is_and_unpaired_markers_stop_it(tmp_path):
    home = tmp_path / "home"
    profile = home / ".codex" / "llmgw.config.toml"
    profile.parent.mkdir(parents=True)
    profile.write_text('model_reasoning_effort = "high"\n\n[tools]\nweb_search = true\n')
    for model in ("first", "second"):
        r = _run(script("codex", "https://llm.example.com", model), home, "llmgw-" + "D" * 40)
        assert r.returncode == 0, r.stderr
    text = profile.read_text()
    assert text.startswith(BEGIN) and text.count(BEGIN) == 1  # top-level keys go before any table
    assert tomllib.loads(text) == {
        "model_provider": "llmgw",
        "model": "second",
        "model_reasoning_effort": "high",
        "tools": {"web_search": True},
    }
    assert len(list(profile.parent.glob("llmgw.config.toml.bak-*"))) == 2  # each change kept what it replaced
    config = home / ".codex" / "config.toml"
    config.write_text(f'model = "gpt-5"\n{BEGIN}\n[model_providers.llmgw]\n')  # its end marker lost
    r = _run(script("codex", "https://llm.example.com", "second"), home, "llmgw-" + "D" * 40)
    assert r.returncode != 0 and "mend it by hand" in r.stderr
    assert config.read_text() == f'model = "gpt-5"\n{BEGIN}\n[model_providers.llmgw]\n'


async def test_without_a_key_in_the_environment_the_setup_script_refuses_and_changes_nothing(served, tmp_path):
    srv, _ = served
    home = tmp_path / "home"
    (home / ".codex").mkdir(parents=True)
    (home / ".codex" / "config.toml").write_text('model = "gpt-5"\n')
    for tool in ("continue", "codex"):
        r = _run(await _script(srv, tool), home, None)
        assert r.returncode != 0 and "LLMGW_API_KEY is not set" in r.stderr and "/profile" in r.stderr
        r = _run(await _script(srv, tool), home, "llmgw-'; touch /tmp/owned; '")
        assert r.returncode != 0 and "nothing was changed" in r.stderr
    assert _files(home) == {".codex/config.toml": 'model = "gpt-5"\n'}


async def test_the_setup_route_refuses_an_unknown_tool_or_model_and_an_address_that_could_inject_shell(served):
    srv, _ = served
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        assert (await http.get("/setup/vim")).status_code == 404
        assert (await http.get("/setup/cline")).status_code == 404  # Cline is pasted, not scripted
        r = await http.get("/setup/continue", params={"model": "m'$(touch /tmp/x)'"})
        assert r.status_code == 404 and "$(" not in r.text
        r = await http.get("/setup/codex", headers={"X-Forwarded-Host": 'evil"; rm -rf ~; echo "'})
        assert r.status_code == 400 and "rm -rf" not in r.text
        r = await http.get(
            "/setup/codex", headers={"X-Forwarded-Host": "llm.example.com", "X-Forwarded-Proto": "https"}
        )
        assert r.status_code == 200 and '"https://llm.example.com/v1"' in r.text


async def test_connect_your_editor_makes_a_key_and_shows_the_configuration_the_script_would_write(served, tmp_path):
    srv, _ = served
    await active_person(srv)
    async with httpx.AsyncClient(base_url=base(srv)) as http:
        await sign_in(http, "ann@example.com")
        pages = {}
        for tool in ("continue", "codex", "cline"):
            r = await _post(http, do="editor", tool=tool, model="m", project="")
            assert r.status_code == 200, r.text
            pages[tool] = r.text
        listed = (await http.get("/profile")).text
    for name in ("Continue", "Codex", "Cline"):
        assert re.search(rf"<td>{name} on \d{{4}}-\d\d-\d\d</td>", listed)
    key = _new_key(pages["continue"])
    command = html.unescape(re.search(r'id="editor-command">([^<]+)<', pages["continue"]).group(1))
    assert command == f"export LLMGW_API_KEY='{key}'\ncurl -fsSL '{base(srv)}/setup/continue?model=m' | sh"
    # What the page shows is what the script writes, key and all.
    home = tmp_path / "home"
    home.mkdir()
    assert _run(await _script(srv, "continue"), home, key).returncode == 0
    written = (home / ".continue/assistants/llmgw.yaml").read_text()
    shown = [html.unescape(t) for t in re.findall(r'<pre class="copy">([^<]+)</pre>', pages["continue"])]
    assert shown == [written]
    codex = [tomllib.loads(html.unescape(t)) for t in re.findall(r'<pre class="copy">([^<]+)</pre>', pages["codex"])]
    assert codex[0]["model_providers"]["llmgw"]["env_key"] == "LLMGW_API_KEY" and codex[1]["model"] == "m"
    # Codex speaks the Responses API, which the gateway serves: no warning that it would be refused.
    assert "codex --profile llmgw" in pages["codex"] and "does not serve" not in pages["codex"]
    cline = pages["cline"]
    assert "OpenAI Compatible" in cline and f"<code>{base(srv)}/v1</code>" in cline and "curl" not in cline
