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
    cmd_bench,
    cmd_cancel,
    cmd_celery,
    cmd_demo,
    cmd_metrics,
    cmd_migrate,
    cmd_parked,
    cmd_prune,
    cmd_roles,
    cmd_status,
    cmd_web,
)

# the command's --help description
DESCRIPTION = """\
``outbox-dispatch``: migrate, status, parked rows, demo, bench, worker and beat shortcuts.

Human tables by default, ``--json`` for scripts. Errors print one line that says what to do,
and exit 2.
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
    parser = argparse.ArgumentParser(prog="outbox-dispatch", description=DESCRIPTION)
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
