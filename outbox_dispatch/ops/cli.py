"""``outbox-dispatch``: migrate, status, parked rows, demo, bench, worker and beat shortcuts.

Human tables by default, ``--json`` for scripts. Errors print one line that says what to do,
and exit 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from outbox_dispatch import operations
from outbox_dispatch.core.errors import ConfigurationError, OutboxError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.tables import pruning_progress, table
from outbox_dispatch.ops.appload import load_dispatcher
from outbox_dispatch.store.migrations import migrate

CONNECT_TIMEOUT = 5  # seconds the CLI waits for the database before saying why it cannot
DB_ENV = "OUTBOX_DATABASE_URL"
SCHEMA_ENV = "OUTBOX_SCHEMA"


def _json_default(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return str(value)


def _rows_text(n: int) -> str:
    return f"{n} row" if n == 1 else f"{n} rows"


def _reachable(name: str, url: str) -> None:
    """Fail in seconds with the server's own words when a database cannot be reached,
    before a pool waits its full timeout and warns page after page."""
    import psycopg

    try:
        psycopg.connect(url, connect_timeout=CONNECT_TIMEOUT).close()
    except psycopg.Error as exc:
        reason = mask_dsn(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc))
        shown = "" if name == "default" else f" {name!r}"
        raise OutboxError(
            f"cannot reach the outbox database{shown} {mask_dsn(url)}: {reason}"
        ) from exc


def _dispatcher(args: argparse.Namespace, *, check: bool = True) -> Any:
    """The app's Dispatcher, with the databases the command works on reachable: the one named
    by ``--database``, else every one."""
    dispatcher, _ = load_dispatcher(args.app)
    chosen = dispatcher.chosen_databases(getattr(args, "database", None))
    for db in chosen if check else ():
        _reachable(db.name, db.url)
    return dispatcher


def _port(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535, got {value}")
    return value


def _positive(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _emit(args: argparse.Namespace, data: Any, rendered: str) -> None:
    if args.json:
        print(json.dumps(data, default=_json_default, indent=2))
    else:
        print(rendered)


def _database(args: argparse.Namespace) -> tuple[list[str], str]:
    """The database URLs (every database of the app, or the one named by ``--database``) and
    the schema: from the app, else from options or the environment."""
    if args.app or os.environ.get("OUTBOX_DISPATCH_APP"):
        dispatcher, _ = load_dispatcher(args.app)
        urls = [db.url for db in dispatcher.chosen_databases(args.database)]
        return urls, dispatcher.schema
    url = args.database_url or os.environ.get(DB_ENV, "")
    schema = args.schema or os.environ.get(SCHEMA_ENV, "outbox")
    if not url:
        raise OutboxError(f"{args.command} needs --app, or --database-url / {DB_ENV}")
    if args.database:
        raise OutboxError(
            f"{args.command}: --database names one of the app's databases: pass --app "
            "(for a URL, use --database-url)"
        )
    return [url], schema


def cmd_roles(args: argparse.Namespace) -> int:
    """Print (or apply, as an administrator) the least-privilege layout: a migrate role that
    owns the schema, a runtime role that reads and writes rows and can change nothing."""
    from outbox_dispatch.store.roles import apply_roles, role_sql

    urls, schema = _database(args)
    roles = {"migrate_role": args.migrate_role, "runtime_role": args.runtime_role}
    if args.apply:
        statements = [s for url in urls for s in apply_roles(url, schema, **roles)]
    else:
        statements = role_sql(schema, **roles)
    data = {"schema": schema, "statements": statements, "applied": args.apply}
    _emit(args, data, ";\n".join(statements) + ";")
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    urls, schema = _database(args)
    lines, applied_all = [], []
    for url in urls:
        applied = migrate(url, schema)
        applied_all.append({"database": mask_dsn(url), "applied": applied})
        text = (
            f"schema {schema}: applied migrations {applied}"
            if applied
            else f"schema {schema}: already up to date"
        )
        lines.append(f"{text} ({mask_dsn(url)})")
    first = applied_all[0]["applied"]
    data: dict[str, Any] = {"schema": schema, "applied": first}
    if len(urls) > 1:
        data["databases"] = applied_all
    _emit(args, data, "\n".join(lines))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args, check=False)
    statuses, down = [], []
    for db in dispatcher.chosen_databases(args.database):  # one database down hides only itself
        try:
            _reachable(db.name, db.url)
            statuses += dispatcher.status(db.name)
        except OutboxError as exc:
            if not dispatcher.several:
                raise
            down.append(str(exc))
    queued = dispatcher.queue_lengths()
    found = [{**dataclasses.asdict(s), "queued": queued.get(s.family)} for s in statuses]
    columns = ["database"] if dispatcher.several else []
    columns += ["family", "due", "scheduled", "in_flight", "queued", "parked", "cancelled", "done"]
    columns += ["maybe_applied", "waiting", "blocked", "actors_at_cap"]
    shown = [
        {
            **r,
            "queued": "-" if r["queued"] is None else r["queued"],
            "oldest_due_age": f"{r['oldest_due_age']:.1f}s",
        }
        for r in found
    ]
    _emit(args, found, table(shown, [*columns, "oldest_due_age"]))
    for problem in down:
        print(problem, file=sys.stderr)
    return 1 if down else 0


def cmd_parked(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    if args.parked_cmd == "list":
        rows = dispatcher.parked_list(family=args.family, limit=args.limit, database=args.database)
        columns = ["database"] if dispatcher.several else []
        columns += ["id", "family", "command", "actor", "attempts", "maybe_applied", "parked_at"]
        text = table(rows, [*columns, "last_error"]) if rows else "no parked rows"
        unknown = args.family is not None and args.family not in dispatcher.families
        if unknown and not rows:
            known = ", ".join(sorted(dispatcher.families))
            text = f"no parked rows: the app declares no family {args.family!r} (it has {known})"
        _emit(args, rows, text)
        return 1 if unknown and not rows else 0
    ids = args.ids or None
    if not ids and not args.all:
        raise OutboxError(f"parked {args.parked_cmd}: name row ids, or pass --all")
    if args.parked_cmd == "retry":
        done = operations.retry_parked(dispatcher, ids, args.family, args.database)
        verb = "due again (attempts reset)"
    else:
        done = operations.purge_parked(dispatcher, ids, args.family, args.database)
        verb = "deleted"
    missing = sorted(set(ids or []) - set(done.ids))
    text = "; ".join([f"{_rows_text(len(done.ids))} {verb}", *done.reasons])
    _emit(args, {"ids": done.ids, "missing": missing, "reasons": done.reasons}, text)
    return 1 if done.missed else 0


def cmd_cancel(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    if not args.ids and not args.dedupe_key and not args.actor:
        raise OutboxError("cancel: name row ids, --dedupe-key, or --actor (with --command)")
    done = operations.cancel(
        dispatcher,
        args.ids or None,
        dedupe_key=args.dedupe_key,
        actor=args.actor,
        command=args.command_name,
        reason=args.reason,
        by=args.by or os.environ.get("USER") or "outbox-dispatch cli",
        database=args.database,
    )
    text = f"{_rows_text(len(done.ids))} cancelled"
    if done.requested:
        text += f"; {_rows_text(len(done.requested))} running asked to stop: {done.requested}"
    text = "; ".join([text, *done.reasons])
    data = {"cancelled": done.ids, "requested": done.requested, "reasons": done.reasons}
    _emit(args, data, text)
    return 1 if done.missed else 0


def cmd_prune(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    with pruning_progress(quiet=args.json) as progress:
        total = dispatcher.prune(
            batch=args.batch, max_batches=1_000_000, progress=progress, database=args.database
        )
    _emit(args, total, f"pruned {_rows_text(sum(total.values()))} {total or ''}".strip())
    return 0


def cmd_celery(args: argparse.Namespace) -> int:
    """Run Celery's own worker or beat on the app's module: nothing new to learn."""
    if getattr(args, "metrics_port", None):
        from outbox_dispatch.observe.metrics import PORT_ENV, prepare_multiprocess_dir

        # before anything imports prometheus_client, and inherited by the pool's children
        os.environ[PORT_ENV] = str(args.metrics_port)
        prepare_multiprocess_dir(args.metrics_dir)
    _, module = load_dispatcher(args.app)
    # this interpreter's celery, so it works from a venv that is not activated
    argv = [sys.executable, "-m", "celery", "-A", module, args.command, *args.rest]
    os.execv(sys.executable, argv)  # noqa: S606 (argv is a list; no shell)
    return 0  # pragma: no cover


def cmd_metrics(args: argparse.Namespace) -> int:
    """Serve the outbox gauges (and, sharing a worker's PROMETHEUS_MULTIPROC_DIR, its counters)
    until interrupted."""
    import time

    from outbox_dispatch.observe.metrics import serve

    dispatcher = _dispatcher(args)
    try:
        server = serve(dispatcher, args.port, args.addr)
    except OSError as exc:
        raise _cannot_listen(args, exc) from exc
    print(f"serving http://{args.addr}:{args.port}/metrics (Ctrl-C stops)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        server.shutdown()
        server.server_close()
    return 0


def cmd_web(args: argparse.Namespace) -> int:
    """Serve the operator page until interrupted; never without credentials."""
    from outbox_dispatch.ops.web import WebApp, parse_credentials, serve

    user, password = parse_credentials(args.auth or os.environ.get("OUTBOX_WEB_AUTH"))
    dispatcher = _dispatcher(args)

    def ready() -> None:  # said once it listens, not before a bind that fails
        print(f"serving http://{args.addr}:{args.port}/ as {user!r} (Ctrl-C stops)", flush=True)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            serve(WebApp(dispatcher, user=user, password=password), args.addr, args.port, ready)
    except OSError as exc:
        raise _cannot_listen(args, exc) from exc
    return 0


def _cannot_listen(args: argparse.Namespace, exc: OSError) -> ConfigurationError:
    return ConfigurationError(
        f"cannot listen on {args.addr}:{args.port} ({exc.strerror or exc}): choose another "
        "--port, or an --addr this machine has"
    )


def cmd_demo(args: argparse.Namespace) -> int:
    from outbox_dispatch.demo.run import run_demo

    return run_demo(
        rows=args.rows,
        workers=args.workers,
        timeout=args.timeout,
        external=args.external,
        events=args.events,
    )


def cmd_bench(args: argparse.Namespace) -> int:
    """The benchmark suite is not part of the installed library: it lives in the repository's
    bench/ folder. Run from a checkout, this runs it there (without the peers and the plot,
    which scripts/bench installs into a venv of its own)."""
    import subprocess
    from pathlib import Path

    if not Path("bench", "run.py").is_file():
        raise OutboxError(
            "the benchmark suite lives in the repository's bench/ folder, not in the installed "
            "package: run this from a checkout, or run scripts/bench there"
        )
    extra = ["--json"] if args.json else []
    return subprocess.call([sys.executable, "-m", "bench.run", *args.bench_args, *extra])


def _common(parser: argparse.ArgumentParser, *, after: bool) -> None:
    """--app, --json and --log-level, before the subcommand or after it (``status --json``).
    After it they default to SUPPRESS, so a value given before is not overwritten."""

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if after else value

    parser.add_argument(
        "--app",
        "-A",
        default=default(None),
        help="module:attribute of your Dispatcher (or env OUTBOX_DISPATCH_APP)",
    )
    parser.add_argument(
        "--json", action="store_true", default=default(False), help="machine-readable output"
    )
    parser.add_argument("--log-level", default=default("WARNING"))
    parser.add_argument(
        "--database",
        default=default(None),
        help="with several databases: only this one (row ids need it)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="outbox-dispatch", description=__doc__)
    _common(parser, after=False)
    common = argparse.ArgumentParser(add_help=False)  # the same options after a subcommand
    _common(common, after=True)
    ours = [common]
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "migrate", parents=ours, help="create or upgrade the outbox schema (safe to repeat)"
    )
    p.add_argument("--database-url", help=f"without --app (or env {DB_ENV})")
    p.add_argument("--schema", help=f"without --app (or env {SCHEMA_ENV}; default outbox)")
    p.set_defaults(fn=cmd_migrate)

    p = sub.add_parser(
        "roles",
        parents=ours,
        help="least-privilege roles: print the SQL, or --apply it as an administrator",
    )
    p.add_argument("--migrate-role", required=True, help="owns the schema, runs migrate")
    p.add_argument("--runtime-role", required=True, help="producers, workers and beat")
    p.add_argument("--apply", action="store_true", help="run it (both roles must exist)")
    p.add_argument("--database-url", help=f"without --app (or env {DB_ENV})")
    p.add_argument("--schema", help=f"without --app (or env {SCHEMA_ENV}; default outbox)")
    p.set_defaults(fn=cmd_roles)

    p = sub.add_parser(
        "status", parents=ours, help="per family: due, scheduled, in flight, parked, oldest due"
    )
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser("parked", parents=ours, help="dead-lettered rows: list, retry, purge")
    psub = p.add_subparsers(dest="parked_cmd", required=True)
    for name, helptext in (
        ("list", "show parked rows with their last error"),
        ("retry", "make parked rows due again, attempts reset"),
        ("purge", "delete parked rows"),
    ):
        q = psub.add_parser(name, parents=ours, help=helptext)
        q.add_argument("--family")
        if name == "list":
            q.add_argument("--limit", type=_positive, default=100)
        else:
            q.add_argument("ids", nargs="*", type=int, help="row ids")
            q.add_argument("--all", action="store_true", help="every parked row (of --family)")
    p.set_defaults(fn=cmd_parked)

    p = sub.add_parser(
        "cancel", parents=ours, help="cancel rows: pending ones at once, running ones asked"
    )
    p.add_argument("ids", nargs="*", type=int, help="row ids")
    p.add_argument("--dedupe-key")
    p.add_argument("--actor")
    p.add_argument("--command", dest="command_name", help="with --actor: only this command")
    p.add_argument("--reason")
    p.add_argument("--by", help="who cancels (default: $USER)")
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser(
        "prune", parents=ours, help="delete settled rows past their family's retention"
    )
    p.add_argument("--batch", type=_positive, help="rows per delete (default: the dispatcher's)")
    p.set_defaults(fn=cmd_prune)

    for name in ("worker", "beat"):
        p = sub.add_parser(name, help=f"celery {name} on the app's module; extra args pass on")
        if name == "worker":
            p.add_argument(
                "--metrics-port", type=int, help="serve Prometheus /metrics from the worker"
            )
            p.add_argument(
                "--metrics-dir",
                help="prometheus multiprocess directory (emptied at start; default: a temp dir)",
            )
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(fn=cmd_celery)

    p = sub.add_parser("metrics", parents=ours, help="serve Prometheus /metrics: per-family gauges")
    p.add_argument("--port", type=_port, default=9808)
    p.add_argument("--addr", default="0.0.0.0")  # noqa: S104 (a metrics endpoint listens)
    p.set_defaults(fn=cmd_metrics)

    p = sub.add_parser(
        "web", parents=ours, help="the operator page: status, parked rows, a row's history"
    )
    p.add_argument("--port", type=_port, default=8080)
    p.add_argument("--addr", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--auth", help="user:password (default: $OUTBOX_WEB_AUTH); required")
    p.set_defaults(fn=cmd_web)

    p = sub.add_parser(
        "demo", parents=ours, help="the demo: a real workload through worker and beat"
    )
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--workers", type=int, default=2, help="worker pool processes")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument(
        "--external", action="store_true", help="use a running worker and beat (compose stack)"
    )
    p.add_argument("--events", action="store_true", help="the worker sends task events (Flower)")
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser(
        "bench",
        help="throughput, latency, RSS and backpressure against plain Celery and peers",
        add_help=False,
        prefix_chars="+",  # every option, --help included, goes to the bench runner
    )
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(fn=cmd_bench)
    return parser


_WORKER_OPTIONS = ("--metrics-port", "--metrics-dir")


def _metrics_options_first(argv: Sequence[str] | None) -> list[str]:
    """``worker``'s own options may come anywhere among Celery's: move them right after
    ``worker``, where argparse looks for them before passing the rest on."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "worker" not in args:
        return args
    at = args.index("worker") + 1
    ours: list[str] = []
    others: list[str] = []
    i = at
    while i < len(args):
        if args[i].split("=", 1)[0] in _WORKER_OPTIONS:
            width = 1 if "=" in args[i] else 2
            ours += args[i : i + width]
            i += width
        else:
            others.append(args[i])
            i += 1
    return args[:at] + ours + others


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_metrics_options_first(argv))
    if extra:
        if args.fn is not cmd_celery:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.rest = [*extra, *args.rest]  # celery's own options, passed on in order
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s"
    )
    try:
        code = int(args.fn(args))
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader (``| head``) stopped reading: end quietly, as Unix tools do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OutboxError as exc:
        print(f"outbox-dispatch: error: {mask_dsn(str(exc))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
