"""How `llmgw up` gets its model through its mirror: the starter fetched by the mirror (or reused, or
resumed), progress from the mirror's counts, and the tiny test model placed in the mirror when the
starter cannot be had. The mirror's management API is stood in for by an httpx MockTransport."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from llmgw.up import UpError
from llmgw.up.model import (
    STARTER_FILE,
    STARTER_NAME,
    STARTER_REPO,
    STARTER_SOURCE,
    STARTER_VERSION,
    TINY_NAME,
    TINY_VERSION,
    fetch_into_mirror,
    mirrored_model,
    own_model,
    place_in_mirror,
)
from llmgw.up.processes import Child, MirrorProcess

API, BASE = "http://127.0.0.1:18082", "http://127.0.0.1:18081"
TOKEN = "llmgw-mirror-up-token"
WHERE = f"/v1/models/{STARTER_NAME}/{STARTER_VERSION}"
URL = f"{BASE}/{STARTER_NAME}/{STARTER_VERSION}/{STARTER_FILE}"


class Mirror:
    """The management API's answers, in order, for GET of the version; what was asked is kept."""

    def __init__(self, gets: list[tuple[int, dict]], post: tuple[int, dict] | None = None) -> None:
        self.gets, self.post, self.asked = list(gets), post, []

    def handler(self, request: httpx.Request) -> httpx.Response:
        assert request.headers.get("Authorization") == f"Bearer {TOKEN}", "every call carries the mirror's token"
        self.asked.append((request.method, request.url.path, json.loads(request.content) if request.content else None))
        if request.method == "POST":
            assert self.post is not None, "nothing should have been fetched"
            return httpx.Response(self.post[0], json=self.post[1])
        status, body = self.gets.pop(0)
        return httpx.Response(status, json=body)

    def fetch(self, messages: list[str], progress: list) -> str | None:
        with httpx.Client(transport=httpx.MockTransport(self.handler)) as c:
            return fetch_into_mirror(
                API,
                BASE,
                STARTER_SOURCE,
                STARTER_NAME,
                STARTER_VERSION,
                lambda d, t: progress.append((d, t)),
                messages.append,
                interval=0,
                client=c,
                token=TOKEN,
            )


def _version(state: str, done: int | None = None, total: int | None = None, **more) -> dict:
    files = [
        {
            "name": STARTER_FILE,
            "state": state,
            "bytes": total if state == "present" else None,
            "bytes_done": done,
            "bytes_total": total,
        }
    ]
    d = {"model": STARTER_NAME, "version": STARTER_VERSION, "state": state, "files": files, **more}
    if state == "fetching":
        d |= {"bytes_done": done, "bytes_total": total}
    if state == "present":
        d["bytes"] = total
    return d


NOT_HELD = (404, {"error": {"message": "the mirror holds no such version"}})


def test_the_starter_is_fetched_by_the_mirror_with_its_progress():
    m = Mirror(
        gets=[NOT_HELD, (200, _version("fetching", 500, 1000)), (200, _version("present", total=1000))],
        post=(202, {**_version("fetching", 0, 1000), "url": URL}),
    )
    messages, progress = [], []
    assert m.fetch(messages, progress) == URL
    assert m.asked[1] == (
        "POST",
        "/v1/models",
        {"source": f"hf:{STARTER_REPO}/{STARTER_FILE}", "model": STARTER_NAME, "version": STARTER_VERSION},
    )
    assert progress == [(0, 1000), (500, 1000), (1000, 1000)] and messages == []


def test_a_version_already_present_is_reused_without_fetching():
    m = Mirror(gets=[(200, _version("present", total=1000))])
    assert m.fetch([], []) == URL
    assert [a[0] for a in m.asked] == ["GET"]


def test_an_interrupted_version_is_fetched_again_so_the_mirror_resumes_it():
    failed = _version("failed", 400, None, reason="interrupted at 400 bytes; fetch again to resume")
    m = Mirror(
        gets=[(200, failed), (200, _version("present", total=1000))],
        post=(202, {**_version("fetching", 400, 1000), "url": URL}),
    )
    progress = []
    assert m.fetch([], progress) == URL
    assert [a[0] for a in m.asked] == ["GET", "POST", "GET"] and progress[0] == (400, 1000)


def test_a_fetch_that_fails_says_why_and_gives_nothing():
    m = Mirror(
        gets=[NOT_HELD, (200, _version("failed", 300, None, reason="the download ended at 300 of 1000 bytes"))],
        post=(202, {**_version("fetching", 0, 1000), "url": URL}),
    )
    messages = []
    assert m.fetch(messages, []) is None
    assert "could not fetch" in messages[0] and "300 of 1000" in messages[0]


def test_hugging_face_out_of_reach_is_said_plainly():
    m = Mirror(gets=[NOT_HELD], post=(400, {"error": {"message": "https://huggingface.co/api/… could not be reached"}}))
    messages = []
    assert m.fetch(messages, []) is None
    assert messages == [
        f"the mirror could not fetch {STARTER_SOURCE}: https://huggingface.co/api/… could not be reached"
    ]


