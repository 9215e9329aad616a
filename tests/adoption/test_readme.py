"""The README's quickstart runs as written: each code block the README marks with
``<!-- file: PATH -->`` is that file of examples/ to the byte, and the quickstart project is
run here (its migrate command taken from the README, then its place_order) on a database of
its own, so it cannot rot."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.fixtures.processes import ROOT

README = ROOT / "README.md"
MARKED = re.compile(r"<!-- file: (\S+)[^\n]*-->\n```\w*\n(.*?)```", re.S)
QUICKSTART = ROOT / "examples" / "quickstart"


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, re.S)


def test_every_marked_readme_block_is_its_example_file() -> None:
    marked = MARKED.findall(README.read_text())
    assert marked, "the README marks no block with its file"
    for path, block in marked:
        assert (ROOT / path).read_text() == block, f"README's copy of {path} differs from it"


@pytest.fixture
def own_database(database_url: str) -> Iterator[str]:
    """A database nobody else uses: the quickstart keeps the default schema ``outbox``."""
    name = f"od_qs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    params = psycopg.conninfo.conninfo_to_dict(database_url)
    yield psycopg.conninfo.make_conninfo("", **{**params, "dbname": name})
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_the_quickstart_runs_as_written(
    own_database: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    env = {
        **os.environ,
        "DATABASE_URL": own_database,
        "PYTHONPATH": os.pathsep.join([str(QUICKSTART), str(ROOT)]),
    }
    commands = [
        line.split("#")[0].strip()
        for block in _blocks(README.read_text(), "sh")
        for line in block.splitlines()
        if line.startswith("outbox-dispatch ")
    ]
    assert commands == ["outbox-dispatch --app proj.tasks:dispatcher migrate"]
    bindir = Path(sys.executable).parent
    for _ in range(2):  # "safe to repeat"
        args = shlex.split(commands[0])
        done = subprocess.run(
            [str(bindir / args[0]), *args[1:]],
            env=env,
            cwd=QUICKSTART,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
    with psycopg.connect(own_database, autocommit=True) as conn:
        conn.execute("CREATE TABLE orders (id int PRIMARY KEY, state text)")
        conn.execute("INSERT INTO orders VALUES (1, 'new')")

    monkeypatch.setenv("DATABASE_URL", own_database)
    monkeypatch.syspath_prepend(str(QUICKSTART))
    for name in [m for m in sys.modules if m == "proj" or m.startswith("proj.")]:
        monkeypatch.delitem(sys.modules, name)
    from proj.tasks import dispatcher, place_order  # type: ignore[import-not-found]

    request.addfinalizer(dispatcher.close)
    place_order(1)
    place_order(1)  # placed twice: the receipt's dedupe key holds
    report = dispatcher.drain(timeout=20)
    out = capsys.readouterr().out
    assert out.count("stock reserved for order 1 (attempt 1)") == 2
    assert out.count("receipt for order 1 (idempotency key receipt:1)") == 1
    assert report.delivered == 3
    with psycopg.connect(own_database) as conn:
        kept = conn.execute("SELECT count(*) FROM outbox.outbox WHERE done_at IS NOT NULL")
        assert kept.fetchone() == (1,)  # the receipt's row, kept 7 days
