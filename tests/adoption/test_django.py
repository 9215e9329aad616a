"""Django: the outbox row rides on Django's connection and transaction (tests/django_project,
on the real Postgres, its tables in the session's schema); the on_commit wake; the
outbox_migrate command; the system checks."""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from celery import Celery
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError, SystemCheckError
from django.db import connection, connections, transaction
from django.test.utils import override_settings

from outbox_dispatch import ConfigurationError, Dispatcher, Message, OutboxTask, OutsideTransaction
from outbox_dispatch.celery.wiring import CLAIM_TASK
from outbox_dispatch.contrib.django import NotInTransaction, enqueue, enqueue_many
from outbox_dispatch.contrib.django import database_url as database_url_of
from outbox_dispatch.contrib.django.checks import database_problems
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.store.sqlfiles import migrations
from tests.conftest import count_rows
from tests.fixtures.inprocess import Effects
from tests.support.django_setup import _served

pytestmark = pytest.mark.usefixtures("clean")


def _wakes(published: list[dict[str, Any]]) -> list[str]:
    """The families of the claim wakes sent so far (the body is ((families,), {}, embed))."""
    return [f for m in published if m["task"] == CLAIM_TASK for f in m["body"][0][0]]


def _wait(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.02)


def test_order_and_its_row_commit_together_and_the_commit_wake_delivers(
    orders: Any,
    commands: Callable[..., str],
    effects: Effects,
    worker: object,
    published: list[dict[str, Any]],
    database_url: str,
    schema: str,
) -> None:
    cmd = commands(family="quick")
    with transaction.atomic():
        order = orders.objects.create(customer="ada", total_cents=4200)
        row_id = enqueue(cmd, {"order": order.pk}, actor=f"order:{order.pk}")
        assert count_rows(database_url, schema) == 0  # nobody sees it before the commit
        assert _wakes(published) == []
    assert orders.objects.filter(pk=order.pk).exists()
    # no beat runs here and the dispatcher does not listen: only the commit wake can claim
    _wait(lambda: effects.rows(cmd) == [row_id])
    assert effects.calls[0][3] == {"order": order.pk}
    assert _wakes(published) == ["quick"]
    _wait(lambda: count_rows(database_url, schema) == 0)


def test_rollback_leaves_neither_the_order_nor_the_row_nor_a_wake(
    orders: Any,
    commands: Callable[..., str],
    published: list[dict[str, Any]],
    database_url: str,
    schema: str,
) -> None:
    cmd = commands()
    with pytest.raises(RuntimeError, match="declined"), transaction.atomic():
        order = orders.objects.create(customer="bob", total_cents=100)
        enqueue(cmd, {"order": order.pk})
        raise RuntimeError("card declined")
    assert orders.objects.count() == 0
    assert count_rows(database_url, schema) == 0
    assert _wakes(published) == []


def test_an_ordered_row_enqueued_first_in_the_block_rolls_back_with_it(
    orders: Any,
    listening: Dispatcher,
    published: list[dict[str, Any]],
    database_url: str,
    schema: str,
) -> None:
    # atomic() begins nothing on the server until the first statement; the ordered insert's
    # own transaction block must not become a commit of its own
    with _served("listening", listening):
        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue("dj.lined", {"n": 1}, actor="customer:1")
            orders.objects.create(customer="cy", total_cents=1)
            raise RuntimeError("rolled back")
        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue_many([Message("dj.lined", {"n": 2}, actor="customer:2")])
            raise RuntimeError("rolled back")
        assert count_rows(database_url, schema) == 0
        assert orders.objects.count() == 0

        with transaction.atomic():
            first = enqueue("dj.lined", {"n": 3}, actor="customer:3")
            second = enqueue("dj.lined", {"n": 4}, actor="customer:3")
            orders.objects.create(customer="cy", total_cents=2)
    assert count_rows(database_url, schema, f"id IN ({first}, {second})") == 2
    # listen=True: the commit's NOTIFY wakes the worker's listener, no Celery wake is sent
    assert _wakes(published) == []


