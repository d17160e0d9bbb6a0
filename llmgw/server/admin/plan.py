"""GET /api/v1/plan: does a model fit the fleet, at which precision, on how many GPUs (`llmgw ctl plan`).

The model is named as the catalog, the mirror or Hugging Face names it, tried in that order:

* a catalog model: its ``source`` says where to read (a mirror version, ``hf:``, a model id);
* ``M/V`` or ``M/V/FILE`` (or ``M`` with one version) in the mirror: the version's
  ``config.json`` from the mirror's byte port, else its GGUF's header (Range requests), else
  the ``config.json`` of the Hugging Face repository its files were fetched from, at that commit;
* ``hf:ORG/NAME[/FILE.gguf]`` or ``ORG/NAME``: the repository's ``config.json`` (or the GGUF's
  header) on Hugging Face, through ``mirror.registry`` when it is set.

Besides fetching weights, reading Hugging Face here is the one egress an operator starts, and it
goes only to the configured registry (huggingface.co unless ``mirror.registry`` says otherwise),
without a token: a gated repository is read from the mirror's copy instead. The arithmetic is
``llmgw/server/control/sizing.py``; the fleet is every registered node's inventory.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote, urlsplit

import httpx
import orjson
from aiohttp import web

from llmgw import gguf
from llmgw import huggingface as hub
from llmgw.config.server import source_kind
from llmgw.protocol.admin import PlanArchitecture, PlanReply, PlanRow
from llmgw.protocol.mirror_api import MirrorFile, MirrorListing, MirrorVersion
from llmgw.server.admin.api import AdminRefused, NotControlPlane
from llmgw.server.control import sizing
from llmgw.server.control.placement import gpu_class_of

if TYPE_CHECKING:
    from llmgw.server.admin.api import AdminAPI
    from llmgw.server.control.agents import Node

PATH = "/api/v1/plan"
READ_TIMEOUT_S = 15.0
CONFIG_MAX_BYTES = 4 << 20  # a config.json is a few kB; anything this large is not one
MAX_CONTEXT = 1 << 24
MAX_CONCURRENCY = 1 << 16
REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")
HEADROOM_WORDS = (
    "TOTAL includes headroom on each GPU of 10% of the card (vLLM uses 90% by default; the rest is the "
    "CUDA context and workspaces) and 2 GiB for activations and CUDA graphs; a CPU node keeps 10% and 2 GiB "
    "for the system and llama.cpp's buffers"
)

# The registry's failures in this route's words: what to check is mirror.registry and the name.
_WORDING: dict[hub.Kind, str] = {
    "unreachable": "{endpoint} could not be reached ({error}); check mirror.registry in server.yaml "
    "and this machine's network",
    "denied": "{what} is gated or private on {endpoint}, and the control plane reads it without a token; "
    "fetch it into the mirror (whose HF_TOKEN may read it) and plan the mirror's version",
    "missing": "{what} was not found on {endpoint}; check the name (ORG/NAME)",
    "status": "{endpoint} answered {status} {reason} for {what}; try again later",
    "not-json": "{url} did not answer with JSON; is {endpoint} a Hugging Face API?",
    "not-described": "{endpoint} did not describe {what}; is it a Hugging Face API?",
    "not-listing": "{endpoint} did not answer {what}'s files with a listing",
    "too-long": "the listing of {what} runs past {pages} pages; is it a model?",
}
_HF_STATUS: dict[hub.Kind, int] = {"missing": 404, "denied": 403, "unreachable": 503}


def _refused(status: int, message: str, code: str = "plan_refused") -> AdminRefused:
    return AdminRefused(status, message, code)


def _int_param(q: Any, name: str, most: int) -> int | None:
    raw = q.get(name)
    if raw in (None, ""):
        return None
    try:
        v = int(raw)
    except ValueError:
        v = 0
    if not 0 < v <= most:
        raise _refused(400, f"{name} is a whole number from 1 to {most}", "invalid_request")
    return v


def machine_of(node: Node) -> sizing.Machine:
    """A node as sizing counts it: each card's class and memory, and the node's main memory."""
    inv = node.inventory
    gpus = tuple((gpu_class_of(g), g.memory_total_bytes) for g in (inv.gpus if inv and inv.gpus else ()))
    memory = node.memory or (inv.memory if inv else None)
    return sizing.Machine(node.node_id, gpus, memory.total_bytes if memory else None)


def _present(v: MirrorVersion) -> list[MirrorFile]:
    # A file that does not say its state is present (mirror_client.entry_from_version reads them so too).
    return [f for f in v.files or () if (f.state if "state" in f.model_fields_set else "present") == "present"]


def _model_ggufs(files: list[MirrorFile]) -> list[MirrorFile]:
    """The GGUF files that are a model: not a vision projector, not an importance matrix."""
    out = []
    for f in files:
        low = f.name.lower()
        if low.endswith(".gguf") and "mmproj" not in low and "imatrix" not in low:
            out.append(f)
    return sorted(out, key=lambda f: f.name)


def _shard_set(name: str, sizes: dict[str, int | None]) -> tuple[str, int | None]:
    """The first part of the set ``name`` is one of (itself when it is no part) and the set's size."""
    m = hub.SHARD.search(name)
    if not m:
        return name, sizes.get(name)
    stem, count = name[: m.start()], int(m.group(2))
    parts = [f"{stem}-{i:05d}-of-{m.group(2)}.gguf" for i in range(1, count + 1)]
    got = [sizes.get(p) for p in parts]
    total = None if any(g is None for g in got) else sum(g or 0 for g in got)
    return parts[0], total


