"""The engine `up` runs: llama.cpp's llama-server, or a given one offered to the agent as llama.cpp's release."""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from llmgw.agent.provision.archive import pack_llama_server
from llmgw.config.server import DEFAULT_LLAMACPP
from llmgw.up import UpError


def check_llama_server(explicit: str) -> Path:
    p = Path(explicit).expanduser()
    if not (p.is_file() and os.access(p, os.X_OK)):
        raise UpError(f"--llama-server {explicit}: not an executable file")
    return p.resolve()


class LocalRelease:
    """A given llama-server offered to the agent as llama.cpp's release, from loopback.

    The agent then installs it the way it installs any release (checksum,
    unpack, prove it runs, record it) under its engines directory.
    """

    def __init__(self, binary: Path, tag: str = DEFAULT_LLAMACPP) -> None:
        self.tag = tag
        self.binary = binary
        # Packed when first asked for: compressing the binary takes seconds, and an agent that
        # installed this release on an earlier run never asks.
        self._archive: bytes | None = None
        self._packing = threading.Lock()
        empty = io.BytesIO()
        with tarfile.open(fileobj=empty, mode="w:gz") as tf:
            note = b"llmgw up: the given llama-server needs nothing more\n"
            info = tarfile.TarInfo("README-llmgw-up.txt")
            info.size = len(note)
            tf.addfile(info, io.BytesIO(note))
        self.extra = empty.getvalue()
        self._srv: ThreadingHTTPServer | None = None

    @property
    def archive(self) -> bytes:
        with self._packing:
            if self._archive is None:
                self._archive = pack_llama_server(self.binary, self.tag)
            return self._archive

    def body(self, path: str) -> bytes | None:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) != 2 or parts[0] != self.tag:
            return None
        name = parts[1]
        sidecar = name.endswith(".sha256")
        asset = name[: -len(".sha256")] if sidecar else name
        if not asset.endswith(".tar.gz"):
            return None
        # The CUDA build comes as two archives; the second (the CUDA runtime) is not needed here.
        data = self.extra if asset.startswith("cudart-") else self.archive
        return f"{hashlib.sha256(data).hexdigest()}  {asset}\n".encode() if sidecar else data

    def start(self) -> str:
        release = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, send_body: bool) -> None:
                body = release.body(self.path)
                self.send_response(404 if body is None else 200)
                self.send_header("Content-Length", str(0 if body is None else len(body)))
                self.end_headers()
                if body is not None and send_body:
                    self.wfile.write(body)

            def do_GET(self) -> None:
                self._answer(True)

            def do_HEAD(self) -> None:
                self._answer(False)

            def log_message(self, *args: object) -> None:
                pass

        self._srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._srv.serve_forever, daemon=True, name="llama-server release").start()
        return f"http://127.0.0.1:{self._srv.server_address[1]}"

    def stop(self) -> None:
        if self._srv is not None:
            self._srv.shutdown()
            self._srv.server_close()
            self._srv = None