def test_enqueue_outside_a_transaction_is_refused_and_writes_nothing(
    orders: Any,
    commands: Callable[..., str],
    effects: Effects,
    worker: object,
    published: list[dict[str, Any]],
    database_url: str,
    schema: str,
) -> None:
    cmd = commands()
    with pytest.raises(NotInTransaction, match=r"transaction\.atomic"):
        enqueue(cmd, {"n": 1})
    with pytest.raises(transaction.TransactionManagementError, match="allow_autocommit"):
        enqueue_many([Message(cmd, {"n": 2})])
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic(savepoint=False):
            raise RuntimeError("the block is now doomed")
        with pytest.raises(transaction.TransactionManagementError, match="An error occurred"):
            enqueue(cmd, {"n": 3})
    assert count_rows(database_url, schema) == 0
    assert _wakes(published) == []

    # asked for explicitly: the row commits at once, and so does its wake
    row_id = enqueue(cmd, {"n": 4}, allow_autocommit=True)
    assert _wakes(published) == ["intent"]
    _wait(lambda: effects.rows(cmd) == [row_id])


def test_one_wake_per_family_per_transaction_sent_after_the_commit(
    orders: Any,
    commands: Callable[..., str],
    effects: Effects,
    worker: object,
    published: list[dict[str, Any]],
) -> None:
    quick, intent = commands(family="quick"), commands()
    with transaction.atomic():
        with pytest.raises(RuntimeError), transaction.atomic():
            enqueue(quick, {"n": 0})  # registers a wake of quick in this savepoint...
            raise RuntimeError("...which is rolled back with it")
        ids = [enqueue(quick, {"n": n}) for n in range(1, 4)]
        ids += enqueue_many([Message(intent, {"n": 4}), Message(intent, {"n": 5})])
        later = enqueue(intent, {"n": "later"}, delay=timedelta(minutes=5))
        assert _wakes(published) == []
    assert sorted(_wakes(published)) == ["intent", "quick"]
    _wait(lambda: sorted(effects.rows(quick) + effects.rows(intent)) == sorted(ids))
    assert later not in effects.rows(intent)

    with transaction.atomic():  # only a scheduled row: nothing to wake for
        enqueue(intent, {"n": "tomorrow"}, delay=timedelta(days=1))
    assert sorted(_wakes(published)) == ["intent", "quick"]


def test_outbox_migrate_applies_pending_migrations_once(
    order_model: Any, database_url: str, run_id: str
) -> None:
    fresh_schema = f"od_test_{run_id}_django"
    app = Celery("outbox_tests_django_fresh", broker="memory://", set_as_current=False)
    fresh = Dispatcher(app, database_url=database_url, schema=fresh_schema, listen=False)
    names = [f"{m.version:04d}_{m.name}" for m in migrations()]
    try:
        with _served("fresh", fresh):
            with pytest.raises(CommandError, match=f"{len(names)} outbox migrations pending"):
                call_command("outbox_migrate", "--check", stdout=io.StringIO())
            out = io.StringIO()
            call_command("outbox_migrate", stdout=out)
            applied = [ln.removeprefix("applied ") for ln in out.getvalue().splitlines()]
            assert applied[:-1] == names and f"{fresh_schema!r}" in applied[-1]
            assert "migrated" in applied[-1]
            for args in (["outbox_migrate"], ["outbox_migrate", "--check"]):
                again = io.StringIO()
                call_command(*args, stdout=again)
                assert "is up to date" in again.getvalue()
        with psycopg.connect(database_url) as conn:
            found = conn.execute("SELECT to_regclass(%s)", (f"{fresh_schema}.outbox",)).fetchone()
        assert found is not None and found[0] is not None
    finally:
        fresh.close()
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{fresh_schema}" CASCADE')


def test_outbox_migrate_says_which_database_it_cannot_reach(order_model: Any) -> None:
    app = Celery("outbox_tests_django_down", broker="memory://", set_as_current=False)
    down = Dispatcher(app, database_url="postgresql://app:hunter2@127.0.0.1:1/shop", listen=False)
    try:
        with (
            _served("unreachable", down),
            pytest.raises(
                CommandError, match=r"cannot migrate the outbox .*127\.0\.0\.1:1"
            ) as info,
        ):
            call_command("outbox_migrate", stdout=io.StringIO())
        assert "hunter2" not in str(info.value)
        assert info.value.returncode == 2  # unreachable, not "migrations pending"
    finally:
        down.close()


