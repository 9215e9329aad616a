"""The ``outbox-dispatch`` argument parser: its subcommands, their options and the argument
types they use."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from outbox_dispatch.ops.cli.commands import (
    DB_ENV,
    SCHEMA_ENV,
    cmd_audit,
    cmd_bench,
    cmd_cancel,
    cmd_celery,
    cmd_demo,
    cmd_metrics,
    cmd_migrate,
    cmd_parked,
    cmd_pause,
    cmd_prune,
    cmd_roles,
    cmd_status,
    cmd_web,
)

# the command's --help description
DESCRIPTION = """\
outbox-dispatch: operate a transactional outbox: migrate its schema, see each family's status,
inspect, retry, purge or cancel rows, pause and resume families, read the audit log, serve
metrics and the operator page, and start Celery's worker and beat on your app.

Human tables by default, --json for scripts. Errors print one line that says what to do,
and exit 2. Name your Dispatcher with --app module:attribute (or OUTBOX_DISPATCH_APP).
"""


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


def _age(text: str) -> float:
    """An argparse type: an age such as 90s, 30m, 2h or 1d (a bare number is seconds)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    number, unit = (text[:-1], text[-1]) if text[-1:] in units else (text, "s")
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age like 90s, 30m, 2h, 1d") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"an age is at least 0, got {text!r}")
    return value * units[unit]


