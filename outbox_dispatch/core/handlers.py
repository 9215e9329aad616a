"""Handlers, the registry that maps commands to them, and the context a handler receives."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox_dispatch.core.errors import DuplicateRegistration, UnknownCommand, UnknownFamily

HandlerFn = Callable[["Context", Any], Any]


class Flag:
    """A yes-or-no answer that reads both ways a handler may write it: ``if ctx.is_cancelled:``
    and ``if ctx.is_cancelled():`` mean the same (a bool property called would raise
    ``TypeError`` on every attempt)."""

    __slots__ = ("_value",)

    def __init__(self, value: bool) -> None:
        self._value = value

    def __bool__(self) -> bool:
        return self._value

    def __call__(self) -> bool:
        return self._value

    def __eq__(self, other: object) -> bool:
        return self._value == other

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return repr(self._value)


@dataclass
class Context:
    """What a handler knows about the attempt it runs.

    ``idempotency_key`` is stable across attempts of the same row: pass it to providers that
    deduplicate (payment APIs, mail services). ``maybe_applied`` is true when an earlier attempt
    ended without an outcome and may have taken effect. ``database`` is the name of the
    dispatcher's database the row lives in (``default`` with one): a handler of a sharded shop
    applies the row's effect there.
    """

    row_id: int
    family: str
    command: str
    actor: str | None
    attempt: int
    idempotency_key: str
    maybe_applied: bool
    cancelled: threading.Event = field(default_factory=threading.Event)
    conn: Any = None  # transactional handlers: the connection whose transaction settles the row
    database: str = "default"
    _beat: Callable[[Any], bool] | None = field(default=None, repr=False)

    @property
    def is_cancelled(self) -> Flag:
        """True when the handler should stop and return soon: the row was cancelled, its
        family's time_limit passed, its cap slot lapsed, or its claim was lost. Only after a
        cancel does a return settle the row (as cancelled); after the others it is retried.
        Read it as a bool or call it: ``ctx.is_cancelled`` and ``ctx.is_cancelled()`` agree."""
        return Flag(self.cancelled.is_set())

    def heartbeat(self, progress: Any = None) -> bool:
        """Extend this attempt's lease now and record ``progress`` (JSON) on the row; False
        (and ``is_cancelled``) when the claim was lost or the row was cancelled."""
        if self._beat is None:
            return not self.cancelled.is_set()
        return self._beat(progress)


@dataclass(frozen=True)
class Registration:
    command: str
    family: str
    fn: HandlerFn | None  # None: declared by a producer that does not deliver it
    per_actor: int | None = None  # overrides the family's per-actor cap for this command
    transactional: bool = False  # fn gets ctx.conn; its writes commit with the settle
    task: bool = False  # a Celery task's calls (celery/tasks.py): Flower shows its own name


Resolver = Callable[[str], Registration | None]


class Registry:
    """Commands and their handlers. ``resolve`` finds a command nobody registered: a Celery
    task's name, whose rows its calls wrote (celery/tasks.py); resolvers added with
    ``add_resolver`` are asked after it, in the order added (a Django task's module path,
    contrib/django/tasks.py). What they find is kept."""

    def __init__(self, resolve: Resolver | None = None) -> None:
        self._by_command: dict[str, Registration] = {}
        self.resolve = resolve
        self._resolvers: tuple[Resolver, ...] = ()
        self._resolved: dict[str, Registration] = {}
        # families with a command capped on its own: asked for every row a commit names
        self._capped: frozenset[str] = frozenset()

    def add(self, reg: Registration, known_families: set[str]) -> None:
        if reg.family not in known_families:
            raise UnknownFamily(
                f"command {reg.command!r} names family {reg.family!r}, which is not declared: "
                f"known families are {sorted(known_families)}; add it with dispatcher.family()"
            )
        existing = self._by_command.get(reg.command)
        if existing is not None:
            if existing == reg:
                return
            if not (existing.fn is None and reg.fn is not None and existing.family == reg.family):
                raise DuplicateRegistration(
                    f"command {reg.command!r} is already registered (family "
                    f"{existing.family!r}): give each command one handler"
                )
            # a declaration upgraded to a handler
        self._by_command[reg.command] = reg
        self._capped = frozenset(
            r.family for r in self._by_command.values() if r.per_actor is not None
        )

    def family_of(self, command: object) -> str:
        if not isinstance(command, str) or not command:
            raise UnknownCommand(f"command must be a non-empty str, got {command!r}")
        reg = self._by_command.get(command)
        if reg is None:
            raise UnknownCommand(
                f"unknown command {command!r}: register a handler with "
                f"@dispatcher.handler({command!r}) or, in a producer that does not run it, "
                f"dispatcher.declare({command!r}, family=...)"
            )
        return reg.family

    def handler(self, command: str) -> HandlerFn | None:
        reg = self.registration(command)
        return reg.fn if reg else None

    def add_resolver(self, resolver: Resolver) -> None:
        """Ask ``resolver`` too for a command nobody registered (after ``resolve``); adding
        one that is already there does nothing."""
        if resolver not in self._resolvers:
            self._resolvers = (*self._resolvers, resolver)

    def registration(self, command: str) -> Registration | None:
        reg = self._by_command.get(command)
        if reg is not None:
            return reg
        found = self._resolved.get(command)
        if found is None:
            # a miss is asked again: its module may load later
            for resolve in (self.resolve, *self._resolvers):
                found = resolve(command) if resolve is not None else None
                if found is not None:
                    self._resolved[command] = found
                    break
        return found

    def commands(self) -> list[Registration]:
        return list(self._by_command.values())

    def cap_override(self, command: str) -> int | None:
        reg = self._by_command.get(command)
        return reg.per_actor if reg else None

    def capped_commands(self, family: str) -> bool:
        return family in self._capped
