"""Raw TCP throughput over a link, both directions at once: ``python -m bench.linktest serve|send HOST PORT MB``.

The physical side of the bounds: what the shaped link really carries, measured with plain sockets.
"""

from __future__ import annotations

import socket
import sys
import threading
import time

CHUNK = 1 << 16


def pump(sock: socket.socket, num_bytes: int, result: dict) -> None:
    """Send ``num_bytes`` and receive as many at the same time; records the seconds both took."""
    started = time.monotonic()
    payload = b"\0" * CHUNK

    def send():
        left = num_bytes
        while left > 0:
            left -= sock.send(payload[: min(CHUNK, left)])

    sender = threading.Thread(target=send)
    sender.start()
    received = 0
    while received < num_bytes:
        data = sock.recv(CHUNK)
        if not data:
            break
        received += len(data)
    sender.join()
    result["seconds"] = time.monotonic() - started
    result["bytes"] = received


def main(argv=None) -> None:
    role, host, port, megabytes = (argv or sys.argv[1:])[:4]
    num_bytes = int(float(megabytes) * 1e6)
    result: dict = {}
    if role == "serve":
        with socket.create_server((host, int(port))) as server:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                pump(conn, num_bytes, result)
    else:
        deadline = time.monotonic() + 60
        while True:
            try:
                conn = socket.create_connection((host, int(port)), timeout=60)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with conn:
            pump(conn, num_bytes, result)
    print(f"{result['bytes']} {result['seconds']:.4f}", flush=True)


if __name__ == "__main__":
    main()
