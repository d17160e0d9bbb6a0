"""The terminal screens of `server init` and `node add` (cli.md §3 and §5, "Interactive behaviour").

:func:`init_form` asks what `server init`'s flags would have said; :func:`run_steps` draws a flow's
:class:`~llmgw.progress.Steps` calls as a live checklist and, once the screen has closed, prints the
whole run as the plain lines, so it stays in the terminal's history. Textual is imported here only:
the commands that draw nothing do not pay for loading it.

Terminal queries. The product this follows once shipped a form that asked the terminal for its
background colour and read stdin until the answer came; a pseudo-terminal that never answered had
the operator's keystrokes eaten as the awaited answer. Textual 8's Linux driver
(textual/drivers/linux_driver.py) sends at start-up two DECRQM mode queries, ``CSI ? 2026 $ p``
(synchronised output) and ``CSI ? 2048 $ p`` (in-band resize), and pushes kitty keyboard flags
(``CSI > 13 u``, a request that expects no reply); it asks for no colour, no cursor position and no
device attributes. Replies, when a terminal sends any, are picked out of the ordinary input stream
by textual/_xterm_parser.py: nothing waits for them and no input is read aside or dropped meanwhile,
so an unanswered query costs nothing and none is turned off here. tests/e2e/test_screens_tmux.py
types into the form as soon as it is drawn, to catch a Textual that starts waiting.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, ClassVar, Generic, TypeVar, cast

from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Button, Checkbox, Input, OptionList, ProgressBar, RadioButton, RadioSet, Static
from textual.widgets.option_list import Option

from llmgw.init import InitError
from llmgw.init.run import Options, check_options
from llmgw.progress import PlainSteps, Status, Steps, format_progress

T = TypeVar("T")

# --------------------------------------------------------------------------------------- the form


def split_names(text: str) -> list[str]:
    """Names typed into one field, separated by commas, spaces or both."""
    return text.replace(",", " ").split()


def store_problem(dsn: str) -> str | None:
    """What is wrong with a PostgreSQL address typed into the form, or None."""
    example = "e.g. postgresql://llmgw@db/llmgw"
    if not dsn:
        return f"give the PostgreSQL database's address, {example}"
    scheme = dsn.partition("://")[0].lower() if "://" in dsn else ""
    # Checked first: the store takes any other text for a SQLite path (and would make its directory).
    if scheme not in ("postgres", "postgresql", "postgresql+asyncpg"):
        return f"a PostgreSQL address starts with postgresql://, {example}"
    from llmgw.store.address import resolve_store_address
    from llmgw.store.errors import StoreError

    try:
        resolve_store_address(dsn)
    except StoreError as exc:
        return str(exc)
    return None


class InitForm(App[Options | None]):
    """`server init` in a terminal without --admin: the administrator, the names, the store, what runs here."""

    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        # Priority: an Input and the screen bind ctrl+c to copying; here it means "leave, change nothing".
        Binding("escape", "cancel", "cancel", priority=True),
        Binding("ctrl+c", "cancel", "cancel", priority=True, show=False),
    ]
    CSS = """
    #form { padding: 0 2; }
    #title { text-style: bold; padding-top: 1; }
    .question { margin-top: 1; text-style: bold; }
    .hint { color: $text-muted; }
    .error { color: $error; display: none; }
    .error.shown { display: block; }
    Input { max-width: 90; }
    RadioSet { width: auto; }
    #submit { margin: 1 0; }
    #dsn { margin-top: 1; }
    """

    def __init__(self, *, names: list[str], addresses: list[str], opts: Options) -> None:
        super().__init__()
        self.names = names
        self.addresses = addresses
        self.opts = opts

    def compose(self) -> ComposeResult:
        o = self.opts
        with VerticalScroll(id="form"):
            yield Static("llmgw server init: make this machine a control plane", id="title", markup=False)
            yield Static(
                "1. The administrator's email, e.g. you@example.com (their password is made and shown once)",
                classes="question",
            )
            yield Input(o.admin, id="admin", compact=True)
            yield Static("", id="admin-error", classes="error", markup=False)
            yield Static(
                "2. Other names nodes will reach this machine by (DNS alias, NAT, floating IP), "
                "separated by commas or spaces, e.g. gateway.example.com, 203.0.113.7",
                classes="question",
            )
            yield Static(self._covered(), id="covered", classes="hint", markup=False)
            yield Input("", id="hosts", compact=True)
            yield Static("3. The store: accounts, keys and usage", classes="question")
            with RadioSet(id="store", compact=True):
                yield RadioButton("SQLite, on this machine", value=o.store is None, id="sqlite")
                yield RadioButton(
                    "PostgreSQL, e.g. postgresql://llmgw@db/llmgw", value=o.store is not None, id="postgres"
                )
            yield Input(o.store or "", id="dsn", compact=True)
            yield Static("", id="dsn-error", classes="error", markup=False)
            yield Static("4. What else runs here", classes="question")
            if o.mirror_url:
                yield Static(f"using the mirror at {o.mirror_url}", id="mirror-in-use", markup=False)
            else:
                yield Checkbox(
                    "Run the mirror here (model weights and llama.cpp for the nodes)",
                    not o.no_mirror,
                    id="mirror",
                    compact=True,
                )
            yield Checkbox("This machine as a node", not o.no_node, id="node", compact=True)
            yield Checkbox("The starter model (Qwen2.5 0.5B, Q4_K_M)", not o.no_model, id="model", compact=True)
            yield Button("Make this machine a control plane", id="submit", variant="primary", compact=True)
            yield Static(
                "Enter: go on · Tab: next field · Space: tick · Escape: leave, nothing changed",
                classes="hint",
                markup=False,
            )

    def _covered(self) -> str:
        parts = []
        if self.names:
            parts.append("names " + ", ".join(self.names))
        if self.addresses:
            parts.append("addresses " + ", ".join(self.addresses))
        if self.opts.hosts:
            parts.append("given with --host " + ", ".join(self.opts.hosts))
        return "Already in the certificate: " + ("; ".join(parts) if parts else "nothing found")

    def on_mount(self) -> None:
        self.query_one("#dsn").display = self.opts.store is not None
        self.query_one("#admin").focus()

    def on_radio_set_changed(self, event: RadioSet.Changed) -> None:
        postgres = event.pressed.id == "postgres"
        dsn = self.query_one("#dsn", Input)
        dsn.display = postgres
        if not postgres:
            self._say("#dsn-error", "")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.submit()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "submit":
            self.submit()

    def action_cancel(self) -> None:
        self.exit(None)

    def answers(self) -> Options:
        """The options as the form now says them (not yet checked)."""
        o = self.opts
        extra = split_names(self.query_one("#hosts", Input).value)
        postgres = self.query_one("#postgres", RadioButton).value
        no_mirror = o.no_mirror if o.mirror_url else not self.query_one("#mirror", Checkbox).value
        return replace(
            o,
            admin=self.query_one("#admin", Input).value.strip(),
            hosts=list(dict.fromkeys(o.hosts + extra)),
            store=self.query_one("#dsn", Input).value.strip() if postgres else None,
            no_mirror=no_mirror,
            no_node=not self.query_one("#node", Checkbox).value,
            no_model=not self.query_one("#model", Checkbox).value,
        )

    def submit(self) -> None:
        """Return the answers, or say beside the field what is wrong and stay."""
        answers = self.answers()
        try:
            check_options(answers)
        except InitError as exc:
            self._say("#admin-error", str(exc))
            self.query_one("#admin").focus()
            return
        self._say("#admin-error", "")
        problem = store_problem(answers.store) if answers.store is not None else None
        self._say("#dsn-error", problem or "")
        if problem is not None:
            self.query_one("#dsn").focus()
            return
        self.exit(answers)

    def _say(self, selector: str, message: str) -> None:
        """A message under a field; the line takes no room while there is none."""
        line = self.query_one(selector, Static)
        line.update(message)
        line.set_class(bool(message), "shown")


def init_form(*, names: list[str], addresses: list[str], opts: Options) -> Options | None:
    """Ask for `server init`'s options; None when the operator left (Escape, Ctrl+C)."""
    return InitForm(names=names, addresses=addresses, opts=opts).run()


