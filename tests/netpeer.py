"""Runs one kvproc rank inside a network namespace (``ip netns exec NS python netpeer.py PATH``).

It connects back to the test over a Unix socket at PATH (filesystem sockets cross network
namespaces), receives (function name, args) and runs that kvproc entry point with the
connection as its pipe.
"""

import sys
from multiprocessing.connection import Client

import kvproc

if __name__ == "__main__":
    conn = Client(sys.argv[1], family="AF_UNIX", authkey=sys.argv[2].encode())
    name, args, kwargs = conn.recv()
    if name not in ("producer_main", "consumer_server"):
        raise SystemExit(f"netpeer: unknown entry point {name!r}")
    getattr(kvproc, name)(*args, conn, **kwargs)
