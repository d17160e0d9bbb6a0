"""The terminal screens of `server init` (the form) and of the steps (the live checklist), driven through
Textual's pilot: what the operator types and ticks reaches the Options, a bad email is refused beside the
field, the steps, progress, password box and questions show and answer as the flow runs, and the closing
transcript is the plain run's very lines."""

from __future__ import annotations

import threading

import pytest
from textual.geometry import Region
from textual.widgets import Checkbox, Input, OptionList, ProgressBar, Static

from llmgw.cli.screens import Ask, InitForm, StepsApp
from llmgw.init import InitError
from llmgw.init.run import Options, check_options
from llmgw.progress import PlainSteps, Status, Steps
from llmgw.testing.waiting import async_until

SIZE = (120, 50)  # the whole form in view, so every field can be clicked


def text(widget: Static) -> str:
    return str(widget.content)


def form(**opts) -> InitForm:
    return InitForm(
        names=["cp1", "localhost"],
        addresses=["127.0.0.1", "192.0.2.2"],
        opts=Options(**{"admin": "", **opts}),
    )


async def asked(app) -> Ask:
    """The question on screen, once it is up and ready for an answer."""
    return await async_until(
        lambda: isinstance(app.screen, Ask) and app.screen.is_mounted and app.screen, what="a question"
    )


async def type_into(pilot, selector: str, value: str) -> None:
    await pilot.click(selector)
    await pilot.press(*value)


async def test_the_form_returns_the_email_the_extra_names_the_postgres_store_and_the_boxes_as_ticked():
    app = form(hosts=["given.example.com"])
    async with app.run_test(size=SIZE) as pilot:
        covered = text(app.query_one("#covered", Static))
        assert "cp1, localhost" in covered and "127.0.0.1, 192.0.2.2" in covered and "given.example.com" in covered
        assert not app.query_one("#dsn").display  # SQLite is the default: no address asked
        await pilot.press(*"Admin@Example.com")  # the email field has the focus from the start
        await type_into(pilot, "#hosts", "gw.lan, 10.0.0.9 gw.lan,given.example.com")
        await pilot.click("#postgres")
        assert app.query_one("#dsn").display
        await pilot.click("#submit")
        # PostgreSQL without an address is refused beside the field.
        assert "give the PostgreSQL database's address" in text(app.query_one("#dsn-error", Static))
        assert app.return_code is None
        await pilot.click("#node")  # ticked by default: now unticked
        await type_into(pilot, "#dsn", "postgresql://llmgw@db/llmgw")
        await pilot.press("enter")  # Enter in a field submits
        await async_until(lambda: app.return_code is not None, what="the form to submit")
    assert app.return_value == Options(
        admin="Admin@Example.com",
        hosts=["given.example.com", "gw.lan", "10.0.0.9"],
        store="postgresql://llmgw@db/llmgw",
        no_mirror=False,
        no_node=True,
        no_model=False,
    )


async def test_a_bad_email_is_refused_beside_the_field_and_the_form_stays_until_it_is_fixed():
    app = form()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"admin.example.com", "enter")
        shown = text(app.query_one("#admin-error", Static))
        with pytest.raises(InitError) as why:
            check_options(Options(admin="admin.example.com"))
        assert shown == str(why.value)
        assert app.return_code is None and app.focused is app.query_one("#admin")
        assert app.query_one("#admin", Input).value == "admin.example.com"  # kept, to be corrected
        await pilot.press("home", *["right"] * 5, "delete", "@", "enter")
        await async_until(lambda: app.return_code is not None, what="the form to submit")
    assert app.return_value is not None and app.return_value.admin == "admin@example.com"
    assert app.return_value.store is None and app.return_value.hosts == []


async def test_escape_leaves_the_form_with_nothing_answered():
    app = form()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"admin@example.com", "escape")
        await async_until(lambda: app.return_code is not None, what="the form to close")
    assert app.return_value is None


async def test_ctrl_c_leaves_the_form_with_nothing_answered():
    app = form()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"admin@example.com", "ctrl+c")
        await async_until(lambda: app.return_code is not None, what="the form to close")
    assert app.return_value is None


