"""Time to first token and inter-token latency, disaggregated against one monolithic instance:
``kvxfer bench e2e`` (see kvxfer/bench/e2e.py)."""

import sys

from kvxfer.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
