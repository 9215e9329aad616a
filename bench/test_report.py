"""The benchmark harness's pure parts: ratios, tables, RSS parsing, options. No timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import rss
from bench.report import (
    CAPPED,
    DEFAULT,
    PER_ROW,
    UNCAPPED,
    Backpressure,
    Latency,
    Results,
    RssGrowth,
    RssSample,
    Throughput,
    goals,
    growth_pct,
    latency_table,
    median_latency,
    median_throughput,
    peer_ratios,
    peer_table,
    percentile,
    ratio,
    render,
    results_from_json,
    throughput_table,
)
from bench.run import QUICK, parse_args

STATUS = """Name:\tcelery
State:\tS (sleeping)
VmPeak:\t  300000 kB
VmRSS:\t   65432 kB
RssAnon:\t   40000 kB
"""


def figures() -> list[Throughput]:
    return [
        Throughput("celery delay()", "celery", 1000, 2.0),
        Throughput(PER_ROW, "outbox", 1000, 1.0, 0.1),
        Throughput(DEFAULT, "outbox", 1000, 0.25),
        Throughput(UNCAPPED, "outbox", 1000, 0.5),
        Throughput(CAPPED, "outbox", 1000, 0.6),
        Throughput("procrastinate", "procrastinate", 1000, 4.0),
        Throughput("django-celery-outbox", "django-celery-outbox", 1000, 1.25),
    ]


def test_ratio_formats_ours_over_theirs() -> None:
    assert ratio(300.0, 100.0) == "3.00x"
    assert ratio(1.0, 3.0) == "0.33x"
    assert ratio(0.0, 100.0) == "-"
    assert ratio(100.0, 0.0) == "-"


def test_throughput_table_shows_absolute_figures_and_ratio_to_plain_celery() -> None:
    text = throughput_table(figures())
    lines = text.splitlines()
    assert lines[0].split()[:2] == ["scenario", "system"]
    per_row = next(line for line in lines if line.startswith(PER_ROW))
    assert "1,000" in per_row  # rows/s
    assert per_row.rstrip().endswith("2.00x")  # 1000/s against 500/s
    baseline = next(line for line in lines if line.startswith("celery delay()"))
    assert baseline.rstrip().endswith("1.00x")


def test_peer_ratios_compare_the_default_family_and_batch_1_with_each_peer() -> None:
    by_peer = {r["peer"]: r for r in peer_ratios(figures())}
    assert set(by_peer) == {"procrastinate", "django-celery-outbox"}
    p = by_peer["procrastinate"]
    assert p["batch=1 ours/theirs"] == 4.0  # 1000/s vs 250/s
    assert p["default ours/theirs"] == 16.0
    d = by_peer["django-celery-outbox"]
    assert d["batch=1 ours/theirs"] == 1.25  # 1000/s vs 800/s
    text = peer_table(figures())
    assert "4.00x" in text and "16.00x" in text


def test_goals_say_target_measured_and_met_and_leave_what_did_not_run_blank() -> None:
    results = Results(
        throughput=figures(),
        latency=[
            Latency(DEFAULT, "outbox", 50, 500, 3.0, 9.0, 12.0),
            Latency("procrastinate", "procrastinate", 50, 500, 4.0, 8.0, 9.0),
        ],
    )
    by_goal = {g["goal"]: g for g in goals(results)}
    plain = by_goal["1. default family vs plain Celery delay()"]
    assert (plain["measured"], plain["met"]) == ("8.00x", True)  # 4000/s vs 500/s
    dco = by_goal["2. batch=1 vs django-celery-outbox"]
    assert (dco["measured"], dco["met"]) == ("1.25x", True)
    capped = by_goal["2. cap 4 vs uncapped (100 actors)"]
    assert (capped["measured"], capped["met"]) == ("0.83x", True)
    assert by_goal["3. commit to start p50 at 50 rows/s"]["met"] is True
    assert by_goal["3. commit to start p99 at 50 rows/s"]["met"] is False  # 9 > 8 ms
    assert by_goal["3. commit to start p99 at 200 rows/s"]["met"] is None  # not run
    assert "goals (issue 14)" in render(results)


def test_peer_ratios_without_our_figures_are_blank() -> None:
    only_peer = [Throughput("procrastinate", "procrastinate", 10, 1.0)]
    (row,) = peer_ratios(only_peer)
    assert row["batch=1 ours/theirs"] is None
    assert row["default ours/theirs"] is None
    assert "-" in peer_table(only_peer)


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.5) == 51.0
    assert percentile(values, 0.99) == 100.0
    assert percentile([], 0.5) == 0.0


def test_rss_growth_of_the_total_and_of_the_worst_process() -> None:
    warm = RssSample(10_000, 300, {1: 100, 2: 100, 3: 100})
    end = RssSample(100_000, 320, {1: 100, 2: 100, 3: 120})
    g = RssGrowth("per-row", 100_000, warm, end, 60.0)
    assert g.growth_pct == pytest.approx(6.6667, rel=1e-3)
    assert g.max_process_growth_pct == pytest.approx(20.0)
    assert growth_pct(0, 10) == 0.0


def test_parse_vmrss_and_ppid() -> None:
    assert rss.parse_vmrss(STATUS) == 65432
    assert rss.parse_vmrss("Name:\tkthreadd\nState:\tS\n") is None
    # the command name may hold spaces and parentheses
    assert rss.parse_ppid("1234 (celery) worker)) S 77 1234 1234 0 -1") == 77
    assert rss.parse_ppid("garbage") is None


def test_tree_rss_walks_a_process_tree(tmp_path: Path) -> None:
    def proc(pid: int, ppid: int, kb: int | None) -> None:
        d = tmp_path / str(pid)
        d.mkdir()
        (d / "stat").write_text(f"{pid} (python -m celery) S {ppid} 1 1 0")
        (d / "status").write_text(f"Name:\tx\nVmRSS:\t{kb} kB\n" if kb else "Name:\tx\n")

    proc(10, 1, 1000)
    proc(11, 10, 200)
    proc(12, 10, 300)
    proc(13, 12, 50)
    proc(20, 1, 9999)  # not in the tree
    proc(14, 10, None)  # a zombie child: no VmRSS
    (tmp_path / "self").mkdir()  # non-numeric entries are skipped
    assert rss.children(10, tmp_path) == [11, 12, 14]
    assert rss.tree(10, tmp_path) == [10, 11, 12, 13, 14]
    assert rss.tree_rss(10, tmp_path) == {10: 1000, 11: 200, 12: 300, 13: 50}


def test_render_and_json_hold_every_section() -> None:
    results = Results(
        machine={"cpu": "2 x test"},
        throughput=figures(),
        latency=[Latency("celery delay()", "celery", 50, 500, 3.1, 5.2, 9.9)],
        rss=[
            RssGrowth(
                "batched",
                1000,
                RssSample(100, 1024, {1: 1024}),
                RssSample(1000, 1024, {1: 1024}),
                1,
            )
        ],
        backpressure=[Backpressure(30_000, 5.0, 100, 5.0, 200.0, 30_000, 30_000, 0, 0, 0, 100, 80)],
    )
    text = render(results)
    for heading in ("machine:", "throughput", "against peers", "->", "RSS", "backpressure"):
        assert heading in text
    assert "30,000" in text
    data = json.loads(json.dumps(results.to_json()))
    assert data["throughput"][1]["per_second"] == 1000.0
    assert data["rss"][0]["growth_pct"] == 0.0
    assert data["backpressure"][0]["twice"] == 0
    assert data["backpressure"][0]["per_second"] == 150.0
    assert {r["peer"] for r in data["peer_ratios"]} == {"procrastinate", "django-celery-outbox"}
    again = results_from_json(data)  # what --replot reads
    assert render(again) == text
    assert again.rss[0].end.per_process_kb == {1: 1024}


def test_options_quick_only_and_sizes() -> None:
    full = parse_args([])
    assert full.rss_rows == 100_000
    assert full.bp_rows == 30_000
    assert "peers" in full.scenarios
    quick = parse_args(["--quick"])
    assert quick.rows == QUICK["rows"]
    assert quick.rss_rows < full.rss_rows
    o = parse_args(["--only", "rss,backpressure", "--rss-rows", "2000", "--peers", ""])
    assert o.scenarios == ("rss", "backpressure")
    assert o.rss_warmup == 200  # a tenth unless given
    assert o.peers == ()
    assert parse_args(["--skip", "claimcost"]).scenarios == (
        "throughput",
        "peers",
        "latency",
        "rss",
        "backpressure",
    )
    with pytest.raises(SystemExit):
        parse_args(["--only", "nonsense"])
    with pytest.raises(SystemExit):
        parse_args(["--rss-rows", "100", "--rss-warmup", "100"])
    assert (full.repeat, quick.repeat, parse_args(["--repeat", "5"]).repeat) == (3, 1, 5)
    with pytest.raises(SystemExit):
        parse_args(["--repeat", "0"])


def test_repeated_rounds_give_each_scenario_its_median_and_each_goal_the_rounds_ratios() -> None:
    """Three rounds: a scenario's figure is its median round (with every round's rows/s),
    and a goal's ratio is the median of the ratios taken round by round, not the ratio of
    two medians that may come from different rounds."""
    plain = [Throughput("celery delay()", "celery", 1000, s) for s in (1.0, 2.0, 1.25)]
    ours = [Throughput(DEFAULT, "outbox", 1000, s, 0.1, {"total": s}) for s in (0.4, 1.0, 0.5)]
    base, mine = median_throughput([*plain]), median_throughput([*ours])
    assert base is not None and mine is not None
    assert base.runs == [1000.0, 500.0, 800.0] and base.per_second == 800.0
    assert mine.runs == [2500.0, 1000.0, 2000.0] and mine.cpu_ms == {"total": 0.5}
    by_goal = {g["goal"]: g for g in goals(Results(throughput=[base, mine]))}
    # round ratios 2.5, 2.0, 2.5: median 2.5 (the medians' ratio would say 2000/800 = 2.5 too,
    # but the range shows how far the rounds went)
    assert by_goal["1. default family vs plain Celery delay()"]["measured"] == "2.50x (2.00-2.50)"
    table = throughput_table([base, mine])
    assert "2,500 1,000 2,000" in table and "2.50x" in table
    failed = median_throughput([None, plain[1], None])
    assert failed is not None and failed.runs == [0.0, 500.0, 0.0]
    assert median_throughput([None, None]) is None


def test_repeated_latency_rounds_take_the_median_p50_and_p99() -> None:
    rounds = [
        Latency(DEFAULT, "outbox", 50, 500, p50, p99, mx)
        for p50, p99, mx in ((4.0, 9.0, 12.0), (3.0, 30.0, 41.0), (5.0, 7.0, 8.0))
    ]
    m = median_latency(rounds)
    assert m is not None
    assert (m.rows, m.p50_ms, m.p99_ms, m.max_ms) == (1500, 4.0, 9.0, 41.0)
    assert "4/9 3/30 5/7" in latency_table([m])
    assert median_latency([]) is None


def test_cpu_groups_follow_the_process_tree_and_count_reaped_children() -> None:
    from bench import cpu

    line = "42 (celery (main)) S 7 42 42 0 -1 4194560 1 0 0 0 30 10 5 2 20 0 3 0 1 2 3"
    p = cpu.parse_stat(line)
    assert (p.pid, p.ppid, p.name, p.ticks) == (42, 7, "celery (main)", 47)
    procs = [
        cpu.Proc(10, 1, "python", 100),  # the worker
        cpu.Proc(11, 10, "python", 50),  # its pool process
        cpu.Proc(12, 11, "python", 5),  # a grandchild
        cpu.Proc(20, 1, "postgres", 7),  # postmaster (reaped backends count here)
        cpu.Proc(21, 20, "postgres", 30),
        cpu.Proc(30, 1, "redis-server", 9),
        cpu.Proc(40, 1, "python", 11),  # the driver
        cpu.Proc(50, 1, "python", 999),  # someone else's process
    ]
    before = cpu.group_ticks(procs, [10], driver=40)
    assert before == {"worker": 155, "postgres": 37, "redis": 9, "driver": 11}
    after = dict(before, worker=155 + 2 * cpu.TICKS, postgres=37 + cpu.TICKS)
    ms = cpu.per_row_ms(before, after, rows=1000)
    assert ms == {"worker": 2.0, "postgres": 1.0, "redis": 0.0, "driver": 0.0, "total": 3.0}


def test_cpu_figures_are_tabled_and_survive_the_json_round_trip() -> None:
    used = {"worker": 1.5, "postgres": 0.3, "redis": 0.1, "driver": 0.05, "total": 1.95}
    results = Results(throughput=[Throughput(PER_ROW, "outbox", 100, 1.0, 0.1, used)])
    text = render(results)
    assert "CPU per row" in text and "1.95" in text
    again = results_from_json(json.loads(json.dumps(results.to_json())))
    assert again.throughput[0].cpu_ms == used
