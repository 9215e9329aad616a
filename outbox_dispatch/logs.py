"""Structured log events: a stable action name plus the row's fields, in the message and in
``extra`` so JSON formatters and log shippers get them as fields."""

from __future__ import annotations

import logging
import re
from typing import Any

ROW_FIELDS = ("row_id", "family", "command", "actor", "attempt")

_PASSWORD = re.compile(r"(://[^:/@]+:)([^@]+)(@)")


def mask_dsn(dsn: str) -> str:
    """Hide the password of a URL-style DSN before it reaches a log or an error message."""
    return _PASSWORD.sub(r"\1***\3", dsn)


def event(logger: logging.Logger, level: int, action: str, message: str, **fields: Any) -> None:
    if not logger.isEnabledFor(level):
        return
    shown = " ".join(f"{k}={fields[k]!r}" for k in fields if fields[k] is not None)
    logger.log(
        level,
        "%s: %s%s",
        action,
        message,
        f" [{shown}]" if shown else "",
        extra={"action": action, **{f"outbox_{k}": v for k, v in fields.items()}},
    )
