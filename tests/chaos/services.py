"""A private Postgres cluster and Redis for one chaos run, on free ports, that the run may
kill -9, shut down or flush, and restart. The machine's shared Postgres and Redis are never
touched.

Postgres: ``initdb`` into a fresh directory with trust auth. initdb and postgres refuse to run
as root, so as root both run as the ``postgres`` OS user (``Popen(user=...)``, no PAM session
in between, so the postmaster is our direct child), in a directory that user owns. A restart
kills the postmaster and every backend at once (their process group) and starts again: crash
recovery, as after a power cut of the database alone. A fast shutdown (``pg_ctl stop -m fast``,
what an orchestrator's stop or a failover does) ends every session with an admin-shutdown
error, checkpoints and exits; then the cluster starts again. ``fsync=off``: a killed process loses
nothing the kernel already has, and the run never crashes the kernel, so this costs no
durability here and spares a shared 2-core machine the flushes.

Redis: ``--save "" --appendonly no``, so a restart loses every key: broker queues, unacked
messages, cap semaphores and their sentinel. FLUSHDB loses them too while the server and every
connection to it stay up (an operator's mistake, or a failover to an empty replica).

Children are wrapped in ``setpriv --pdeathsig KILL`` when it exists, so they die with the
orchestrator even if it is killed -9 (postgres backends follow their postmaster).
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
import redis

from outbox_dispatch.core.logs import event

log = logging.getLogger(__name__)


APP_ROLE = "chaos_app"  # the matrix's workers' role: no superuser, so no reserved slot


class ServiceError(RuntimeError):
    """A private service could not be set up: the message says what is missing."""


@dataclass(frozen=True)
class Binaries:
    postgres: str
    initdb: str
    redis: str
    pg_ctl: str | None = None  # a fast shutdown without it is the SIGINT pg_ctl would send


def find_binaries() -> Binaries:
    """The newest installed PostgreSQL server and redis-server (``CHAOS_PG_BINDIR`` overrides
    the Postgres directory)."""
    bindir = os.environ.get("CHAOS_PG_BINDIR")
    candidates = [bindir] if bindir else []
    candidates += sorted(
        glob.glob("/usr/lib/postgresql/*/bin"),
        key=lambda p: int(p.split("/")[-2]) if p.split("/")[-2].isdigit() else 0,
        reverse=True,
    )
    found = shutil.which("postgres")
    if found:
        candidates.append(str(Path(found).resolve().parent))
    pg = next(
        (
            c
            for c in candidates
            if os.access(f"{c}/postgres", os.X_OK) and os.access(f"{c}/initdb", os.X_OK)
        ),
        None,
    )
    rs = shutil.which("redis-server")
    missing = []
    if pg is None:
        missing.append("PostgreSQL server binaries (postgres, initdb; set CHAOS_PG_BINDIR)")
    if rs is None:
        missing.append("redis-server")
    if missing:
        raise ServiceError("the chaos run needs " + " and ".join(missing))
    assert pg is not None
    assert rs is not None
    pg_ctl = f"{pg}/pg_ctl" if os.access(f"{pg}/pg_ctl", os.X_OK) else None
    return Binaries(f"{pg}/postgres", f"{pg}/initdb", rs, pg_ctl)


def preflight() -> Binaries:
    """Everything the private services need, checked before anything starts: the binaries,
    and an OS user Postgres will run as."""
    binaries = find_binaries()
    _owner()
    return binaries


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _owner() -> pwd.struct_passwd | None:
    """The OS user Postgres runs as: ``postgres`` when we are root, else ourselves (None)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam("postgres")
    except KeyError as exc:
        raise ServiceError(
            "running as root, and PostgreSQL refuses root: create a 'postgres' OS user "
            "or run the chaos suite as a normal user"
        ) from exc


def _spawn(
    args: list[str], logfile: Path, *, owner: pwd.struct_passwd | None = None, cwd: str = "/"
) -> subprocess.Popen[bytes]:
    setpriv = shutil.which("setpriv")
    wrapped = [setpriv, "--pdeathsig", "KILL", "--", *args] if setpriv else args
    user: dict[str, Any] = {}
    if owner is not None:
        user = {"user": owner.pw_uid, "group": owner.pw_gid, "extra_groups": []}
    with logfile.open("ab") as out:
        return subprocess.Popen(
            wrapped,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=cwd,
            **user,
        )


