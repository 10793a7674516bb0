"""Transfer throughput and latency of every installed connector beside same-run baselines
(memcpy, raw socket, raw ucxx) and, with --peers, NIXL and Mooncake: ``kvxfer bench transfer``
(see kvxfer/bench/transfer.py)."""

import sys

from kvxfer.bench.transfer import main

if __name__ == "__main__":
    sys.exit(main())
