"""Write a tiny random-weight Llama and a locally trained tokenizer to a folder (nothing downloaded).

    python examples/vllm_pd/tiny_model.py OUT_DIR [--seed N]
"""

from __future__ import annotations

import argparse

from kvxfer.integrations.tiny_llama import write_tiny_llama


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(write_tiny_llama(args.out, args.seed))


if __name__ == "__main__":
    main()
