"""A TCP forwarder that tests can cut and restore, to take Postgres or Redis "down" for one
client without touching the shared servers other test runs use.

``cut()`` closes every live connection (clients see the server hang up) and stops listening
(new connections are refused); ``restore()`` listens on the same port again.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from types import TracebackType
from urllib.parse import urlsplit, urlunsplit


class FaultProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.accepted = 0  # connections forwarded since start, for tests to see traffic passed
        self._lock = threading.Lock()
        self._live: set[socket.socket] = set()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._up = threading.Event()

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> FaultProxy:
        self._listen()
        return self

    def cut(self) -> None:
        """Postgres/Redis "goes down": live connections drop, new ones are refused."""
        self._up.clear()
        with self._lock:
            listener, self._listener = self._listener, None
            live, self._live = self._live, set()
        if listener is not None:
            listener.close()
        if self._acceptor is not None:
            self._acceptor.join(timeout=2)
        for s in live:
            _hang_up(s)

    def restore(self) -> None:
        """Back up on the same port."""
        if not self._up.is_set():
            self._listen()

    def close(self) -> None:
        self.cut()

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def is_up(self) -> bool:
        return self._up.is_set()

    def url(self, url: str) -> str:
        """``url`` (postgresql://, redis://) with its host and port replaced by the proxy's."""
        parts = urlsplit(url)
        userinfo, _, _ = parts.netloc.rpartition("@")
        netloc = f"{userinfo}@" if userinfo else ""
        netloc += f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    # -- forwarding --------------------------------------------------------------------------

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.05)  # the accept loop checks for a cut this often
        self.port = listener.getsockname()[1]
        with self._lock:
            self._listener = listener
        self._up.set()
        self._acceptor = threading.Thread(
            target=self._accept_loop, args=(listener,), name="faultproxy-accept", daemon=True
        )
        self._acceptor.start()

    def _accept_loop(self, listener: socket.socket) -> None:
        while self._up.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # the listener was closed by cut()
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _hang_up(client)
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                if not self._up.is_set():
                    _hang_up(client)
                    _hang_up(upstream)
                    return
                self._live |= {client, upstream}
                self.accepted += 1
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(
                    target=self._pump, args=(src, dst), name="faultproxy-pump", daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._live.discard(src)
                self._live.discard(dst)
            _hang_up(src)
            _hang_up(dst)


def _hang_up(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


@contextlib.contextmanager
def proxied(target_port: int) -> Iterator[FaultProxy]:
    with FaultProxy(target_port) as proxy:
        yield proxy
