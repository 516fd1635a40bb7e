"""A slow peer for timing tests: every answer held back, requests passed at once."""

from __future__ import annotations

import socket
import threading
import time


class SlowRelay:
    """A TCP relay on loopback to ``target_port`` that holds back the first
    bytes of every answer ``delay_s``: a far or loaded peer (an agent's
    control port, the server), as a request sees it. ``close()`` ends it."""

    def __init__(self, target_port: int, delay_s: float) -> None:
        self.target, self.delay_s = target_port, delay_s
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
            self.socks += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, 0.0), daemon=True).start()
            threading.Thread(
                target=self._pipe, args=(upstream, client, self.delay_s), daemon=True
            ).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(65536):
                if delay_s:
                    time.sleep(delay_s)
                    delay_s = 0.0
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self) -> None:
        self.listener.close()
        for s in self.socks:
            s.close()

    def __enter__(self) -> SlowRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
