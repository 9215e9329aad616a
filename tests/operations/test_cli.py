"""The CLI as a shell user meets it: options after the subcommand, a database that cannot be
reached, operations that matched nothing, output cut short by ``head``, and its wording."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import psycopg

from tests.fixtures.processes import ROOT, cli


def _insert(env: dict[str, str], sql_values: str) -> list[int]:
    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        rows = conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, due_at, parked_at,'
            f" attempts, last_error) VALUES {sql_values} RETURNING id"
        ).fetchall()
    return [int(r[0]) for r in rows]


def test_options_work_after_the_subcommand_and_status_shows_queue_lengths(
    clean_acc: dict[str, str],
) -> None:
    env = clean_acc
    _insert(env, "('custom', 'acc.custom', '{}', now(), now(), 2, 'boom')")
    status = cli(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    by_family = {s["family"]: s for s in json.loads(status.stdout)}
    assert by_family["custom"]["parked"] == 1
    assert by_family["intent"]["queued"] == 0  # the broker's queue length, per family
    table = cli(env, "status").stdout.splitlines()
    assert table[0].split()[:5] == ["family", "due", "scheduled", "in_flight", "queued"]
    listed = cli(env, "parked", "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout)[0]["last_error"] == "boom"
    both = cli(env, "--json", "parked", "list", "--json", "--family", "custom")
    assert both.returncode == 0 and len(json.loads(both.stdout)) == 1


def test_an_unreachable_or_missing_database_fails_in_seconds_with_the_servers_words(
    clean_acc: dict[str, str],
) -> None:
    down = {**clean_acc, "OUTBOX_TEST_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nowhere"}
    t0 = time.monotonic()
    result = cli(down, "status")
    assert time.monotonic() - t0 < 10
    assert result.returncode == 2
    assert "cannot reach the outbox database" in result.stderr
    assert "refused" in result.stderr  # the connection's own error
    assert len(result.stderr.strip().splitlines()) == 1  # one line, not a page of warnings
    missing = {
        **clean_acc,
        "OUTBOX_TEST_DATABASE_URL": "postgresql://postgres@127.0.0.1:5432/od_no_such_db",
    }
    result = cli(missing, "parked", "list")
    assert result.returncode == 2
    assert 'database "od_no_such_db" does not exist' in result.stderr


def test_operations_that_match_nothing_say_why_and_exit_non_zero(
    clean_acc: dict[str, str],
) -> None:
    env = clean_acc
    [parked] = _insert(env, "('custom', 'acc.custom', '{}', now(), now(), 2, 'boom')")
    [live] = _insert(env, "('intent', 'acc.email', '{}', now() + interval '1 h', NULL, 0, NULL)")
    cancel = cli(env, "cancel", str(parked))
    assert cancel.returncode == 1
    assert f"row {parked} is parked: parked rows are purged, not cancelled" in cancel.stdout
    assert "0 rows cancelled" in cancel.stdout
    gone = cli(env, "cancel", "987654321", "--json")
    assert gone.returncode == 1
    assert json.loads(gone.stdout)["reasons"] == [
        "row 987654321 does not exist (delivered rows are deleted unless kept by retention)"
    ]
    retry = cli(env, "parked", "retry", str(live))
    assert retry.returncode == 1
    assert f"row {live} is not parked" in retry.stdout
    one = cli(env, "cancel", str(live))
    assert one.returncode == 0 and one.stdout.strip() == "1 row cancelled"
    again = cli(env, "cancel", str(live))
    assert again.returncode == 1 and f"row {live} is already cancelled" in again.stdout


def test_json_cut_short_by_head_ends_quietly(clean_acc: dict[str, str]) -> None:
    env = clean_acc
    values = ", ".join(
        "('custom', 'acc.custom', '{}', now(), now(), 2, '" + "x" * 200 + "')" for _ in range(2000)
    )
    _insert(env, values)
    pipeline = subprocess.run(  # noqa: S602 (a fixed command line: the test is about the pipe)
        f"{sys.executable} -m outbox_dispatch.ops.cli parked list --json --limit 2000"
        " | head -c 100",
        shell=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert len(pipeline.stdout) == 100
    assert pipeline.stderr == ""  # no BrokenPipeError traceback


def test_prune_shows_its_progress_per_family_and_the_status_table_is_aligned(
    clean_acc: dict[str, str],
) -> None:
    env = clean_acc
    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, due_at, done_at)'
            " SELECT 'custom', 'acc.custom', '{}', now(), now() - interval '1 hour'"
            " FROM generate_series(1, 25)"
        )
    pruned = cli(env, "prune", "--batch", "10")
    assert pruned.returncode == 0, pruned.stderr
    assert pruned.stdout.startswith("pruned 25 rows")
    # the progress's last state: the family and its count (a live line on a terminal)
    assert "prune: custom: 25 rows deleted" in pruned.stderr
    quiet = cli(env, "prune", "--json")
    assert quiet.returncode == 0 and quiet.stderr == "" and json.loads(quiet.stdout) == {}
    lines = cli(env, "status").stdout.splitlines()
    assert set(lines[1].replace(" ", "")) == {"─"}  # the rule under the header
    header, rows = lines[0], lines[2:]
    assert all(len(r) <= len(lines[1]) for r in rows)
    queued = header.index("queued")  # every row's value starts under its column
    assert all(r[queued] != " " for r in rows)


def test_limits_must_be_positive_and_an_unknown_family_is_named(clean_acc: dict[str, str]) -> None:
    for args in (["parked", "list", "--limit", "0"], ["prune", "--batch", "-1"]):
        result = cli(clean_acc, *args)
        assert result.returncode == 2 and "must be at least 1" in result.stderr
    unknown = cli(clean_acc, "parked", "list", "--family", "nosuch")
    assert unknown.returncode == 1 and "declares no family 'nosuch'" in unknown.stdout


def test_a_server_that_cannot_listen_says_so_in_one_line(clean_acc: dict[str, str]) -> None:
    """A busy port, or one out of range: one line and exit 2, and no 'serving' before it
    (it printed 'serving ...' and then a traceback, exit 1)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for command in (["web", "--auth", "ops:secret"], ["metrics"]):
            result = cli(clean_acc, *command, "--addr", "127.0.0.1", "--port", port)
            assert result.returncode == 2, result.stderr
            assert "serving" not in result.stdout
            lines = result.stderr.strip().splitlines()
            assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{port}" in lines[0], lines
    for bad in ("99999", "-1"):
        result = cli(clean_acc, "web", "--auth", "ops:secret", "--port", bad)
        assert result.returncode == 2 and "a port is 0 to 65535" in result.stderr