async def test_a_mirror_given_on_the_command_line_is_shown_in_use_and_the_flags_set_the_boxes():
    app = form(admin="ops@example.com", mirror_url="http://models:8082", no_node=True, no_model=True)
    async with app.run_test(size=SIZE) as pilot:
        assert text(app.query_one("#mirror-in-use", Static)) == "using the mirror at http://models:8082"
        assert not app.query("#mirror")  # nothing to offer: a mirror is in use
        assert not app.query_one("#node", Checkbox).value and not app.query_one("#model", Checkbox).value
        assert app.query_one("#admin", Input).value == "ops@example.com"
        await pilot.click("#model")
        await pilot.click("#submit")
        await async_until(lambda: app.return_code is not None, what="the form to submit")
    o = app.return_value
    assert o is not None
    assert (o.mirror_url, o.no_mirror, o.no_node, o.no_model) == ("http://models:8082", False, True, False)


async def test_unticking_the_mirror_means_no_mirror():
    app = form(admin="ops@example.com")
    async with app.run_test(size=SIZE) as pilot:
        assert app.query_one("#mirror", Checkbox).value
        await pilot.click("#mirror")
        await pilot.click("#submit")
        await async_until(lambda: app.return_code is not None, what="the form to submit")
    assert app.return_value is not None and app.return_value.no_mirror


# ------------------------------------------------------------------------------------------- the steps

PASSWORD = "Zq8-secret-password"
# Enough steps to overflow the screen: the password box must stay in view regardless.
MANY = 40


def the_flow(st: Steps) -> tuple[str | None, str | None, str | None]:
    """Every Steps call, as a flow makes them: steps, a download, the secret, both kinds of question, notes."""
    st.begin("1", "user and directories")
    st.end("1", Status.MADE, "user and directories: made /etc/llmgw")
    st.begin("2", "llama.cpp")
    st.progress("2", 50, 100, "llama.cpp archive")
    st.secret("administrator a@example.com, password (printed only now)", PASSWORD)
    picked = st.ask("Which fabric is mlx5_0 on?", ["fabric-a", "fabric-b"], "fabric-b")
    st.progress("2", 100, 100, "llama.cpp archive")
    st.end("2", Status.CHANGED, "llama.cpp: fetched b4000")
    named = st.ask("Name the fabric of mlx5_1", [], "fabric-c")
    for i in range(3, MANY):
        st.begin(str(i), f"step {i}")
        st.end(str(i), Status.KEPT if i % 2 else Status.SKIPPED, f"step {i}: nothing to do")
    empty = st.ask("Which fabric are mlx5_2 on? Empty to leave them undeclared", [], "")
    st.begin("node b: ssh", "ssh")
    st.end("node b: ssh", Status.WARNED, "ssh: host key new")
    st.note("done.")
    st.note("Back up /etc/llmgw/pki/ca-key.pem: every node's certificate comes from it.")
    return picked, named, empty


def in_view(app, widget) -> bool:
    return widget.display and widget.region.height > 0 and Region(0, 0, *app.size).contains_region(widget.region)


async def test_the_steps_fill_in_the_password_stays_in_view_and_the_answers_reach_the_flow():
    app = StepsApp(the_flow, title="llmgw server init")
    async with app.run_test(size=(100, 24)) as pilot:
        ask = await asked(app)
        first, second = app.rows["1"], app.rows["2"]
        assert first.line_text == "✓ 1. user and directories  made" and first.detail_text == "made /etc/llmgw"
        assert second.line_text == "… 2. llama.cpp"  # still running: no status yet
        bar = second.query_one(ProgressBar)
        assert (bar.progress, bar.total) == (50, 100)
        assert text(second.query_one(".what", Static)) == "llama.cpp archive: 50 bytes of 100 bytes (50%)"
        secret = app.query_one("#secret", Static)
        assert PASSWORD in text(secret) and in_view(app, secret)

        # A choice: the default is preselected; the operator moves up to the other one.
        assert ask.query_one(OptionList).highlighted == 1
        await pilot.press("up", "enter")
        # A free question: the default is prefilled; the operator types over it.
        await async_until(lambda: app.screen is not ask, what="the first question to go")
        ask = await asked(app)
        assert ask.query_one(Input).value == "fabric-c"
        await pilot.press("end", "backspace", "d", "enter")  # the default comes selected: End keeps it
        await async_until(lambda: app.screen is not ask, what="the second question to go")
        await asked(app)
        await pilot.press("enter")  # an empty line is an answer too, not "nobody to ask"

        await async_until(lambda: app.done, what="the flow to end")
        assert not second.query_one(".transfer").display  # the bar goes once the step has ended
        assert second.line_text == "✓ 2. llama.cpp  changed"
        assert app.rows["3"].line_text == "✓ 3. step 3  kept" and app.rows["4"].line_text == "– 4. step 4  skipped"
        assert app.rows["node b: ssh"].line_text == "! node b: ssh  warned"
        assert "Back up /etc/llmgw/pki/ca-key.pem" in text(app.query_one("#notes", Static))
        assert "press Enter to close" in text(app.query_one("#closing", Static))
        assert PASSWORD in text(secret) and in_view(app, secret)  # still there at the end, past MANY steps
        assert app.return_code is None  # the screen waits for the operator
        await pilot.press("enter")
        await async_until(lambda: app.return_code is not None, what="the screen to close")

    lines: list[str] = []
    assert app.finish(lines.append) == ("fabric-a", "fabric-d", "")
    plain: list[str] = []
    the_flow(PlainSteps(plain.append))
    assert lines == plain
    assert f"   administrator a@example.com, password (printed only now): {PASSWORD}" in lines
    assert lines[:3] == [
        "1. user and directories: made /etc/llmgw",
        "   llama.cpp archive: 50 bytes of 100 bytes (50%)",
        f"   administrator a@example.com, password (printed only now): {PASSWORD}",
    ]