# --------------------------------------------------------------------------------------- the steps

MARKS: dict[Status, tuple[str, str]] = {
    Status.RUNNING: ("…", "bold"),
    Status.MADE: ("✓", "green"),
    Status.CHANGED: ("✓", "green"),
    Status.KEPT: ("✓", "green"),
    Status.SKIPPED: ("–", "dim"),
    Status.WARNED: ("!", "yellow"),
    Status.FAILED: ("✗", "bold red"),
}


def lead(key: str) -> str:
    """How a step's key starts its line: "3. " for a number, "node b: " for a name (as PlainSteps)."""
    return f"{key}. " if key.isdigit() else f"{key}: "


class _Answer:
    """A question's answer, handed from the screen's thread to the flow's."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.value: str | None = None

    def give(self, value: str | None) -> None:
        self.value = value
        self.ready.set()


class ScreenSteps:
    """The Steps a flow gets from :class:`StepsApp`: every call goes to the transcript (a PlainSteps,
    so it is the plain run's very text) and, while the screen is up, to the screen."""

    # A download calls progress for every chunk; drawing each would be a round trip to the screen's
    # thread per chunk. Drawn at most this often per step, and always when complete.
    DRAW_EVERY = 0.1

    def __init__(self, app: StepsApp[Any]) -> None:
        self.app = app
        self.lines: list[str] = []
        self.lock = threading.Lock()
        # every=inf: the transcript keeps a download's first and last line, not its ticks.
        self.plain = PlainSteps(self.lines.append, every=float("inf"))
        self._drawn: dict[str, float] = {}

    def transcript(self) -> list[str]:
        with self.lock:
            return list(self.lines)

    def begin(self, key: str, title: str) -> None:
        with self.lock:
            self.plain.begin(key, title)
        self._draw(self.app.show_begin, key, title)

    def end(self, key: str, status: Status, detail: str) -> None:
        with self.lock:
            self.plain.end(key, status, detail)
        self._draw(self.app.show_end, key, status, detail)

    def progress(self, key: str, done: int, total: int | None, what: str) -> None:
        with self.lock:
            self.plain.progress(key, done, total, what)
        now = time.monotonic()
        if (total is not None and done >= total) or now - self._drawn.get(key, -self.DRAW_EVERY) >= self.DRAW_EVERY:
            self._drawn[key] = now
            self._draw(self.app.show_progress, key, done, total, what)

    def secret(self, label: str, value: str) -> None:
        with self.lock:
            self.plain.secret(label, value)
        self._draw(self.app.show_secret, label, value)

    def note(self, text: str) -> None:
        with self.lock:
            self.plain.note(text)
        self._draw(self.app.show_note, text)

    def ask(self, question: str, choices: Sequence[str], default: str | None) -> str | None:
        with self.lock:
            self.plain.ask(question, choices, default)  # prints nothing; fed for the same calls
        answer = _Answer()
        if not self._draw(self.app.show_question, question, list(choices), default, answer):
            return None
        answer.ready.wait()
        return answer.value

    def _draw(self, show: Callable[..., object], *args: Any) -> bool:
        """Run ``show`` on the screen's thread and wait until it has; False once the screen is closing."""
        if self.app.closing:
            return False
        try:
            self.app.call_from_thread(show, *args)
        except RuntimeError:  # the app stopped between the check and the call
            return False
        return True


class StepRow(Vertical):
    """One step: its mark and title, its progress while it runs, its detail line once it ended."""

    def __init__(self, key: str, title: str) -> None:
        super().__init__()
        self.key = key
        self.title_text = title
        self.status = Status.RUNNING

    def compose(self) -> ComposeResult:
        yield Static(self._line(), classes="line")
        with Horizontal(classes="transfer"):
            yield ProgressBar(total=None, show_percentage=False, show_eta=False)
            yield Static("", classes="what", markup=False)
        yield Static("", classes="detail", markup=False)

    def _line(self) -> Text:
        mark, style = MARKS[self.status]
        # A named key often ends with its title already ("node b: ssh" for "ssh").
        name = self.key if not self.key.isdigit() and self.key.endswith(self.title_text) else None
        line = Text.assemble((mark, style), " ", name or lead(self.key) + self.title_text)
        if self.status == Status.FAILED:
            line.append("  FAILED", style="bold red")
        elif self.status != Status.RUNNING:
            line.append(f"  {self.status.value}", style=style)
        return line

    @property
    def line_text(self) -> str:
        return str(self.query_one(".line", Static).content)

    @property
    def detail_text(self) -> str:
        return str(self.query_one(".detail", Static).content)

    def restart(self, title: str) -> None:
        self.title_text, self.status = title, Status.RUNNING
        self.query_one(".line", Static).update(self._line())
        self.query_one(".detail").display = False

    def show_end(self, status: Status, detail: str) -> None:
        self.status = status
        self.query_one(".line", Static).update(self._line())
        self.query_one(".transfer").display = False
        # The flows start a detail with the step's title, already on the line above.
        shown = detail.removeprefix(f"{self.title_text}: ")
        box = self.query_one(".detail", Static)
        box.update(shown)
        box.display = bool(shown)
        box.set_class(status == Status.FAILED, "failed")

    def show_progress(self, done: int, total: int | None, what: str) -> None:
        self.query_one(".transfer").display = True
        self.query_one(ProgressBar).update(total=total, progress=done)
        self.query_one(".what", Static).update(f"{what}: {format_progress(done, total)}")


class Ask(ModalScreen[str]):
    """A question from the flow: pick one of its choices, or type a name when it has none."""

    CSS = """
    Ask { align: center middle; }
    #ask { width: 80%; max-width: 100; height: auto; border: thick $accent; padding: 1 2; background: $surface; }
    #question { margin-bottom: 1; }
    #choices { height: auto; max-height: 12; }
    .hint { color: $text-muted; margin-top: 1; }
    """

    def __init__(self, question: str, choices: list[str], default: str | None) -> None:
        super().__init__()
        self.question = question
        self.choices = choices
        self.default = default

    def compose(self) -> ComposeResult:
        with Vertical(id="ask"):
            yield Static(self.question, id="question", markup=False)
            if self.choices:
                yield OptionList(*(Option(Content(c)) for c in self.choices), id="choices")
                yield Static("↑↓: choose · Enter: answer", classes="hint", markup=False)
            else:
                yield Input(self.default or "", id="answer")
                yield Static("Enter: answer", classes="hint", markup=False)

    def on_mount(self) -> None:
        if self.choices:
            options = self.query_one(OptionList)
            options.highlighted = self.choices.index(self.default) if self.default in self.choices else 0
            options.focus()
        else:
            self.query_one(Input).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.dismiss(self.choices[event.option_index])

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        # An empty line is an answer too: the flow decides what it means (node add: leave undeclared).
        self.dismiss(event.value.strip())


class StepsApp(App[None], Generic[T]):
    """A flow's steps as a live checklist; the flow runs in a thread of its own (it is blocking code)."""

    ENABLE_COMMAND_PALETTE = False
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("ctrl+c", "interrupt", "interrupt", priority=True, show=False),
        Binding("enter,escape", "close", "close", show=False),
    ]
    CSS = """
    #title { text-style: bold; padding: 0 1; background: $primary; color: $text; }
    #log { height: 1fr; padding: 0 1; }
    #steps { height: auto; }
    StepRow { height: auto; }
    StepRow .detail { padding-left: 4; color: $text-muted; display: none; }
    StepRow .detail.failed { color: $error; }
    StepRow .transfer { height: 1; padding-left: 4; display: none; }
    StepRow ProgressBar { width: 44; }
    StepRow .what { width: 1fr; }
    #notes { height: auto; margin-top: 1; display: none; }
    #secret { display: none; height: auto; border: heavy $warning; border-title-color: $warning; padding: 0 1; margin: 0 1; }
    #closing { height: auto; padding: 0 1; text-style: bold; display: none; }
    """

    def __init__(self, flow: Callable[[Steps], T], *, title: str) -> None:
        super().__init__()
        self.flow = flow
        self.heading = title
        self.steps = ScreenSteps(self)
        self.closing = False  # set on the screen's thread before it exits; the flow stops drawing
        self.done = False
        self.interrupted = False
        self.result: T | None = None
        self.error: BaseException | None = None
        self.notes: list[str] = []
        self.secrets: list[tuple[str, str]] = []
        self.rows: dict[str, StepRow] = {}
        self._waiting: list[_Answer] = []

    def compose(self) -> ComposeResult:
        yield Static(self.heading, id="title", markup=False)
        with VerticalScroll(id="log"):
            yield Vertical(id="steps")
            yield Static("", id="notes", markup=False)
        yield Static("", id="secret")
        yield Static("", id="closing")

    def on_mount(self) -> None:
        self.query_one("#secret").border_title = "shown only now"
        # A daemon: after Ctrl+C the process exits without waiting for a step to end (each is
        # written to be run again), as the plain run does on Ctrl+C.
        threading.Thread(target=self._work, name="llmgw-steps", daemon=True).start()

    def _work(self) -> None:
        try:
            self.result = self.flow(self.steps)
        except BaseException as exc:  # anything, SystemExit included: finish() raises it after the transcript
            self.error = exc
        self.steps._draw(self.show_finished)

    # Called on the screen's thread through ScreenSteps; each checks `closing` there, so none
    # touches widgets that are being taken down.

    async def _row(self, key: str, title: str | None = None) -> StepRow:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = StepRow(key, title if title is not None else key)
            # Awaited: the flow's next call for this step (end, progress) finds the row's widgets.
            await self.query_one("#steps").mount(row)
        return row

    def _scroll(self) -> None:
        self.query_one("#log", VerticalScroll).scroll_end(animate=False)

    async def show_begin(self, key: str, title: str) -> None:
        if self.closing:
            return
        if key in self.rows:
            self.rows[key].restart(title)
        else:
            await self._row(key, title)
        self._scroll()

    async def show_end(self, key: str, status: Status, detail: str) -> None:
        if not self.closing:
            (await self._row(key)).show_end(status, detail)
            self._scroll()

    async def show_progress(self, key: str, done: int, total: int | None, what: str) -> None:
        if not self.closing:
            (await self._row(key)).show_progress(done, total, what)

    def show_secret(self, label: str, value: str) -> None:
        if self.closing:
            return
        self.secrets.append((label, value))
        box = self.query_one("#secret", Static)
        text = Text()
        for i, (lab, val) in enumerate(self.secrets):
            text.append(("\n" if i else "") + f"{lab}:\n")
            text.append(val, style="bold")
        box.update(text)
        box.display = True

    def show_note(self, text: str) -> None:
        if self.closing:
            return
        self.notes.append(text)
        notes = self.query_one("#notes", Static)
        notes.update("\n".join(self.notes))
        notes.display = True
        self._scroll()

    def show_question(self, question: str, choices: list[str], default: str | None, answer: _Answer) -> None:
        if self.closing:
            answer.give(None)
            return
        self._waiting.append(answer)

        def answered(value: str | None) -> None:
            if answer in self._waiting:
                self._waiting.remove(answer)
            answer.give(value)

        self.push_screen(Ask(question, choices, default), answered)

    def show_finished(self) -> None:
        if self.closing:
            return
        self.done = True
        closing = Text()
        if self.error is not None:
            # A flow that raised without reporting its step: the step that was running stopped there.
            for row in self.rows.values():
                if row.status == Status.RUNNING:
                    row.show_end(Status.FAILED, "")
            closing.append(f"stopped: {str(self.error) or type(self.error).__name__}\n", style="red")
        closing.append("press Enter to close")
        box = self.query_one("#closing", Static)
        box.update(closing)
        box.display = True

    # Keys.

    def action_close(self) -> None:
        if self.done:
            self._leave()

    def action_interrupt(self) -> None:
        if not self.done:
            self.interrupted = True
        self._leave()

    async def action_quit(self) -> None:
        self.action_interrupt()

    def _leave(self) -> None:
        self.closing = True
        for answer in self._waiting:  # a flow waiting on a question gets "nobody can be asked"
            answer.give(None)
        self._waiting.clear()
        self.exit()

    def finish(self, emit: Callable[[str], None] = print) -> T:
        """Once the app has exited: the whole run as the plain lines, then the flow's result, or its
        exception re-raised (KeyboardInterrupt when the operator stopped it)."""
        for line in self.steps.transcript():
            emit(line)
        if self.interrupted:
            raise KeyboardInterrupt
        if self.error is not None:
            raise self.error
        if not self.done:
            raise RuntimeError("the screen closed before the steps ended; run the command again with --plain")
        return cast(T, self.result)


def run_steps(flow: Callable[[Steps], T], *, title: str) -> T:
    """Run ``flow`` with its steps drawn on the terminal; after the screen closes, print the run again as
    plain lines (the secret included, for the terminal's history) and return the flow's result."""
    app: StepsApp[T] = StepsApp(flow, title=title)
    # No mouse reporting: the terminal's own selection then copies the password out of its box.
    app.run(mouse=False)
    return app.finish()
