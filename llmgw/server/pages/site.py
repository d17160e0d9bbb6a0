"""The pages on the client port: the open ones (/, /about), signing in and out, signing up.

Every route is added through :meth:`Site.route`, which puts the session guard in
front of it (open, session or admin) and records that guard, so the route-guard
test can list each page route with the guard it has.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from llmgw.config.server import ServerConfig
from llmgw.server.pages.assets import Assets
from llmgw.server.pages.charts import Prometheus
from llmgw.server.pages.render import Menu, Renderer
from llmgw.server.pages.session import Sessions, current, local_target, redirect
from llmgw.server.pages.signin_limit import SigninLimiter, SigninUnavailable, wait_text
from llmgw.store import Store, StoreError

MIN_PASSWORD = 10
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def client_address(request: web.Request) -> str:
    """The address a sign-in attempt is counted against (the proxy's X-Forwarded-For is not trusted)."""
    return request.remote or "unknown"


def base_url(request: web.Request) -> str:
    """The API's address as the client sees it, through a proxy (X-Forwarded-Host/-Proto) or not."""
    host = (request.headers.get("X-Forwarded-Host") or request.host).split(",")[0].strip()
    proto = (request.headers.get("X-Forwarded-Proto") or request.scheme).split(",")[0].strip()
    return f"{proto}://{host}/v1"


class Site:
    def __init__(self, store: Store, config: ServerConfig) -> None:
        self.store = store
        self.config = config
        self.assets = Assets()
        self.menu = Menu()
        self.render = Renderer(self.assets, self.menu)
        self.sessions = Sessions(store, config.auth.session_ttl)
        self.limiter = SigninLimiter(store)
        self.history = Prometheus(config.monitoring.prometheus)  # the charts' source (monitoring.prometheus)
        self.guards: dict[tuple[str, str], str] = {}  # (method, path) -> open | session | admin
        self._routes: list[tuple[str, str, Handler]] = []

    # -- routes -------------------------------------------------------------

    def route(self, method: str, path: str, who: str, handler: Handler) -> None:
        self.guards[(method, path)] = who
        self._routes.append((method, path, self.sessions.guard(who, self.refuse)(handler)))

    def add_routes(self, app: web.Application) -> None:
        self.route("GET", "/", "open", self.landing)
        self.route("GET", "/about", "open", self.about)
        self.route("GET", "/login", "open", self.login_form)
        self.route("POST", "/login", "open", self.login)
        self.route("POST", "/logout", "session", self.logout)
        self.route("GET", "/signup", "open", self.signup_form)
        self.route("POST", "/signup", "open", self.signup)
        for method, path, handler in self._routes:
            app.router.add_route(method, path, handler)
        self.assets.add_routes(app)
        app.on_cleanup.append(self._close)

    async def _close(self, _app: web.Application) -> None:
        await self.history.close()

    def refuse(self, request: web.Request, status: int, message: str) -> web.StreamResponse:
        if request.content_type == "application/json" or request.path.startswith("/chat/"):
            return web.json_response({"error": {"message": message}}, status=status)
        title = {401: "Sign in again", 403: "Not allowed", 404: "Nothing here", 429: "Too many attempts"}.get(
            status, "Refused"
        )
        return self.render.page(request, "message.html", status, title=title, message=message, problem=True, link=None)

    # -- open pages ---------------------------------------------------------

    async def landing(self, request: web.Request) -> web.StreamResponse:
        return self.render.page(
            request,
            "landing.html",
            base_url=base_url(request),
            contact=self.config.landing.contact,
            signup_open=self.config.auth.signup_open,
        )

    async def about(self, request: web.Request) -> web.StreamResponse:
        from llmgw import __version__

        return self.render.page(request, "about.html", dev=".dev" in __version__ or "+" in __version__)

    # -- signing in and out ---------------------------------------------------

    def _login(self, request: web.Request, status: int = 200, problem: str = "", email: str = "", next_: str = ""):
        return self.render.page(
            request,
            "login.html",
            status,
            problem=problem,
            email=email,
            next=next_,
            signup_open=self.config.auth.signup_open,
        )

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        if current(request) is not None:
            return redirect(request, local_target(request.query.get("next"), "/"))
        return self._login(request, next_=local_target(request.query.get("next"), ""))

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        email = str(form.get("email", "")).strip().lower()[:320]
        password = str(form.get("password", ""))[:1024]
        next_ = local_target(str(form.get("next", "")), "/")
        if not email or not password:
            # Nothing to check, so nothing is counted.
            return self._login(request, 400, "Give your email and your password.", email, next_)
        # Counted before the password is checked: attempts sent together are counted one
        # after another, so none of them is checked past the limit.
        try:
            counted = await self.limiter.attempt(email, client_address(request))
        except SigninUnavailable as exc:
            return self._login(request, 503, str(exc), email, next_)
        if counted.refused:
            wait = wait_text(counted.wait_s)
            page = self._login(request, 429, f"Too many sign-in attempts; try again in {wait} seconds.", email, next_)
            page.headers["Retry-After"] = wait
            return page
        user = await self.store.verify_password(email, password)
        if user is None:
            return self._login(
                request,
                401,
                "That email and password do not match an account that can sign in. A new account can sign in "
                "once an administrator has approved it.",
                email,
                next_,
            )
        try:
            await self.limiter.right(counted)
        except SigninUnavailable as exc:
            return self._login(request, 503, str(exc), email, next_)
        await self.sessions.start(request, user)
        return redirect(request, next_)

    async def logout(self, request: web.Request) -> web.StreamResponse:
        visitor = current(request)
        if visitor is not None:
            await self.sessions.end(request, visitor)
        return redirect(request, "/login")

    # -- signing up -------------------------------------------------------------

    def _closed(self, request: web.Request) -> web.StreamResponse:
        contact = self.config.landing.contact
        return self.render.page(
            request,
            "message.html",
            404,
            title="Sign-up is closed",
            message="Accounts here are made by an administrator." + (f" Ask: {contact}" if contact else ""),
            problem=False,
            link=("/login", "Sign in"),
        )

    def _signup(self, request: web.Request, status: int = 200, problem: str = "", email: str = ""):
        return self.render.page(request, "signup.html", status, problem=problem, email=email, min_password=MIN_PASSWORD)

    async def signup_form(self, request: web.Request) -> web.StreamResponse:
        if not self.config.auth.signup_open:
            return self._closed(request)
        return self._signup(request)

    async def signup(self, request: web.Request) -> web.StreamResponse:
        if not self.config.auth.signup_open:
            return self._closed(request)
        form = await request.post()
        email = str(form.get("email", "")).strip().lower()[:320]
        password, again = str(form.get("password", ""))[:1024], str(form.get("password2", ""))[:1024]
        if "@" not in email or email.startswith("@") or email.endswith("@"):
            return self._signup(request, 400, "Give your email address.", email)
        if len(password) < MIN_PASSWORD:
            return self._signup(request, 400, f"Choose a password of at least {MIN_PASSWORD} characters.", email)
        if password != again:
            return self._signup(request, 400, "The two passwords differ; type the same one twice.", email)
        # Every sign-up counts against its address (it names no account), before the password is hashed.
        try:
            counted = await self.limiter.attempt("", client_address(request))
        except SigninUnavailable as exc:
            return self._signup(request, 503, str(exc), email)
        if counted.refused:
            wait = wait_text(counted.wait_s)
            page = self._signup(request, 429, f"Too many attempts; try again in {wait} seconds.", email)
            page.headers["Retry-After"] = wait
            return page
        try:
            await self.store.sign_up(email, password)
        except StoreError as exc:
            return self._signup(request, 400, str(exc), email)
        return self.render.page(
            request,
            "message.html",
            title="Your account waits for approval",
            message=f"An administrator approves {email} (nothing is sent by email): sign in once they have.",
            problem=False,
            link=("/login", "Sign in"),
        )
