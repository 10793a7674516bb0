"""A real vLLM prefill/decode pair through NixlConnector and KvxferConnector, same prompts, one
run: ``kvxfer bench vllm`` (see kvxfer/bench/vllm.py)."""

import sys

from kvxfer.bench.vllm import main

if __name__ == "__main__":
    sys.exit(main())