def _kill_group(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


class _PrivateServer(ABC):
    """A server process of ours, in its own process group: killed with every child at once,
    and restarted on the same port."""

    proc: subprocess.Popen[bytes] | None
    port: int
    logfile: Path
    restarted = "chaos_server_restarted"
    restart_note = ""

    @abstractmethod
    def start(self) -> None:
        """Start the server (again) on ``self.port`` and wait until it answers."""

    def _wait_until_up(
        self,
        ping: Callable[[], object],
        errors: type[Exception] | tuple[type[Exception], ...],
        timeout: float,
        what: str,
        interval: float,
    ) -> None:
        """Ping until the server answers; a server that exits or stays silent is an error
        that quotes its log."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                ping()
                return
            except errors as exc:
                assert self.proc is not None
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise ServiceError(
                        f"private {what} did not start on port {self.port} ({exc}); its log "
                        f"ends with: {_tail(self.logfile)}"
                    ) from exc
                time.sleep(interval)

    def kill(self) -> None:
        """kill -9 the server and every process it started (they share its process group)."""
        _kill_group(self.proc)
        self.proc = None

    def restart(self, down: float = 1.0) -> None:
        self.kill()
        time.sleep(down)
        self.start()
        event(log, logging.WARNING, self.restarted, f"port {self.port}{self.restart_note}")


class PrivatePostgres(_PrivateServer):
    restarted = "chaos_postgres_restarted"

    def __init__(self, binaries: Binaries, logdir: Path, port: int) -> None:
        self.binaries = binaries
        self.port = port
        self.logfile = logdir / "postgres.log"
        self.owner = _owner()
        self.root = Path(tempfile.mkdtemp(prefix="chaos-pg-"))
        self.data = self.root / "data"
        self.proc: subprocess.Popen[bytes] | None = None
        # what the next start sets; the fault matrix lowers it for its pool exhaustion cell.
        # The reserved slots are for superusers: the matrix runs its workers as APP_ROLE, so
        # its own sessions (run records, the producer, the monitor) are never refused
        self.max_connections = 400
        self.reserved_connections = 50
        if self.owner is not None:
            os.chown(self.root, self.owner.pw_uid, self.owner.pw_gid)

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def app_url(self) -> str:
        """As ``APP_ROLE``: a runtime role without superuser rights (see ``grant_app``)."""
        return f"postgresql://{APP_ROLE}@127.0.0.1:{self.port}/postgres"

    def grant_app(self, schema: str) -> None:
        """``APP_ROLE`` (created if missing) may read and write every table of ``schema``:
        what the outbox's runtime path needs (store/roles.py)."""
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(
                "DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = "
                f"'{APP_ROLE}') THEN CREATE ROLE {APP_ROLE} LOGIN; END IF; END $$"
            )
            conn.execute(f'GRANT USAGE ON SCHEMA "{schema}" TO {APP_ROLE}')
            conn.execute(
                f'GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "{schema}"'
                f" TO {APP_ROLE}"
            )
            conn.execute(f'GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA "{schema}" TO {APP_ROLE}')

    def _user(self) -> dict[str, Any]:
        """subprocess arguments that run a Postgres tool as the cluster's owner."""
        if self.owner is None:
            return {}
        return {"user": self.owner.pw_uid, "group": self.owner.pw_gid, "extra_groups": []}

    def init(self) -> None:
        args = [
            self.binaries.initdb,
            "-D",
            str(self.data),
            "-A",
            "trust",
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
        ]
        done = subprocess.run(
            args, capture_output=True, text=True, cwd=str(self.root), check=False, **self._user()
        )
        if done.returncode != 0:
            raise ServiceError(f"initdb failed ({done.returncode}): {done.stderr[-1500:]}")

    def start(self, timeout: float = 60.0) -> None:
        args = [
            self.binaries.postgres,
            "-D",
            str(self.data),
            "-p",
            str(self.port),
            "-k",
            str(self.root),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"max_connections={self.max_connections}",
            "-c",
            f"superuser_reserved_connections={self.reserved_connections}",
            "-c",
            "fsync=off",
            "-c",
            "shared_buffers=128MB",
            "-c",
            "log_min_messages=warning",
        ]
        self.proc = _spawn(args, self.logfile, owner=self.owner, cwd=str(self.root))

        def ping() -> None:
            with psycopg.connect(self.url, connect_timeout=2) as conn:
                conn.execute("SELECT 1")

        self._wait_until_up(ping, psycopg.OperationalError, timeout, "Postgres", 0.1)

    def fast_restart(self, down: float = 1.0, timeout: float = 30.0) -> str:
        """``pg_ctl stop -m fast``, then start again: every session is ended with an
        admin-shutdown error, and new ones are refused while it shuts down. Returns how it was
        stopped (pg_ctl, or its SIGINT where pg_ctl is missing or fails)."""
        assert self.proc is not None
        how = "SIGINT to the postmaster"
        if self.binaries.pg_ctl is not None:
            args = [self.binaries.pg_ctl, "stop", "-D", str(self.data), "-m", "fast", "-w"]
            done = subprocess.run(
                [*args, "-t", str(int(timeout))],
                capture_output=True,
                text=True,
                cwd=str(self.root),
                check=False,
                **self._user(),
            )
            if done.returncode == 0:
                how = "pg_ctl stop -m fast"
            else:
                event(log, logging.WARNING, "chaos_pg_ctl_failed", done.stderr[-500:])
        if how != "pg_ctl stop -m fast":
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGINT)  # what pg_ctl -m fast sends
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            how += ", then kill -9 (it did not stop in time)"
        self.kill()  # reaps it; kills any backend still about
        time.sleep(down)
        self.start()
        event(log, logging.WARNING, self.restarted, f"port {self.port}, {how}")
        return how

    def terminate_backends(self, exclude: tuple[int, ...] = ()) -> int:
        """``pg_terminate_backend`` of every client session but ours (and ``exclude``): what an
        operator's kill of stuck sessions, a pooler's reset or an idle-session timeout does to
        each of them. Returns how many were ended."""
        with psycopg.connect(self.url, autocommit=True, connect_timeout=3) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()"
                " AND NOT pid = ANY(%s)",
                (list(exclude),),
            ).fetchone()
        return int(row[0]) if row else 0

    def client_sessions(self, user: str | None = None) -> int:
        """Client sessions open now (of ``user``; else all, ours included)."""
        with psycopg.connect(self.url, autocommit=True, connect_timeout=3) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend'"
                " AND usename = coalesce(%s, usename)",
                (user,),
            ).fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


