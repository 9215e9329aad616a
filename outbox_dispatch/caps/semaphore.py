"""Per-actor concurrency caps: one Redis semaphore per (family, actor).

A semaphore is a sorted set of holder tokens (the rows' claim tokens) scored by lease end in
Redis server time, so a holder that dies simply expires; a counter with a TTL would leak. The
scripts are loaded once and run by SHA. Keys carry a hash tag per actor, so on Redis Cluster
one actor's keys share a slot; but the acquire script checks the completeness sentinel and
takes a whole claim's slots, of many actors, in one run, and therefore needs a single Redis
(or a primary with replicas), not a cluster.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis

from outbox_dispatch.caps.releases import PipelinedSlotWrites, Wake
from outbox_dispatch.core import timings
from outbox_dispatch.core.errors import ConfigurationError, OutboxError
from outbox_dispatch.core.forksafe import ForkSafeLock
from outbox_dispatch.core.logs import event, mask_dsn

log = logging.getLogger(__name__)

SCRIPTS = {  # lua/: one script per step a slot goes through
    "acquire": "caps_acquire.lua",
    "renew": "caps_renew.lua",
    "release": "caps_release.lua",
    "restore": "caps_restore.lua",
    "take_freed": "caps_take_freed.lua",
}

# Slots per script run of a claim's acquire: a run holds Redis while it loops (a few
# microseconds a slot).
SLOTS_PER_RUN = 100


# A heartbeat's slot renewal gives up this soon (a partition must not hang the heartbeat
# thread past the slot's end): the holder can then stop before its slot runs out.
RENEW_TIMEOUT = 1.0


class CapsUnavailable(OutboxError):
    """Redis is unreachable, so capped rows cannot be claimed: they wait in Postgres until it is
    back. Check the redis_url and that Redis is running."""


class CapsIncomplete(OutboxError):
    """Redis lost its semaphores (restart or flush): they must be rebuilt before claiming."""


@dataclass(frozen=True)
class Slot:
    family: str
    actor: str
    token: uuid.UUID
    cap: int
    scope: str = ""  # "": the family's cap; else the command whose own cap this slot counts


def _script(name: str) -> str:
    return resources.files("outbox_dispatch.caps").joinpath("lua", name).read_text("utf-8")


class Caps:
    """Acquire, renew, release and restore cap slots. Connects lazily."""

    def __init__(
        self, redis_url: str, prefix: str, *, wake_window: float = timings.WAKE_WINDOW
    ) -> None:
        if any(c in prefix for c in "{} \n"):
            raise ConfigurationError(f"cap key prefix {prefix!r} must not contain braces or spaces")
        self.redis_url = redis_url
        self.prefix = prefix
        self.sentinel = f"{prefix}:caps:complete"
        self.wake_ms = max(1, int(wake_window * 1000))
        self._client: redis.Redis | None = None
        self._renew_client: redis.Redis | None = None
        self._lock = ForkSafeLock()
        self._scripts: dict[str, Any] = {}
        self._run_id_seen: str | None = None  # the server's, read on a claim after a connect
        # the databases whose claimers take freed slots (None: the first, whose keys name none)
        self.databases: list[str | None] = [None]
        self._writes = PipelinedSlotWrites(self)

    @property
    def client(self) -> redis.Redis:
        if self._client is None:
            with self._lock:
                if self._client is None:
                    client = redis.Redis.from_url(
                        self.redis_url,
                        socket_timeout=5,
                        socket_connect_timeout=5,
                        redis_connect_func=self._connected,
                    )
                    for name, file in SCRIPTS.items():
                        self._scripts[name] = client.register_script(_script(file))
                    self._client = client
        return self._client

    @property
    def renew_client(self) -> redis.Redis:
        """The heartbeat's own connection, with short timeouts (see RENEW_TIMEOUT)."""
        _ = self.client  # the scripts are registered there
        if self._renew_client is None:
            with self._lock:
                if self._renew_client is None:
                    self._renew_client = redis.Redis.from_url(
                        self.redis_url,
                        socket_timeout=RENEW_TIMEOUT,
                        socket_connect_timeout=RENEW_TIMEOUT,
                    )
        return self._renew_client

    def key(self, family: str, actor: str, scope: str = "") -> str:
        """One semaphore per cap as declared: the family's, or a command's own (``scope``).
        The hash tag is the actor's either way, so an actor's keys share a cluster slot."""
        base = f"{self.prefix}:cap:{{{family}:{actor}}}"
        return f"{base}:cmd:{scope}" if scope else base

    def _run(
        self, name: str, keys: list[str], args: list[Any], client: redis.Redis | None = None
    ) -> int:
        client = client or self.client
        try:
            return int(self._scripts[name](keys=keys, args=args, client=client))
        except redis.RedisError as exc:
            raise CapsUnavailable(
                f"cap {name} failed: Redis at {mask_dsn(self.redis_url)} answered {_why(exc)}; "
                "capped rows wait in Postgres until it is back"
            ) from exc

    def acquire_many(
        self, slots: Sequence[Slot], lease: float, *, waiting: bool = False
    ) -> list[bool]:
        """One round trip for every slot of a claim (all of one family), one script run per
        ``SLOTS_PER_RUN`` slots (each run holds Redis while it loops); raises CapsIncomplete
        after a data loss. A refused slot, or ``waiting`` (the claim sets rows waiting
        anyway), sets the family's waiting flag (caps_acquire.lua)."""
        if not slots:
            return []
        family = slots[0].family
        assert all(s.family == family for s in slots), "one family per claim"
        ms = int(lease * 1000)
        flag = self.waiting_key(family)
        calls = []
        for at in range(0, len(slots), SLOTS_PER_RUN):  # a script run per SLOTS_PER_RUN slots
            chunk = slots[at : at + SLOTS_PER_RUN]
            keys = [self.sentinel, flag, *(self.key(s.family, s.actor, s.scope) for s in chunk)]
            args = [ms, int(waiting), *(x for s in chunk for x in (str(s.token), s.cap))]
            calls.append((keys, args))
        try:
            answers = self._pipelined("acquire", calls)
        except redis.RedisError as exc:
            raise CapsUnavailable(
                f"cap acquire failed: Redis at {mask_dsn(self.redis_url)} answered {_why(exc)}; "
                "capped rows wait in Postgres until it is back"
            ) from exc
        results = [int(r) for answer in answers for r in answer]
        if any(r == -1 for r in results):
            # Slots granted before the sentinel check failed are released by the caller's
            # rollback path: it releases every slot of the claim.
            raise CapsIncomplete()
        return [r == 1 for r in results]

    def renew(
        self,
        family: str,
        actor: str,
        token: uuid.UUID,
        lease: float,
        scope: str = "",
        *,
        heartbeat: bool = False,
    ) -> int:
        """1 renewed, 0 lapsed (another row may hold the slot), -1 semaphores being rebuilt.
        ``heartbeat``: on the short-timeout connection."""
        return self._run(
            "renew",
            self.renew_keys(family, actor, scope),
            [str(token), int(lease * 1000)],
            self.renew_client if heartbeat else None,
        )

    def freed_key(self, family: str, database: str | None = None) -> str:
        """Freed slots for one database's claimer of the family (None: the first database)."""
        if database is None:
            return f"{self.prefix}:caps:freed:{family}"
        return f"{self.prefix}:caps:freed:{database}:{family}"

    def waiting_key(self, family: str) -> str:
        """Set (for two leases) while rows of the family may wait for a slot: only then does
        a release note its freed slot and wake the claimer (caps_release.lua)."""
        return f"{self.prefix}:caps:waiting:{family}"

    def note_waiting(self, leases: Mapping[str, float]) -> None:
        """Set the waiting flag of each family (name -> lease): after a rebuild, whose data
        loss took the flags with it, as rows may still wait."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for family, lease in leases.items():
                    pipe.set(self.waiting_key(family), "1", px=int(lease * 2000))
                pipe.execute()
        except redis.RedisError as exc:
            raise CapsUnavailable(f"cap waiting flags failed: {_why(exc)}") from exc

    def release(self, slots: Sequence[Slot], database: str | None = None) -> bool:
        """Free the slots (of one family) and note them for every database's claimer, which
        lets each actor's next waiting row in. Returns True when the caller should wake the
        claimer of ``database``, where the rows settled (once per wake window); the others
        find the note at their next pass."""
        if not slots:
            return False
        try:
            return self._run("release", *self.release_call(slots, database)) == 1
        except CapsUnavailable as exc:
            # The slots expire with their leases anyway; the cap stays safe, only slower.
            event(
                log,
                logging.WARNING,
                "cap_release_failed",
                f"{exc}; the slots free when their leases end",
                family=slots[0].family,
                actors=sorted({s.actor for s in slots}),
            )
            return False

    def renew_keys(self, family: str, actor: str, scope: str) -> list[str]:
        return [self.key(family, actor, scope), self.sentinel]

    def release_call(
        self, slots: Sequence[Slot], database: str | None, *, unrenewed: bool = False
    ) -> tuple[list[str], list[Any]]:
        """Keys and arguments of caps_release.lua for ``slots``, all of one family;
        ``database``: whose claimer the wake key is for; ``unrenewed``: only slots no
        heartbeat renewed."""
        family = slots[0].family
        assert all(s.family == family for s in slots), "one family per release run"
        wake = f"{self.prefix}:wake:" + (family if database is None else f"{database}:{family}")
        freed = [self.freed_key(family, d) for d in self.databases]
        slot_keys = (self.key(s.family, s.actor, s.scope) for s in slots)
        keys = [wake, self.waiting_key(family), *freed, *slot_keys]
        args: list[Any] = [self.wake_ms, len(freed), int(unrenewed)]
        for s in slots:
            args += [str(s.token), s.actor]
        return keys, args

    def release_settled(
        self, slots: Sequence[Slot], database: str | None = None, *, wait: bool = True
    ) -> set[Wake]:
        """``release`` for the slots of finished rows, sent without waiting for Redis's
        answers (caps/releases.py); returns the claimers to wake, as (family, database), from
        the answers read (also of releases this process sent for its other databases): all of
        them with ``wait``, else those already in. A failure is logged: the slots expire with
        their leases, the cap stays safe."""
        return self._writes.release(slots, database, wait=wait)

    def release_lapsed(self, slots: Sequence[Slot], database: str | None = None) -> bool:
        """``release`` for the slots (of one family) of started attempts whose lease ran out
        (a claim gives them back before it takes slots), those no heartbeat renewed only
        (caps_release.lua); True when the claimer of ``database`` should be woken. Raises
        CapsUnavailable."""
        if not slots:
            return False
        return self._run("release", *self.release_call(slots, database, unrenewed=True)) == 1

    def release_many(self, slots: Sequence[Slot]) -> None:
        """Return slots a claim took but did not use (nothing was settled: no freed note)."""
        if not slots:
            return
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for s in slots:
                    pipe.zrem(self.key(s.family, s.actor, s.scope), str(s.token))
                pipe.execute()
        except redis.RedisError as exc:
            event(
                log, logging.WARNING, "cap_release_failed", f"{_why(exc)}; slots expire with lease"
            )

    def take_freed(self, family: str, database: str | None = None) -> dict[str, int]:
        """Actors whose slots freed since this database's last claim, with how many. A capped
        claim's first Redis call: it also checks the semaphores' generation, so that a Redis
        restarted from an old snapshot is rebuilt before this claim takes slots."""
        raw = self._run_list("take_freed", [self.freed_key(family, database), self.sentinel])
        written_by, *pairs = [v.decode() if isinstance(v, bytes) else str(v) for v in raw]
        self._check_generation(written_by)
        return {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}

    def freed_families(self, families: Sequence[str], database: str | None = None) -> set[str]:
        """The families among ``families`` with freed slots noted for this database's claimer
        (one round trip): a capped family with no due row needs a claim only then."""
        if not families:
            return set()
        try:
            with self.client.pipeline(transaction=False) as pipe:
                for family in families:
                    pipe.exists(self.freed_key(family, database))
                found = pipe.execute()
        except redis.RedisError as exc:
            raise CapsUnavailable(f"cap freed-slot check failed: {_why(exc)}") from exc
        return {f for f, n in zip(families, found, strict=True) if n}

    def give_back_freed(
        self, family: str, freed: dict[str, int], database: str | None = None
    ) -> None:
        """A claim that took freed counts and then failed puts them back."""
        if not freed:
            return
        # if Redis fails here too, the waiting rows still come due after one lease
        with contextlib.suppress(redis.RedisError), self.client.pipeline(False) as pipe:
            for actor, n in freed.items():
                pipe.hincrby(self.freed_key(family, database), actor, n)
            pipe.execute()

    def _pipelined(self, name: str, calls: list[tuple[list[str], list[Any]]]) -> list[Any]:
        """One script run per (keys, args), all in one round trip; raises redis.RedisError.

        EVALSHA itself, not redis-py's script objects, which check that the script is loaded
        (SCRIPT EXISTS, a round trip of its own) before every pipeline: a run that finds it
        missing (Redis restarted) loads it and runs again; nothing ran for such a call."""
        client = self.client  # connects and registers the scripts on first use
        script = self._scripts[name]
        if len(calls) == 1:  # a pipeline of one costs more than the call (redis-py builds it)
            keys, args = calls[0]
            try:
                return [client.evalsha(script.sha, len(keys), *keys, *args)]
            except redis.exceptions.NoScriptError:
                client.script_load(script.script)
                return [client.evalsha(script.sha, len(keys), *keys, *args)]
        results: list[Any] = [None] * len(calls)
        todo = list(range(len(calls)))
        for attempt in range(2):
            with client.pipeline(transaction=False) as pipe:
                for i in todo:
                    keys, args = calls[i]
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                answers = pipe.execute(raise_on_error=False)
            missing = []
            for i, answer in zip(todo, answers, strict=True):
                if isinstance(answer, redis.exceptions.NoScriptError) and attempt == 0:
                    missing.append(i)
                elif isinstance(answer, Exception):
                    raise answer
                else:
                    results[i] = answer
            if not missing:
                break
            client.script_load(script.script)
            todo = missing
        return results

    def script_sha(self, name: str) -> str:
        _ = self.client  # registers the scripts
        return str(self._scripts[name].sha)

    def script_text(self, name: str) -> str:
        _ = self.client
        return str(self._scripts[name].script)

    def _run_list(self, name: str, keys: list[str]) -> list[Any]:
        client = self.client
        try:
            return list(self._scripts[name](keys=keys, args=[], client=client))
        except redis.RedisError as exc:
            raise CapsUnavailable(f"cap {name} failed: {_why(exc)}") from exc

    def _run_id(self) -> str:
        info = self.client.info("server")
        return str(info.get("run_id", ""))

    def _connected(self, connection: Any) -> None:
        """Every new connection (redis_connect_func): it may reach a server that restarted, so
        the next generation check reads the run id again; between reconnects it cannot change."""
        connection.on_connect()
        self._run_id_seen = None

    def _check_generation(self, written_by: str) -> None:
        """Drop the sentinel when it was written by another Redis run: a server restarted from
        an older snapshot brings the sentinel back but not the newer holders, so the semaphores
        must be rebuilt (the acquire finds no sentinel and says so). The run id is read once per
        connection, not per claim. (Use maxmemory-policy noeviction: an evicted key loses
        holders too.)"""
        if not written_by:
            return
        try:
            current = self._run_id_seen
            if current is None:
                current = self._run_id_seen = self._run_id()
            if written_by != current:
                self.client.delete(self.sentinel)
        except redis.RedisError as exc:
            raise CapsUnavailable(f"Redis at {mask_dsn(self.redis_url)}: {_why(exc)}") from exc

    def complete(self) -> bool:
        try:
            return bool(self.client.exists(self.sentinel))
        except redis.RedisError as exc:
            raise CapsUnavailable(f"Redis at {mask_dsn(self.redis_url)}: {_why(exc)}") from exc

    def restore(self, holders: Sequence[tuple[Slot, int]]) -> None:
        """Put back (slot, remaining lease ms) holders, then mark the set complete."""
        client = self.client
        try:
            with client.pipeline(transaction=False) as pipe:
                for slot, remaining in holders:
                    self._scripts["restore"](
                        keys=[self.key(slot.family, slot.actor, slot.scope)],
                        args=[str(slot.token), remaining],
                        client=pipe,
                    )
                pipe.set(self.sentinel, self._run_id())
                pipe.execute()
        except redis.RedisError as exc:
            raise CapsUnavailable(f"cap rebuild failed: {_why(exc)}") from exc

    def holders(self, family: str, actor: str, scope: str = "") -> list[str]:
        """Live holder tokens (for status and tests)."""
        t = self.client.time()
        now_ms = int(t[0]) * 1000 + int(t[1]) // 1000
        raw = self.client.zrangebyscore(self.key(family, actor, scope), now_ms, "+inf")
        return [m.decode() if isinstance(m, bytes) else str(m) for m in raw]

    def close(self) -> None:
        self._writes.close()
        for client in (self._client, self._renew_client):
            if client is not None:
                client.close()
        self._client = self._renew_client = None


def _why(exc: BaseException) -> str:
    """The error's class and text, password masked: redis-py's repr names only the class."""
    return f"{type(exc).__name__}: {mask_dsn(str(exc))}"
