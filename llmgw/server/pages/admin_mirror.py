"""The administrator's Mirror page (/admin/mirror) and its Hugging Face browser (/admin/mirror/repo).

Mounted only when server.yaml has a ``mirror:`` block. Everything it does goes through the admin
API's own methods (``llmgw/server/admin/api.py``, called in process), so the page and ``llmgw ctl
mirror list|fetch|serve|remove`` (``/api/v1/mirror…``) see and do the same:

* **Holdings**: what the mirror holds or is fetching, grouped by model (the mirror's first directory
  level), each version with its files (size, state, checksum on hover), its total, the catalog models
  whose source lies in it and how they run; an unreachable mirror is said outright.
* **Downloads**: each file arriving, with bytes and percent, and each failed one with its reason and
  Retry. While anything downloads, htmx fetches the page again every five seconds and swaps only that
  part (``static/admin.js`` pauses it while the tab is hidden); the serve forms inside it keep what
  was typed (``hx-preserve``).
* **Fetch** (a URL or ``hf:ORG/REPO/FILE``): the mirror reads a GGUF's header first and refuses an
  architecture the nodes' llama.cpp cannot load, or a vision projector; the refusal is shown with the
  form as it was typed, and "Fetch anyway" passes ``anyway``.
* **Serve** a present version as a catalog model (``ctl mirror serve``), and **remove** one: refused
  while a catalog model still uses it, with the API's sentence and a "Remove anyway".
* **Browse** a Hugging Face repository (through ``mirror.registry`` when set, else huggingface.co):
  its GGUF files with sizes and the quantisation read from each name, shard sets as one row, vision
  projectors and importance matrices marked as not a model, and a Fetch button for each.

The Organization page (org.py) is added with this one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

import httpx
from aiohttp import web

from llmgw import huggingface as hub
from llmgw.config.server import DEFAULT_IDLE_TIMEOUT
from llmgw.gguf import pinned_architectures, pinned_build
from llmgw.protocol.admin import MirrorServeRequest, ModelReply
from llmgw.protocol.mirror_api import MirrorFetchRequest, MirrorFile, MirrorListing, MirrorVersion
from llmgw.server.admin.api import AdminAPI, AdminRefused
from llmgw.server.pages import PageError
from llmgw.server.pages.admin_cluster import Refusal, answer, fragment
from llmgw.server.pages.admin_format import FMT, duration
from llmgw.server.pages.org import OrgPage
from llmgw.server.pages.session import redirect
from llmgw.server.pages.site import Site

if TYPE_CHECKING:
    from llmgw.server.app import Server

PATH = "/admin/mirror"
REPO_PATH = PATH + "/repo"
REFRESH_S = 5
NOSCRIPT_REFRESH_S = 15
HF_TIMEOUT_S = 15.0
HF_MAX_PAGES = 20  # a repository whose listing runs past this many pages is not a model repository
MAX_FIELD = 1000
QUANT = re.compile(
    r"(?<![A-Za-z0-9])(I?Q[1-8](?:_(?:[0-9]+|[A-Z]+))*|BF16|FP16|F16|FP32|F32|MXFP4(?:_MOE)?|TQ[12]_0)(?![A-Za-z0-9])",
    re.I,
)
REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
MODES = {
    "always": ("always on", {"min": 1}),
    "on-demand": (
        f"on demand (loads on the first request, stops after {duration(DEFAULT_IDLE_TIMEOUT)} idle)",
        {"min": 0},
    ),
}
SAID = {
    "fetching": "Fetching {m}/{v}: it is listed below as it arrives.",
    "served": "Added {m} to the catalog; the Cluster page shows its replicas.",
    "removed": "Removed {m}/{v} from the mirror.",
}

# -- the holdings -------------------------------------------------------------------------------


def percent(done: int | None, total: int | None) -> float | None:
    if not total or done is None:
        return None
    return min(100.0, 100.0 * done / total)


def retry_source(f: MirrorFile) -> str | None:
    """The source to fetch a failed file again: an hf: source without the commit it was pinned to."""
    src = f.source
    if not src:
        return None
    if src.startswith("hf:"):
        return src.split("@", 1)[0]
    return src


@dataclass
class UsedBy:
    name: str
    runs: str  # always on / on demand / stopped, and where it is declared


@dataclass
class VersionLine:
    v: MirrorVersion
    address: str  # what a catalog source should say: the file, or the version ending in /
    used_by: list[UsedBy]
    anchor: str

    @property
    def files(self) -> list[MirrorFile]:
        return list(self.v.files or ())

    @property
    def size(self) -> int:
        return self.v.bytes or sum(f.bytes or 0 for f in self.files)

    @property
    def percent(self) -> float | None:
        return percent(self.v.bytes_done, self.v.bytes_total)


@dataclass
class Family:
    model: str
    versions: list[VersionLine] = field(default_factory=list)

    @property
    def size(self) -> int:
        return sum(v.size for v in self.versions)


@dataclass
class Arriving:
    model: str
    version: str
    file: MirrorFile

    @property
    def percent(self) -> float | None:
        return percent(self.file.bytes_done, self.file.bytes_total)

    @property
    def retry(self) -> str | None:
        return retry_source(self.file)

    @property
    def retry_as(self) -> str:
        """For a URL source, the name it was kept under (hf: sources name their own files)."""
        return "" if (self.file.source or "").startswith("hf:") else self.file.name


def _anchor(model: str, version: str) -> str:
    return "v-" + re.sub(r"[^A-Za-z0-9_-]", "-", f"{model}-{version}")


def address(base: str, v: MirrorVersion) -> str:
    root = f"{base.rstrip('/')}/{quote(v.model, safe='')}/{quote(v.version, safe='')}/"
    files = [f.name for f in v.files or ()]
    return root + quote(files[0], safe="") if len(files) == 1 else root


def families(listing: MirrorListing, runs: Any) -> list[Family]:
    out: dict[str, Family] = {}
    base = listing.base or ""
    for v in listing.models or ():
        fam = out.setdefault(v.model, Family(v.model))
        used = [UsedBy(name, runs(name)) for name in v.used_by or ()]
        fam.versions.append(VersionLine(v, address(base, v), used, _anchor(v.model, v.version)))
    return sorted(out.values(), key=lambda f: f.model.lower())


def arriving(listing: MirrorListing) -> tuple[list[Arriving], list[Arriving]]:
    """Files downloading now, and files whose download failed."""
    fetching, failed = [], []
    for v in listing.models or ():
        for f in v.files or ():
            if f.state == "fetching":
                fetching.append(Arriving(v.model, v.version, f))
            elif f.state == "failed":
                failed.append(Arriving(v.model, v.version, f))
    return fetching, failed


# -- Hugging Face ---------------------------------------------------------------------------------


class RegistryError(PageError):
    """The registry could not be read; the message says why, in words."""


def quant_of(name: str) -> str:
    m = QUANT.search(name.rsplit("/", 1)[-1])
    return m.group(1).upper() if m else ""


def not_a_model(name: str) -> str:
    low = name.rsplit("/", 1)[-1].lower()
    if "mmproj" in low:
        return "a vision projector (mmproj): not a model on its own"
    if "imatrix" in low:
        return "an importance matrix (for quantising): not a model"
    return ""


def _slug(text: str) -> str:
    s = re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.")
    return s[:80] or "model"


def default_model(repo: str) -> str:
    name = repo.split("/", 1)[-1]
    return _slug(re.sub(r"[-_.]gguf$", "", name, flags=re.I))


def default_version(quant: str, today: datetime | None = None) -> str:
    day = (today or datetime.now(UTC)).strftime("%Y-%m-%d")
    return f"{day}-{quant.lower()}" if quant else day


@dataclass
class RepoFile:
    path: str  # the first file (a shard set: its first part)
    label: str  # the file, or "STEM-000NN-of-000MM.gguf (M files)"
    size: int | None
    quant: str
    parts: int = 1
    note: str = ""  # why it is not a model

    def source(self, repo: str) -> str:
        return f"hf:{repo}/{self.path}"


@dataclass
class RepoView:
    repo: str
    endpoint: str
    commit: str = ""
    gated: bool = False
    architecture: str = ""
    loadable: bool | None = None
    context: int | None = None
    license: str = ""
    downloads: int | None = None
    modified: str = ""
    ggufs: list[RepoFile] = field(default_factory=list)
    others: list[tuple[str, int | None]] = field(default_factory=list)


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def repo_files(entries: list[hub.TreeFile]) -> tuple[list[RepoFile], list[tuple[str, int | None]]]:
    """GGUF files (a shard set as one), and every other file, by path."""
    ggufs: list[RepoFile] = []
    sets: dict[tuple[str, str], list[tuple[int, str, int | None]]] = {}
    others: list[tuple[str, int | None]] = []
    for e in entries:
        path = e.path
        if not path.lower().endswith(".gguf"):
            others.append((path, e.size))
            continue
        m = hub.SHARD.search(path)
        if m:
            sets.setdefault((path[: m.start()], m.group(2)), []).append((int(m.group(1)), path, e.size))
        else:
            ggufs.append(RepoFile(path, path, e.size, quant_of(path), note=not_a_model(path)))
    for (_, count), parts in sets.items():
        parts.sort()
        sizes = [s for _, _, s in parts]
        first = parts[0][1]
        whole = len(parts) == int(count)
        label = f"{first} ({len(parts)} files{'' if whole else f' of {int(count)}: some are missing'})"
        ggufs.append(
            RepoFile(
                first,
                label,
                None if any(s is None for s in sizes) else sum(s or 0 for s in sizes),
                quant_of(first),
                parts=len(parts),
                note=not_a_model(first),
            )
        )
    ggufs.sort(key=lambda f: (f.note != "", f.size is None, f.size or 0, f.path))
    others.sort()
    return ggufs, others


# The registry's failures in the page's words: what to check is mirror.registry in server.yaml.
_WORDING: dict[hub.Kind, str] = {
    "unreachable": "{endpoint} could not be reached ({error}); "
    "check mirror.registry in server.yaml and this machine's network.",
    "denied": "{what} is gated or private on {endpoint}: it cannot be listed without a token.",
    "missing": "{what} was not found on {endpoint}; check the name (ORG/NAME).",
    "status": "{endpoint} answered {status} {reason} for {what}; try again later.",
    "not-json": "{endpoint} did not answer with JSON; is it a Hugging Face API?",
    "not-described": "{endpoint} did not describe {what}; is it a Hugging Face API?",
    "not-listing": "{endpoint} did not answer {what}'s files with a listing.",
    "too-long": "the listing of {what} runs past {pages} pages; is it a model?",
}


async def read_repo(endpoint: str, repo: str, transport: httpx.AsyncBaseTransport | None = None) -> RepoView:
    """The repository's facts (/api/models/ORG/NAME) and files (…/tree/main, every page of it)."""
    base = endpoint.rstrip("/")
    view = RepoView(repo, base)
    async with httpx.AsyncClient(timeout=HF_TIMEOUT_S, follow_redirects=True, transport=transport) as client:
        try:
            info = await hub.model_info(client, base, repo)
            files = await hub.tree(client, base, repo, "main", max_pages=HF_MAX_PAGES)
        except hub.HFError as exc:
            raise RegistryError(exc.worded(_WORDING, what=f"hf:{repo}", pages=HF_MAX_PAGES)) from None
    sha = info.get("sha")
    view.commit = sha if isinstance(sha, str) else ""
    view.gated = hub.is_gated(info.get("gated"))
    meta = _dict(info.get("gguf"))
    arch = meta.get("architecture")
    if isinstance(arch, str) and arch:
        view.architecture = arch
        known = pinned_architectures()
        view.loadable = (arch in known) if known else None
    ctx = meta.get("context_length")
    view.context = ctx if isinstance(ctx, int) and not isinstance(ctx, bool) else None
    card = _dict(info.get("cardData"))
    lic = card.get("license")
    view.license = lic if isinstance(lic, str) else ""
    dl = info.get("downloads")
    view.downloads = dl if isinstance(dl, int) and not isinstance(dl, bool) else None
    mod = info.get("lastModified")
    view.modified = mod[:10] if isinstance(mod, str) else ""
    view.ggufs, view.others = repo_files(files)
    return view


