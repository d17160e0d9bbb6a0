"""A TCP relay that a test can cut: a store (or any server) that becomes unreachable and comes back."""

from __future__ import annotations

import socket
import threading

from llmgw.testing.ports import free_port


class CuttableProxy:
    """A TCP relay (to PostgreSQL, say) that the test can cut (every connection closed, new ones
    refused) and restore on the same port: a store that becomes unreachable."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        listener, self._listener = self._listener, None
        with self._lock:
            socks = [*([listener] if listener is not None else []), *self._open]
            self._open.clear()
        for s in socks:
            _close(s)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _close(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                if self._listener is not listener:  # cut while connecting
                    _close(client)
                    _close(upstream)
                    return
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    _close(src)
    _close(dst)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept() or recv() on it
    except OSError:
        pass
    s.close()
