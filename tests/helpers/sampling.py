"""The samplers' fixtures: a one-character-per-token tokenizer, a tiny Llama with peaked distributions, and the
prompts both samplers are compared on."""
from __future__ import annotations

import torch

from tests.helpers.models import tiny_llama

CHARS = list("abcdefghijklmnopqrstuvwxyz .,!?'")


SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]


# prompts of lengths 1..12, all regular tokens (ids >= 4)
PROMPTS = [[4 + (7 * i + 3 * k) % len(CHARS) for k in range(n)]
           for i, n in enumerate([1, 3, 5, 2, 8, 12, 4, 7])]


LOGP_TOL = 1e-4


def char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="[PAD]", bos_token="[BOS]", eos_token="[EOS]",
        unk_token="[UNK]")


def peaked_llama(vocab_size: int):
    """Peaked distributions (initializer_range 0.3: no near-ties for greedy to flip on), tied head, seed 0, eval."""
    model = tiny_llama(0, vocab_size=vocab_size, hidden_size=64, intermediate_size=128, head_dim=32,
                       max_position_embeddings=256, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2, initializer_range=0.3, torch_dtype="float32").float().eval()
    with torch.no_grad():  # make EOS a likely-but-not-certain choice so some completions stop
        model.model.embed_tokens.weight[2] *= 3.0
    return model


def tiny64():
    tok = char_tokenizer()
    return peaked_llama(len(tok)).double(), tok  # float64: equal-in-exact-arithmetic checks to 1e-10
