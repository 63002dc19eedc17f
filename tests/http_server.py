"""A throwaway HTTP server on 127.0.0.1 for tests that need a real one (uploads, config URLs)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class QuietHandler(BaseHTTPRequestHandler):
    """A request handler that keeps the test's output clean."""

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """``http://127.0.0.1:PORT`` of a threaded server running ``handler`` until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True  # a handler still writing does not hold up the end of the block
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
