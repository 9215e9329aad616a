"""Names that end up inside SQL text or Redis keys are checked here, once."""

from __future__ import annotations

import re

from .errors import InvalidIdentifier

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


def quoted(name: str) -> str:
    """A validated identifier in double quotes, for substitution into SQL files."""
    return '"' + identifier(name) + '"'
