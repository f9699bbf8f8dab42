"""The authors' math recipe (experiment=paper_math): the <think>/<answer> system prompt and the reward
8 x accuracy + 1 x format + 1 x tag_count, hand-computed on example completions."""
from __future__ import annotations

import string

import pytest
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.data.collate import Encoder
from humanline_cli.errors import UserError
from humanline_cli.rewards.scorers import checked, make_scorer
from humanline_cli.rewards.think_format import format_reward, tag_count_reward

RECIPE = {"kind": "verifier", "method": "math_latex", "weights": {"accuracy": 8.0, "format": 1.0, "tag_count": 1.0}}

# (completion, reference answer, accuracy under math_latex, format, tag_count); total = 8 acc + format + tags
CASES = [
    ("<think>\n2+2\n</think>\n<answer>\n\\boxed{4}\n</answer>", "4", 1, 1, 1.0),       # all right: 10
    ("<think>\n2+3\n</think>\n<answer>\n\\boxed{5}\n</answer>", "4", 0, 1, 1.0),       # wrong answer: 2
    ("<think>\nx</think><answer>\\boxed{4}</answer>", "4", 1, 0, 0.25),                # only "<think>\n": 8.25
    ("The answer is 4.", "4", 0, 0, 0.0),                                               # no LaTeX, no tags: 0
    ("<think>\na\n</think>\n<answer>\n$4$\n</answer>\nmore", "4", 1, 1, 1.0),           # text on a later line: 10
    ("<think>\na\n</think>\n<answer>\n$4$\n</answer>!", "4", 1, 0, 1.0),                # "</answer>!" ends no line: 9
    ("<think>\n<think>\n2+2\n</think>\n<answer>\n\\frac{8}{2}\n</answer>", "4", 1, 1, 0.75),  # "<think>\n" twice: 9.75
    ("<think>\n\n</think>\n<answer>\n\n</answer>", "4", 0, 1, 1.0),                    # empty blocks match: 2
]


def test_format_and_tag_count_by_hand():
    for text, _, _, fmt, tags in CASES:
        assert format_reward(text) == fmt, text
        assert tag_count_reward(text) == tags, text


def test_the_recipe_labeller_sums_8_accuracy_format_and_tag_count():
    """As the run builds it (make_scorer on the labeller's config): 10, 2, 8.25, 0, 10, 9, 9.75, 2. Method math
    (our default extraction) also reads the bare "4" of "The answer is 4." (8 instead of 0): the recipe's
    math_latex only reads LaTeX."""
    name, scorer = make_scorer(RECIPE)
    texts, answers = [c[0] for c in CASES], [c[1] for c in CASES]
    got = checked(name, scorer, [""] * len(texts), texts, answers)
    assert got == [10.0, 2.0, 8.25, 0.0, 10.0, 9.0, 9.75, 2.0]
    assert got == [8 * acc + fmt + tags for _, _, acc, fmt, tags in CASES]
    _, plain = make_scorer({**RECIPE, "method": "math"})
    assert plain([""], ["The answer is 4."], ["4"]) == [8.0]
    _, accuracy_only = make_scorer({"kind": "verifier", "method": "math_latex"})  # no weights: accuracy alone
    assert accuracy_only([""] * len(texts), texts, answers) == [float(c[2]) for c in CASES]


def _char_tokenizer():
    """Printable ASCII, one token per character, and a chat template with a system role."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(string.printable) - set("\r\x0b\x0c"))
    vocab = {t: i for i, t in enumerate(["[PAD]", "[EOS]", "[UNK]"] + chars)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="[PAD]", eos_token="[EOS]", unk_token="[UNK]")
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}[assistant]{% endif %}")
    return tok


def test_the_system_prompt_goes_before_every_string_prompt():
    """task.system_prompt: a string prompt is encoded as [system, user] through the chat template; a
    conversational prompt keeps its own messages; no template: one-line error."""
    tok = _char_tokenizer()
    enc = Encoder(tok, max_prompt_length=200, max_length=300, system_prompt="Think first.")
    want = tok("[system]Think first.[user]What is 2+2?[assistant]", add_special_tokens=False)["input_ids"]
    assert enc.prompt_ids("What is 2+2?") == want
    own = [{"role": "user", "content": "hi"}]
    assert enc.prompt_ids(own) == tok("[user]hi[assistant]", add_special_tokens=False)["input_ids"]
    tok.chat_template = None
    with pytest.raises(UserError, match="task.system_prompt needs a tokenizer with a chat template"):
        Encoder(tok, 200, 300, system_prompt="Think first.").prompt_ids("What is 2+2?")


def _compose(overrides):
    with initialize_config_module("conf", version_base=None):
        return compose("train", overrides=overrides)


def test_paper_math_uses_the_recipes_prompt_and_rewards():
    spec = resolve(_compose(["experiment=paper_math"]))
    t = spec.task_cfg
    assert t.system_prompt == (
        "You are a helpful AI Assistant that provides well-reasoned and detailed responses. You first think about "
        "the reasoning process as an internal monologue and then provide the user with the answer. Respond in the "
        "following format: <think>\n...\n</think>\n<answer>\n...\n</answer>")
    assert (t.labeller.kind, t.labeller.method, t.labeller.weights) == (
        "verifier", "math_latex", {"accuracy": 8.0, "format": 1.0, "tag_count": 1.0})
    assert t.judge.weights is None  # evaluation scores accuracy alone
    assert resolve(_compose(["task=math"])).task_cfg.system_prompt is None
    with pytest.raises(UserError, match="task.labeller.weights' must map some of accuracy, format, tag_count"):
        resolve(_compose(["experiment=paper_math", "+task.labeller.weights.length=1.0"]))
    with pytest.raises(UserError, match="task.labeller.weights' needs task.labeller.kind=verifier"):
        resolve(_compose(["experiment=paper_math", "task.labeller.kind=model", "task.labeller.name_or_path=x"]))
    with pytest.raises(UserError, match="task.system_prompt needs the chat template"):
        resolve(_compose(["experiment=paper_math", "chat_template=false"]))
