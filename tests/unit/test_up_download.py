"""The starter-model download of `llmgw up`, against a local server standing in for Hugging Face."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from llmgw import up

PAYLOAD = b"GGUF" + bytes(range(256)) * 4000


class Hub(BaseHTTPRequestHandler):
    body = PAYLOAD
    status = 200
    seen: list = []

    def do_GET(self):  # noqa: N802 - http.server's naming
        Hub.seen.append((self.path, self.headers.get("Range")))
        if self.status != 200:
            self.send_response(self.status)
            self.end_headers()
            return
        start = 0
        rng = self.headers.get("Range")
        if rng:
            start = int(rng.split("=")[1].rstrip("-"))
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{len(self.body) - 1}/{len(self.body)}")
        else:
            self.send_response(200)
        self.send_header("Content-Length", str(len(self.body) - start))
        self.end_headers()
        self.wfile.write(self.body[start:])

    def log_message(self, *args):
        pass


@pytest.fixture
def hub(monkeypatch, tmp_path):
    Hub.body, Hub.status, Hub.seen = PAYLOAD, 200, []
    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{srv.server_address[1]}/")
    monkeypatch.setenv("LLMGW_CACHE_DIR", str(tmp_path))
    yield tmp_path
    srv.shutdown()


def _get(messages=None):
    progress = []
    path = up.download_starter(lambda done, total: progress.append((done, total)),
                               (messages if messages is not None else []).append)
    return path, progress


def test_downloads_once_to_the_cache(hub):
    path, progress = _get()
    assert path == hub / "models" / up.STARTER_FILE
    assert path.read_bytes() == PAYLOAD
    assert Hub.seen[0][0] == f"/{up.STARTER_REPO}/resolve/main/{up.STARTER_FILE}"
    assert progress[-1] == (len(PAYLOAD), len(PAYLOAD))
    assert not list((hub / "models").glob("*.part"))
    Hub.seen.clear()
    assert _get()[0] == path and Hub.seen == []  # already there: nothing fetched


def test_resumes_a_partial_download(hub):
    part = hub / "models" / (up.STARTER_FILE + ".part")
    part.parent.mkdir(parents=True)
    part.write_bytes(PAYLOAD[:1000])
    path, _ = _get()
    assert Hub.seen[0][1] == "bytes=1000-"
    assert path.read_bytes() == PAYLOAD


def test_not_a_gguf_is_discarded(hub):
    Hub.body = b"<html>login</html>"
    messages = []
    path, _ = _get(messages)
    assert path is None and "not a GGUF" in messages[0]
    assert not (hub / "models" / up.STARTER_FILE).exists()


def test_http_error_says_so(hub):
    Hub.status = 404
    messages = []
    assert _get(messages)[0] is None and "HTTP 404" in messages[0]


def test_unreachable_says_so(monkeypatch, tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("LLMGW_CACHE_DIR", str(tmp_path))
    messages = []
    assert _get(messages)[0] is None and "could not be downloaded" in messages[0]
