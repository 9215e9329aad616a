"""Names that end up inside SQL text or Redis keys are checked here, once."""

from __future__ import annotations

import re

from outbox_dispatch.core.errors import InvalidIdentifier

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
_FAMILY = re.compile(r"^[a-z][a-z0-9_]{0,47}$")


def identifier(value: object, what: str = "identifier") -> str:
    """Return ``value`` if it is a safe SQL identifier; it is still quoted wherever it is used."""
    if not isinstance(value, str) or not _IDENTIFIER.match(value):
        raise InvalidIdentifier(
            f"{what} {value!r} is not a valid identifier: use 1-63 letters, digits or _, "
            "not starting with a digit"
        )
    return value


def family_name(value: object) -> str:
    """Family names become queue names and metric labels, so they are kept lower-case and short."""
    if not isinstance(value, str) or not _FAMILY.match(value):
        raise InvalidIdentifier(
            f"family name {value!r} is not valid: use 1-48 lower-case letters, digits or _, "
            "starting with a letter"
        )
    return value


def command_name(value: object) -> str:
    """Command names are stored in every row (text), shown by Flower and matched exactly: a
    name Postgres cannot store (NUL, a lone surrogate) would be refused at each enqueue."""
    if not isinstance(value, str) or not value or len(value) > 200:
        raise InvalidIdentifier(f"command must be a 1-200 character str, got {value!r}")
    if "\x00" in value:
        raise InvalidIdentifier(
            f"command {value!r} contains a NUL character: Postgres cannot store it"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidIdentifier(f"command {value!r} is not valid Unicode ({exc.reason})") from exc
    return value


def quoted(name: str) -> str:
    """A validated identifier in double quotes, for substitution into SQL files."""
    return '"' + identifier(name) + '"'
