"""Write a tiny random-weight model and a locally trained tokenizer to a folder (nothing downloaded).

    python examples/vllm_pd/tiny_model.py OUT_DIR [--seed N] [--arch llama|gemma2] [--sliding-window N]

``llama`` (default): 2 layers, 2 KV heads of 32. ``gemma2``: the same sizes in Gemma 2's
architecture, its layers alternating sliding-window (``--sliding-window`` tokens, default 64)
and full attention, as vLLM's hybrid KV cache allocator knows them.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvxfer.integrations.tiny_llama import write_tiny_llama

ARCHS = ("llama", "gemma2")


def write_tiny_gemma2(out: str | Path, seed: int = 0, sliding_window: int = 64) -> Path:
    """The tiny Llama's tokenizer and sizes (vocabulary 1000), as a Gemma 2: layer 0 slides over ``sliding_window``
    tokens, layer 1 attends to all (Gemma 2's alternation); random weights from ``seed``."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM, PreTrainedTokenizerFast

    if sliding_window < 1:
        raise ValueError(f"sliding_window: expected >= 1, got {sliding_window}")
    out = write_tiny_llama(out, seed)  # the tokenizer; its weights are replaced below
    tok = PreTrainedTokenizerFast.from_pretrained(out)
    cfg = Gemma2Config(vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32,
                       sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                       max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():  # as the tiny Llama: wide weights, sharp logits, so a KV change shows
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arch", choices=ARCHS, default="llama")
    ap.add_argument("--sliding-window", type=int, default=None, help="gemma2 only: tokens a sliding layer sees (64)")
    args = ap.parse_args()
    if args.arch == "gemma2":
        print(write_tiny_gemma2(args.out, args.seed, 64 if args.sliding_window is None else args.sliding_window))
    elif args.sliding_window is not None:
        ap.error("--sliding-window: only with --arch gemma2 (the tiny Llama has no sliding layers)")
    else:
        print(write_tiny_llama(args.out, args.seed))


if __name__ == "__main__":
    main()
