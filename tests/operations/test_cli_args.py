"""The worker's own options may come anywhere among Celery's."""

from __future__ import annotations

from outbox_dispatch.ops.cli.parser import _metrics_options_first, build_parser


def test_worker_metrics_options_are_found_among_celerys() -> None:
    argv = ["worker", "-l", "INFO", "--metrics-port", "9808", "-c", "2", "--metrics-dir=/tmp/m"]
    args, extra = build_parser().parse_known_args(_metrics_options_first(argv))
    assert (args.metrics_port, args.metrics_dir) == (9808, "/tmp/m")
    assert [*extra, *args.rest] == ["-l", "INFO", "-c", "2"]


def test_other_commands_are_left_alone() -> None:
    assert _metrics_options_first(["status", "--json"]) == ["status", "--json"]
    assert _metrics_options_first(["beat", "-s", "x"]) == ["beat", "-s", "x"]
