"""Passwords never reach a log line: mask_dsn on every DSN form we accept, and the log filter
for records of libraries we do not own."""

from __future__ import annotations

import logging
import time

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_dispatch.core.logs import MaskDsnFilter, event, mask_dsn

SECRET = "Zq9sEcReT"


@pytest.mark.parametrize(
    ("dsn", "masked"),
    [
        ("postgresql://app:pw@db:5432/shop", "postgresql://app:***@db:5432/shop"),
        ("postgres://app:pw@db/shop?sslmode=require", "postgres://app:***@db/shop?sslmode=require"),
        ("postgresql+psycopg://app:pw@db/shop", "postgresql+psycopg://app:***@db/shop"),
        ("postgresql://app:p@ss:w/rd@db/shop", "postgresql://app:***@db/shop"),
        ("postgresql://app@db/shop", "postgresql://app@db/shop"),
        # an '@' after the host: masking errs on the side of hiding too much
        ("postgresql://app:pw@db/shop?application_name=a@b", "postgresql://app:***@b"),
        ("postgresql://db/shop?user=app&password=pw", "postgresql://db/shop?user=app&password=***"),
        ("postgresql://db/shop?sslpassword=pw&x=1", "postgresql://db/shop?sslpassword=***&x=1"),
        ("redis://:pw@cache:6379/0", "redis://:***@cache:6379/0"),
        ("rediss://default:pw@cache:6380/1", "rediss://default:***@cache:6380/1"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
        ("redis://cache:6379/0?password=pw", "redis://cache:6379/0?password=***"),
        ("unix://:pw@/run/redis.sock?db=2", "unix://:***@/run/redis.sock?db=2"),
        ("host=db user=app password=pw dbname=shop", "host=db user=app password=*** dbname=shop"),
        ("host=db password = pw dbname=shop", "host=db password = *** dbname=shop"),
        ("host=db password='p w\\' x' dbname=shop", "host=db password=*** dbname=shop"),
        ("host=db sslpassword=pw", "host=db sslpassword=***"),
        ("PGPASSWORD=pw psql", "PGPASSWORD=*** psql"),
        ("host=db user=app dbname=shop", "host=db user=app dbname=shop"),
        (
            "cannot reach postgresql://root:it's-x@db/shop",
            "cannot reach postgresql://root:***@db/shop",
        ),
        ('redis://:p"w d@cache:6379/0', "redis://:***@cache:6379/0"),
        ("postgresql://db/shop?password=it's&x=1", "postgresql://db/shop?password=***&x=1"),
        ("postgresql://u:a://b@db/shop", "postgresql://u:***@db/shop"),
        ("", ""),
    ],
)
def test_mask_dsn_hides_the_password_of_every_form(dsn: str, masked: str) -> None:
    assert mask_dsn(dsn) == masked


def test_text_that_embeds_several_dsns_is_masked_throughout() -> None:
    text = (
        "broker redis://:rpw@cache:6379/0 and db postgresql://u:ppw@db/x failed "
        "(conninfo 'host=db password=kpw'): retry"
    )
    masked = mask_dsn(text)
    assert not {"rpw", "ppw", "kpw"} & set(masked.replace(":", " ").replace("=", " ").split())
    assert "redis://:***@cache:6379/0" in masked
    assert "postgresql://u:***@db/x" in masked
    assert "retry" in masked


def test_a_driver_error_that_quotes_the_url_is_masked() -> None:
    """libpq repeats the whole URI when it cannot parse it: that text is what we would log."""
    with pytest.raises(psycopg.Error) as info:
        psycopg.connect(f"postgresql://app:{SECRET}@[broken/db", connect_timeout=1)
    assert SECRET in str(info.value)  # the driver does leak it...
    assert SECRET not in mask_dsn(str(info.value))  # ...and mask_dsn removes it


# anything a password may hold, quotes, spaces, '@' and '/' included; a line break ends a line
_password_chars = st.characters(codec="utf-8", exclude_categories=["Cs", "Cc", "Zl", "Zp"])


@given(
    user=st.from_regex(r"[a-z_][a-z0-9_]{0,10}", fullmatch=True) | st.just(""),
    password=st.text(_password_chars, min_size=0, max_size=20),
    host=st.from_regex(r"[a-z][a-z0-9.-]{0,15}", fullmatch=True),
    scheme=st.sampled_from(["postgresql", "postgres", "redis", "rediss", "postgresql+psycopg"]),
    tail=st.sampled_from(["", "/db", ":5432/db", "/0?sslmode=require", "/x#frag"]),
)
def test_no_url_password_survives(
    user: str, password: str, host: str, scheme: str, tail: str
) -> None:
    secret = SECRET + password
    dsn = f"{scheme}://{user}:{secret}@{host}{tail}"
    masked = mask_dsn(dsn)
    assert SECRET not in masked
    assert masked == f"{scheme}://{user}:***@{host}{tail}"  # the rest stays readable


@given(password=st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20))
def test_no_quoted_keyword_password_survives(password: str) -> None:
    quoted = "'" + (SECRET + password).replace("\\", "\\\\").replace("'", "\\'") + "'"
    masked = mask_dsn(f"host=db password={quoted} dbname=shop")
    assert SECRET not in masked
    assert masked == "host=db password=*** dbname=shop"


