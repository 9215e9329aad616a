"""The databases one Dispatcher serves. An outbox row commits with the business change, so it
lives in the database that holds that change; a shop with several databases (shards, regions,
Django aliases) has an outbox in each. Each database gets its own pool, claimer, commit
listener, delivery and maintenance; families, handlers, queues and the Redis caps are shared.

A delivery message names its database only when it is not the first one, so the messages already
queued stay valid when a database is added to a running shop.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from outbox_dispatch.claim.claimer import Claimer
from outbox_dispatch.core.errors import ConfigurationError, UnknownDatabase
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store import Store
from outbox_dispatch.store.adapters import check_database_url, database_target
from outbox_dispatch.store.maintenance import Maintenance
from outbox_dispatch.worker.delivery import Delivery

DEFAULT = "default"  # the name of the one database given as ``database_url``
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,39}$")

Target = tuple[str, str, str]


def database_urls(database_url: str | None, databases: Mapping[str, str] | None) -> dict[str, str]:
    """Name -> URL, checked: ``database_url`` alone is the database ``default``."""
    if (database_url is None) == (databases is None):
        raise ConfigurationError(
            "pass database_url (one database) or databases={name: url, ...} (several), not "
            "both and not neither"
        )
    if database_url is not None:
        if not database_url:
            raise ConfigurationError("database_url is required (a postgresql:// URL or DSN)")
        check_database_url(database_url)
        return {DEFAULT: database_url}
    if not isinstance(databases, Mapping) or not databases:
        raise ConfigurationError("databases must be a non-empty mapping of name -> URL")
    seen: dict[Target, str] = {}
    for name, url in databases.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigurationError(
                f"database name {name!r} is not valid: use 1-40 lower-case letters, digits or "
                "_, starting with a letter (it is a metric label and part of messages)"
            )
        if not isinstance(url, str) or not url:
            raise ConfigurationError(f"database {name!r} needs a postgresql:// URL or DSN")
        check_database_url(url)
        for target in url_targets(url):
            if target in seen:
                raise ConfigurationError(
                    f"databases {seen[target]!r} and {name!r} are the same database "
                    f"({mask_dsn(url)}): give each database one entry"
                )
            seen[target] = name
    return dict(databases)


def url_targets(url: str) -> frozenset[Target]:
    """Every (host, port, dbname) a URL may connect to: one, or one per host of a multi-host
    URL (``host=a,b``, libpq's failover list); none when a service file decides."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(url)
    hosts = str(params.get("host") or "").split(",")
    ports = str(params.get("port") or "").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    found = (
        database_target({**params, "host": host, "port": port})
        for host, port in zip(hosts, ports, strict=False)
    )
    return frozenset(t for t in found if t is not None)


@dataclass
class Database:
    """One database's outbox and the parts that work on it."""

    name: str
    url: str
    primary: bool  # the first database: its messages carry no database name
    store: Store
    claimer: Claimer
    delivery: Delivery
    maintenance: Maintenance

    @cached_property
    def targets(self) -> frozenset[Target]:
        """Where its URL connects (read once: every enqueue with several databases asks)."""
        return url_targets(self.url)


def pick(
    databases: Mapping[str, Database], name: str | None = None, where: Target | None = None
) -> Database:
    """The database of the caller's connection, which goes to ``where`` (host, port, name).
    ``name`` says it outright (for a proxy that hides where a connection goes); a connection
    that is plainly to another of our databases is still refused. With one database nothing
    is checked: every row goes to it."""
    if name is not None and name not in databases:
        raise UnknownDatabase(
            f"no database {name!r}: this dispatcher has {', '.join(map(repr, databases))}"
        )
    if len(databases) == 1:
        return next(iter(databases.values()))
    # The database exactly where the connection goes (the loopback names count as one host):
    # a staging server's ``shop`` is not production's, and a row written there would never
    # be claimed.
    exact = [d for d in databases.values() if where is not None and where in d.targets]
    found = exact[0] if len(exact) == 1 else None
    if name is not None:
        if found is not None and found.name != name:
            raise UnknownDatabase(
                f"the connection is to database {found.name!r}, not {name!r}: the row must be "
                "written where your transaction writes"
            )
        return databases[name]
    if found is None:
        shown = f"database {where[2]!r} on {where[0]}:{where[1]}" if where else "a database"
        raise UnknownDatabase(
            f"the connection is to {shown}, which is none of this dispatcher's databases "
            f"({', '.join(map(repr, databases))}): add it to Dispatcher(databases=...), or pass "
            "database= when a proxy hides which one it is"
        )
    return found


def message_args(database: Database, args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A delivery message's args: the first database's unchanged, another's with its name in
    front."""
    return args if database.primary else (database.name, *args)


def split_message(args: tuple[Any, ...]) -> tuple[str | None, tuple[Any, ...]]:
    """(database name or None for the first database, the rest): a message names a database
    when its first argument is a string (row ids and batches never are)."""
    if args and isinstance(args[0], str):
        return args[0], tuple(args[1:])
    return None, args
