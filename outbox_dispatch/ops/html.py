"""The outbox page's HTML: its style, security headers, tables and forms, escaped; and the
request helpers the handlers share (form fields, row ids, the body)."""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from outbox_dispatch.core.errors import OutboxError

HEADERS = [
    (
        "Content-Security-Policy",
        "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'",
    ),
    ("X-Frame-Options", "DENY"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "same-origin"),
    ("Cache-Control", "no-store"),
]

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222 }
nav a { margin-right: 1em } table { border-collapse: collapse; margin: .5em 0 1.5em }
th, td { border-bottom: 1px solid #ddd; padding: .25em .6em; text-align: left;
  vertical-align: top } th { background: #f4f4f4 } td.n { text-align: right }
.msg { background: #eef6ee; border: 1px solid #9c9; padding: .5em; margin: .5em 0 }
.warn { background: #fdf3e7; border-color: #e0a060 } form.inline { display: inline }
pre { background: #f7f7f7; padding: .5em; white-space: pre-wrap; max-width: 60em }
"""


class Page:
    """What a handler produced: a page to show, or where to send the browser."""

    def __init__(
        self,
        title: str,
        body: str = "",
        flash: Sequence[tuple[str, bool]] = (),
        redirect: str | None = None,
    ) -> None:
        self.title = title
        self.body = body
        self.flash = list(flash)
        self.redirect = redirect


def ids_of(params: dict[str, list[str]]) -> list[int]:
    ids = []
    for value in params.get("id", []):
        if not (value.isascii() and value.isdigit()) or len(value) > 18:
            raise OutboxError(f"{value!r} is not a row id")
        ids.append(int(value))
    if not ids:
        raise OutboxError("no row named: pick a row first")
    return ids


def request_body(environ: Mapping[str, Any]) -> str:
    try:
        length = int(environ.get("CONTENT_LENGTH") or 0)
    except ValueError:
        length = 0
    data: bytes = environ["wsgi.input"].read(min(length, 64 * 1024)) if length > 0 else b""
    return data.decode("utf-8", "replace")


def table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    link: Mapping[str, str] | None = None,
) -> str:
    out = "<table><tr>" + "".join(f"<th>{esc(label)}</th>" for _k, label in columns) + "</tr>"
    for r in rows:
        out += "<tr>"
        for key, _label in columns:
            value = r.get(key)
            cell = esc("-" if value is None else value)
            if link and key in link and value:
                cell = f'<a href="{esc(link[key].format(**r))}">{cell}</a>'
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            out += f"<td{' class=n' if numeric else ''}>{cell}</td>"
        out += "</tr>"
    return out + "</table>"


def search_form(q: str = "") -> str:
    return (
        '<form method="get" action="/rows"><label>row id, actor or dedupe key '
        f'<input name="q" value="{esc(q)}" size="40"></label> <button>find</button></form>'
    )


def first(params: dict[str, list[str]], key: str) -> str:
    return (params.get(key) or [""])[0]


def esc(value: object) -> str:
    return html.escape(str(value), quote=True)


def when(value: datetime | None) -> str:
    return "-" if value is None else value.isoformat(timespec="seconds")


def short(text: str | None) -> str:
    text = text or ""
    return text if len(text) <= 120 else text[:117] + "..."


def as_json(value: Any) -> str:
    return json.dumps(value, indent=2, ensure_ascii=False, default=str)


AUDIT_COLUMNS = [
    ("at", "when"),
    ("by", "who"),
    ("action", "action"),
    ("rows", "rows"),
    ("selection", "selection"),
    ("reason", "why"),
]


def audit_section(recent: Sequence[Mapping[str, Any]]) -> str:
    """The latest operator actions: each time to the second, as every time on the page, and
    each selection as compact JSON on one line (as ``outbox-dispatch audit`` shows it)."""
    shown = [
        {
            **r,
            "at": when(r["at"]),
            "selection": json.dumps(r["selection"], ensure_ascii=False, default=str),
        }
        for r in recent
    ]
    return "<h3>recent operator actions</h3>" + (
        table(shown, AUDIT_COLUMNS) if shown else "<p>none recorded</p>"
    )


FILTER_FIELDS = (
    ("family", "family"),
    ("command", "command"),
    ("actor", "actor"),
    ("error", "error contains"),
    ("older", "parked over (minutes)"),
)


def filter_form(values: Mapping[str, str]) -> str:
    """The parked page's selection: rows of a family, command, actor, error text and age."""
    fields = "".join(
        f'<label>{esc(label)} <input name="{name}" value="{esc(values.get(name, ""))}" '
        'size="14"></label> '
        for name, label in FILTER_FIELDS
    )
    return f'<form method="get" action="/parked">{fields}<button>select</button></form>'


def bulk_form(values: Mapping[str, str], count: int, token: str, listed: int) -> str:
    """What a selection matches and the buttons that act on all of it: the count is shown
    before anything is done, and acting takes a click on a button that names it; the form
    carries that count, so a selection that has changed since is shown again, not acted on.
    ``listed``: how many of those rows the list below shows (it is bounded)."""
    hidden = "".join(
        f'<input type="hidden" name="{name}" value="{esc(values[name])}">'
        for name, _label in FILTER_FIELDS
        if values.get(name)
    )
    hidden += f'<input type="hidden" name="count" value="{count}">'
    token_field = f'<input type="hidden" name="token" value="{esc(token)}">'
    buttons = "".join(
        f'<form class="inline" method="post" action="/bulk">{token_field}{hidden}'
        f'<input type="hidden" name="action" value="{action}">'
        f"<button>{action} all {count} matching rows</button></form> "
        for action in ("retry", "purge")
    )
    part = f" (the first {listed} are listed)" if listed < count else ""
    return f'<p class="msg warn">{count} parked rows match this selection{part}. {buttons}</p>'


def pause_forms(paused: Sequence[Mapping[str, Any]], families: Sequence[str], token: str) -> str:
    """Paused families with why, a form to pause one (with a reason), and resume buttons."""
    token_field = f'<input type="hidden" name="token" value="{esc(token)}">'
    names = "".join(f"<option>{esc(f)}</option>" for f in families)
    columns = [("family", "family"), ("paused_at", "since"), ("reason", "why"), ("paused_by", "by")]
    shown = [{**p, "paused_at": when(p["paused_at"])} for p in paused]  # to the second
    out = "<h3>paused families</h3>" + (table(shown, columns) if shown else "<p>none</p>")
    out += (
        f'<form method="post" action="/pause">{token_field}<select name="family">{names}</select>'
        ' <input name="reason" placeholder="why" size="30"> <button>pause</button></form>'
    )
    for p in paused:
        out += (
            f'<form class="inline" method="post" action="/resume">{token_field}'
            f'<input type="hidden" name="family" value="{esc(p["family"])}">'
            f"<button>resume {esc(p['family'])}</button></form> "
        )
    return out