async def test_a_failed_step_shows_failed_and_the_error_is_raised_after_the_transcript():
    def flow(st: Steps) -> None:
        st.begin("1", "user and directories")
        st.end("1", Status.KEPT, "user and directories: all there")
        st.begin("2", "authority")
        st.end("2", Status.FAILED, "authority: ca-key.pem does not load; restore it from its backup")
        raise InitError("ca-key.pem does not load; restore it from its backup")

    app = StepsApp(flow, title="llmgw server init")
    async with app.run_test() as pilot:
        await async_until(lambda: app.done, what="the flow to end")
        row = app.rows["2"]
        assert row.line_text == "✗ 2. authority  FAILED"
        assert row.detail_text == "ca-key.pem does not load; restore it from its backup"
        closing = text(app.query_one("#closing", Static))
        assert "stopped: ca-key.pem does not load" in closing and "press Enter to close" in closing
        await pilot.press("enter")
        await async_until(lambda: app.return_code is not None, what="the screen to close")

    lines: list[str] = []
    with pytest.raises(InitError, match="ca-key.pem does not load"):
        app.finish(lines.append)
    assert lines == [
        "1. user and directories: all there",
        "2. FAILED: authority: ca-key.pem does not load; restore it from its backup",
    ]


async def test_a_flow_that_raises_inside_a_step_leaves_that_step_shown_failed():
    def flow(st: Steps) -> None:
        st.begin("1", "store and administrator")
        raise OSError("disk full")

    app = StepsApp(flow, title="t")
    async with app.run_test() as pilot:
        await async_until(lambda: app.done, what="the flow to end")
        assert app.rows["1"].line_text == "✗ 1. store and administrator  FAILED"
        assert "stopped: disk full" in text(app.query_one("#closing", Static))
        await pilot.press("enter")
    with pytest.raises(OSError, match="disk full"):
        app.finish(lambda line: None)


async def test_enter_does_not_close_the_screen_while_the_flow_runs():
    release = threading.Event()

    def flow(st: Steps) -> str:
        st.begin("1", "waiting")
        release.wait(30)
        st.end("1", Status.MADE, "waiting: over")
        return "ok"

    app = StepsApp(flow, title="t")
    async with app.run_test() as pilot:
        await async_until(lambda: "1" in app.rows, what="the first step")
        await pilot.press("enter")
        assert app.return_code is None and not app.closing
        release.set()
        await async_until(lambda: app.done, what="the flow to end")
        await pilot.press("enter")
        await async_until(lambda: app.return_code is not None, what="the screen to close")
    assert app.finish(lambda line: None) == "ok"


async def test_ctrl_c_during_a_question_closes_the_screen_the_flow_gets_no_answer_and_the_run_is_interrupted():
    got: list[str | None] = []
    past = threading.Event()

    def flow(st: Steps) -> None:
        st.begin("1", "fabric")
        got.append(st.ask("Which fabric?", ["a", "b"], None))
        past.set()
        st.end("1", Status.MADE, "fabric: a")  # after the screen closed: transcript only

    app = StepsApp(flow, title="t")
    async with app.run_test() as pilot:
        await asked(app)
        await pilot.press("ctrl+c")
        await async_until(lambda: app.return_code is not None, what="the screen to close")
    await async_until(past.is_set, what="the flow to get past its question")
    assert got == [None]
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        app.finish(lines.append)
    assert lines == ["1. fabric: a"]
