"""Identifiers, SQL files and message parsing."""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
from celery import Celery

import outbox_dispatch
from outbox_dispatch import (
    ConfigurationError,
    Dispatcher,
    DuplicateRegistration,
    InvalidIdentifier,
    UnknownFamily,
)
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.naming import identifier, quoted
from outbox_dispatch.core.settle import BATCH_QUERY, QUERY
from outbox_dispatch.core.tables import table
from outbox_dispatch.store.sqlfiles import migrations, queries_for, raw_queries
from outbox_dispatch.worker.messages import parse_message


@pytest.mark.parametrize(
    "bad", ["", "1abc", 'x"; DROP TABLE y; --', "a b", "a-b", "x" * 64, None, 3, "é"]
)
def test_bad_identifiers_are_refused(bad: object) -> None:
    with pytest.raises(InvalidIdentifier):
        identifier(bad)


def test_good_identifier_is_quoted() -> None:
    assert quoted("outbox_2") == '"outbox_2"'


def test_named_queries_are_complete_and_schema_qualified() -> None:
    names = set(raw_queries())
    assert {"enqueue_insert", "claim_lease", "claim_capped_candidates", "deliver_begin"} <= names
    for name, text in queries_for("my_schema").items():
        assert "__SCHEMA__" not in text, name
        if "outbox" in text:
            assert '"my_schema".outbox' in text, name


def test_every_query_the_package_names_exists_and_every_query_is_used() -> None:
    """Queries are named in the code by their full name (``q["claim_lease"]``, or the
    settle decision's table), never built from parts, so a reader finds each one from its use
    and each use from the SQL."""
    package = Path(outbox_dispatch.__file__).parent
    source = "\n".join(p.read_text("utf-8") for p in package.rglob("*.py"))
    used = set(re.findall(r'\bq\[\s*"([a-z_]+)"\s*\]', source))
    used |= set(QUERY.values()) | set(BATCH_QUERY.values())
    assert used == set(raw_queries())


def test_migrations_are_numbered_in_order() -> None:
    found = migrations()
    assert [m.version for m in found] == list(range(1, len(found) + 1))
    assert all("__SCHEMA__" in m.text for m in found)


@pytest.mark.parametrize(
    ("args", "ok"),
    [
        ((1, str(uuid.uuid4())), True),
        ((1, "nope"), False),
        ((0, str(uuid.uuid4())), False),
        ((True, str(uuid.uuid4())), False),
        (("1", str(uuid.uuid4())), False),
        ((1,), False),
        ((1, str(uuid.uuid4()), 3), False),
        ((1, None), False),
    ],
)
def test_parse_message(args: tuple[object, ...], ok: bool) -> None:
    assert (parse_message(args) is not None) is ok


def test_dispatcher_refuses_bad_configuration() -> None:
    app = Celery("unit", set_as_current=False)
    url = "postgresql://nobody@127.0.0.1:1/none"
    with pytest.raises(InvalidIdentifier):
        Dispatcher(app, database_url=url, schema="bad schema")
    with pytest.raises(ConfigurationError):
        Dispatcher(app, database_url="")
    d = Dispatcher(app, database_url=url)  # connects to nothing until used
    with pytest.raises(UnknownFamily):
        d.handler("x", family="nope")(lambda ctx, p: None)
    d.handler("x")(lambda ctx, p: None)
    with pytest.raises(DuplicateRegistration):
        d.handler("x", family="job")(lambda ctx, p: None)
    with pytest.raises(ConfigurationError):
        d.family("f", on_lost="explode")
    with pytest.raises(InvalidIdentifier):
        d.family("has space")


def test_table_and_dsn_masking() -> None:
    text = table([{"a": 1, "b": None}, {"a": 22, "b": "x" * 100}], ["a", "b"])
    assert text.splitlines()[0].split() == ["a", "b"]
    assert "-" in text.splitlines()[2]
    assert mask_dsn("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"
    assert mask_dsn("postgresql://u@h/db") == "postgresql://u@h/db"


def test_users_own_celery_config_wins_over_our_defaults() -> None:
    app = Celery("unit_defaults", set_as_current=False)
    Dispatcher(app, database_url="postgresql://nobody@127.0.0.1:1/none")

    class Config:
        worker_prefetch_multiplier = 3
        accept_content = ["json", "pickle"]

    app.config_from_object(Config)
    assert app.conf.worker_prefetch_multiplier == 3  # a default: the user's value stands
    assert app.conf.accept_content == ["json"]  # enforced: nothing is unpickled
