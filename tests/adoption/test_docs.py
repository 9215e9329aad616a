"""Every fenced code block of README.md and docs/*.md is checked against the real thing, so the
docs cannot rot:

- a block marked ``<!-- file: PATH -->`` is that file of examples/ to the byte, and the file
  belongs to an example that a test runs (test_readme.py, test_example_shop.py,
  test_example_django.py);
- a shell block's commands are parsed by the real parsers (``outbox-dispatch`` by the CLI's,
  ``celery`` by Celery's, on the app the line names, imported), ``pip install`` names this
  project and its extras, ``psql -c`` runs its SQL, ``scripts/...`` exist;
- every other block is run here, in a process of its own, with what it needs around it (a
  Celery app, a database, a Django project): ``RUNS`` names the test that runs each one.

A block nobody checks fails ``test_every_block_is_checked``. The scaffolding lives here, not in
the blocks: a block stays what a reader needs."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import psycopg
import pytest

ROOT = Path(__file__).resolve().parents[2]  # not from the fixtures: the harnesses below run alone
QUICKSTART = ROOT / "examples" / "quickstart"
DJANGO_SHOP = ROOT / "examples" / "django_shop"
BINDIR = Path(sys.executable).parent

# each example folder, and the test that runs it: a marked block must be a file of one of them
EXAMPLES_RUN_BY = {
    "examples/quickstart/": "tests/adoption/test_readme.py",
    "examples/celery_shop/": "tests/adoption/test_example_shop.py",
    "examples/django_shop/": "tests/adoption/test_example_django.py",
    "examples/fastapi_shop/": "tests/adoption/test_example_fastapi.py",
}

SHELL = ("sh", "bash", "shell")

# (page, text only that block of the page holds): the test that runs it. Marked blocks and
# shell blocks not named here are checked by test_marked_block and test_shell_block.
RUNS: dict[tuple[str, str], str] = {
    ("README.md", "(attempt 1)"): "test_quickstart_runs_as_the_page_shows",
    ("docs/index.md", "(attempt 1)"): "test_quickstart_runs_as_the_page_shows",
    ("docs/index.md", "send_receipt.delay(order.id)"): "test_index_dual_write_block",
    ("docs/celery-tasks.md", "task_cls=OutboxTask"): "test_celery_tasks_block",
    ("docs/databases.md", "databases={"): "test_databases_block",
    ("docs/django.md", "OUTBOX_DISPATCHER ="): "test_django_quickstart_runs",
    ("docs/django.md", "manage.py outbox_migrate"): "test_django_quickstart_runs",
    ("docs/django.md", "@shared_task"): "test_django_existing_tasks_block",
    ("docs/django.md", "contrib.django.tasks.OutboxBackend"): "test_django_tasks_block",
    ("docs/sqlalchemy.md", "create_engine"): "test_sqlalchemy_block",
    ("docs/testing.md", "def test_receipt_is_sent"): "test_testing_block",
}


@dataclass(frozen=True)
class Block:
    page: str  # relative to the repository
    line: int  # of the block's first line in the page
    lang: str
    body: str
    file: str | None  # the example file a <!-- file: PATH --> marker names

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


FENCE = re.compile(
    r"^(?:<!-- file: (?P<file>\S+)[^\n]*-->\n)?"
    r"(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.S | re.M,
)


def pages() -> list[str]:
    return ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]


@cache
def blocks() -> tuple[Block, ...]:
    found = []
    for page in pages():
        text = (ROOT / page).read_text("utf-8")
        for m in FENCE.finditer(text):
            indent = m["indent"]
            body = "".join(
                line.removeprefix(indent) for line in m["body"].splitlines(keepends=True)
            )
            line = text.count("\n", 0, m.start("body")) + 1
            found.append(Block(page, line, m["lang"], body, m["file"]))
    return tuple(found)


def block(page: str, needle: str) -> Block:
    """The one block of ``page`` that holds ``needle``."""
    hits = [b for b in blocks() if b.page == page and needle in b.body]
    assert len(hits) == 1, f"{page}: {len(hits)} blocks hold {needle!r}, not one"
    return hits[0]


def _claimed(b: Block) -> list[str]:
    return [test for (page, needle), test in RUNS.items() if page == b.page and needle in b.body]


def _exec(b: Block, namespace: dict[str, Any], source: str | None = None, at: int = 0) -> None:
    """Run a block's Python (or ``source``, a part of it, ``at`` lines into it, filled in) so
    that a traceback names the page and its line."""
    code = "\n" * (b.line - 1 + at) + (b.body if source is None else source)
    exec(compile(code, str(ROOT / b.page), "exec"), namespace)  # noqa: S102 (the docs' own code)


def _fill(b: Block, source: str, fills: dict[str, str]) -> str:
    """``source`` (a block or part of one) with each placeholder of the reader's (``...``, a
    URL of theirs) replaced: a placeholder no longer there fails, so a fill cannot go stale."""
    for old, new in fills.items():
        assert source.count(old) == 1, f"{b.where}: {old!r} is no longer in the block"
        source = source.replace(old, new)
    return source


def _files(b: Block) -> dict[str, tuple[int, str]]:
    """A block that shows several files, each opened by a ``# path/to/file.py`` line: each
    file's first line in the block, and its text."""
    out: dict[str, tuple[int, str]] = {}
    current = None
    for i, line in enumerate(b.body.splitlines(keepends=True)):
        m = re.match(r"# ([\w/]+\.py)\b", line)
        if m:
            current = m[1]
            out[current] = (i, "")
        assert current is not None, f"{b.where}: a line before any `# file.py` line: {line!r}"
        out[current] = (out[current][0], out[current][1] + line)
    return out


