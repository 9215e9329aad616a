"""Structured log events: a stable action name plus the row's fields, in the message and in
``extra`` so JSON formatters and log shippers get them as fields."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

ROW_FIELDS = ("row_id", "family", "command", "actor", "attempt")

MASK = "***"

# scheme://user:password@host — the user may be empty (redis://:pw@host). A password may hold
# anything, quotes, spaces and '@' included, and parsers disagree on where an unencoded '@'
# ends it, so everything from the user's ':' to the last '@' before the line's next URL is
# masked: a line with an '@' after the URL shows less of itself, and no password shows.
_URL_PASSWORD = re.compile(
    r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'\"]*:)"
    r"(?P<secret>(?:(?!\b[a-zA-Z][a-zA-Z0-9+.-]*://)[^\n])*)(?P<post>@)"
)
# what the pattern above left: a password that holds '://' itself, masked to the line's last '@'
_URL_PASSWORD_LEFT = re.compile(
    r"(?P<pre>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s:/@'\"]*:)(?!\*\*\*@)(?P<secret>[^\n]*)(?P<post>@)"
)
# ?password=... or &sslpassword=... in a URL's query string
_QUERY_PASSWORD = re.compile(r"(?P<pre>[?&][a-zA-Z_]*password=)(?P<secret>[^&#\s]*)", re.I)
# password=... in a libpq keyword DSN: an unquoted value up to whitespace, or a quoted one
# with \' and \\ escapes
_KEYWORD_PASSWORD = re.compile(
    r"(?P<pre>(?<![\w?&])[a-zA-Z_]*password\s*=\s*)(?P<secret>'(?:[^'\\]|\\.)*'?|[^\s]*)", re.I
)


def mask_dsn(text: str) -> str:
    """Hide every password in ``text`` before it reaches a log line or an error message.

    Works on a DSN (URL or libpq keyword form, Postgres or Redis) and on any text that embeds
    one, such as a driver error that quotes the URL it could not parse.
    """
    text = _URL_PASSWORD.sub(rf"\g<pre>{MASK}\g<post>", text)
    text = _URL_PASSWORD_LEFT.sub(rf"\g<pre>{MASK}\g<post>", text)
    text = _QUERY_PASSWORD.sub(rf"\g<pre>{MASK}", text)
    return _KEYWORD_PASSWORD.sub(rf"\g<pre>{MASK}", text)


class MaskDsnFilter(logging.Filter):
    """Masks passwords in records of loggers we do not own (psycopg_pool logs the driver's
    connection errors, which can quote the DSN). Attach it to a handler, or to a logger for
    the records logged on that logger itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        masked = mask_dsn(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = mask_dsn(record.exc_text)
        return True


# the database a claim pass or a delivery is about, when the dispatcher serves several
_database: ContextVar[str | None] = ContextVar("outbox_dispatch_database", default=None)


@contextmanager
def about_database(name: str | None) -> Iterator[None]:
    """Events logged inside the block carry ``database=name`` (None: no such field)."""
    token = _database.set(name)
    try:
        yield
    finally:
        _database.reset(token)


def event(logger: logging.Logger, level: int, action: str, message: str, **fields: Any) -> None:
    if not logger.isEnabledFor(level):
        return
    database = _database.get()
    if database is not None and "database" not in fields:
        fields = {"database": database, **fields}
    shown = " ".join(f"{k}={fields[k]!r}" for k in fields if fields[k] is not None)
    logger.log(
        level,
        "%s: %s%s",
        action,
        message,
        f" [{shown}]" if shown else "",
        extra={"action": action, **{f"outbox_{k}": v for k, v in fields.items()}},
    )
