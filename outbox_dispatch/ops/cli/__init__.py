"""The ``outbox-dispatch`` command: ``main`` parses its arguments (parser.py) and runs one
subcommand (commands.py)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from outbox_dispatch.core.errors import OutboxError
from outbox_dispatch.core.logs import mask_dsn
from outbox_dispatch.ops.cli.commands import cmd_celery
from outbox_dispatch.ops.cli.parser import _metrics_options_first, build_parser

__all__ = ["build_parser", "main"]


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