def test_a_mirror_that_does_not_answer_is_said_plainly():
    def refuse(request):
        raise httpx.ConnectError("refused", request=request)

    messages = []
    with httpx.Client(transport=httpx.MockTransport(refuse)) as c:
        assert (
            fetch_into_mirror(API, BASE, STARTER_SOURCE, "m", "v", lambda d, t: None, messages.append, client=c) is None
        )
    assert "did not answer" in messages[0]


def test_a_file_is_placed_in_the_mirror_once(tmp_path):
    src = tmp_path / "t.gguf"
    src.write_bytes(b"GGUF" + b"\1" * 100)
    root = tmp_path / "mirror"
    url = place_in_mirror(root, BASE, src, "tiny-test", "v1")
    target = root / "tiny-test" / "v1" / "t.gguf"
    assert url == f"{BASE}/tiny-test/v1/t.gguf" and target.read_bytes() == src.read_bytes()
    assert [p.name for p in target.parent.iterdir()] == ["t.gguf"]  # no temporary left behind
    os.utime(target, (1, 1))
    assert place_in_mirror(root, BASE, src, "tiny-test", "v1") == url
    assert target.stat().st_mtime == 1  # identical: kept as it was
    src.write_bytes(b"GGUF" + b"\2" * 100)
    place_in_mirror(root, BASE, src, "tiny-test", "v1")
    assert target.read_bytes() == src.read_bytes()  # a different tiny model (a newer llmgw) replaces it


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    tiny = tmp_path / "tiny-llama.gguf"
    tiny.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setattr("llmgw.up.model.tiny_model_path", lambda: tiny)
    return MirrorProcess(tmp_path / "mirror", tmp_path / "mirror.log", 18081, 18082)


def test_the_starter_through_the_mirror_with_the_mirrors_token(mirror):
    asked = []
    mirror.token = TOKEN  # what start() read from, or made in, <data dir>/mirror.api-token

    def fetch(api, base, source, model, version, progress, say, token):
        asked.append((api, base, source, model, version, token))
        return URL

    c = mirrored_model(mirror, None, print, lambda d, t: None, False, fetch=fetch)
    assert (c.source, c.name, c.file, c.noise) == (URL, STARTER_NAME, STARTER_FILE, False)
    assert asked == [(mirror.api, mirror.base, STARTER_SOURCE, STARTER_NAME, STARTER_VERSION, TOKEN)]
    assert mirrored_model(mirror, "mine", print, lambda d, t: None, False, fetch=fetch).name == "mine"


def test_without_the_starter_the_tiny_model_is_served_from_the_mirror(mirror):
    messages = []
    c = mirrored_model(mirror, None, messages.append, lambda d, t: None, False, fetch=lambda *a, **k: None)
    assert c.noise and c.name == TINY_NAME
    assert c.source == f"{mirror.base}/{TINY_NAME}/{TINY_VERSION}/tiny-llama.gguf"
    assert (mirror.root / TINY_NAME / TINY_VERSION / "tiny-llama.gguf").is_file()
    assert "replies are noise" in messages[-1]


def test_offline_asks_the_mirror_for_nothing(mirror):
    def fetch(*a, **k):
        raise AssertionError("offline: nothing is fetched")

    c = mirrored_model(mirror, None, lambda s: None, lambda d, t: None, True, fetch=fetch)
    assert c.noise and c.source.startswith(mirror.base + "/")


def test_ones_own_model_is_served_where_it_is(tmp_path):
    own = tmp_path / "My-Model.gguf"
    own.write_bytes(b"GGUF" + b"\0" * 8)
    c = own_model(str(own), None)
    assert (c.source, c.name, c.file, c.noise) == (str(own.resolve()), "my-model", "My-Model.gguf", False)
    with pytest.raises(UpError, match="no such file"):
        own_model(str(tmp_path / "nope.gguf"), None)
    (tmp_path / "x.gguf").write_bytes(b"<html>")
    with pytest.raises(UpError, match="not a GGUF"):
        own_model(str(tmp_path / "x.gguf"), None)


def test_ups_mirror_token_is_made_before_the_mirror_starts_and_kept_across_runs(tmp_path, monkeypatch):
    started = []
    monkeypatch.setattr(Child, "start", lambda self: started.append(self.cmd))
    m = MirrorProcess(tmp_path / "mirror", tmp_path / "mirror.log", 18081, 18082)
    m.start()
    assert m.token_file == tmp_path / "mirror.api-token" and (m.token_file.stat().st_mode & 0o777) == 0o600
    assert m.token == m.token_file.read_text().strip() and m.token.startswith("llmgw-mirror-")
    cmd = started[0]
    assert cmd[cmd.index("--api-token-file") + 1] == str(m.token_file)
    again = MirrorProcess(tmp_path / "mirror", tmp_path / "mirror.log", 18081, 18082)
    again.start()
    assert again.token == m.token
    m.token_file.chmod(0o644)
    with pytest.raises(UpError, match="others can read it"):
        MirrorProcess(tmp_path / "mirror", tmp_path / "mirror.log", 18081, 18082).start()
