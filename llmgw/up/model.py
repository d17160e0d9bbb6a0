"""The model `up` serves: the user's own file where it is, or the starter model through up's mirror, or the
tiny test model placed in the mirror when the starter cannot be had."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from llmgw.files import write_atomic
from llmgw.mirror.api import source_url
from llmgw.protocol.mirror_api import MirrorFetchRequest, MirrorVersion
from llmgw.up import UpError
from llmgw.up.tiny_model import tiny_model_path

if TYPE_CHECKING:
    from llmgw.up.processes import MirrorProcess

STARTER_REPO = "Qwen/Qwen2.5-0.5B-Instruct-GGUF"
STARTER_FILE = "qwen2.5-0.5b-instruct-q4_k_m.gguf"
STARTER_NAME = "qwen2.5-0.5b-instruct"
STARTER_SOURCE = f"hf:{STARTER_REPO}/{STARTER_FILE}"
STARTER_VERSION = "starter"  # fixed: a later run finds the version it fetched and reuses it
TINY_NAME = "tiny-test"
TINY_VERSION = "v1"

OnBytes = Callable[[int, int | None], None]


@dataclass
class Choice:
    """The model `up` serves: what clients call it, and the catalog source the agent loads it from."""

    source: str  # a URL on up's mirror, or the path of the user's own file (served where it is)
    name: str
    file: str  # the file's name, for the messages
    noise: bool = False  # the tiny test model: its replies are random text


def _message(resp: httpx.Response) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {resp.status_code}"


def fetch_into_mirror(
    api: str,
    base: str,
    source: str,
    model: str,
    version: str,
    progress: OnBytes,
    say: Callable[[str], None],
    *,
    interval: float = 0.5,
    client: httpx.Client | None = None,
    token: str | None = None,
) -> str | None:
    """``source`` in up's mirror as ``model/version``: the URL the agent fetches it from there.

    A version already present is reused (nothing fetched); one that failed or was
    interrupted is fetched again (the mirror resumes its partial file). Progress
    comes from the mirror's own counts. None, said why, when the mirror cannot get it.
    """
    own = client is None
    c = client or httpx.Client(timeout=httpx.Timeout(60.0, connect=5.0), trust_env=False)  # loopback: no proxy
    where = f"{api}/v1/models/{model}/{version}"
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        r = c.get(where, headers=auth)
        if r.status_code == 200:
            have = MirrorVersion.model_validate(r.json())
            if have.state == "present":
                return source_url(base, model, version, [f.name for f in have.files or []])
        request = MirrorFetchRequest(source=source, model=model, version=version)
        r = c.post(f"{api}/v1/models", json=request.model_dump(mode="json", exclude_defaults=True), headers=auth)
        if r.status_code != 202:
            say(f"the mirror could not fetch {source}: {_message(r)}")
            return None
        d = MirrorVersion.model_validate(r.json())
        url = d.url
        while d.state == "fetching":
            if d.bytes_done is not None:
                progress(d.bytes_done, d.bytes_total)
            time.sleep(interval)
            r = c.get(where, headers=auth)
            if r.status_code != 200:
                say(f"the mirror lost {model}/{version}: {_message(r)}")
                return None
            d = MirrorVersion.model_validate(r.json())
        if d.state != "present" or not url:
            say(f"the mirror could not fetch {source}: {d.reason or d.state}")
            return None
        progress(d.bytes or 0, d.bytes)
        return url
    except httpx.HTTPError as exc:
        say(f"the mirror's API at {api} did not answer ({type(exc).__name__}: {exc})")
        return None
    except ValueError as exc:  # not JSON, or not the mirror's shape (pydantic's ValidationError is one)
        say(f"the mirror's API at {api} answered something it should not ({exc})")
        return None
    finally:
        if own:
            c.close()


def place_in_mirror(root: Path, base: str, file: Path, model: str, version: str) -> str:
    """A copy of ``file`` at ``root/model/version/<name>`` (the mirror serves hand-copied files); its URL there.

    Written atomically under a hidden name (never served); an identical copy is kept.
    """
    target = root / model / version / file.name
    data = file.read_bytes()  # the tiny model: a few megabytes
    if not (target.is_file() and target.stat().st_size == len(data) and target.read_bytes() == data):
        write_atomic(target, data)
    return source_url(base, model, version, [file.name])


def own_model(model: str, name: str | None) -> Choice:
    """The user's own .gguf, checked; served where it is (gigabytes are not copied into the mirror)."""
    path = Path(model).expanduser()
    if not path.is_file():
        raise UpError(f"--model {model}: no such file; give the path of a .gguf file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UpError(f"--model {model}: not a GGUF file (llama.cpp loads .gguf files)")
    return Choice(str(path.resolve()), name or path.stem.lower(), path.name)


TINY_WORDS = (
    "using the tiny test model instead: it loads in a moment, but its weights are random, "
    "so its replies are noise. Give --model PATH.gguf for a real model."
)


def mirrored_model(
    mirror: MirrorProcess,
    name: str | None,
    say: Callable[[str], None],
    progress: OnBytes,
    offline: bool,
    fetch: Callable[..., str | None] = fetch_into_mirror,
) -> Choice:
    """The starter model through the mirror; the tiny test model, placed in the mirror, when it cannot be had."""
    if not offline:
        url = fetch(
            mirror.api, mirror.base, STARTER_SOURCE, STARTER_NAME, STARTER_VERSION, progress, say, token=mirror.token
        )
        if url is not None:
            return Choice(url, name or STARTER_NAME, STARTER_FILE)
    say(TINY_WORDS)
    tiny = tiny_model_path()
    url = place_in_mirror(mirror.root, mirror.base, tiny, TINY_NAME, TINY_VERSION)
    return Choice(url, name or TINY_NAME, tiny.name, noise=True)
