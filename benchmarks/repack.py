"""Receive-side repack beside memcpy of the same bytes: ``kvxfer bench repack`` (see kvxfer/bench/repack.py)."""

import sys

from kvxfer.bench.repack import main

if __name__ == "__main__":
    sys.exit(main())
