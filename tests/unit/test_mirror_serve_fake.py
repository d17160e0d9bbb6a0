"""A stand-in for llmgw.mirror.fetcher.Manager (same methods, the real status
classes), for the mirror's serving, API and CLI tests: downloads are driven
by the test (``finish``) instead of the network."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from llmgw.mirror.fetcher import FileStatus, VersionStatus
from llmgw.mirror.layout import MirrorError, check_segment


class FakeManager:
    def __init__(self, root, **_):
        self.root = Path(root)
        self.versions: dict[tuple[str, str], VersionStatus] = {}
        self.fetched: list[tuple] = []
        self.closed = False
        self.payloads: dict[str, bytes] = {}  # source -> bytes that "arrive" on finish
        self.auto_finish = False

    # test helpers -------------------------------------------------------
    def put(self, model, version, name, data: bytes, *, sha=True):
        d = self.root / model / version
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_bytes(data)
        vs = self.versions.setdefault((model, version), VersionStatus(model, version, "present"))
        vs.files.append(
            FileStatus(
                name, "present", len(data), len(data), len(data), hashlib.sha256(data).hexdigest() if sha else None
            )
        )
        return vs

    def finish(self, model, version):
        vs = self.versions[(model, version)]
        for f in vs.files:
            data = self.payloads.get(f.source, b"x" * (f.bytes_total or 3))
            (self.root / model / version).mkdir(parents=True, exist_ok=True)
            (self.root / model / version / f.name).write_bytes(data)
            f.state, f.size, f.bytes_done, f.sha256 = "present", len(data), len(data), hashlib.sha256(data).hexdigest()
        vs.state = "present"

    # the contract -------------------------------------------------------
    async def close(self):
        self.closed = True

    def list(self):
        return list(self.versions.values())

    def status(self, model, version):
        return self.versions.get((model, version))

    async def fetch(self, source, model, version, *, as_name=None, anyway=False):
        check_segment(model, "--model")
        check_segment(version, "--version")
        old = self.versions.get((model, version))
        if old is not None and old.state == "present":
            raise MirrorError(
                f"{model}/{version} is already here; a version is never overwritten, add a new one beside it."
            )
        self.fetched.append((source, model, version, as_name, anyway))
        sources = source.split("+")  # a test's way to ask for several files
        files = [
            FileStatus(as_name or s.split("?", 1)[0].rsplit("/", 1)[-1], "fetching", None, 1, 10, source=s)
            for s in sources
        ]
        vs = VersionStatus(model, version, "fetching", files)
        self.versions[(model, version)] = vs
        if self.auto_finish:
            self.finish(model, version)
        return vs

    async def wait(self, model, version):
        return self.versions[(model, version)]

    async def remove(self, model, version):
        vs = self.versions.get((model, version))
        if vs is not None and vs.state == "fetching":
            raise MirrorError(f"{model}/{version} is still downloading; wait for it or let it fail first.")
        self.versions.pop((model, version), None)

    async def remove_file(self, model, version, name):
        vs = self.versions.get((model, version))
        if vs is None or not any(f.name == name for f in vs.files):
            raise MirrorError(f"the mirror holds no {model}/{version}/{name}")
        vs.files = [f for f in vs.files if f.name != name]
        os.unlink(self.root / model / version / name)

    def path_of(self, model, version, name):
        p = self.root / model / version / name
        return p if p.is_file() else None
