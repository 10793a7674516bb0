"""A small random-weight Llama and a locally trained byte-level BPE tokenizer, written to a folder.

vLLM loads it with ``HF_HUB_OFFLINE=1``: nothing is downloaded. Two seeds give one architecture
with different weights (the vLLM tests use that to show the KV really crossed). Imports
``transformers`` and ``tokenizers`` (vLLM's own dependencies) only when called.
"""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving moves the prompt's KV cache from prefill to decode.",
    "kvxfer pulls blocks over TCP or UCX and checks every byte.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
] * 50


def write_tiny_llama(out: str | Path, seed: int = 0, vocab_size: int = 1000, num_layers: int = 2,
                     hidden: int = 128, heads: int = 4, kv_heads: int = 2) -> Path:
    """Default: 2 layers, hidden 128, 4 heads, 2 KV heads (head size 32); returns ``out``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(out)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=4096,
                      bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # wider weights than the default init: sharper logits, so KV changes show
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    # typeshed's functools.wraps result does not bind self, and transformers wraps PreTrainedModel.to
    model.to(torch.bfloat16).save_pretrained(out)  # type: ignore[arg-type]
    return out