def test_outbox_migrate_can_run_as_another_role(
    order_model: Any, database_url: str, schema: str
) -> None:
    """The Dispatcher connects as the runtime role; --database-url migrates as the migrate
    role (here: the Dispatcher's URL is unreachable, the given one works). The session's
    schema is migrated already, so there is nothing to apply."""
    app = Celery("outbox_tests_django_other", broker="memory://", set_as_current=False)
    runtime = Dispatcher(
        app, database_url="postgresql://app@127.0.0.1:1/shop", schema=schema, listen=False
    )
    try:
        with _served("other_role", runtime):
            out = io.StringIO()
            call_command("outbox_migrate", "--database-url", database_url, stdout=out)
        assert out.getvalue().splitlines() == [
            f"outbox schema {schema!r} on {mask_dsn(database_url)} is up to date"
        ]
    finally:
        runtime.close()


def _ours(messages: list[Any]) -> list[str]:
    return sorted(m.id for m in messages if str(m.id).startswith("outbox_dispatch."))


def test_system_checks_flag_a_missing_or_broken_setting(order_model: Any) -> None:
    assert _ours(run_checks()) == []  # the test project is set up right

    with override_settings():
        del settings.OUTBOX_DISPATCHER
        assert _ours(run_checks()) == ["outbox_dispatch.W001"]
        with pytest.raises(ImproperlyConfigured, match="OUTBOX_DISPATCHER is not set"):
            enqueue("anything", {})

    for bad, why in [
        ("tests.django_project.outbox:nowhere", "has no attribute 'nowhere'"),
        ("tests.django_project.no_such_module:dispatcher", "cannot import"),
        ("tests.django_project.shop.models:Order", "not a Dispatcher"),
        (42, "must be a 'module:attribute' string"),
    ]:
        with override_settings(OUTBOX_DISPATCHER=bad):
            found = [m for m in run_checks() if m.id == "outbox_dispatch.E001"]
            assert len(found) == 1 and why in found[0].msg, found
            with pytest.raises(SystemCheckError, match=r"outbox_dispatch\.E001"):
                call_command("check", stdout=io.StringIO(), stderr=io.StringIO())
            with pytest.raises(ImproperlyConfigured, match="OUTBOX_DISPATCHER"):
                enqueue("anything", {})


