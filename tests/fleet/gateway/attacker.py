"""Hostile clients of an HTTP server, in a process of their own (so that their work does not
share the test process's interpreter with the well-behaved client it measures).

``python -m tests.fleet.gateway.attacker --port P --kind slow-header|slow-body|big-body
--connections N [--body-bytes B] [--every-s S] [--wait-s W]``: opens the connections, then
drips (a byte per connection every S seconds) or pours (up to B bytes of body each, as fast as
the server reads) until the server has closed every one or W seconds passed. Prints one JSON
line: how many were opened, how many the server closed, and the seconds the last close took.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import selectors
import socket
import sys
import time

PATH = b"/v1/completions"


def _head(kind: str, body_bytes: int) -> bytes:
    if kind == "slow-header":
        return b"POST " + PATH + b" HTTP/1.1\r\nHost: gw\r\n"
    length = 1000 if kind == "slow-body" else body_bytes + (1 << 19)  # never complete
    return (
        b"POST " + PATH + b" HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(length).encode() + b"\r\n\r\n" + b'{"prompt": "'
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--kind", choices=("slow-header", "slow-body", "big-body"), required=True)
    parser.add_argument("--connections", type=int, required=True)
    parser.add_argument("--body-bytes", type=int, default=15 << 20)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--wait-s", type=float, default=30.0)
    args = parser.parse_args(argv)

    head = _head(args.kind, args.body_bytes)
    socks: dict[socket.socket, int] = {}  # socket -> body bytes sent
    start = time.monotonic()
    for _ in range(args.connections):
        s = socket.create_connection(("127.0.0.1", args.port), timeout=10)
        s.sendall(head)
        s.setblocking(False)
        socks[s] = 0
    print(json.dumps({"opened": len(socks)}), flush=True)
    sel = selectors.DefaultSelector()
    for s in socks:
        sel.register(s, selectors.EVENT_READ, s)
    closed = 0
    last_close = 0.0
    chunk = b"x" * (256 << 10)
    next_drip = time.monotonic()
    while socks and time.monotonic() - start < args.wait_s:
        for key, _ in sel.select(timeout=0.05):
            s = key.data
            try:
                data = s.recv(65536)
            except OSError:
                data = b""
            if not data:  # the server closed it (an answer may have come before)
                sel.unregister(s)
                s.close()
                socks.pop(s, None)
                closed += 1
                last_close = time.monotonic() - start
        now = time.monotonic()
        if args.kind == "big-body":
            for s, sent in list(socks.items()):
                if sent >= args.body_bytes:
                    continue
                try:
                    socks[s] = sent + s.send(chunk[: args.body_bytes - sent])
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    pass  # refused: the close shows on the read side
        elif now >= next_drip:
            next_drip = now + args.every_s
            for s in list(socks):
                with contextlib.suppress(BlockingIOError, InterruptedError, OSError):
                    s.send(b"a")
    print(
        json.dumps({"opened": args.connections, "closed": closed, "last_close_s": last_close}),
        flush=True,
    )
    for s in socks:
        s.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