def _python(
    harness: str,
    env: dict[str, str],
    *,
    cwd: Path = ROOT,
    path: Sequence[Path] = (),
    stdin: str | None = None,
) -> str:
    """Run one of the harness functions below in a Python process of its own."""
    done = subprocess.run(
        [sys.executable, "-c", f"from tests.adoption.test_docs import {harness}; {harness}()"],
        env={
            **os.environ,
            **env,
            "PYTHONPATH": os.pathsep.join([*map(str, path), str(ROOT)]),
            "PYTHONUNBUFFERED": "1",
        },
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, f"{harness}:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return done.stdout


def _shell(
    line: str, env: dict[str, str], cwd: Path, *, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """A command line of a block, run by bash as a reader's shell runs it (the venv first)."""
    return subprocess.run(
        ["bash", "-c", line],
        env={**os.environ, **env, "PATH": f"{BINDIR}{os.pathsep}{os.environ['PATH']}"},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
def own_database(database_url: str) -> Iterator[str]:
    """A database nobody else uses, for blocks whose Dispatcher keeps the default schema."""
    name = f"od_docs_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    params = psycopg.conninfo.conninfo_to_dict(database_url)
    yield psycopg.conninfo.make_conninfo("", **{**params, "dbname": name})
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def own_schema(database_url: str) -> Iterator[str]:
    """A schema nobody else uses (not migrated), dropped after the test."""
    name = f"od_docs_{uuid.uuid4().hex[:10]}"
    yield name
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


# -- every block is checked -----------------------------------------------------------------


def test_every_block_is_checked() -> None:
    for page in pages():  # every fence is found (none of ~~~ or four backticks, none unclosed)
        fences = re.findall(r"^[ \t]*(?:```|~~~)", (ROOT / page).read_text("utf-8"), re.M)
        found = [b for b in blocks() if b.page == page]
        assert len(fences) == 2 * len(found), f"{page}: {len(fences)} fences, {len(found)} blocks"
    unchecked = []
    for b in blocks():
        claimed = _claimed(b)
        assert len(claimed) <= 1, f"{b.where} is claimed by {claimed}: make the needles unique"
        if not (b.file or b.lang in SHELL or claimed):
            unchecked.append(f"{b.where} ({b.lang or 'text'}): {b.body.splitlines()[0]!r}")
    assert not unchecked, "blocks nobody runs (add each to RUNS, with a test):\n" + "\n".join(
        unchecked
    )
    for (page, needle), test in RUNS.items():
        block(page, needle)  # exactly one block holds it
        assert callable(globals().get(test)), f"RUNS names {test}, which is not a test here"


# -- marked blocks --------------------------------------------------------------------------


@pytest.mark.parametrize("b", [b for b in blocks() if b.file], ids=lambda b: f"{b.where}:{b.file}")
def test_marked_block_is_its_example_file(b: Block) -> None:
    assert b.file is not None
    assert (ROOT / b.file).read_text("utf-8") == b.body, f"{b.where} differs from {b.file}"
    runners = [t for folder, t in EXAMPLES_RUN_BY.items() if b.file.startswith(folder)]
    assert runners, f"{b.where}: {b.file} is in no example a test runs ({list(EXAMPLES_RUN_BY)})"
    folder = Path(b.file).parts[1]
    assert folder in (ROOT / runners[0]).read_text("utf-8"), f"{runners[0]} no longer runs it"


# -- shell blocks ---------------------------------------------------------------------------


def _commands(body: str) -> list[tuple[str, list[str]]]:
    """Each command of a shell block: its line (comment included) and its words."""
    out = []
    for line in body.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if words:
            out.append((line, words))
    return out


@cache
def _package_env_names() -> frozenset[str]:
    names: set[str] = set()
    for path in (ROOT / "outbox_dispatch").rglob("*.py"):
        names.update(re.findall(r"[\"']([A-Z][A-Z0-9_]{2,})[\"']", path.read_text("utf-8")))
    return frozenset(names)


def _pip_problems(spec: str) -> list[str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    project = tomllib.loads((ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    req = Requirement(spec)
    if canonicalize_name(req.name) != canonicalize_name(project["name"]):
        return [f"pip install {spec}: the distribution is {project['name']!r}"]
    unknown = sorted(req.extras - set(project["optional-dependencies"]))
    return [f"pip install {spec}: no extra {e!r} in pyproject.toml" for e in unknown]


def _psql_problems(argv: list[str], database_url: str) -> list[str]:
    """``psql URL -c SQL``: the SQL runs, in a schema of its own, rolled back."""
    if "-c" not in argv:
        return [f"{shlex.join(argv)}: no -c SQL to check"]
    sql = argv[argv.index("-c") + 1]
    schema = f"od_docs_psql_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(database_url) as conn:
        try:
            conn.execute(f'CREATE SCHEMA "{schema}"')
            conn.execute(f'SET LOCAL search_path TO "{schema}"')
            conn.execute(sql.encode())
        except psycopg.Error as exc:
            return [f"{shlex.join(argv)}: {exc}"]
        finally:
            conn.rollback()
    return []


class _Parsed(Exception):
    pass


def _argparse_of(main: Callable[[list[str]], object], args: list[str]) -> argparse.Namespace:
    """What a ``main`` that builds its parser inside parses from ``args``, without running it."""
    real = argparse.ArgumentParser.parse_args
    got: list[argparse.Namespace] = []

    def capture(self: argparse.ArgumentParser, *a: Any, **kw: Any) -> argparse.Namespace:
        got.append(real(self, *a, **kw))
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
        with contextlib.suppress(_Parsed):
            main(args)
    assert got, "main() parsed no arguments"
    return got[0]


def _argparse_problems(what: str, parse: Callable[[], object]) -> list[str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse()
    except SystemExit:
        return [f"{what}: {err.getvalue().strip()}"]
    return []


def _python_module_problems(module: str, args: list[str]) -> list[str]:
    what = f"python -m {module} {shlex.join(args)}"
    if module == "bench.ablation":
        from bench import ablation

        got: list[argparse.Namespace] = []
        problems = _argparse_problems(what, lambda: got.append(_argparse_of(ablation.main, args)))
        known = {"all", "two-nodes", *ablation.SWITCHES}
        for config in (c for ns in got for c in ns.configs.split(",") if c):
            if config not in known:
                problems.append(f"{what}: no configuration {config!r} (known: {sorted(known)})")
        return problems
    if module == "bench.run":
        from bench import run

        return _argparse_problems(what, lambda: run.parse_args(args))
    return [f"{what}: no check for module {module!r}: add one to tests/adoption/test_docs.py"]


def _script_problems(script: str, args: list[str]) -> list[str]:
    path = ROOT / script
    if not (path.is_file() and os.access(path, os.X_OK)):
        return [f"{script}: no such executable script"]
    if script == "scripts/bench":  # its arguments go to python -m bench.run
        return _python_module_problems("bench.run", args)
    return [f"{script} {shlex.join(args)}: no check for its arguments"] if args else []


def _line_problems(body: str, database_url: str, project: Path) -> list[tuple[str, list[str]]]:
    """Each command of a shell block with what is wrong with it; ``outbox-dispatch`` and
    ``celery`` lines are checked in one process whose working directory is ``project`` (where
    the app they name, ``proj.tasks``, imports from)."""
    out: list[tuple[str, list[str]]] = []
    in_project: list[tuple[int, list[str]]] = []
    for line, words in _commands(body):
        problems: list[str] = []
        while words and re.match(r"[A-Za-z_]\w*=", words[0]):
            name = words.pop(0).split("=", 1)[0]
            if name not in _package_env_names():
                problems.append(f"the package reads no environment variable {name}")
        for spec in re.findall(r"pip install\s+(\"[^\"]+\"|'[^']+'|\S+)", line):
            problems += _pip_problems(spec.strip("\"'"))
        cmd, args = words[0], words[1:]
        if cmd in ("outbox-dispatch", "celery"):
            in_project.append((len(out), words))
        elif cmd == "psql":
            problems += _psql_problems(words, database_url)
        elif cmd == "python" and args[:1] == ["-m"] and len(args) > 1:
            problems += _python_module_problems(args[1], args[2:])
        elif cmd.startswith("scripts/"):
            problems += _script_problems(cmd, args)
        elif cmd != "pip":  # pip: its requirement is checked above
            problems.append(f"no check for {cmd!r}: add one to tests/adoption/test_docs.py")
        out.append((line, problems))
    if in_project:
        found = _project_problems([words for _, words in in_project], project, {})
        for (i, _), problems in zip(in_project, found, strict=True):
            out[i][1].extend(problems)
    return out


def _project_problems(
    lines: list[list[str]], project: Path, env: dict[str, str]
) -> list[list[str]]:
    out = _python("_check_in_project", env, cwd=project, path=[project], stdin=json.dumps(lines))
    problems: list[list[str]] = json.loads(out.strip().splitlines()[-1])
    return problems


def _check_in_project() -> None:
    """(Run in the project's directory.) Each ``outbox-dispatch`` and ``celery`` command line
    of stdin's JSON list, parsed by its real parser, on the app it names, imported; prints
    each line's problems."""
    found: list[list[str]] = []
    for argv in json.loads(sys.stdin.read()):
        try:
            if argv[0] == "outbox-dispatch":
                found.append(_outbox_dispatch_problems(argv[1:]))
            else:
                found.append(_celery_problems(argv[1:]))
        except Exception as exc:
            found.append([f"{shlex.join(argv)}: {exc!r}"])
    print(json.dumps(found))


def _outbox_dispatch_problems(args: list[str]) -> list[str]:
    """As the CLI's main() parses: its parser, and only worker and beat pass options on (to
    Celery, checked too); the --app loads, and a --family it names exists."""
    from outbox_dispatch import Dispatcher
    from outbox_dispatch.ops.cli import build_parser

    what = f"outbox-dispatch {shlex.join(args)}"
    got: list[tuple[argparse.Namespace, list[str]]] = []
    problems = _argparse_problems(what, lambda: got.append(build_parser().parse_known_args(args)))
    if problems:
        return problems
    ns, extra = got[0]
    if extra and not hasattr(ns, "rest"):
        return [f"{what}: unrecognized arguments: {' '.join(extra)}"]
    if ns.app is None:
        return [f"{what}: no --app to check the line against"]
    module_name, _, attr = ns.app.partition(":")
    module = importlib.import_module(module_name)
    if attr:
        found = getattr(module, attr)
    else:
        held = [v for v in vars(module).values() if isinstance(v, Dispatcher)]
        if len(held) != 1:
            return [f"{what}: {module_name} holds {len(held)} Dispatchers: name one"]
        found = held[0]
    dispatcher = getattr(found, "outbox_dispatcher", found)
    if not isinstance(dispatcher, Dispatcher):
        return [f"{what}: {ns.app} is a {type(found).__name__}, not a Dispatcher"]
    family = getattr(ns, "family", None)
    if family is not None and family not in dispatcher.families:
        problems.append(f"{what}: {ns.app} has no family {family!r} ({list(dispatcher.families)})")
    if hasattr(ns, "rest"):  # `outbox-dispatch worker ...` runs `celery -A module worker ...`
        problems += _celery_problems(["-A", module_name, ns.command, *extra, *ns.rest])
    return problems


def _celery_problems(args: list[str]) -> list[str]:
    """``celery ARGS`` parsed by Celery's own command line, nothing run: the app it names
    imports and is a Celery app, the subcommand and its options exist."""
    import warnings

    import click
    from celery import Celery
    from celery.app.utils import find_app
    from celery.bin.base import CLIContext
    from celery.bin.celery import celery as celery_cli

    what = f"celery {shlex.join(args)}"
    try:
        ctx = celery_cli.make_context("celery", list(args))
        if not ctx.params.get("app"):
            return [f"{what}: no -A app"]
        app = find_app(ctx.params["app"])
        if not isinstance(app, Celery):
            return [f"{what}: {ctx.params['app']} is a {type(app).__name__}, not a Celery app"]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # click 8.2's protected_args
            rest = [*ctx.protected_args, *ctx.args]
        name, sub, sub_args = celery_cli.resolve_command(ctx, rest)
        ctx.obj = CLIContext(app=app, no_color=True, workdir=None, quiet=True)
        sub.make_context(name, list(sub_args), parent=ctx)
    except click.ClickException as exc:
        return [f"{what}: {exc.format_message()}"]
    return []


def _generic_shell_blocks() -> list[Block]:
    return [b for b in blocks() if b.lang in SHELL and not b.file and not _claimed(b)]


@pytest.mark.parametrize("b", _generic_shell_blocks(), ids=lambda b: b.where)
def test_shell_block(b: Block, database_url: str) -> None:
    wrong = [
        f"{line}\n  {p}"
        for line, ps in _line_problems(b.body, database_url, QUICKSTART)
        for p in ps
    ]
    assert not wrong, f"{b.where}:\n" + "\n".join(wrong)


WRONG_LINES = """\
pip install outbox-dispatcher
pip install "outbox-dispatch[flask]"
OUTBOX_NO_SUCH=1 outbox-dispatch --app proj.tasks:dispatcher status
outbox-dispatch --app proj.tasks:dispatcher parked list --familly email
outbox-dispatch --app proj.tasks:dispatcher parked list --family webhook
outbox-dispatch --app proj.nothing:dispatcher status
outbox-dispatch --app proj.tasks:dispatcher worker -P nosuchpool
celery -A proj.tasks wurker
celery -A proj.tasks worker --no-such-option
celery -A proj.elsewhere worker
psql "$DATABASE_URL" -c "INSERT INTO nowhere VALUES (1)"
python -m bench.ablation --configs all,fast
python -m bench.ablation --rounds three
scripts/nothing
scripts/bench --no-such-option
make docs
"""


def test_shell_checks_fail_on_wrong_lines(database_url: str) -> None:
    """The checks can fail: each of these lines is wrong in one way."""
    checked = _line_problems(WRONG_LINES, database_url, QUICKSTART)
    assert len(checked) == len(WRONG_LINES.splitlines())
    assert [line for line, problems in checked if not problems] == []


# -- the quickstart (README.md, docs/index.md) ----------------------------------------------


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_quickstart_runs_as_the_page_shows(page: str, own_database: str, redis_url: str) -> None:
    """The page's quickstart as a reader follows it, on a database of its own: its file (a
    marked copy of examples/quickstart), its psql and migrate lines run as written, then
    ``place_order(N)`` as its prose says, printing what its output block shows."""
    text = (ROOT / page).read_text("utf-8")
    marked = block(page, "def place_order(")
    assert marked.file == "examples/quickstart/proj/tasks.py", f"{marked.where} is not marked"
    commands = block(page, "outbox-dispatch --app proj.tasks:dispatcher migrate")
    env = {"DATABASE_URL": own_database, "REDIS_URL": redis_url}
    ran = []
    for line, words in _commands(commands.body):
        if words[0] in ("psql", "outbox-dispatch"):  # celery's lines: test_shell_block
            done = _shell(line, env, QUICKSTART)
            assert done.returncode == 0, f"{commands.where}: {line}\n{done.stderr}"
            ran.append(words[0])
    assert ran == ["psql", "outbox-dispatch"], f"{commands.where}: {ran}"
    call = re.search(r"call `place_order\((\d+)\)`", text)
    assert call, f"{page}: no `place_order(N)` call in the prose"
    shown = block(page, "(attempt 1)")
    out = _python("_place_order", {**env, "DOCS_ORDER": call[1]}, cwd=QUICKSTART, path=[QUICKSTART])
    printed = [line for line in out.splitlines() if line and not line.startswith("drained:")]
    assert sorted(printed) == sorted(shown.body.splitlines()), f"{shown.where}: {out}"
    assert "drained: 2" in out


def _place_order() -> None:
    from proj.tasks import dispatcher, place_order  # type: ignore[import-not-found]

    place_order(int(os.environ["DOCS_ORDER"]))
    report = dispatcher.drain(timeout=30)
    dispatcher.close()
    print(f"drained: {report.delivered}")


# -- Python blocks --------------------------------------------------------------------------


def test_index_dual_write_block() -> None:
    """The problem the overview shows: the order commits, and only then is the task called."""
    out = _python("_dual_write", {})
    assert json.loads(out.strip().splitlines()[-1]) == [["save", True], ["send_receipt", False]]


def _dual_write() -> None:
    import django
    from celery import Celery
    from django.conf import settings

    settings.configure(
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}}
    )
    django.setup()
    from django.db import connection, transaction

    seen: list[tuple[str, bool]] = []
    app = Celery("docs", broker="memory://", set_as_current=False)
    app.conf.task_always_eager = True  # run at the call: did the call come inside the atomic?

    @app.task  # type: ignore[untyped-decorator]
    def send_receipt(order_id: int) -> None:
        seen.append(("send_receipt", connection.in_atomic_block))

    class Order:
        id = 42

        def save(self) -> None:
            seen.append(("save", connection.in_atomic_block))

    b = block("docs/index.md", "send_receipt.delay(order.id)")
    _exec(b, {"transaction": transaction, "order": Order(), "send_receipt": send_receipt})
    print(json.dumps(seen))


def test_celery_tasks_block(own_database: str) -> None:
    """The one line that moves an app's tasks: a task's ``.delay()`` in a transaction writes
    a row that commits (or rolls back) with it and is delivered."""
    out = _python("_celery_tasks", {"DOCS_DATABASE_URL": own_database})
    assert json.loads(out.strip().splitlines()[-1]) == {"delivered": 1, "shipped": [7]}


def _celery_tasks() -> None:
    from outbox_dispatch import EnqueuedTask, using

    url = os.environ["DOCS_DATABASE_URL"]
    ns: dict[str, Any] = {"BROKER_URL": "memory://", "DATABASE_URL": url}  # the reader's
    _exec(block("docs/celery-tasks.md", "task_cls=OutboxTask"), ns)
    app, dispatcher = ns["app"], ns["dispatcher"]
    shipped: list[int] = []

    @app.task  # type: ignore[untyped-decorator]
    def ship(order_id: int) -> None:
        shipped.append(order_id)

    dispatcher.migrate()
    with psycopg.connect(url) as conn:
        with conn.transaction(), using(conn):
            call = ship.delay(7)
        with conn.transaction(force_rollback=True), using(conn):
            ship.delay(8)  # rolled back: never runs
    assert isinstance(call, EnqueuedTask) and call.row_id
    report = dispatcher.drain(timeout=30)
    dispatcher.close()
    print(json.dumps({"delivered": report.delivered, "shipped": shipped}))


def test_databases_block() -> None:
    """One Dispatcher over two databases, as written (building it connects to neither)."""
    out = _python("_databases", {})
    assert json.loads(out.strip().splitlines()[-1]) == ["eu", "us"]


def _databases() -> None:
    from celery import Celery

    from outbox_dispatch import Dispatcher

    ns: dict[str, Any] = {
        "app": Celery("docs", broker="memory://", set_as_current=False),
        "Dispatcher": Dispatcher,
    }
    _exec(block("docs/databases.md", "databases={"), ns)
    print(json.dumps(sorted(ns["dispatcher"].databases)))


def test_sqlalchemy_block(database_url: str, own_schema: str) -> None:
    """A Session and a Core Connection each enqueue in their transaction; both rows and the
    session's order commit, and both rows are delivered."""
    env = {"DOCS_DATABASE_URL": database_url, "DOCS_SCHEMA": own_schema}
    out = _python("_sqlalchemy", env)
    assert json.loads(out.strip().splitlines()[-1]) == {
        "delivered": 2,
        "payloads": [{"order": 7}, {"order": 7}],
        "orders": [7],
    }


def _sqlalchemy() -> None:
    from celery import Celery
    from sqlalchemy import Integer
    from sqlalchemy.orm import DeclarativeBase, mapped_column

    from outbox_dispatch import Context, Dispatcher

    url, schema = os.environ["DOCS_DATABASE_URL"], os.environ["DOCS_SCHEMA"]

    class Base(DeclarativeBase):
        pass

    class Order(Base):
        __tablename__ = "orders"
        __table_args__ = {"schema": schema}
        id = mapped_column(Integer, primary_key=True)  # no annotation: this module's are strings

    dispatcher = Dispatcher(
        Celery("docs", broker="memory://", set_as_current=False),
        database_url=url,
        schema=schema,
        listen=False,
    )
    payloads: list[Any] = []

    @dispatcher.handler("email.send")
    def send(ctx: Context, payload: Any) -> None:
        payloads.append(payload)

    dispatcher.migrate()
    with psycopg.connect(url) as conn:
        conn.execute(f'CREATE TABLE "{schema}".orders (id int PRIMARY KEY)')
    b = block("docs/sqlalchemy.md", "create_engine")
    ours = "postgresql+psycopg://" + url.split("://", 1)[1]  # the reader's database: ours
    ns: dict[str, Any] = {"order": Order(id=7), "order_id": 7, "dispatcher": dispatcher}
    _exec(b, ns, _fill(b, b.body, {"postgresql+psycopg://app@127.0.0.1:5432/shop": ours}))
    ns["engine"].dispose()
    report = dispatcher.drain(timeout=30)
    dispatcher.close()
    with psycopg.connect(url) as conn:
        orders = [r[0] for r in conn.execute(f'SELECT id FROM "{schema}".orders')]
    print(json.dumps({"delivered": report.delivered, "payloads": payloads, "orders": orders}))


# -- Django ---------------------------------------------------------------------------------

DJANGO_SETTINGS = """\
# the test's: the database, Celery's key prefix
import os
from psycopg.conninfo import conninfo_to_dict

_db = conninfo_to_dict(os.environ["DOCS_DATABASE_URL"])
SECRET_KEY = "docs-only"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db["dbname"],
        "USER": _db.get("user", ""),
        "PASSWORD": _db.get("password", ""),
        "HOST": _db.get("host", ""),
        "PORT": _db.get("port", ""),
    }
}
CELERY_BROKER_TRANSPORT_OPTIONS = {"global_keyprefix": os.environ["DOCS_KEY_PREFIX"]}
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

"""

DJANGO_SETTINGS_AFTER = """
# the test's: the block's `...` stands for the project's own apps
INSTALLED_APPS = [
    app
    for entry in INSTALLED_APPS
    for app in (
        ["django.contrib.contenttypes", "django.contrib.auth", "shop"]
        if entry is Ellipsis
        else [entry]
    )
]
"""

DJANGO_PROJECT = {
    "manage.py": """\
import os
import sys

from django.core.management import execute_from_command_line

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
execute_from_command_line(sys.argv)
""",
    "shop/__init__.py": "",
    "shop/models.py": """\
from django.conf import settings
from django.db import models


class Order(models.Model):
    customer = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE)
    total_cents = models.IntegerField()

    def get_absolute_url(self):
        return f"/orders/{self.pk}/"
""",
    "shop/mail.py": """\
class Mailer:
    def __init__(self):
        self.sent = []

    def send(self, to, idempotency_key):
        self.sent.append([to, idempotency_key])


mailer = Mailer()
""",
}

DJANGO_PLACE = """
import json
from django.contrib.auth.models import User
from django.test import RequestFactory
from shop.mail import mailer
from shop.outbox import dispatcher
from shop.views import place_order

request = RequestFactory().post("/orders/")
request.user = User.objects.create(username="ada", email="ada@example.com")
response = place_order(request)
report = dispatcher.drain(timeout=30)
dispatcher.close()
print(json.dumps([response.status_code, response["Location"], report.delivered, mailer.sent]))
"""


def test_django_quickstart_runs(own_database: str, tmp_path: Path, run_id: str) -> None:
    """django.md's quickstart as a project (its three files as the block writes them, plus
    the models and mail client it imports), its shell lines run (manage.py) or parsed
    (celery), then an order placed through its view and the receipt delivered."""
    code = block("docs/django.md", "OUTBOX_DISPATCHER =")
    files = _files(code)
    assert set(files) == {"shop/settings.py", "shop/outbox.py", "shop/views.py"}, code.where
    project = tmp_path / "project"
    written = {
        **DJANGO_PROJECT,
        **{name: text for name, (_, text) in files.items()},
        "shop/settings.py": DJANGO_SETTINGS + files["shop/settings.py"][1] + DJANGO_SETTINGS_AFTER,
    }
    for name, text in written.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    env = {
        "DOCS_DATABASE_URL": own_database,
        # nothing is published (drain() delivers), but a key prefix of its own all the same
        "DOCS_KEY_PREFIX": f"od_docs_{run_id}_{uuid.uuid4().hex[:6]}:",
        "PYTHONPATH": str(ROOT),
        "DJANGO_SETTINGS_MODULE": "shop.settings",
    }
    done = _shell("python manage.py makemigrations shop", env, project)  # the reader has them
    assert done.returncode == 0, done.stderr
    commands = block("docs/django.md", "manage.py outbox_migrate")
    celery_lines = []
    for line, words in _commands(commands.body):
        if words[:2] == ["python", "manage.py"]:
            done = _shell(line, env, project)
            assert done.returncode == 0, f"{commands.where}: {line}\n{done.stderr[-3000:]}"
        else:
            assert words[0] == "celery", f"{commands.where}: no check for {line!r}"
            celery_lines.append(words)
    done = _shell("python manage.py outbox_migrate --check", env, project)  # "--check for CI"
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(celery_lines) == 2
    assert _project_problems(celery_lines, project, env) == [[], []]
    done = _shell(f"python manage.py shell -c {shlex.quote(DJANGO_PLACE)}", env, project)
    assert done.returncode == 0, done.stderr[-3000:]
    status, location, delivered, sent = json.loads(done.stdout.strip().splitlines()[-1])
    order = location.strip("/").split("/")[-1]
    assert (status, delivered) == (302, 1), done.stdout
    assert sent == [["ada@example.com", f"receipt:{order}"]]


def test_django_existing_tasks_block(database_url: str, redis_url: str, own_schema: str) -> None:
    """The unchanged ``@shared_task``, called as the block calls it in ``transaction.atomic()``
    on examples/django_shop (its app has ``task_cls=OutboxTask``): the call is made inside the
    atomic block and its row is not visible elsewhere until the block commits; then it is
    delivered."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{own_schema}"')  # Django's tables go here too
    env = {
        "DJSHOP_DATABASE_URL": database_url,
        "DJSHOP_SCHEMA": own_schema,
        "DJSHOP_BROKER_URL": redis_url,
        "DJSHOP_KEY_PREFIX": f"{own_schema}:",  # nothing is published: drain() delivers
        "DJANGO_SETTINGS_MODULE": "djshop.settings",
    }
    out = _python("_django_existing_tasks", env, cwd=DJANGO_SHOP, path=[DJANGO_SHOP])
    assert json.loads(out.strip().splitlines()[-1]) == {
        "at_the_call": {"in_atomic_block": True, "rows_seen_elsewhere": 0},
        "committed": ["docs_django.send_receipt"],
        "delivered": 1,
    }


def _django_existing_tasks() -> None:
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)
    call_command("outbox_migrate", verbosity=0)
    from celery import shared_task
    from django.db import connection, transaction
    from djshop.celery import dispatcher  # type: ignore[import-not-found]
    from shop.models import Order  # type: ignore[import-not-found]

    b = block("docs/django.md", "@shared_task")
    files = _files(b)
    assert set(files) == {"shop/tasks.py", "shop/views.py"}, b.where
    at, tasks_py = files["shop/tasks.py"]
    tasks: dict[str, Any] = {"__name__": "docs_django", "shared_task": shared_task}
    _exec(b, tasks, tasks_py, at)
    task = tasks["send_receipt"]

    def rows(conn: Any) -> list[str]:
        return [r[0] for r in conn.execute(f'SELECT command FROM "{dispatcher.schema}".outbox')]

    at_the_call: dict[str, Any] = {}

    class Observed:  # the block's task, looked at as the block calls it
        @staticmethod
        def delay(*args: Any, **kwargs: Any) -> Any:
            called = task.delay(*args, **kwargs)
            with psycopg.connect(os.environ["DJSHOP_DATABASE_URL"]) as elsewhere:
                at_the_call["rows_seen_elsewhere"] = len(rows(elsewhere))
            at_the_call["in_atomic_block"] = connection.in_atomic_block
            return called

    at, views_py = files["shop/views.py"]
    views = _fill(b, views_py, {"(...)": '(customer="docs", cents=100)'})
    ns = {"transaction": transaction, "Order": Order, "send_receipt": Observed}
    _exec(b, ns, views, at)
    with psycopg.connect(os.environ["DJSHOP_DATABASE_URL"]) as conn:
        committed = rows(conn)
    report = dispatcher.drain(timeout=30)
    dispatcher.close()
    print(
        json.dumps(
            {"at_the_call": at_the_call, "committed": committed, "delivered": report.delivered}
        )
    )


def test_django_tasks_block(own_database: str, tmp_path: Path, run_id: str) -> None:
    """django.md's tasks framework section as a project: the quickstart's files with the
    block's lines added (settings, outbox), its tasks and views files, then an order placed
    through its view: the task call's row commits with the order (the task's path as its
    command, its queue as its family) and is delivered, the result's id its idempotency key."""
    from importlib.util import find_spec

    quickstart = _files(block("docs/django.md", "OUTBOX_DISPATCHER ="))
    b = block("docs/django.md", "contrib.django.tasks.OutboxBackend")
    files = _files(b)
    assert set(files) == {"shop/settings.py", "shop/outbox.py", "shop/tasks.py", "shop/views.py"}
    tasks_py = files["shop/tasks.py"][1]
    if find_spec("django.tasks") is None:  # before Django 6: the backport, its own name
        tasks_py = _fill(b, tasks_py, {"from django.tasks ": "from django_tasks "})
    project = tmp_path / "project"
    written = {
        **DJANGO_PROJECT,
        "shop/settings.py": DJANGO_SETTINGS
        + quickstart["shop/settings.py"][1]
        + files["shop/settings.py"][1]
        + DJANGO_SETTINGS_AFTER,
        "shop/outbox.py": quickstart["shop/outbox.py"][1] + files["shop/outbox.py"][1],
        "shop/tasks.py": tasks_py,
        "shop/views.py": files["shop/views.py"][1],
    }
    for name, text in written.items():
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text(text)
    env = {
        "DOCS_DATABASE_URL": own_database,
        "DOCS_KEY_PREFIX": f"od_docs_{run_id}_{uuid.uuid4().hex[:6]}:",
        "DJANGO_SETTINGS_MODULE": "shop.settings",
    }
    out = _python("_django_tasks_place", env, cwd=project, path=[project])
    got = json.loads(out.strip().splitlines()[-1])
    (row_id, order, *row), *more = got["rows"]
    assert more == [], got
    assert row == ["shop.tasks.send_receipt", "emails", {"args": [order], "kwargs": {}}], got
    assert (got["status"], got["delivered"]) == (302, 1), got
    assert got["sent"] == [["ada@example.com", f"outbox:{row_id}"]], got


def _django_tasks_place() -> None:
    """(Run in the project's directory.) Migrate, place an order through the view; print the
    committed rows, then what delivering them sent."""
    import django
    from django.core.management import call_command

    django.setup()
    call_command("makemigrations", "shop", verbosity=0)  # the reader has them
    call_command("migrate", verbosity=0)
    call_command("outbox_migrate", verbosity=0)
    from django.contrib.auth.models import User
    from django.test import RequestFactory
    from shop.mail import mailer  # type: ignore[import-not-found]
    from shop.outbox import dispatcher  # type: ignore[import-not-found]
    from shop.views import place_order  # type: ignore[import-not-found]

    request = RequestFactory().post("/orders/")
    request.user = User.objects.create(username="ada", email="ada@example.com")
    response = place_order(request)
    order = int(response["Location"].strip("/").split("/")[-1])  # the view's redirect
    with psycopg.connect(os.environ["DOCS_DATABASE_URL"]) as conn:
        rows = conn.execute(
            f'SELECT id, command, family, payload FROM "{dispatcher.schema}".outbox'
        ).fetchall()
    report = dispatcher.drain(timeout=30)
    dispatcher.close()
    print(
        json.dumps(
            {
                "status": response.status_code,
                "rows": [[row_id, order, *rest] for row_id, *rest in rows],
                "delivered": report.delivered,
                "sent": mailer.sent,
            }
        )
    )


# -- the pytest plugin (testing.md) ---------------------------------------------------------

USER_TASKS = """
from celery import Celery
from outbox_dispatch import Dispatcher

URL = {url!r}
app = Celery("proj", broker="memory://", set_as_current=False)
dispatcher = Dispatcher(app, database_url=URL, schema={schema!r})


@dispatcher.handler("email.receipt")
def send_receipt(ctx, payload):
    from proj.orders import mailer

    mailer.send(payload["order"], idempotency_key=ctx.idempotency_key)
"""

USER_ORDERS = """
import psycopg
from proj.tasks import URL, dispatcher


class Mailer:
    def __init__(self):
        self.sent = []

    def send(self, order, idempotency_key):
        self.sent.append(idempotency_key)


mailer = Mailer()


def place_order(order_id):
    with psycopg.connect(URL) as conn, conn.transaction():
        dispatcher.enqueue(
            conn, "email.receipt", {"order": order_id}, dedupe_key=f"receipt:{order_id}"
        )
"""


def test_testing_block(pytester: pytest.Pytester, database_url: str, own_schema: str) -> None:
    """testing.md's tests, as a user's suite with the plugin runs them."""
    from outbox_dispatch.store.migrations import migrate

    migrate(database_url, own_schema)
    b = block("docs/testing.md", "def test_receipt_is_sent")
    pytester.mkpydir("proj")
    (pytester.path / "proj" / "tasks.py").write_text(
        USER_TASKS.format(url=database_url, schema=own_schema)
    )
    (pytester.path / "proj" / "orders.py").write_text(USER_ORDERS)
    (pytester.path / "test_docs_block.py").write_text(b.body)
    result = pytester.runpytest_subprocess(
        "--outbox-app", "proj.tasks:dispatcher", "-p", "no:cacheprovider"
    )
    result.assert_outcomes(passed=2)