def _filters(q: argparse.ArgumentParser) -> None:
    """The bulk selection of parked rows, used when no ids are given."""
    q.add_argument("--command", dest="command_name", help="only rows of this command")
    q.add_argument("--actor", help="only rows of this actor")
    q.add_argument("--error", help="only rows whose last error contains this text")
    q.add_argument("--older-than", type=_age, help="only rows parked longer ago (30m, 2h, 1d)")
    q.add_argument("--dry-run", action="store_true", help="count and show a sample, change nothing")


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
    parser.add_argument(
        "--log-level", default=default("WARNING"), help="DEBUG, INFO, WARNING (default), ERROR"
    )
    parser.add_argument(
        "--database",
        default=default(None),
        help="with several databases: only this one (row ids need it)",
    )
    parser.add_argument(
        "--database-url",
        default=default(None),
        help=f"migrate and roles without --app: the database (or env {DB_ENV})",
    )
    parser.add_argument(
        "--schema",
        default=default(None),
        help=f"migrate and roles without --app: the schema (or env {SCHEMA_ENV}; default outbox)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="outbox-dispatch",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    _common(parser, after=False)
    common = argparse.ArgumentParser(add_help=False)  # the same options after a subcommand
    _common(common, after=True)
    ours = [common]
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser(
        "migrate",
        parents=ours,
        help="create or upgrade the outbox schema (safe to repeat)",
        description="create or upgrade the outbox schema (safe to repeat)",
    )
    p.set_defaults(fn=cmd_migrate)

    p = sub.add_parser(
        "roles",
        parents=ours,
        help="least-privilege roles: print the SQL, or --apply it as an administrator",
        description="least-privilege roles: print the SQL, or --apply it as an administrator",
    )
    p.add_argument("--migrate-role", required=True, help="owns the schema, runs migrate")
    p.add_argument("--runtime-role", required=True, help="producers, workers and beat")
    p.add_argument("--apply", action="store_true", help="run it (both roles must exist)")
    p.set_defaults(fn=cmd_roles)

    p = sub.add_parser(
        "status",
        parents=ours,
        help="per family: due, scheduled, in flight, parked, oldest due",
        description="per family: due, scheduled, in flight, parked, oldest due",
    )
    p.set_defaults(fn=cmd_status)

    p = sub.add_parser(
        "parked",
        parents=ours,
        help="dead-lettered rows: list, show, retry, purge",
        description="dead-lettered rows: list, show, retry, purge",
    )
    psub = p.add_subparsers(dest="parked_cmd", required=True)
    q = psub.add_parser(
        "show",
        parents=ours,
        help="one row: its fields, last error and the handler's traceback",
        description="one row: its fields, last error and the handler's traceback",
    )
    q.add_argument("id", type=int, help="row id")
    for name, helptext in (
        ("list", "show parked rows with their last error"),
        ("retry", "make parked rows due again, attempts reset"),
        ("purge", "delete parked rows"),
    ):
        q = psub.add_parser(name, parents=ours, help=helptext, description=helptext)
        q.add_argument("--family", help="only this family's rows")
        if name == "list":
            q.add_argument("--limit", type=_positive, default=100, help="at most N rows (100)")
        else:
            q.add_argument("ids", nargs="*", type=int, help="row ids")
            q.add_argument("--all", action="store_true", help="every parked row (of --family)")
            q.add_argument("--reason", help="why, for the audit log")
            q.add_argument("--by", help="who, for the audit log (default: $USER)")
            _filters(q)
    p.set_defaults(fn=cmd_parked)

    p = sub.add_parser(
        "cancel",
        parents=ours,
        help="cancel rows: pending ones at once, running ones asked",
        description="cancel rows: pending ones at once, running ones asked",
    )
    p.add_argument("ids", nargs="*", type=int, help="row ids")
    p.add_argument("--dedupe-key", help="the row holding this dedupe key")
    p.add_argument("--actor", help="every unsettled row of this actor")
    p.add_argument("--command", dest="command_name", help="with --actor: only this command")
    p.add_argument("--reason", help="why, kept on the rows and in the audit log")
    p.add_argument("--by", help="who cancels (default: $USER)")
    p.add_argument("--family", help="with no ids, key or actor: every pending row of the family")
    p.add_argument("--older-than", type=_age, help="only rows enqueued longer ago (30m, 2h, 1d)")
    p.add_argument("--dry-run", action="store_true", help="count and show a sample, change nothing")
    p.set_defaults(fn=cmd_cancel)

    p = sub.add_parser(
        "audit",
        parents=ours,
        help="operator actions: who retried, purged, cancelled, paused",
        description="operator actions: who retried, purged, cancelled, paused",
    )
    p.add_argument("--limit", type=_positive, default=50, help="latest N actions (default 50)")
    p.set_defaults(fn=cmd_audit)

    p = sub.add_parser(
        "pause",
        parents=ours,
        help="stop claiming a family's rows (running ones finish; enqueues still commit)",
        description="stop claiming a family's rows (running ones finish; enqueues still commit)",
    )
    p.add_argument("family")
    p.add_argument("--reason", help="why, shown by status and the outbox page")
    p.add_argument("--by", help="who pauses (default: $USER)")
    p.set_defaults(fn=cmd_pause, cmd="pause")
    p = sub.add_parser(
        "resume",
        parents=ours,
        help="claim a paused family's rows again, at once",
        description="claim a paused family's rows again, at once",
    )
    p.add_argument("family")
    p.add_argument("--by", help="who resumes (default: $USER)")
    p.set_defaults(fn=cmd_pause, cmd="resume")

    p = sub.add_parser(
        "prune",
        parents=ours,
        help="delete settled rows past their family's retention",
        description="delete settled rows past their family's retention",
    )
    p.add_argument("--batch", type=_positive, help="rows per delete (default: the dispatcher's)")
    p.set_defaults(fn=cmd_prune)

    for name in ("worker", "beat"):
        p = sub.add_parser(
            name,
            help=f"celery {name} on the app's module; extra args pass on",
            description=f"celery {name} on the app's module; extra args pass on",
        )
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

    p = sub.add_parser(
        "metrics",
        parents=ours,
        help="serve Prometheus /metrics: per-family gauges",
        description="serve Prometheus /metrics: per-family gauges",
    )
    p.add_argument("--port", type=_port, default=9808, help="port to serve on (9808)")
    p.add_argument(
        "--addr",
        default=None,
        help="bind address (loopback, or env OUTBOX_METRICS_ADDR; 0.0.0.0 exposes it)",
    )
    p.set_defaults(fn=cmd_metrics)

    p = sub.add_parser(
        "web",
        parents=ours,
        help="the operator page: status, parked rows, a row's history",
        description="the operator page: status, parked rows, a row's history",
    )
    p.add_argument("--port", type=_port, default=8080, help="port to serve on (8080)")
    p.add_argument("--addr", default="127.0.0.1", help="bind address (loopback by default)")
    p.add_argument("--auth", help="user:password (default: $OUTBOX_WEB_AUTH); required")
    p.add_argument(
        "--viewer-auth",
        help="user:password of a read-only credential (default: $OUTBOX_WEB_VIEWER_AUTH)",
    )
    p.set_defaults(fn=cmd_web)

    p = sub.add_parser(
        "demo",
        parents=ours,
        help="the demo: a real workload through worker and beat",
        description="the demo: a real workload through worker and beat",
    )
    p.add_argument("--rows", type=int, default=3000, help="rows the workload writes (3000)")
    p.add_argument("--workers", type=int, default=2, help="worker pool processes")
    p.add_argument("--timeout", type=float, default=180.0)
    p.add_argument(
        "--external", action="store_true", help="use a running worker and beat (compose stack)"
    )
    p.add_argument("--events", action="store_true", help="the worker sends task events (Flower)")
    p.add_argument(
        "--force", action="store_true", help="clear the demo's keys in a Redis db that holds others"
    )
    p.set_defaults(fn=cmd_demo)

    p = sub.add_parser(
        "bench",
        help="throughput, latency, RSS and backpressure against plain Celery and peers",
        description="throughput, latency, RSS and backpressure against plain Celery and peers",
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


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("outbox-dispatch")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown"