def _one_model(names: list[str], where: str) -> str:
    """The one GGUF model (a file, or a set of parts) among ``names``; refused, listing them, when several."""
    firsts = sorted({_shard_set(n, {})[0] for n in names})
    if len(firsts) == 1:
        return firsts[0]
    shown = ", ".join(firsts[:6]) + (f" and {len(firsts) - 6} more" if len(firsts) > 6 else "")
    raise _refused(400, f"{where} holds several GGUF models ({shown}); name one: {where}/FILE")


def _architecture_view(arch: sizing.Architecture, read_from: str) -> PlanArchitecture:
    return PlanArchitecture(
        read_from=read_from,
        format="gguf" if arch.gguf else "config.json",
        name=arch.name,
        model_type=arch.model_type,
        parameters=arch.parameters,
        active_parameters=arch.active_parameters,
        layers=arch.layers,
        hidden_size=arch.hidden,
        attention_heads=arch.heads,
        kv_heads=arch.kv_heads,
        head_dim=arch.head_dim,
        intermediate_size=arch.intermediate,
        vocab_size=arch.vocab,
        experts=arch.experts or None,
        experts_per_token=arch.experts_per_token or None,
        shared_experts=arch.shared_experts or None,
        tied_embeddings=None if arch.gguf else arch.tied,
        latent_attention=arch.kv_split == "copied",
        max_context=arch.max_context,
        kv_elements_per_token=arch.kv_per_token,
        checkpoint=arch.checkpoint,
        file_bytes=arch.file_bytes,
        notes=list(arch.notes),
    )


def _row(f: sizing.Fit) -> PlanRow:
    if f.fits is None:
        return PlanRow(
            precision=f.precision,
            engine=f.engine,
            pool=f.pool,
            gpu=f.gpu,
            weights_bytes=f.weights_bytes,
            kv_cache_bytes=f.kv_cache_bytes,
            checkpoint=f.checkpoint,
        )
    laid_out = f.tp > 0 or not f.gpu
    return PlanRow(
        precision=f.precision,
        engine=f.engine,
        pool=f.pool,
        gpu=f.gpu,
        memory_bytes=f.memory_bytes,
        fits=f.fits,
        gpus_per_replica=f.tp if laid_out else None,
        tensor_parallel=f.tp if f.gpu and laid_out else None,
        nodes=f.nodes if laid_out else None,
        weights_bytes=f.weights_bytes,
        kv_cache_bytes=f.kv_cache_bytes,
        headroom_bytes=f.headroom_bytes,
        total_bytes=f.total_bytes,
        free_bytes=f.free_bytes,
        reason=f.reason,
        checkpoint=f.checkpoint,
    )


