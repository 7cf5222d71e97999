"""Builds a tiny GPT-2 on disk (random weights from a fixed seed, so every
build is the same model; a byte-level BPE tokenizer trained by
``tokenizers``), so the transformers backend is tested without downloading
anything."""

from pathlib import Path


def build_tiny_gpt2(
    path: Path, n_layer: int = 2, n_embd: int = 32, n_head: int = 2, n_positions: int = 256
) -> Path:
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    corpus = [
        "the quick brown fox jumps over the lazy dog",
        "infergate batches requests onto gpu workers",
        "hello world, one string in and one string out",
    ] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        corpus, vocab_size=300, min_frequency=1, special_tokens=["<|endoftext|>"]
    )
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        bos_token="<|endoftext|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.save_pretrained(path)
    eos = int(tokenizer.eos_token_id)
    config = GPT2Config(
        bos_token_id=eos,
        eos_token_id=eos,
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=n_head,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(path)
    return path
