"""Django for the in-process tests: the test project set up once per session on the session's
schema (tests/fixtures/inprocess.py registers these fixtures, for adoption/test_django.py and
adoption/test_django_admin.py), and the helper that points OUTBOX_DISPATCHER at a given
dispatcher."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import django
import pytest
from celery import Celery
from django.conf import settings
from django.db import connection, connections
from django.test.utils import override_settings

from outbox_dispatch import Dispatcher
from outbox_dispatch.contrib.django import get_dispatcher
from tests.django_project import outbox

SETTINGS = "tests.django_project.settings"


@contextmanager
def _served(name: str, dispatcher: Dispatcher) -> Iterator[None]:
    """OUTBOX_DISPATCHER pointed at ``outbox.<name>``, which holds ``dispatcher``.

    get_dispatcher() caches what each setting value named for the whole process, so a name
    reused by two tests would hand the second one the first one's dispatcher (its database
    and schema): the identity check makes such a reuse fail here, not in the command."""
    setattr(outbox, name, dispatcher)
    try:
        with override_settings(OUTBOX_DISPATCHER=f"tests.django_project.outbox:{name}"):
            assert get_dispatcher() is dispatcher, f"outbox.{name} served another dispatcher"
            yield
    finally:
        setattr(outbox, name, None)


@pytest.fixture(scope="session")
def order_model(dispatcher: Dispatcher, schema: str) -> Iterator[Any]:
    """Django set up on the test project; the Order table created in the session's schema
    (dropped with it)."""
    outbox.dispatcher = dispatcher
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DJANGO_SETTINGS_MODULE", SETTINGS)
        env.setenv("OUTBOX_TEST_DJANGO_SCHEMA", schema)
        django.setup()
        assert settings.SETTINGS_MODULE == SETTINGS, "Django was set up by another project"
    assert get_dispatcher() is dispatcher, "OUTBOX_DISPATCHER served another dispatcher"
    from tests.django_project.shop.models import Order

    with connection.schema_editor() as editor:
        editor.create_model(Order)
    yield Order
    connections.close_all()


@pytest.fixture
def orders(order_model: Any) -> Any:
    order_model.objects.all().delete()
    return order_model


@pytest.fixture(scope="session")
def listening(
    order_model: Any, database_url: str, redis_url: str, schema: str, key_prefix: str
) -> Iterator[Dispatcher]:
    """A dispatcher whose workers would listen for NOTIFY (nobody runs them here), with an
    ordered family; its own queue prefix keeps anything it published away from the worker."""
    app = Celery("outbox_tests_django", broker=redis_url, set_as_current=False)
    app.conf.broker_transport_options = {"global_keyprefix": key_prefix}
    d = Dispatcher(app, database_url=database_url, schema=schema, queue_prefix="djlisten")
    d.family("lined", ordered=True)
    d.declare("dj.lined", family="lined")
    yield d
    d.close()
