"""In-process training pieces: a tiny offline run's parts and spec, the loop driven once, and an online source
over fixed completions."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from humanline_cli.backend import make_backend
from humanline_cli.config import TrainSpec
from humanline_cli.core.batches import PairBatch
from humanline_cli.core.corrections import NO_CORRECTION
from humanline_cli.core.humanline import HumanlineSpec, ReferenceRule
from humanline_cli.core.interfaces import Completions, SamplingParams
from humanline_cli.core.logprobs import PolicyForward
from humanline_cli.core.reference import CachedReference, FrozenCopy
from humanline_cli.data.collate import Collator, Encoder, make_seqs
from humanline_cli.data.examples import PairExample
from humanline_cli.eval.evaluator import Side
from humanline_cli.sources.offline import OfflineSource
from humanline_cli.sources.online import OnlineSource, RoundSpec
from humanline_cli.train import checkpoint as C
from humanline_cli.train.build import Parts
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import Tracker
from humanline_cli.train.trainer import train
from humanline_cli.world.tokenizer import build_tokenizer
from tests.helpers.models import tiny_llama


def checkpoint_llama():
    """The checkpoint tests' policy: vocab 32, hidden 32, 2 layers, tied head, 32 positions, seed 0."""
    return tiny_llama(0, vocab_size=32, head_dim=16, max_position_embeddings=32, tie_word_embeddings=True).train()


def _ids(text: str) -> list[int]:
    return [10 + ord(c) % 20 for c in text] + [2]


def _collate(mine, theirs):
    prompts = [_ids(u.prompt)[:-1] for u in mine]
    return PairBatch(make_seqs(prompts * 2, [_ids(u.chosen) for u in mine] + [_ids(u.rejected) for u in mine], 0))


UNITS = [PairExample(f"q{i}", f"a{i * 7 % 10}b", f"c{i % 3}") for i in range(14)]


def offline_parts(lora: bool, moving: bool, cached: bool = False):
    policy = checkpoint_llama()
    if lora:
        from humanline_cli.core.lora import apply_lora
        from humanline_cli.core.reference import make_lora_reference

        policy = apply_lora(policy, 4, 8.0, 0.0)
        reference = make_lora_reference(policy, moving=moving)
    else:
        reference = FrozenCopy(policy)
    if cached:  # a fixed reference's log-prob cache, over 3-step epochs: steps 4-6 reuse cached numbers
        reference = CachedReference(reference)
    source = OfflineSource(UNITS[:6] if cached else UNITS, _collate, batch_size=2, micro_batch_size=2, seed=3)
    evaluator = SimpleNamespace(baseline=Side(["x", "yz"], [0.25, 0.5]),
                                greedy_baseline=Side(["g", ""], [1.0, 0.0]))
    return Parts(make_backend("cpu", "fp32"), None, None, policy, reference, source, evaluator, None,
                 PolicyForward(policy))


def train_spec(steps: int, moving: bool, every: int, keep: int = 2):
    tr = TrainSpec(steps=steps, batch_size=2, micro_batch_size=2, lr=1e-2, weight_decay=0.01, warmup_ratio=0.5,
                   schedule="cosine", max_grad_norm=1.0, max_length=32, max_prompt_length=8, log_every=1,
                   save_model=False, checkpoint_every=every, keep_checkpoints=keep)
    hl = HumanlineSpec(clamp=True, sync=True) if moving else HumanlineSpec()
    return SimpleNamespace(train=tr, humanline=hl, objective_cfg=SimpleNamespace(name="dpo", beta=0.1),
                           regime="offline", eval_cfg=SimpleNamespace(every=0), correction=NO_CORRECTION)


def run_train(run_dir: Path, parts, spec, resume_from=None, checkpoints=None):
    run_dir.mkdir(parents=True, exist_ok=True)
    tracker = Tracker(run_dir, {}, {"mode": "disabled"}, "t")
    ckpts = checkpoints or C.Checkpoints(run_dir, spec.train.checkpoint_every, spec.train.keep_checkpoints)
    timer = PhaseTimer()
    last = train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
                 rule=ReferenceRule.from_spec(spec.humanline, spec.regime, spec.correction), correction=spec.correction,
                 tracker=tracker, timer=timer, checkpoints=ckpts, resume_from=resume_from)
    tracker.finish()
    return last, ckpts, timer


class ObjectiveStub:
    std_ddof, std_eps = 0, 0.01


def online_source(objective, texts, scorer, n_prompts=4, batch=4):
    tok = build_tokenizer()
    enc = Encoder(tok, 16, 32)
    rows = [{"prompt": [{"role": "user", "content": f"{i:02d}+01="}]} for i in range(n_prompts)]
    rounds = RoundSpec(objective, batch, batch, SamplingParams(n=len(texts)), prompts_per_round=2, min_gap=0.01, seed=0)
    return OnlineSource(rows, enc, Collator(enc, ObjectiveStub()), FixedSampler(tok, texts), ("fake", scorer), rounds,
                        timer=PhaseTimer(), policy=None)


def length_score(prompts, completions, answers=None):
    return [len(c) / 10 for c in completions]  # "1" -> 0.1, "333" -> 0.3


class FixedSampler:
    """Unit-test helper: returns scripted completions (text -> ids with the real tokenizer)."""

    def __init__(self, tok, texts_per_prompt):
        self.tok, self.texts, self.pushes = tok, texts_per_prompt, 0

    def push_weights(self, policy):
        self.pushes += 1

    def sleep(self):
        pass

    def generate(self, prompt_ids, params, indices=None):
        texts = [t for _ in prompt_ids for t in self.texts[: params.n]]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        return Completions(params.n, ids, [[-0.5] * len(i) for i in ids], texts)

    def close(self):
        pass