def test_database_check_wants_the_dispatchers_postgresql_on_psycopg_3(
    order_model: Any, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg = dict(settings.DATABASES["default"])

    def ids(databases: dict[str, Any], url: str | None = database_url) -> list[str]:
        return [m.id for m in database_problems(databases, "default", url)]

    assert ids({"default": pg}) == []
    assert ids({"default": {**pg, "HOST": "localhost"}}) == []  # the same server
    assert ids({}) == ["outbox_dispatch.W002"]
    sqlite = {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}
    assert ids({"default": sqlite}) == ["outbox_dispatch.W002"]

    parts = urlsplit(database_url)
    user, _, host = parts.netloc.rpartition("@")
    with_secret = urlunsplit(
        parts._replace(netloc=f"{user.partition(':')[0] or 'postgres'}:s3cret@{host}")
    )
    elsewhere = database_problems(
        {"default": {**pg, "NAME": "shop_replica"}}, "default", with_secret
    )
    assert [m.id for m in elsewhere] == ["outbox_dispatch.W004"]
    assert "never be claimed" in elsewhere[0].msg and "s3cret" not in elsewhere[0].msg
    other_port = str(int(pg["PORT"] or 5432) + 1)
    assert ids({"default": {**pg, "PORT": other_port}}) == ["outbox_dispatch.W004"]
    assert ids({"default": {**pg, "NAME": "shop_replica"}}, None) == []  # no dispatcher: no view

    # psycopg2 is written through as psycopg 3 is: no warning for it (W003 is gone)
    from django.db.backends.postgresql import psycopg_any

    monkeypatch.setattr(psycopg_any, "is_psycopg3", False)
    assert ids({"default": pg}) == []


def test_a_dispatcher_built_from_a_django_alias_writes_with_the_models_and_delivers(
    orders: Any, database_url: str, redis_url: str, schema: str, key_prefix: str
) -> None:
    """``database_url("default")`` gives the Dispatcher Django's own database (the test
    project's OPTIONS included), so the URL is written once; bad aliases are refused."""
    url = database_url_of("default")
    got = psycopg.conninfo.conninfo_to_dict(url)
    want = psycopg.conninfo.conninfo_to_dict(database_url)
    assert (got["dbname"], got.get("host"), got.get("port")) == (
        want["dbname"],
        want.get("host"),
        want.get("port"),
    )
    assert got["options"] == f"-c search_path={schema}"  # Django's OPTIONS came along
    app = Celery("outbox_tests_django_alias", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": key_prefix}
    d = Dispatcher(app, database_url=url, schema=schema, queue_prefix="djalias", listen=False)
    ran: list[int] = []
    d.handler("dj.alias", family="intent")(lambda ctx, payload: ran.append(payload["order"]))
    try:
        with transaction.atomic():
            order = orders.objects.create(customer="grace", total_cents=100)
            d.enqueue(connection, "dj.alias", {"order": order.pk})
        with transaction.atomic():
            orders.objects.create(customer="rolled back", total_cents=1)
            d.enqueue(connection, "dj.alias", {"order": -1})
            transaction.set_rollback(True)
        assert d.drain(timeout=10).delivered == 1
        assert ran == [order.pk]
    finally:
        d.close()
    with pytest.raises(
        ConfigurationError,
        match=r"no database 'replica' in DATABASES \(it has: default, elsewhere, orders\)",
    ):
        database_url_of("replica")
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(settings.DATABASES, "lite", {"ENGINE": "django.db.backends.sqlite3"})
        with pytest.raises(ConfigurationError, match="the outbox lives in PostgreSQL"):
            database_url_of("lite")


# -- existing Celery tasks (OutboxTask) inside Django transactions ------------------------------


@pytest.fixture
def task_calls(dispatcher: Dispatcher) -> tuple[Any, list[Any]]:
    """A bound OutboxTask of the session's app that records its args and retries."""
    seen: list[Any] = []

    def body(self: Any, order: int) -> None:
        seen.append((order, self.request.retries))
        if self.request.retries == 0:
            raise self.retry(countdown=0, exc=ConnectionError("mail server busy"))

    name = f"shop.receipt{time.monotonic_ns()}"
    return dispatcher.app.task(name=name, base=OutboxTask, bind=True)(body), seen


def test_a_task_call_in_atomic_commits_with_the_order_and_retries_through_self_retry(
    orders: Any,
    task_calls: tuple[Any, list[Any]],
    dispatcher: Dispatcher,
    database_url: str,
    schema: str,
) -> None:
    receipt, seen = task_calls
    with transaction.atomic():
        order = orders.objects.create(customer="ada", total_cents=4200)
        row_id = receipt.delay(order.pk).row_id
        assert count_rows(database_url, schema) == 0  # not before the commit
    with pytest.raises(RuntimeError), transaction.atomic():
        lost = orders.objects.create(customer="bob", total_cents=1)
        receipt.delay(lost.pk)
        raise RuntimeError("declined")
    assert count_rows(database_url, schema) == 1
    deadline = time.monotonic() + 10
    while count_rows(database_url, schema) and time.monotonic() < deadline:
        dispatcher.drain(timeout=5)
    assert seen == [(order.pk, 0), (order.pk, 1)]  # retried once through self.retry
    assert count_rows(database_url, schema, f"id = {row_id}") == 0


def test_a_task_call_rides_on_a_named_database_and_is_refused_on_another_one(
    orders: Any, task_calls: tuple[Any, list[Any]], database_url: str, schema: str
) -> None:
    receipt, _seen = task_calls
    with pytest.raises(RuntimeError), transaction.atomic(using="orders"):
        receipt.delay(1)
        assert connections["orders"].in_atomic_block
        raise RuntimeError("rolled back on the named database")
    assert count_rows(database_url, schema) == 0
    with transaction.atomic(using="orders"):
        kept = receipt.delay(2).row_id
    assert count_rows(database_url, schema, f"id = {kept}") == 1
    # a transaction on a database the outbox is not in cannot carry the row
    with transaction.atomic(using="elsewhere"):
        with pytest.raises(OutsideTransaction, match="'elsewhere', which is not the outbox's"):
            receipt.delay(3)
    # outside any transaction (Django's autocommit) the row commits at once, by default
    alone = receipt.delay(4).row_id
    assert count_rows(database_url, schema, f"id = {alone}") == 1