class PrivateRedis(_PrivateServer):
    """Restarted empty on the same port: every key is gone."""

    restarted = "chaos_redis_restarted"
    restart_note = ", data lost"

    def __init__(self, binary: str, logdir: Path, port: int) -> None:
        self.binary = binary
        self.port = port
        self.logfile = logdir / "redis.log"
        self.root = Path(tempfile.mkdtemp(prefix="chaos-redis-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5, socket_connect_timeout=3)

    def start(self, timeout: float = 30.0) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--daemonize",
            "no",
            "--dir",
            str(self.root),
            "--maxclients",
            "4000",
        ]
        self.proc = _spawn(args, self.logfile, cwd=str(self.root))
        client = self.client()
        try:
            self._wait_until_up(client.ping, redis.RedisError, timeout, "Redis", 0.05)
        finally:
            client.close()

    def cut_connections(self) -> int:
        """Close every client connection (workers' broker and cap connections, pub/sub
        included) except our own: what a network blip or a proxy restart does."""
        client = self.client()
        try:
            n = 0
            for kind in ("normal", "pubsub"):
                n += int(client.client_kill_filter(_type=kind, skipme=True))
            return n
        finally:
            client.close()

    def flushdb(self) -> int:
        """FLUSHDB on the run's database: every key gone, the server and every connection up.
        Returns how many keys there were."""
        client = self.client()
        try:
            keys = int(client.dbsize())
            client.flushdb()
            event(log, logging.WARNING, "chaos_redis_flushed", f"port {self.port}, {keys} keys")
            return keys
        finally:
            client.close()

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)


class Services:
    """Both private services, started on enter and killed (their data removed) on exit."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.binaries = find_binaries()
        self.postgres = PrivatePostgres(self.binaries, logdir, free_port())
        self.redis = PrivateRedis(self.binaries.redis, logdir, free_port())

    def __enter__(self) -> Services:
        try:
            self.postgres.init()
            self.postgres.start()
            self.redis.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        self.redis.close()
        self.postgres.close()