def test_cli_migrate_status_and_parked(clean_acc: dict[str, str]) -> None:
    env = clean_acc
    first = cli(env, "migrate")
    assert first.returncode == 0, first.stderr
    assert "already up to date" in first.stdout

    schema = env["OUTBOX_TEST_SCHEMA"]
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".outbox (family, command, payload, due_at, parked_at,'
            " attempts, last_error) VALUES"
            " ('custom', 'acc.custom', '{}', now(), now(), 2, 'boom'),"
            " ('custom', 'acc.custom', '{}', now(), now(), 2, 'boom'),"
            " ('intent', 'acc.email', '{}', now() - interval '5 s', NULL, 0, NULL),"
            " ('intent', 'acc.email', '{}', now() + interval '1 h', NULL, 0, NULL)"
        )
        ids = [
            r[0]
            for r in conn.execute(
                f'SELECT id FROM "{schema}".outbox WHERE parked_at IS NOT NULL ORDER BY id'
            )
        ]

    status = cli(env, "--json", "status")
    assert status.returncode == 0, status.stderr
    by_family = {s["family"]: s for s in json.loads(status.stdout)}
    assert by_family["custom"]["parked"] == 2
    assert by_family["intent"]["due"] == 1
    assert by_family["intent"]["scheduled"] == 1
    assert by_family["intent"]["oldest_due_age"] >= 5
    assert by_family["job"]["due"] == 0
    table = cli(env, "status").stdout
    assert table.splitlines()[0].split()[:3] == ["family", "due", "scheduled"]

    listed = cli(env, "parked", "list")
    assert listed.returncode == 0 and "boom" in listed.stdout

    refused = cli(env, "parked", "retry")
    assert refused.returncode == 2 and "name row ids, a selection" in refused.stderr

    retried = cli(env, "parked", "retry", str(ids[0]), "999999")
    assert retried.returncode == 1  # one of the two matched nothing: says why, exits non-zero
    assert "1 row due again" in retried.stdout
    assert "row 999999 does not exist" in retried.stdout
    purged = cli(env, "--json", "parked", "purge", "--all")  # in batches, every parked row
    assert json.loads(purged.stdout) == {"count": 1, "done": 1, "requested": 0}
    with psycopg.connect(env["OUTBOX_TEST_DATABASE_URL"]) as conn:
        row = conn.execute(
            f'SELECT attempts, parked_at FROM "{schema}".outbox WHERE id = %s',
            (ids[0],),
        ).fetchone()
    assert row == (0, None)

    missing_app = cli({**env, "OUTBOX_DISPATCH_APP": ""}, "status")
    assert missing_app.returncode == 2 and "--app module:attribute" in missing_app.stderr
    bad_app = cli(env, "--app", "tests.apps.nowhere:x", "status")
    assert bad_app.returncode == 2 and "cannot import" in bad_app.stderr
