"""``outbox-dispatch web``: the outbox's operator page, for shops without Django's admin.

Per-family status (with queue length and oldest due age), parked rows with retry and purge,
a row found by id, actor or dedupe key with its history, and cancel. A WSGI app on the
standard library's server: nothing to install.

It never runs open: every request needs the credentials it was started with (HTTP basic
auth; it refuses to start without them), and it binds to loopback unless told otherwise.
Actions are POST forms carrying a token derived from a per-process secret, and a request
whose Origin is another site is refused, so another site cannot make an operator's browser
act. The actions run operations.py, the CLI's own code.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs, urlencode, urlsplit

from outbox_dispatch.core.errors import ConfigurationError, OutboxError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.rows import STATE_WORDS, RowFilter, history, state_of
from outbox_dispatch.ops import actions
from outbox_dispatch.ops.html import (
    FILTER_FIELDS,
    HEADERS,
    STYLE,
    Page,
    as_json,
    audit_section,
    bulk_form,
    esc,
    filter_form,
    first,
    ids_of,
    pause_forms,
    request_body,
    search_form,
    short,
    table,
    when,
)

if TYPE_CHECKING:
    from outbox_dispatch.dispatcher import Dispatcher

StartResponse = Callable[[str, list[tuple[str, str]]], Any]

STATUS_COLUMNS = [
    ("family", "family"),
    ("due", "due"),
    ("scheduled", "scheduled"),
    ("in_flight", "in flight"),
    ("queued", "queued"),
    ("waiting", "waiting"),
    ("blocked", "blocked"),
    ("parked", "parked"),
    ("oldest_due_age", "oldest due"),
    ("paused", "paused"),
]


def parse_credentials(text: str | None) -> tuple[str, str]:
    """``user:password``, both non-empty; the page refuses to start without them."""
    user, sep, password = (text or "").partition(":")
    if not sep or not user or not password:
        raise ConfigurationError(
            "outbox-dispatch web needs credentials: set OUTBOX_WEB_AUTH=user:password (or "
            "--auth user:password); the page never runs open"
        )
    return user, password


class WebApp:
    """The WSGI app. ``secret`` signs the action forms (random per process by default)."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        *,
        user: str,
        password: str,
        secret: bytes | None = None,
        viewer: tuple[str, str] | None = None,
    ) -> None:
        if not user or not password:
            raise ConfigurationError("the outbox page needs a user and a password")
        self.dispatcher = dispatcher
        self.user = user
        self.password = password
        self.viewer = viewer  # a read-only credential: it sees everything and acts on nothing
        self.secret = secret or secrets.token_bytes(32)
        self.routes: dict[tuple[str, str], Callable[[dict[str, list[str]]], Page]] = {
            ("GET", "/"): self.status,
            ("GET", "/parked"): self.parked,
            ("GET", "/rows"): self.rows,
            ("POST", "/retry"): self.retry,
            ("POST", "/purge"): self.purge,
            ("POST", "/cancel"): self.cancel,
            ("POST", "/pause"): self.pause,
            ("POST", "/resume"): self.resume,
            ("POST", "/bulk"): self.bulk,
        }

    # -- WSGI --------------------------------------------------------------------------------

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        header = environ.get("HTTP_AUTHORIZATION", "")
        operator = self._authorized(header, (self.user, self.password))
        if not operator and not (self.viewer and self._authorized(header, self.viewer)):
            start_response(
                "401 Unauthorized",
                [("WWW-Authenticate", 'Basic realm="outbox", charset="UTF-8"'), *HEADERS],
            )
            return [b"credentials needed"]
        method = environ.get("REQUEST_METHOD", "GET")
        path = environ.get("PATH_INFO", "/") or "/"
        handler = self.routes.get((method, path))
        if handler is None:
            known = any(p == path for _m, p in self.routes)
            status = "405 Method Not Allowed" if known else "404 Not Found"
            start_response(status, [("Content-Type", "text/plain; charset=utf-8"), *HEADERS])
            return [status.encode()]
        if method == "POST":
            params = parse_qs(request_body(environ), keep_blank_values=True)
            refused = self._refused(environ, params) or (
                None if operator else "refused: this credential is read-only"
            )
            if refused:
                start_response("403 Forbidden", [("Content-Type", "text/plain"), *HEADERS])
                return [refused.encode()]
        else:
            params = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        try:
            page = handler(params)
        except OutboxError as exc:
            page = Page("error", f'<p class="msg warn">{esc(mask_dsn(str(exc)))}</p>')
        if page.redirect is not None:
            start_response("303 See Other", [("Location", page.redirect), *HEADERS])
            return [b""]
        body = self._layout(page).encode()
        start_response("200 OK", [("Content-Type", "text/html; charset=utf-8"), *HEADERS])
        return [body]

    def _authorized(self, header: str, credential: tuple[str, str]) -> bool:
        scheme, _, encoded = header.partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            given = base64.b64decode(encoded, validate=True).decode()
        except (ValueError, UnicodeDecodeError):
            return False
        user, _, password = given.partition(":")
        return hmac.compare_digest(user.encode(), credential[0].encode()) & hmac.compare_digest(
            password.encode(), credential[1].encode()
        )

    def token(self) -> str:
        return hmac.new(self.secret, b"outbox-web-actions", hashlib.sha256).hexdigest()

    def _refused(self, environ: Mapping[str, Any], params: dict[str, list[str]]) -> str | None:
        """Why a POST is refused: another site's Origin, or no valid form token."""
        origin = environ.get("HTTP_ORIGIN")
        host = environ.get("HTTP_HOST", "")
        if origin and (origin == "null" or urlsplit(origin).netloc != host):
            return f"refused: a form from {origin} may not act on this page"
        if environ.get("HTTP_SEC_FETCH_SITE", "same-origin") not in ("same-origin", "none"):
            return "refused: a form from another site may not act on this page"
        given = (params.get("token") or [""])[0]
        if not hmac.compare_digest(given.encode(), self.token().encode()):
            return "refused: the form's token is missing or stale; reload the page"
        return None

    # -- pages ---------------------------------------------------------------------------------

    def status(self, params: dict[str, list[str]]) -> Page:
        d = self.dispatcher
        queued = d.runtime.queue_lengths()
        rows = []
        for s in d.ops.status():
            rows.append(
                {
                    **s.__dict__,
                    "queued": queued.get(s.family, "-"),
                    "oldest_due_age": f"{s.oldest_due_age:.1f} s",
                    "paused": "PAUSED" if s.paused else "",
                }
            )
        if self.several:
            columns = [("database", "database"), *STATUS_COLUMNS]
            link = {"parked": "/parked?family={family}&db={database}"}
        else:
            columns, link = STATUS_COLUMNS, {"parked": "/parked?family={family}"}
        body = search_form() + table(rows, columns, link) + self._pause_forms()
        body += audit_section(self.dispatcher.ops.audit_log(limit=20))
        return Page("status", body, self._message(params))

    def _pause_forms(self) -> str:
        families = sorted(self.dispatcher.families)
        return pause_forms(self.dispatcher.ops.paused(), families, self.token())

    def pause(self, params: dict[str, list[str]]) -> Page:
        family = first(params, "family")
        reason = first(params, "reason") or None
        self.dispatcher.ops.pause(family, reason=reason, by=f"outbox page: {self.user}")
        return self._back("/", f"family {family} paused")

    def resume(self, params: dict[str, list[str]]) -> Page:
        family = first(params, "family")
        done = self.dispatcher.ops.resume(family, by=f"outbox page: {self.user}")
        return self._back("/", f"family {family} " + ("resumed" if done else "was not paused"))

    def _back(self, target: str, ok: str) -> Page:
        query = {"ok": ok, "sig": self._sign(ok, "")}
        return Page("", redirect=f"{target}?{urlencode(query)}")

    @property
    def several(self) -> bool:
        return self.dispatcher.several

    def _database(self, params: dict[str, list[str]]) -> str | None:
        """The database a request names (``db``), checked; None: every database (or, for row
        ids, the only one)."""
        name = first(params, "db") or None
        if name is not None and name not in self.dispatcher.databases:
            raise OutboxError(f"no database {name!r} here")
        return name

    def parked(self, params: dict[str, list[str]]) -> Page:
        family = first(params, "family") or None
        db = self._database(params)
        values = {name: first(params, name) for name, _label in FILTER_FIELDS}
        selection = filter_form(values)
        if any(values[name] for name in ("command", "actor", "error", "older")):
            # a selection: its count, and only the rows it counts listed (bounded as the list is)
            chosen = self._filter(values)
            count = actions.bulk(self.dispatcher, "retry", chosen, dry_run=True, database=db).count
            rows = actions.parked_matching(self.dispatcher, chosen, limit=200, database=db)
            selection += bulk_form(values, count, self.token(), len(rows))
        else:
            rows = self.dispatcher.ops.parked_list(family=family, limit=200, database=db)
        if not rows:
            body = "<p>no parked rows</p>"
        else:
            body = "<table><tr>" + ("<th>database</th>" if self.several else "")
            body += "<th>id</th><th>family</th><th>command</th><th>actor</th>"
            body += "<th>attempts</th><th>parked at</th><th>last error</th><th></th></tr>"
            for r in rows:
                where = self._where(r["database"])
                body += (
                    "<tr>"
                    + (f"<td>{esc(r['database'])}</td>" if self.several else "")
                    + f'<td><a href="/rows?q={r["id"]}{where}">{r["id"]}</a></td>'
                    f"<td>{esc(r['family'])}</td><td>{esc(r['command'])}</td>"
                    f"<td>{esc(r['actor'] or '-')}</td><td class=n>{r['attempts']}</td>"
                    f"<td>{when(r['parked_at'])}</td><td>{esc(short(r['last_error']))}</td>"
                    f"<td>{self._button('/retry', r['id'], 'retry', r['database'])}"
                    f"{self._button('/purge', r['id'], 'purge', r['database'])}</td></tr>"
                )
            body += "</table>"
        title = f"parked rows of {family}" if family else "parked rows"
        return Page(title, selection + body, self._message(params))

    def _filter(self, values: Mapping[str, str]) -> RowFilter:
        older = values.get("older") or ""
        if older and not older.replace(".", "", 1).isdigit():
            raise OutboxError(f"{older!r} is not a number of minutes")
        return RowFilter(
            family=values.get("family") or None,
            command=values.get("command") or None,
            actor=values.get("actor") or None,
            error=values.get("error") or None,
            older_than=float(older) * 60 if older else None,
        )

    def bulk(self, params: dict[str, list[str]]) -> Page:
        action = first(params, "action")
        if action not in ("retry", "purge"):
            raise OutboxError(f"{action!r} is not an action on parked rows")
        values = {name: first(params, name) for name, _label in FILTER_FIELDS}
        where, db = self._filter(values), self._database(params)
        confirmed = first(params, "count")
        if confirmed:  # the page's form says how many rows the operator saw and confirmed
            now = actions.bulk(self.dispatcher, action, where, dry_run=True, database=db).count
            if str(now) != confirmed:
                warn = (
                    f"nothing done: the selection matches {now} rows now, not the {confirmed} "
                    "you confirmed; look at them and confirm again"
                )
                shown = {**values, "db": db or "", "warn": warn, "sig": self._sign("", warn)}
                query = urlencode({k: v for k, v in shown.items() if v})
                return Page("", redirect=f"/parked?{query}")
        done = actions.bulk(
            self.dispatcher, action, where, by=f"outbox page: {self.user}", database=db
        )
        verb = "due again (attempts reset)" if action == "retry" else "purged"
        return self._back("/parked", f"{done.done} rows {verb}")

    def _where(self, database: str) -> str:
        """The query part naming a row's database, when there are several."""
        return f"&db={esc(database)}" if self.several else ""

    def rows(self, params: dict[str, list[str]]) -> Page:
        q = first(params, "q").strip()
        if not q:
            return Page("find a row", search_form(), self._message(params))
        families = sorted(self.dispatcher.families)
        found = [
            {**r, "database": db.name}
            for db in self.dispatcher.chosen_databases(self._database(params))
            for r in db.store.find_rows(q, families)
        ]
        if not found:
            body = f"<p>no row has the id, actor or dedupe key {esc(q)!s}</p>"
            return Page(f"rows for {q}", search_form(q) + body, self._message(params))
        now = datetime.now(UTC)
        body = search_form(q)
        for r in found:
            state = state_of(r, now)
            where = f" in {esc(r['database'])}" if self.several else ""
            body += f"<h2>row {r['id']}{where}: {esc(STATE_WORDS[state])}</h2><table>"
            for key in ("family", "command", "actor", "dedupe_key", "attempts", "lost_attempts"):
                body += f"<tr><th>{key}</th><td>{esc(r[key] if r[key] is not None else '-')}</td>"
            body += "</table><h3>history</h3><table>"
            for at, what in history(r):
                body += f"<tr><td>{when(at)}</td><td>{esc(what)}</td></tr>"
            body += f"</table><h3>payload</h3><pre>{esc(as_json(r['payload']))}</pre>"
            if r["last_error"]:
                body += f"<h3>last error</h3><pre>{esc(r['last_error'])}</pre>"
            if r.get("last_traceback"):
                body += f"<h3>traceback</h3><pre>{esc(r['last_traceback'])}</pre>"
            db = r["database"]
            if state == "parked":
                body += self._button("/retry", r["id"], "retry", db)
                body += self._button("/purge", r["id"], "purge", db)
            elif state not in ("done", "cancelled"):
                body += self._button("/cancel", r["id"], "cancel", db)
        return Page(f"rows for {q}", body, self._message(params))

    # -- actions ---------------------------------------------------------------------------------

    def retry(self, params: dict[str, list[str]]) -> Page:
        who, db = f"outbox page: {self.user}", self._database(params)
        done = actions.retry_parked(self.dispatcher, ids_of(params), None, db, by=who)
        return self._after(params, done, "due again (attempts reset)")

    def purge(self, params: dict[str, list[str]]) -> Page:
        who, db = f"outbox page: {self.user}", self._database(params)
        done = actions.purge_parked(self.dispatcher, ids_of(params), None, db, by=who)
        return self._after(params, done, "purged")

    def cancel(self, params: dict[str, list[str]]) -> Page:
        done = actions.cancel(
            self.dispatcher,
            ids_of(params),
            reason="cancelled on the outbox page",
            by=f"outbox page: {self.user}",
            database=self._database(params),
        )
        text = "cancelled" + (
            f"; running, asked to stop: {done.requested}" if done.requested else ""
        )
        return self._after(params, done, text)

    def _after(self, params: dict[str, list[str]], done: actions.Done, verb: str) -> Page:
        """Post/redirect/get: back to the row (or the parked list) with what happened, signed
        so that a link cannot put words of its own on the page."""
        rows = "1 row" if len(done.ids) == 1 else f"{len(done.ids)} rows"
        ok, warn = f"{rows} {verb}", "; ".join(done.reasons)
        query = {"ok": ok, "warn": warn, "sig": self._sign(ok, warn)}
        ids = ids_of(params)
        db = self._database(params)
        target = f"/rows?q={ids[0]}" if len(ids) == 1 and verb != "purged" else "/parked"
        if db is not None and self.several:
            query = {"db": db, **query}
        sep = "&" if "?" in target else "?"
        return Page("", redirect=f"{target}{sep}{urlencode({k: v for k, v in query.items() if v})}")

    def _sign(self, ok: str, warn: str) -> str:
        text = f"{ok}\n{warn}".encode()
        return hmac.new(self.secret, b"message:" + text, hashlib.sha256).hexdigest()

    def _message(self, params: dict[str, list[str]]) -> list[tuple[str, bool]]:
        ok, warn, sig = first(params, "ok"), first(params, "warn"), first(params, "sig")
        if not (ok or warn) or not hmac.compare_digest(sig.encode(), self._sign(ok, warn).encode()):
            return []
        return [(m, False) for m in [ok] if m] + [(m, True) for m in [warn] if m]

    def _button(self, action: str, row_id: int, label: str, database: str) -> str:
        db = f'<input type="hidden" name="db" value="{esc(database)}">' if self.several else ""
        return (
            f'<form class="inline" method="post" action="{action}">'
            f'<input type="hidden" name="token" value="{self.token()}">'
            f'<input type="hidden" name="id" value="{row_id}">{db}'
            f'<button type="submit" name="do" value="{label}">{label} row {row_id}</button></form>'
        )

    def _layout(self, page: Page) -> str:
        flash = "".join(
            f'<p class="msg{" warn" if warn else ""}">{esc(text)}</p>' for text, warn in page.flash
        )
        return (
            "<!doctype html><html lang=en><head><meta charset=utf-8>"
            f"<title>outbox: {esc(page.title)}</title><style>{STYLE}</style></head><body>"
            '<nav><a href="/">status</a><a href="/parked">parked</a><a href="/rows">find a row</a>'
            f"<span>schema {esc(self.dispatcher.schema)}</span></nav>"
            f"<h1>{esc(page.title)}</h1>{flash}{page.body}</body></html>"
        )


def serve(app: WebApp, host: str, port: int, ready: Callable[[], None] = lambda: None) -> None:
    """Serve until interrupted, one thread per request; ``ready`` once it listens (a port it
    cannot bind raises OSError before)."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True

    class Quiet(WSGIRequestHandler):
        timeout = 10  # a client that stalls mid-request gives its thread back

        def log_message(self, format: str, *args: Any) -> None:
            pass

    with make_server(host, port, app, server_class=Server, handler_class=Quiet) as server:
        ready()
        server.serve_forever()