# -- the forms -------------------------------------------------------------------------------------


@dataclass
class FetchForm:
    source: str = ""
    model: str = ""
    version: str = ""
    as_name: str = ""
    anyway: bool = False


def _text(form: Any, name: str, most: int = MAX_FIELD) -> str:
    return str(form.get(name, "")).strip()[:most]


# -- the pages -------------------------------------------------------------------------------------


class MirrorPages:
    def __init__(self, site: Site, server: Server) -> None:
        self.site = site
        self.server = server
        self.api = AdminAPI(server)

    def add_routes(self) -> None:
        if self.server.mirror is not None:  # mounted only with a mirror: block in server.yaml
            self.site.menu.add("Mirror", PATH, "admin")
            self.site.route("GET", PATH, "admin", self.page)
            self.site.route("POST", PATH + "/fetch", "admin", self.fetch)
            self.site.route("POST", PATH + "/serve", "admin", self.serve)
            self.site.route("POST", PATH + "/remove", "admin", self.remove)
            self.site.route("GET", REPO_PATH, "admin", self.repo)
        OrgPage(self.site, self.server).add_routes()

    @property
    def registry(self) -> str:
        m = self.server.config.mirror
        return m.registry if m is not None and m.registry else hub.DEFAULT_ENDPOINT

    def _runs(self, name: str) -> str:
        catalog = self.server.catalog
        entry = catalog.get(name) if catalog is not None else None
        if entry is None:
            return ""
        s = entry.model.scaling
        if s is None:
            runs = "served by the endpoints in server.yaml"
        elif s.state == "stopped":
            runs = "stopped (scaled to 0)"
        elif s.state == "on demand":
            runs = f"on demand, stops after {duration(s.idle_timeout)} idle"
        else:
            runs = "always on"
        return runs + ("; declared in server.yaml, changed there" if entry.declared else "")

    def _said(self, what: str, m: str, v: str, listing: MirrorListing | None) -> str:
        """The sentence after a redirect, only where it is still true (a link cannot make the page say
        something that did not happen)."""
        held = {(x.model, x.version) for x in listing.models or ()} if listing is not None else set()
        catalog = self.server.catalog
        true = {
            "fetching": (m, v) in held,
            "served": catalog is not None and catalog.get(m) is not None,
            "removed": listing is not None and (m, v) not in held,
        }
        return SAID[what].format(m=m, v=v) if true.get(what) else ""

    async def _render(
        self,
        request: web.Request,
        status: int = 200,
        *,
        form: FetchForm | None = None,
        problem: str = "",
        refused: str = "",  # the fetch's refusal, shown under its form
        confirm: tuple[str, str, str] | None = None,  # (model, version, the API's sentence): remove anyway?
    ) -> web.Response:
        listing: MirrorListing | None = None
        unreachable = ""
        try:
            listing = await self.api.mirror_list()
        except AdminRefused as exc:  # the mirror is unreachable or answered nonsense: said on the page
            unreachable = exc.message
        fams = families(listing, self._runs) if listing is not None else []
        fetching, failed = arriving(listing) if listing is not None else ([], [])
        q = request.query
        said = self._said(q.get("said", ""), q.get("m", ""), q.get("v", ""), listing)
        if form is None:
            form = FetchForm(source=q.get("source", "")[:MAX_FIELD], model=q.get("model", "")[:200])
            form.version = q.get("version", "")[:200]
        values = dict(
            fmt=FMT,
            api=self.server.mirror.api if self.server.mirror is not None else "",
            base=listing.base if listing is not None else "",
            unreachable=unreachable,
            families=fams,
            fetching=fetching,
            failed=failed,
            form=form,
            problem=problem,
            refused=refused,
            confirm=confirm,
            said=said,
            can_serve=self.server.catalog is not None,
            modes=MODES,
            refresh_s=REFRESH_S,
            noscript_refresh_s=NOSCRIPT_REFRESH_S,
            registry=self.registry,
            build=pinned_build(),
        )
        template = "admin_mirror_live.html" if fragment(request) else "admin_mirror.html"
        return self.site.render.page(request, template, status, **values)

    async def page(self, request: web.Request) -> web.StreamResponse:
        return await self._render(request)

    async def fetch(self, request: web.Request) -> web.StreamResponse:
        data = await request.post()
        form = FetchForm(
            source=_text(data, "source"),
            model=_text(data, "model", 200),
            version=_text(data, "version", 200),
            as_name=_text(data, "as", 255),
            anyway=bool(data.get("anyway")),
        )
        if not (form.source and form.model and form.version):
            return await self._render(
                request,
                400,
                form=form,
                refused="Give the source (a URL or hf:ORG/REPO/FILE), the model's name and the version to keep it under.",
            )
        body: dict[str, Any] = {"source": form.source, "model": form.model, "version": form.version}
        if form.as_name:
            body["as"] = form.as_name
        if form.anyway:
            body["anyway"] = True
        req = MirrorFetchRequest.model_validate(body)
        got = answer(await self.api.mirror_fetch(req), MirrorVersion)
        if isinstance(got, Refusal):
            return await self._render(request, got.status, form=form, refused=got.message)
        return redirect(
            request, f"{PATH}?{urlencode({'said': 'fetching', 'm': got.model, 'v': got.version})}#downloads"
        )

    async def serve(self, request: web.Request) -> web.StreamResponse:
        data = await request.post()
        m, v = _text(data, "model", 255), _text(data, "version", 255)
        mode = MODES.get(_text(data, "mode")) or MODES["always"]
        req = MirrorServeRequest(
            name=_text(data, "name", 200) or None,
            gpu_class=_text(data, "gpu_class", 100) or None,
            scaling=dict(mode[1]),
        )
        if not (m and v):
            return await self._render(request, 400, problem="Choose a version to serve.")
        got = answer(await self.api.mirror_serve(m, v, req), ModelReply)
        if isinstance(got, Refusal):
            return await self._render(request, got.status, problem=f"{m}/{v} was not served: {got.message}")
        return redirect(request, f"{PATH}?{urlencode({'said': 'served', 'm': got.model.name})}")

    async def remove(self, request: web.Request) -> web.StreamResponse:
        data = await request.post()
        m, v = _text(data, "model", 255), _text(data, "version", 255)
        if not (m and v):
            return await self._render(request, 400, problem="Choose a version to remove.")
        resp = await self.api.mirror_remove(m, v, force=data.get("force") == "1")
        if resp.status >= 300:
            refusal = answer(resp, MirrorVersion)
            assert isinstance(refusal, Refusal)
            if resp.status == 409 and self.api.users_of(m, v):
                return await self._render(request, 409, confirm=(m, v, refusal.message))
            return await self._render(request, refusal.status, problem=f"{m}/{v} was not removed: {refusal.message}")
        return redirect(request, f"{PATH}?{urlencode({'said': 'removed', 'm': m, 'v': v})}")

    @staticmethod
    def _choose(source: str, model: str, quant: str) -> str:
        """The Mirror page with its fetch form filled in, to choose other names."""
        return f"{PATH}?{urlencode({'source': source, 'model': model, 'version': default_version(quant)})}#fetch"

    async def repo(self, request: web.Request) -> web.StreamResponse:
        repo = request.query.get("repo", "").strip().strip("/")[:200]
        values: dict[str, Any] = dict(fmt=FMT, repo=repo, registry=self.registry, view=None, problem="")
        status = 200
        if repo:
            if not REPO.fullmatch(repo) or ".." in repo:
                status, values["problem"] = 400, "A repository is named ORG/NAME, e.g. Qwen/Qwen2.5-0.5B-Instruct-GGUF."
            else:
                try:
                    view = await read_repo(self.registry, repo)
                except RegistryError as exc:
                    status, values["problem"] = 502, str(exc)
                else:
                    model = default_model(repo)
                    values["view"] = view
                    values["rows"] = [
                        (f, model, default_version(f.quant), self._choose(f.source(repo), model, f.quant))
                        for f in view.ggufs
                    ]
        return self.site.render.page(request, "admin_mirror_repo.html", status, **values)
