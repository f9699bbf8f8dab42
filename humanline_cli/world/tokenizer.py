"""Character-level tokenizer for the bundled world.

Consumes nothing (the vocabulary is fixed here); produces a
`transformers.PreTrainedTokenizerFast` with pad/bos/eos, the chat markers
`<|user|>` / `<|assistant|>` and a Jinja chat template, ready for
`save_pretrained` next to the policy weights.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, USER, ASSISTANT = "<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"
SPECIALS = [PAD, BOS, EOS, USER, ASSISTANT]
# Every character either task can write; a-z serve the preference task, the
# rest arithmetic. Anything else has no id (it simply never occurs).
CHARS = list("0123456789+=-*") + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(" .,:;?!")

# `{bos}<|user|>PROMPT` then `<|assistant|>REPLY{eos}` per reply; the
# generation prompt opens a reply, so prompt-with-generation-prompt is a
# token prefix of prompt + completion (callers rely on that to split them).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# world.format=plain: the prototype's format, `{bos}PROMPT` then `REPLY{eos}` (no chat markers;
# the generation prompt adds nothing, so the prefix property above still holds).
PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}"
    "{% endfor %}"
)
TEMPLATES = {"chat": CHAT_TEMPLATE, "plain": PLAIN_TEMPLATE}


def build_tokenizer(fmt: str = "chat") -> PreTrainedTokenizerFast:
    """`fmt`: `chat` (the markers above) or `plain` (PLAIN_TEMPLATE)."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS + CHARS)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=None))
    # Split into single characters; spaces are ordinary tokens (no merging).
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        additional_special_tokens=[USER, ASSISTANT],
        chat_template=TEMPLATES[fmt],
        model_max_length=64,
        clean_up_tokenization_spaces=False,
    )
    return tok
