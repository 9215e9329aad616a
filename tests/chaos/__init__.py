"""The chaos suite: a mixed workload through real worker and claimer processes while workers,
claimers, Redis and Postgres are killed, then a check of every invariant that can be measured
from the records the handlers left.

- ``services``: a private Postgres cluster and Redis the run may kill (never the shared ones).
- ``workload``: families, handlers that record every run, the planned rows, the schema.
- ``app``: the Celery app the worker and claimer processes load (``celery -A``).
- ``fleet``: worker and claimer processes, started, killed and restarted.
- ``checks``: the pure checks (loss accounting, duplicates, overlap sweep, order).
- ``report``: from the records to the figures, the verdicts and the printed table.
- ``run``: the orchestrator (``scripts/chaos``).
- ``matrix``: the fault and pressure matrix (``scripts/chaos --matrix``), one fault a cell
  against a clean baseline; ``clock`` (with ``clockstep.c``) steps the workers' wall clock.
- ``deploy``: a rolling deploy under load (``--rolling``) and the commit listener's failover
  (``--failover``), measured.
"""