def test_log_filter_masks_messages_args_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("tests.operations.test_logs.foreign")
    mask = MaskDsnFilter()
    logger.addFilter(mask)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            logger.warning("error connecting to %s", f"postgresql://u:{SECRET}@db/x")
            try:
                raise ConnectionError(f"redis://:{SECRET}@cache:6379/0 refused")
            except ConnectionError:
                logger.exception("broker down")
        assert len(caplog.records) == 2
        assert caplog.records[0].getMessage() == "error connecting to postgresql://u:***@db/x"
        assert SECRET not in caplog.text
        assert "redis://:***@cache:6379/0 refused" in caplog.text
    finally:
        logger.removeFilter(mask)


def test_event_puts_action_and_row_fields_in_message_and_extra(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("tests.operations.test_logs.event")
    with caplog.at_level(logging.INFO, logger=logger.name):
        event(logger, logging.INFO, "parked", "row parked", row_id=7, family="job", actor=None)
        event(logger, logging.DEBUG, "hidden", "below the level")
    [record] = caplog.records
    assert record.getMessage() == "parked: row parked [row_id=7 family='job']"
    assert record.__dict__["action"] == "parked"
    assert record.__dict__["outbox_row_id"] == 7


# -- where a malformed DSN's password still leaks (libpq quotes a URI it cannot parse) ----------

BROKEN_URL = f"postgresql://app:{SECRET}@[broken/db"


def test_cli_migrate_with_a_malformed_url_fails_cleanly_without_the_password(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from outbox_dispatch.ops.cli import main

    assert main(["migrate", "--database-url", BROKEN_URL, "--schema", "od_never"]) == 2
    err = capsys.readouterr().err
    assert "outbox-dispatch: error:" in err
    assert SECRET not in err


def test_wake_listener_warning_does_not_quote_the_password(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from outbox_dispatch.claim.claimer import ClaimReport
    from outbox_dispatch.claim.listener import CommitListener

    listener = CommitListener(BROKEN_URL, "outbox", "outbox_outbox", lambda f: ClaimReport())
    with caplog.at_level(logging.WARNING, logger="outbox_dispatch.claim.listener"):
        listener.start()
        try:
            deadline = time.monotonic() + 5
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.01)
        finally:
            listener.stop()
    assert caplog.records, "the listener logged nothing"
    assert SECRET not in caplog.text


def test_a_malformed_database_url_is_refused_at_once_and_masked() -> None:
    from celery import Celery

    from outbox_dispatch import ConfigurationError, Dispatcher

    app = Celery("masking", broker="memory://", set_as_current=False)
    with pytest.raises(ConfigurationError) as info:
        Dispatcher(app, database_url=BROKEN_URL)
    assert SECRET not in str(info.value)
