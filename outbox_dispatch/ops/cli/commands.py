"""The ``outbox-dispatch`` subcommands, one ``cmd_*`` function each, and the helpers they share:
reaching the databases, and printing a table or, with ``--json``, the data."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from datetime import datetime
from typing import Any

from outbox_dispatch.core.errors import ConfigurationError, OutboxError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.core.rows import RowFilter
from outbox_dispatch.core.tables import pruning_progress, table
from outbox_dispatch.ops import actions
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
            statuses += dispatcher.ops.status(db.name)
        except OutboxError as exc:
            if not dispatcher.several:
                raise
            down.append(str(exc))
    queued = dispatcher.runtime.queue_lengths()
    found = [{**dataclasses.asdict(s), "queued": queued.get(s.family)} for s in statuses]
    columns = ["database"] if dispatcher.several else []
    columns += ["family", "due", "scheduled", "in_flight", "queued", "parked", "cancelled", "done"]
    columns += ["maybe_applied", "waiting", "blocked", "actors_at_cap", "paused"]
    shown = [
        {
            **r,
            "paused": "PAUSED" if r["paused"] else "",
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
    if args.parked_cmd == "show":
        row = dispatcher.ops.row(args.id, database=args.database)
        if row is None:
            _emit(args, None, f"no row {args.id}")
            return 1
        shown = {k: v for k, v in row.items() if k not in ("last_traceback", "payload")}
        text = "\n".join(f"{k}: {v}" for k, v in shown.items() if v is not None)
        text += f"\npayload: {json.dumps(row['payload'], default=str)}"
        if row.get("last_traceback"):
            text += f"\n\n{row['last_traceback']}"
        _emit(args, row, text)
        return 0
    if args.parked_cmd == "list":
        rows = dispatcher.ops.parked_list(
            family=args.family, limit=args.limit, database=args.database
        )
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
    where = RowFilter(args.family, args.command_name, args.actor, args.error, args.older_than)
    if not ids and (args.all or where != RowFilter(args.family) or args.dry_run):
        return _bulk(args, dispatcher, args.parked_cmd, where)
    if not ids and not args.all:
        raise OutboxError(
            f"parked {args.parked_cmd}: name row ids, a selection (--family, --command, "
            "--actor, --error, --older-than), or pass --all"
        )
    if args.parked_cmd == "retry":
        done = actions.retry_parked(
            dispatcher, ids, args.family, args.database, by=_by(args), reason=args.reason
        )
        verb = "due again (attempts reset)"
    else:
        done = actions.purge_parked(
            dispatcher, ids, args.family, args.database, by=_by(args), reason=args.reason
        )
        verb = "deleted"
    missing = sorted(set(ids or []) - set(done.ids))
    text = "; ".join([f"{_rows_text(len(done.ids))} {verb}", *done.reasons])
    _emit(args, {"ids": done.ids, "missing": missing, "reasons": done.reasons}, text)
    return 1 if done.missed else 0


def cmd_cancel(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    if not args.ids and not args.dedupe_key and (args.family or args.older_than or args.dry_run):
        where = RowFilter(args.family, args.command_name, args.actor, None, args.older_than)
        return _bulk(args, dispatcher, "cancel", where)
    if not args.ids and not args.dedupe_key and not args.actor:
        raise OutboxError("cancel: name row ids, --dedupe-key, or --actor (with --command)")
    done = actions.cancel(
        dispatcher,
        args.ids or None,
        dedupe_key=args.dedupe_key,
        actor=args.actor,
        command=args.command_name,
        reason=args.reason,
        by=_by(args),
        database=args.database,
    )
    text = f"{_rows_text(len(done.ids))} cancelled"
    if done.requested:
        text += f"; {_rows_text(len(done.requested))} running asked to stop: {done.requested}"
    text = "; ".join([text, *done.reasons])
    data = {"cancelled": done.ids, "requested": done.requested, "reasons": done.reasons}
    _emit(args, data, text)
    return 1 if done.missed else 0


def cmd_pause(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    if args.cmd == "pause":
        dispatcher.ops.pause(args.family, reason=args.reason, by=_by(args), database=args.database)
        text = f"family {args.family!r} paused: its due rows wait until `resume {args.family}`"
        _emit(args, {"paused": args.family}, text)
        return 0
    resumed = dispatcher.ops.resume(args.family, by=_by(args), database=args.database)
    text = f"family {args.family!r} " + ("resumed" if resumed else "was not paused")
    _emit(args, {"resumed": args.family if resumed else None}, text)
    return 0 if resumed else 1


def cmd_audit(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    rows = dispatcher.ops.audit_log(limit=args.limit, database=args.database)
    shown = [
        {**r, "at": r["at"].isoformat(timespec="seconds"), "selection": json.dumps(r["selection"])}
        for r in rows
    ]
    columns = ["database"] if dispatcher.several else []
    columns += ["at", "by", "action", "rows", "selection", "reason"]
    _emit(args, rows, table(shown, columns) if rows else "no operator actions recorded")
    return 0


def cmd_prune(args: argparse.Namespace) -> int:
    dispatcher = _dispatcher(args)
    with pruning_progress(quiet=args.json) as progress:
        total = dispatcher.ops.prune(
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

    from outbox_dispatch.observe.metrics import ADDR_ENV, serve

    dispatcher = _dispatcher(args)
    args.addr = args.addr or os.environ.get(ADDR_ENV) or "127.0.0.1"
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
    viewer_text = args.viewer_auth or os.environ.get("OUTBOX_WEB_VIEWER_AUTH")
    viewer = parse_credentials(viewer_text) if viewer_text else None
    dispatcher = _dispatcher(args)

    def ready() -> None:  # said once it listens, not before a bind that fails
        print(f"serving http://{args.addr}:{args.port}/ as {user!r} (Ctrl-C stops)", flush=True)

    try:
        with contextlib.suppress(KeyboardInterrupt):
            app = WebApp(dispatcher, user=user, password=password, viewer=viewer)
            serve(app, args.addr, args.port, ready)
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
        force=args.force,
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


def _by(args: argparse.Namespace) -> str:
    """Who acts, for the audit log: ``--by``, else the OS user, marked as the CLI."""
    return getattr(args, "by", None) or f"{os.environ.get('USER') or 'unknown'} (cli)"


def _bulk(args: argparse.Namespace, dispatcher: Any, action: str, where: RowFilter) -> int:
    """A retry, purge or cancel of every row a selection matches, in batches, with progress;
    ``--dry-run`` counts and shows a sample."""
    verb = {"retry": "due again", "purge": "deleted", "cancel": "cancelled"}[action]
    kw: dict[str, Any] = {"by": _by(args), "reason": args.reason, "database": args.database}
    if args.dry_run:
        found = actions.bulk(dispatcher, action, where, dry_run=True, **kw)
        if not found.count:
            _emit(args, {"count": 0, "sample": []}, "no row matches this selection")
            return 1
        sample = table(found.sample, ["id", "family", "command", "actor", "last_error"])
        text = f"{_rows_text(found.count)} would be {verb} ({action}); a sample:\n{sample}"
        _emit(args, {"count": found.count, "sample": found.sample}, text)
        return 0

    def progress(done: int, count: int) -> None:
        if not args.json:
            print(f"{action}: {done}/{count}", file=sys.stderr)

    found = actions.bulk(dispatcher, action, where, progress=progress, **kw)
    if not found.count:
        _emit(args, {"count": 0, "done": 0, "requested": 0}, "no row matches this selection")
        return 1
    text = f"{_rows_text(found.done)} {verb}"
    if found.requested:
        text += f"; {_rows_text(found.requested)} running asked to stop"
    data = {"count": found.count, "done": found.done, "requested": found.requested}
    _emit(args, data, text)
    return 0