class PlanAPI:
    """The plan route over the admin API's parts (its mirror client, catalog and agent service)."""

    def __init__(self, api: AdminAPI) -> None:
        self.api = api
        self.s = api.s

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PATH, self._api_plan)

    async def _api_plan(self, request: web.Request) -> web.Response:
        q = request.query
        try:
            model = (q.get("model") or "").strip()
            if not model:
                raise _refused(
                    400, "name the model: ?model=NAME (catalog, M/V in the mirror, or hf:ORG/NAME)", "invalid_request"
                )
            context = _int_param(q, "context", MAX_CONTEXT)
            concurrency = _int_param(q, "concurrency", MAX_CONCURRENCY) or 1
            kv = q.get("kv_cache") or "fp16"
            if kv not in sizing.KV_TYPES:
                raise _refused(400, "kv_cache is fp16 or fp8", "invalid_request")
        except AdminRefused as exc:
            return exc.response()
        return await self.api._reply(self.plan(model, context=context, concurrency=concurrency, kv_cache=kv))

    async def plan(
        self, model: str, *, context: int | None = None, concurrency: int = 1, kv_cache: str = "fp16"
    ) -> PlanReply:
        """The figures for ``model`` on every GPU class (and CPU node size) in the fleet."""
        if self.s.agents is None or self.s.catalog is None:
            raise NotControlPlane()
        arch, read_from = await self.architecture(model)
        machines = [machine_of(n) for n in self.s.agents.nodes()]
        try:
            p = sizing.plan(arch, machines, context=context, concurrency=concurrency, kv_type=kv_cache)
        except sizing.SizingError as exc:
            raise _refused(400, f"{model}: {exc}") from None
        notes = list(p.notes)
        if not machines:
            notes.append("no nodes have registered, so nothing is fitted; the figures are below")
        return PlanReply(
            model=model,
            context=p.context,
            concurrency=p.concurrency,
            kv_cache=p.kv_type,
            architecture=_architecture_view(arch, read_from),
            rows=[_row(f) for f in p.fits],
            figures=[_row(f) for f in p.figures],
            headroom=HEADROOM_WORDS,
            notes=notes,
        )

    # -- finding the model ------------------------------------------------------------------

    def _client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=READ_TIMEOUT_S, follow_redirects=True)

    @property
    def registry(self) -> str:
        m = self.s.config.mirror
        return m.registry if m is not None and m.registry else hub.DEFAULT_ENDPOINT

    async def architecture(self, model: str) -> tuple[sizing.Architecture, str]:
        """What ``model`` is, and where that was read, in words."""
        if model.startswith("hf:"):
            return await self._from_hf(model[3:])
        catalog = self.s.catalog
        entry = catalog.get(model) if catalog is not None else None
        if entry is not None:
            return await self._from_source(entry.name, entry.model.source)
        tried = [f"no model {model} in the catalog"]
        unasked: AdminRefused | None = None  # the mirror could not be asked: said if nothing else has it
        if self.s.mirror is not None:
            try:
                listing = await self._listing()
            except AdminRefused as exc:
                unasked = exc
                tried.append(f"the mirror could not be asked ({exc.message})")
            else:
                found = self._in_mirror(listing, model)
                if found is not None:
                    return await self._from_mirror(listing, *found)
                tried.append("none in the mirror (M, M/V or M/V/FILE)")
        if REPO.fullmatch(model):
            try:
                return await self._from_hf(model)
            except AdminRefused as exc:
                if exc.status != 404:
                    raise
                tried.append(exc.message)
        else:
            tried.append("and it is not a Hugging Face name (hf:ORG/NAME)")
        if unasked is not None:
            raise _refused(unasked.status, "; ".join(tried), unasked.code)
        raise _refused(404, "; ".join(tried), "model_not_found")

    async def _listing(self) -> MirrorListing:
        return await self.api._mirror_as(self.api._need_mirror().list(), MirrorListing)

    @staticmethod
    def _in_mirror(listing: MirrorListing, model: str) -> tuple[MirrorVersion, str | None] | None:
        """The mirror version ``model`` names (M/V/FILE, M/V, or M when it has one version), and the file."""
        parts = model.split("/")
        versions = [v for v in listing.models or () if v.model == parts[0]]
        if not versions:
            return None
        if len(parts) == 1:
            if len(versions) > 1:
                names = ", ".join(f"{v.model}/{v.version}" for v in versions)
                raise _refused(400, f"the mirror holds several versions of {model} ({names}); name one as M/V")
            return versions[0], None
        chosen = next((v for v in versions if v.version == parts[1]), None)
        if chosen is None or len(parts) > 3:
            return None
        return chosen, parts[2] if len(parts) == 3 else None

    async def _from_source(self, name: str, source: str | None) -> tuple[sizing.Architecture, str]:
        """A catalog model, read where its source is."""
        if not source:
            raise _refused(
                400,
                f"{name} is served from endpoints in server.yaml and has no source to read; "
                "plan its Hugging Face repository (hf:ORG/NAME) or its mirror version (M/V)",
            )
        kind = source_kind(source)
        if kind == "hf":
            return await self._from_hf(source[3:])
        if kind == "model_id":
            if REPO.fullmatch(source):
                return await self._from_hf(source)
            raise _refused(400, f"{name}'s source {source!r} is not a Hugging Face name (ORG/NAME)")
        if kind == "path":
            raise _refused(
                400,
                f"{name}'s source is a path on the nodes ({source}), which the control plane cannot read; "
                "plan the repository it came from (hf:ORG/NAME)",
            )
        if self.s.mirror is not None:
            listing = await self._listing()
            found = self._source_in_mirror(listing, source)
            if found is not None:
                return await self._from_mirror(listing, *found)
        raise _refused(
            400,
            f"{name}'s source {source} is not a version in the mirror; plan reads the mirror and "
            "Hugging Face (through mirror.registry) only: plan hf:ORG/NAME",
        )

    @staticmethod
    def _source_in_mirror(listing: MirrorListing, source: str) -> tuple[MirrorVersion, str | None] | None:
        """The mirror version a catalog source lies in, compared by path as the catalog's users are."""
        prefix = [s for s in urlsplit(listing.base or "").path.split("/") if s]
        segs = [unquote(s) for s in urlsplit(source).path.split("/") if s]
        if segs[: len(prefix)] != prefix:
            return None
        rest = segs[len(prefix) :]
        if len(rest) not in (2, 3):
            return None
        v = next((v for v in listing.models or () if (v.model, v.version) == (rest[0], rest[1])), None)
        return None if v is None else (v, rest[2] if len(rest) == 3 else None)

    # -- reading from the mirror ------------------------------------------------------------

    async def _from_mirror(
        self, listing: MirrorListing, v: MirrorVersion, file: str | None
    ) -> tuple[sizing.Architecture, str]:
        where = f"{v.model}/{v.version}"
        if not listing.base:
            raise _refused(503, "the mirror did not say the address of its byte port (base)", "mirror_unavailable")
        root = f"{listing.base.rstrip('/')}/{quote(v.model, safe='')}/{quote(v.version, safe='')}/"
        files = _present(v)
        sizes = {f.name: f.bytes for f in files}
        if file is not None and file not in sizes:
            raise _refused(404, f"the mirror's {where} holds no {file} (that is present)", "model_not_found")
        ggufs = [f.name for f in _model_ggufs(files)]
        if file is not None and file.lower().endswith(".gguf"):
            return await self._mirror_gguf(root, where, file, sizes)
        if "config.json" in sizes:
            url = root + "config.json"
            async with self._client() as client:
                config = await self._read_json(client, url, f"the mirror's {where}/config.json")
            return _config_arch(config, url), f"config.json of {where} in the mirror ({url})"
        if ggufs:
            return await self._mirror_gguf(root, where, _one_model(ggufs, where), sizes)
        for f in files:
            src = f.source or ""
            m = re.fullmatch(r"hf:([^/@]+/[^/@]+)/[^@]+@([0-9a-f]{40})", src)
            if m:
                arch, read = await self._from_hf(m.group(1), revision=m.group(2))
                return arch, f"{read}, the source of {where}'s {f.name}"
        raise _refused(
            400,
            f"the mirror's {where} holds no config.json and no GGUF file, and its files do not say which "
            "Hugging Face repository they came from; plan hf:ORG/NAME",
        )

    async def _mirror_gguf(
        self, root: str, where: str, name: str, sizes: dict[str, int | None]
    ) -> tuple[sizing.Architecture, str]:
        first, total = _shard_set(name, sizes)
        if total is None:
            raise _refused(400, f"the mirror's {where} does not hold every part of {first}")
        url = root + quote(first, safe="")
        async with self._client() as client:
            meta = await self._read_gguf(client, url, f"{where}/{first}", "mirror_unavailable")
        return _gguf_arch(meta, total, url), f"the GGUF header of {where}/{first} in the mirror ({url})"

    # -- reading from Hugging Face ----------------------------------------------------------

    async def _from_hf(self, spec: str, *, revision: str = "main") -> tuple[sizing.Architecture, str]:
        """``ORG/NAME`` (its config.json, else its one GGUF) or ``ORG/NAME/FILE.gguf`` on the registry;
        ``ORG/NAME/FILE@COMMIT`` (a mirrored file's recorded source) is read at that commit."""
        spec, _, pinned = spec.partition("@")
        parts = spec.split("/")
        if len(parts) < 2 or not REPO.fullmatch("/".join(parts[:2])) or any(p in ("", ".", "..") for p in parts):
            raise _refused(
                400, f"hf:{spec} is not a Hugging Face name; write it as hf:ORG/NAME or hf:ORG/NAME/FILE.gguf"
            )
        if pinned and COMMIT.fullmatch(pinned):
            revision = pinned
        repo, path = "/".join(parts[:2]), "/".join(parts[2:])
        what, base = f"hf:{repo}", self.registry.rstrip("/")
        at = "" if revision == "main" else f" at {revision[:12]}"
        if path and not path.lower().endswith(".gguf"):
            path = ""  # a safetensors file (or any other): the repository's config.json describes it
        async with self._client() as client:
            try:
                if not path:
                    try:
                        config = await hub.json_file(client, base, repo, revision, "config.json")
                    except hub.HFError as exc:
                        if exc.kind != "missing":
                            raise
                        config = None
                    if config is not None:
                        arch = _config_arch(config, f"{what}'s config.json")
                        return arch, f"config.json of {what}{at} on {base}"
                listing = await hub.tree(client, base, repo, revision)
            except hub.HFError as exc:
                raise _refused(
                    _HF_STATUS.get(exc.kind, 502),
                    exc.worded(_WORDING, what=what, pages=hub.MAX_TREE_PAGES),
                    "model_not_found" if exc.kind == "missing" else "registry_unavailable",
                ) from None
            sizes = {f.path: f.size for f in listing}
            if not path:
                ggufs = [f.name for f in _model_ggufs([MirrorFile(name=p) for p in sizes])]
                if not ggufs:
                    raise _refused(404, f"{what}{at} on {base} has no config.json and no GGUF file", "model_not_found")
                path = _one_model(ggufs, what)
            if path not in sizes:
                raise _refused(404, f"{what}{at} on {base} has no {path}", "model_not_found")
            first, total = _shard_set(path, sizes)
            if total is None:
                raise _refused(400, f"{what} does not list every part of {first} with its size")
            url = hub.file_url(base, repo, revision, first)
            meta = await self._read_gguf(client, url, f"{what}/{first}", "registry_unavailable")
        return _gguf_arch(meta, total, f"{what}/{first}"), f"the GGUF header of {what}/{first}{at} on {base}"

    # -- reading one file -------------------------------------------------------------------

    @staticmethod
    async def _read_json(client: httpx.AsyncClient, url: str, what: str) -> Any:
        try:
            async with client.stream("GET", url) as resp:
                if resp.status_code != 200:
                    raise _refused(
                        502, f"{what} could not be read: {url} answered {resp.status_code}", "mirror_unavailable"
                    )
                body = b""
                async for chunk in resp.aiter_bytes():
                    body += chunk
                    if len(body) > CONFIG_MAX_BYTES:
                        raise _refused(400, f"{what} is larger than {CONFIG_MAX_BYTES} bytes: not a config.json")
        except httpx.HTTPError as exc:
            raise _refused(
                503, f"{what} could not be read from {url} ({type(exc).__name__}: {exc})", "mirror_unavailable"
            ) from None
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError:
            raise _refused(400, f"{what} is not JSON") from None

    @staticmethod
    async def _read_gguf(client: httpx.AsyncClient, url: str, what: str, code: str) -> dict[str, Any]:
        def has_vocab(meta: dict[str, Any]) -> bool:
            arch = meta.get(gguf.ARCH_KEY)
            return f"{arch}.vocab_size" in meta or "tokenizer.ggml.tokens" in meta

        try:
            header = await gguf.read_header(url, client, until=has_vocab)
        except gguf.GGUFError as exc:
            raise _refused(400, f"the header of {what} could not be read: {exc}") from None
        except httpx.HTTPError as exc:
            raise _refused(503, f"{what} could not be read from {url} ({type(exc).__name__}: {exc})", code) from None
        meta: dict[str, Any] = header["metadata"]
        return meta


def _config_arch(config: Any, what: str) -> sizing.Architecture:
    try:
        return sizing.from_config(config)
    except sizing.SizingError as exc:
        raise _refused(400, f"{what}: {exc}") from None


def _gguf_arch(meta: dict[str, Any], total: int, what: str) -> sizing.Architecture:
    try:
        return sizing.from_gguf(meta, total)
    except sizing.SizingError as exc:
        raise _refused(400, f"{what}: {exc}") from None
