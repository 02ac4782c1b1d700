"""The dashboard's web server: its pages, their live parts, and the actions behind the token.

Pages are rendered on the server (Jinja2, every value escaped); `live.js` refreshes the parts
marked live, and nothing else needs script. Every response forbids inline script and framing.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import logging
import math
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

from aiohttp import web
from jinja2 import Environment, PackageLoader, StrictUndefined, select_autoescape
from sqlalchemy.exc import SQLAlchemyError

from mersal.errors import ConfigurationError, MersalError
from mersal.urls import mask
from mersal_dashboard.charts import rate_chart
from mersal_dashboard.jobs import Job, Jobs
from mersal_dashboard.security import COOKIE, Guard
from mersal_dashboard.sources import Sampler, Source, find_sagas, pending_timeouts
from mersal_sqlalchemy.dead_letters import PAGE
from mersal_sqlalchemy.repairs import list_rows, purge_rows, retry_rows

log = logging.getLogger("mersal.dashboard")

SHOWN_BODY = 16 * 1024
"""The bytes of a body a page shows; the whole body is a download."""

SHOWN_HEADER = 2048
"""The characters of a header value a page shows."""

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")

LOCAL_PATH = re.compile(r"/(?:[^/\\\x00-\x20\x7f-\U0010ffff][\x21-\x7e]*)?")
"""A path on this site: one slash, then printable ASCII (no `//`, `/\\` or spaces to strip)."""

ROW_ID = re.compile(r"[0-9]{1,18}")
"""A row id as a form or a URL gives it (ASCII digits, within a BIGINT)."""

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


Action = Callable[["Dashboard", web.Request], Awaitable[web.StreamResponse]]


def guarded(action: Action) -> Action:
    """`action`, run only when the request may change something (else a 403 page saying why)."""

    @functools.wraps(action)
    async def run(dashboard: Dashboard, request: web.Request) -> web.StreamResponse:
        refused = await dashboard.refused(request)
        return refused if refused is not None else await action(dashboard, request)

    return run


class Dashboard:
    """The dashboard of some apps: `serving(host, port)` runs it while a block runs."""

    def __init__(
        self,
        sources: Sequence[Source],
        *,
        token: str | None = None,
        read_only: bool = False,
        ingest: bool = True,
        interval: float = 2.0,
        allowed_hosts: Sequence[str] = (),
    ) -> None:
        if not sources:
            raise ConfigurationError("the dashboard needs at least one app (--app module:app)")
        names = [source.name for source in sources]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"the dashboard was given the same app twice: {names}")
        self.sources = {source.name: source for source in sources}
        self.guard = Guard(token, read_only)
        self.sampler = Sampler(sources, interval, ingest=ingest and self.guard.actions_allowed)
        self.jobs = Jobs()
        self.allowed_hosts = set(allowed_hosts)
        self.templates = _environment()

    @asynccontextmanager
    async def serving(self, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
        """Serve on `host:port` while the block runs; yields the dashboard's URL."""
        for source in self.sources.values():
            await source.start()
        runner = web.AppRunner(self.application(host), access_log=None, handle_signals=False)
        try:
            async with self.sampler.running():
                await runner.setup()
                site = web.TCPSite(runner, host, port)
                await site.start()
                bound = runner.addresses[0][1]
                shown = f"[{host}]" if ":" in host else host
                yield f"http://{shown}:{bound}"
        finally:
            await self.jobs.cancel()
            await runner.cleanup()
            for source in self.sources.values():
                await source.stop()

    def application(self, host: str) -> web.Application:
        """The aiohttp application with every route."""
        self.allowed_hosts.update({host, *LOOPBACK} - {"0.0.0.0", "::", ""})
        server = web.Application(middlewares=[self._headers_middleware], client_max_size=1 << 20)
        get, post = server.router.add_get, server.router.add_post
        get("/", self.overview)
        get("/live/overview", self.overview_live)
        get("/static/{name}", self.static)
        get("/signin", self.signin_page)
        post("/signin", self.signin)
        post("/signout", self.signout)
        get("/apps/{app}/failures", self.failures)
        get("/apps/{app}/failures/{id:[0-9]+}", self.failure)
        get("/apps/{app}/failures/{id:[0-9]+}/body", self.failure_body)
        post("/apps/{app}/failures/confirm", self.failures_confirm)
        post("/apps/{app}/failures/do", self.failures_do)
        get("/apps/{app}/outbox", self.outbox)
        post("/apps/{app}/outbox/confirm", self.outbox_confirm)
        post("/apps/{app}/outbox/do", self.outbox_do)
        get("/apps/{app}/sagas", self.sagas)
        get("/jobs/{id}", self.job)
        get("/live/jobs/{id}", self.job_live)
        return server

    # Every response.

    @web.middleware
    async def _headers_middleware(self, request: web.Request, handler: Handler) -> Any:
        if not self.answers_for(request.host):
            response: web.StreamResponse = web.Response(
                status=421, text=f"this dashboard does not answer for host {request.host!r}"
            )
        else:
            try:
                response = await handler(request)
            except web.HTTPException as error:
                error.headers.update(SECURITY_HEADERS)
                raise
            except (SQLAlchemyError, OSError, MersalError) as error:
                log.debug("a page failed", exc_info=True)
                reason = mask(str(error).splitlines()[0] if str(error) else type(error).__name__)
                response = self.render(request, "unavailable.html", status=503, reason=reason)
        response.headers.update(SECURITY_HEADERS)
        return response

    def answers_for(self, host: str) -> bool:
        """Whether a request for `host` (a Host header) is for this dashboard.

        A name must be one it listens on or was told (`allowed_hosts`): another site's page
        that renames itself to this machine's address (DNS rebinding) names its own. An IP
        address is always one a browser was pointed at, so any is answered.
        """
        name = _hostname(host)
        return name in self.allowed_hosts or _is_address(name.strip("[]"))

    def render(
        self, request: web.Request, template: str, status: int = 200, **values: Any
    ) -> web.Response:
        """A page from `template`, with what every page shows."""
        session = self.guard.session_of(request.cookies.get(COOKIE))
        page = self.templates.get_template(template).render(
            apps=list(self.sources),
            signed_in=session is not None,
            csrf=self.guard.csrf_of(session),
            actions_allowed=self.guard.actions_allowed,
            read_only=self.guard.read_only,
            has_token=self.guard.token is not None,
            path=request.path_qs,
            **{"source": None, "active": None, **values},
        )
        return web.Response(text=page, status=status, content_type="text/html", charset="utf-8")

    def source(self, request: web.Request) -> Source:
        """The app a page is about; 404 for an unknown one."""
        source = self.sources.get(request.match_info["app"])
        if source is None:
            raise web.HTTPNotFound(text="no such app on this dashboard")
        return source

    async def refused(self, request: web.Request) -> web.Response | None:
        """A 403 page when the request may not change anything, else None."""
        form = await request.post()
        csrf = form.get("csrf")
        why = self.guard.refusal(
            cookie=request.cookies.get(COOKIE),
            authorization=request.headers.get("Authorization"),
            csrf=csrf if isinstance(csrf, str) else None,
            origin=request.headers.get("Origin"),
            fetch_site=request.headers.get("Sec-Fetch-Site"),
            own_origin=f"{request.scheme}://{request.host}",
        )
        if why is None:
            return None
        return self.render(request, "refused.html", status=403, reason=why)

    # The overview.

    async def overview(self, request: web.Request) -> web.Response:
        """Every app: its queues, failures, outbox and sagas, live."""
        return self.render(request, "overview.html", **self._overview_values())

    async def overview_live(self, request: web.Request) -> web.Response:
        """The overview's live part alone."""
        return self.render(request, "_overview.html", **self._overview_values())

    def _overview_values(self) -> dict[str, Any]:
        return {
            "sources": list(self.sources.values()),
            "charts": {name: rate_chart(s.history) for name, s in self.sources.items()},
            "rounds": self.sampler.rounds,
            "now": time.time(),
        }

    # Failed messages.

    async def failures(self, request: web.Request) -> web.Response:
        """The app's failure groups, and a page of its failures (of a group, or searched)."""
        source = self.source(request)
        store = _store(source)
        group = _query_text(request, "group")
        search = _query_text(request, "q")
        before = _int(request.query.get("before"))
        groups = await store.groups()
        page = await store.page(group=group, search=search, before=before, limit=PAGE + 1)
        more = len(page) > PAGE
        page = page[:PAGE]
        older = None
        if more:
            query = {k: v for k, v in (("group", group), ("q", search)) if v}
            older = f"?{urlencode({**query, 'before': page[-1].id})}"
        chosen = next((g for g in groups if g.key == group), None)
        return self.render(
            request,
            "failures.html",
            source=source,
            groups=groups,
            group=chosen,
            group_key=group,
            search=search or "",
            failures=page,
            older=older,
            total=await store.count(group),
        )

    async def failure(self, request: web.Request) -> web.Response:
        """One failed message: its error, traceback, headers and body."""
        source = self.source(request)
        failure = await _failure(source, request)
        if failure is None:
            return self.render(request, "gone.html", status=404, source=source, what="failure")
        body = failure.body or b""
        return self.render(
            request,
            "failure.html",
            source=source,
            failure=failure,
            headers=_shown_headers(failure.headers or {}),
            body=_shown_body(body),
            body_size=len(body),
            truncated=len(body) > SHOWN_BODY,
        )

    async def failure_body(self, request: web.Request) -> web.Response:
        """A failed message's whole body, as a download."""
        source = self.source(request)
        failure = await _failure(source, request)
        if failure is None:
            raise web.HTTPNotFound(text="no such failure")
        name = f"failure-{failure.id}.bin"
        return web.Response(
            body=failure.body or b"",
            content_type="application/octet-stream",
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )

    @guarded
    async def failures_confirm(self, request: web.Request) -> web.StreamResponse:
        """What an action on failures is about to do, with the button that does it."""
        source = self.source(request)
        action, ids, group = _failure_action(await request.post())
        store = _store(source)
        count = await store.count(group) if group else len(ids)
        one = await store.page(group=group, limit=1) if group else []
        label = one[0].group_label if one else None
        return self._confirm(request, source, action, ids, "failures", group, label, count)

    def _confirm(
        self,
        request: web.Request,
        source: Source,
        action: str,
        ids: list[int],
        page: str,
        group: str | None = None,
        label: str | None = None,
        count: int | None = None,
    ) -> web.Response:
        """The confirmation page of `action` on the rows of `page` (failures or outbox)."""
        return self.render(
            request,
            "confirm.html",
            source=source,
            action=action,
            ids=ids,
            group=group,
            group_label=label,
            count=len(ids) if count is None else count,
            target=f"/apps/{quote(source.name)}/{page}/do",
            what="failure" if page == "failures" else "parked outbox row",
        )

    @guarded
    async def failures_do(self, request: web.Request) -> web.StreamResponse:
        """Run a confirmed retry or delete of failures as a job; off to its progress page."""
        source = self.source(request)
        action, ids, group = _failure_action(await request.post())
        store = _store(source)
        back = f"/apps/{quote(source.name)}/failures"

        async def work(job: Job) -> str:
            if action == "retry":
                retried = await (
                    store.retry_group(group, progress=job.progress) if group else store.retry(ids)
                )
                job.progress(retried.sent)
                await source.send_outbox()
                self.sampler.wake()
                kept = (
                    f"; {len(retried.without_queue)} kept (no source queue recorded)"
                    if retried.without_queue
                    else ""
                )
                return f"{retried.sent} failure(s) sent back through the outbox{kept}"
            deleted = await (
                store.delete_group(group, progress=job.progress) if group else store.delete(ids)
            )
            job.progress(deleted)
            self.sampler.wake()
            return f"{deleted} failure(s) deleted"

        total = await store.count(group) if group else len(ids)
        what = f"{action} {'group' if group else f'{len(ids)} failure(s)'}"
        job = self.jobs.start(source.name, what, back, work, total=total)
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    # Parked outbox rows.

    async def outbox(self, request: web.Request) -> web.Response:
        """The app's parked outbox rows: why each was parked."""
        source = self.source(request)
        engine = _engine(source)
        rows, _, parked = await list_rows(
            engine, source.tables.outbox, parked=True, app=source.name
        )
        return self.render(request, "outbox.html", source=source, rows=rows, parked=parked)

    @guarded
    async def outbox_confirm(self, request: web.Request) -> web.StreamResponse:
        """What an action on parked rows is about to do, with the button that does it."""
        action, ids = _outbox_action(await request.post())
        return self._confirm(request, self.source(request), action, ids, "outbox")

    @guarded
    async def outbox_do(self, request: web.Request) -> web.StreamResponse:
        """Run a confirmed retry or purge of parked rows as a job."""
        source = self.source(request)
        action, ids = _outbox_action(await request.post())
        engine, table = _engine(source), source.tables.outbox

        async def work(job: Job) -> str:
            if action == "retry":
                done = await retry_rows(engine, table, ids, app=source.name)
                job.progress(len(done))
                sent = await source.send_outbox()
                self.sampler.wake()
                return f"{len(done)} row(s) un-parked" + (f", {sent} sent now" if sent else "")
            purged = await purge_rows(
                engine, table, ids, lambda done, _: job.progress(done), app=source.name
            )
            self.sampler.wake()
            return f"{len(purged)} row(s) purged"

        back = f"/apps/{quote(source.name)}/outbox"
        job = self.jobs.start(
            source.name, f"{action} {len(ids)} row(s)", back, work, total=len(ids)
        )
        raise web.HTTPSeeOther(f"/jobs/{job.id}")

    # Sagas.

    async def sagas(self, request: web.Request) -> web.Response:
        """The app's sagas in flight by type; found by type, correlation value or id."""
        source = self.source(request)
        engine = _engine(source)
        saga = _query_text(request, "saga")
        correlation = _query_text(request, "correlation")
        saga_id = _query_text(request, "id")
        searched = any((saga, correlation, saga_id))
        found = await find_sagas(
            engine,
            source.tables,
            source.name,
            saga=saga,
            correlation=correlation,
            saga_id=saga_id,
        )
        timeouts = {}
        if searched and len(found) <= 10:
            for row in found:
                timeouts[row.id] = await pending_timeouts(
                    engine, source.tables, source.name, row.id
                )
        last = source.last
        return self.render(
            request,
            "sagas.html",
            source=source,
            counts=last.sagas if last else [],
            found=found,
            searched=searched,
            query={"saga": saga or "", "correlation": correlation or "", "id": saga_id or ""},
            timeouts=timeouts,
            pretty=_pretty_json,
        )

    # Jobs and signing in.

    async def job(self, request: web.Request) -> web.Response:
        """A job's progress line, then its outcome."""
        job = self.jobs.get(request.match_info["id"])
        if job is None:
            return self.render(request, "gone.html", status=404, source=None, what="job")
        return self.render(request, "job.html", job=job, source=self.sources.get(job.app))

    async def job_live(self, request: web.Request) -> web.Response:
        """A job's progress line alone."""
        job = self.jobs.get(request.match_info["id"])
        if job is None:
            raise web.HTTPNotFound(text="no such job")
        return self.render(request, "_job.html", job=job)

    async def signin_page(self, request: web.Request) -> web.Response:
        """The form that takes the token."""
        return self.render(request, "signin.html", failed=False, then=_local(request.query))

    async def signin(self, request: web.Request) -> web.Response:
        """Check the token; a session cookie when it matches."""
        form = await request.post()
        token = form.get("token")
        then = _local(form)
        fetch_site = request.headers.get("Sec-Fetch-Site")
        cross = fetch_site is not None and fetch_site not in ("same-origin", "none")
        own = f"{request.scheme}://{request.host}"
        origin = request.headers.get("Origin")
        if cross or (origin is not None and origin != own):
            return self.render(request, "refused.html", status=403, reason="another site")
        if not isinstance(token, str) or not self.guard.token_matches(token):
            return self.render(request, "signin.html", status=403, failed=True, then=then)
        response = web.HTTPSeeOther(then)
        response.set_cookie(
            COOKIE, self.guard.sign_in(), httponly=True, samesite="Strict", path="/"
        )
        raise response

    async def signout(self, request: web.Request) -> web.Response:
        """End the session (a form of its own only: another site cannot sign anyone out)."""
        cookie = request.cookies.get(COOKIE)
        session = self.guard.session_of(cookie)
        csrf = (await request.post()).get("csrf")
        response = web.HTTPSeeOther("/")
        if session is not None and isinstance(csrf, str) and csrf == self.guard.csrf_of(session):
            self.guard.sign_out(cookie)
            response.del_cookie(COOKIE, path="/")
        raise response

    async def static(self, request: web.Request) -> web.Response:
        """The stylesheet and the script."""
        name = request.match_info["name"]
        kinds = {"style.css": "text/css", "live.js": "text/javascript"}
        if name not in kinds:
            raise web.HTTPNotFound()
        text = resources.files("mersal_dashboard").joinpath("static", name).read_text("utf-8")
        return web.Response(text=text, content_type=kinds[name], charset="utf-8")


def _environment() -> Environment:
    environment = Environment(
        loader=PackageLoader("mersal_dashboard", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(age=age, when=when, count=count, short=short)
    environment.globals.update(quote=lambda value: quote(str(value), safe=""))
    return environment


def age(seconds: float | None) -> str:
    """`4s`, `3m 12s`, `2h 5m`, `3d 4h`; `-` for none."""
    if seconds is None or math.isnan(seconds):
        return "-"
    whole = int(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m {whole % 60}s"
    if whole < 86400:
        return f"{whole // 3600}h {whole % 3600 // 60}m"
    return f"{whole // 86400}d {whole % 86400 // 3600}h"


def when(moment: datetime | None) -> str:
    """A time as `2026-12-04 19:30:05` (UTC); `-` for none."""
    if moment is None:
        return "-"
    if moment.tzinfo is not None:
        moment = moment.astimezone(UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def count(value: int | None) -> str:
    """A count with thousands separated; `?` when unknown."""
    return "?" if value is None else f"{value:,}"


def short(text: str | None, width: int = 120) -> str:
    """The first line of `text`, cut at `width` characters."""
    if not text:
        return ""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= width else line[: width - 1] + "…"


def _store(source: Source) -> Any:
    store = source.store
    if store is None:
        raise web.HTTPNotFound(text=f"app {source.name!r} has no database on this dashboard")
    return store


async def _failure(source: Source, request: web.Request) -> Any:
    """The failure the URL names, or None (an id no row can have included)."""
    row_id = _int(request.match_info["id"])
    return None if row_id is None else await _store(source).get(row_id)


def _engine(source: Source) -> Any:
    if source.engine is None:
        raise web.HTTPNotFound(text=f"app {source.name!r} has no database on this dashboard")
    return source.engine


def _hostname(host: str) -> str:
    """The name in a Host header, without its port."""
    if host.startswith("["):
        return host.partition("]")[0] + "]"
    return host.rsplit(":", 1)[0]


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and ROW_ID.fullmatch(text) else None


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _query_text(request: web.Request, name: str) -> str | None:
    """A text the query gives, or None; a 400 for one no database column can hold (NUL)."""
    value = request.query.get(name) or None
    if value is not None and "\x00" in value:
        raise web.HTTPBadRequest(text=f"{name} may not hold a NUL character")
    return value


def _ids(values: list[Any]) -> list[int]:
    ids = sorted({int(v) for v in values if isinstance(v, str) and ROW_ID.fullmatch(v)})
    if not ids:
        raise web.HTTPBadRequest(text="choose at least one row")
    return ids


def _failure_action(form: Any) -> tuple[str, list[int], str | None]:
    action = form.get("action")
    if action not in ("retry", "delete"):
        raise web.HTTPBadRequest(text="the action is retry or delete")
    group = form.get("group")
    if isinstance(group, str) and group:
        if "\x00" in group:
            raise web.HTTPBadRequest(text="a group's key holds no NUL character")
        return action, [], group
    return action, _ids(form.getall("id", [])), None


def _outbox_action(form: Any) -> tuple[str, list[int]]:
    action = form.get("action")
    if action not in ("retry", "purge"):
        raise web.HTTPBadRequest(text="the action is retry or purge")
    return action, _ids(form.getall("id", []))


def _local(values: Any) -> str:
    """Where to go after signing in: a path of this dashboard, never another site."""
    then = values.get("then")
    return then if isinstance(then, str) and LOCAL_PATH.fullmatch(then) else "/"


def _shown_headers(headers: dict[str, str]) -> list[tuple[str, str, bool]]:
    """(name, value as shown, cut) of each header, by name."""
    return [
        (name, value[:SHOWN_HEADER], len(value) > SHOWN_HEADER)
        for name, value in sorted(headers.items())
    ]


def _shown_body(body: bytes) -> str:
    """The body as text: JSON laid out when it is JSON and whole; cut at SHOWN_BODY."""
    if len(body) <= SHOWN_BODY:
        try:
            return json.dumps(json.loads(body), indent=2, ensure_ascii=False)
        except (ValueError, UnicodeDecodeError, RecursionError):
            pass
    return body[:SHOWN_BODY].decode("utf-8", errors="replace")


def _pretty_json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except (ValueError, RecursionError):
        return text
