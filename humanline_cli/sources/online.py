"""Online source: rounds of sample -> label -> feedback -> batches, inside the training process.

Per round: take the next P prompts (each used once per epoch), push the policy's weights to the
sampler, sample N completions per prompt, score them with the task's labeller, turn the scored
groups into the objective's units (DPO best vs worst if the gap exceeds min_gap; KTO the same pair
split; GRPO the whole group), then yield one epoch of optimizer steps over them. Yields the same
StepData as the offline source.

Under DDP/FSDP each rank samples and labels only its share of the round's prompts (Shard.share), with
per-completion seeds from (seed, round, prompt index, sample index); the shares are then gathered in
prompt order, so every rank holds exactly the one-process round and builds the same units from it.

Asynchronous rounds (data.async_lag = L > 0): a `producer` (sampling/rounds_worker.py) samples each
round from a snapshot of the weights taken L rounds before it trains: at the start of round r the source
submits round r + L with the current weights (round 1 submits rounds 1..1+L, all from the starting
weights) and collects round r, sampled meanwhile. Each round's info carries the optimizer step of the
weights that sampled it (online/policy_version) and its staleness in steps. A checkpoint holds the
in-flight rounds' completions (it waits for them), so a resumed run trains on exactly the same samples.
Under DDP/FSDP every rank has its own producer and submits only its share of the round (with the
prompts' indices in the round: the same per-completion seeds as one process); the collected shares are
labelled and gathered as in synchronous rounds. The snapshot is taken by every rank at the same point
(under FSDP2 it gathers each parameter: a collective), and a checkpoint gathers the in-flight rounds'
shares, so it stores whole rounds, exactly as one process would.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from humanline_cli.core import objectives
from humanline_cli.core.feedback import ScoredGroup
from humanline_cli.core.interfaces import Completions, SamplingParams, StepData
from humanline_cli.data.examples import units_from_group
from humanline_cli.errors import cannot_write
from humanline_cli.rewards.scorers import checked
from humanline_cli.sampling.rounds_worker import snapshot
from humanline_cli.sources.source import Shard, micro_batches


@dataclass(frozen=True)
class TokenCompletion:
    """A sampled completion kept as the sampler's token ids (no re-tokenisation drift)."""

    ids: tuple[int, ...]
    text: str
    logps: tuple[float, ...]


@dataclass(frozen=True)
class RoundSpec:
    """What a round does: the objective's unit, how many prompts and samples, the DPO/KTO gap."""

    objective: str
    batch_size: int          # units per optimizer step (global)
    micro_batch_size: int
    params: SamplingParams   # n samples per prompt, temperature, top_p, max_new_tokens
    prompts_per_round: int
    min_gap: float
    seed: int


class OnlineSource:
    def __init__(self, rows, encoder, collate, sampler, labeller, spec: RoundSpec, timer, policy,
                 samples_path: Path | None = None, shard: Shard = Shard(), length=None, lag: int = 0,
                 producer=None):
        self.shard = shard
        # asynchronous rounds: `lag` rounds stale, sampled by `producer` (InlineRounds or SamplerProcess)
        self.lag, self.producer = lag, producer
        self._pending: dict[int, dict] = {}   # submitted rounds: their prompt indices and policy version
        self._done: dict[int, Completions] = {}  # rounds already collected from the producer (a checkpoint's)
        self._steps_done = 0                  # optimizer steps behind the live weights (the policy version)
        # per sampled round (this process's, not a checkpoint's): when the trainer began it and collected it,
        # when the producer sampled it (time.monotonic(), one clock across processes) and its CPU and
        # run-queue seconds: the overlap actually achieved, round by round (the bench and the tests read it)
        self.round_clock: dict[int, dict] = {}
        self.length = length  # unit -> tokens: length bucketing in micro_batches (None: off)
        self.rows, self.encoder, self.collate = rows, encoder, collate
        self.sampler, (self.labeller_name, self.labeller) = sampler, labeller
        self.objective, self.batch_size, self.micro = spec.objective, spec.batch_size, spec.micro_batch_size
        self.params, self.ppr, self.min_gap = spec.params, spec.prompts_per_round, spec.min_gap
        self.rng, self.seed, self.timer, self.policy = random.Random(spec.seed), spec.seed, timer, policy
        self.samples_path = samples_path
        self.round = 0
        self.epoch = 0
        self._order: list[int] = []
        self._queue: list = []
        self._round_info: dict = {}
        self._sample_tokens = 0
        self._sample_seconds = 0.0

    def describe(self) -> str:
        p = self.params
        return (f"online: {len(self.rows)} prompts, {self.ppr} per round x {p.n} samples "
                f"(T={p.temperature}, top_p={p.top_p}, max_new_tokens={p.max_new_tokens}), "
                f"sampler {self.producer.name if self.lag else type(self.sampler).__name__}, "
                f"labeller {self.labeller_name}")

    def _next_prompts(self) -> list[dict]:
        return [self.rows[i] for i in self._next_prompt_indices()]

    def _next_prompt_indices(self) -> list[int]:
        out = []
        while len(out) < self.ppr:
            if not self._order:  # each prompt once per epoch, reshuffled per epoch
                self._order = list(range(len(self.rows)))
                self.rng.shuffle(self._order)
                self.epoch += 1
            out.append(self._order.pop())
        return out

    def _sample_share(self, rows: list[dict], params: SamplingParams) -> list[tuple]:
        """Sample and label this rank's share of the round; gather every rank's, in prompt order.
        Returns per prompt of the whole round: (token ids, texts, log-probs, scores) of its n completions."""
        n = params.n
        mine = self.shard.share(len(rows))
        prompts = [rows[i]["prompt"] for i in mine]
        with self.timer.phase("sample"):
            t = time.perf_counter()
            out = self.sampler.generate([self.encoder.prompt_ids(p) for p in prompts], params, indices=mine)
            self._sample_seconds += time.perf_counter() - t
        return self._label_share(rows, mine, out, n)

    def _label_share(self, rows: list[dict], mine: list[int], out: Completions, n: int) -> list[tuple]:
        prompts = [rows[i]["prompt"] for i in mine]
        with self.timer.phase("label"):
            texts = [self.encoder.prompt_text(p) for p in prompts for _ in range(n)]
            answers = [rows[i].get("answer") for i in mine for _ in range(n)] if "answer" in rows[0] else None
            scores = checked(self.labeller_name, self.labeller, texts, out.texts, answers) if mine else []
        local = [(i, out.token_ids[a * n:(a + 1) * n], out.texts[a * n:(a + 1) * n], out.logps[a * n:(a + 1) * n],
                  scores[a * n:(a + 1) * n]) for a, i in enumerate(mine)]
        groups = sorted((g for part in self.shard.gather(local) for g in part), key=lambda g: g[0])
        if [g[0] for g in groups] != list(range(len(rows))):
            raise RuntimeError("the ranks' shares of the round do not cover its prompts exactly once")
        return [g[1:] for g in groups]

    def _round_params(self, round_no: int) -> SamplingParams:
        return SamplingParams(**{**vars(self.params), "seed": self.seed * 100003 + round_no})

    def _submit(self, round_no: int, weights) -> None:
        """Asynchronous rounds: draw round `round_no`'s prompts now (every rank draws all of them: the same
        order) and hand this rank's share of them to the producer with `weights` (the snapshot that must
        sample them) and their places in the round (the completions' seeds). An empty share is submitted
        too: every rank's producer runs every round."""
        idx = self._next_prompt_indices()
        mine = self.shard.share(len(idx))
        prompt_ids = [self.encoder.prompt_ids(self.rows[idx[a]]["prompt"]) for a in mine]
        self.round_clock.setdefault(round_no, {})["submitted_at"] = time.monotonic()
        self.producer.submit(round_no, weights, prompt_ids, self._round_params(round_no), indices=mine)
        self._pending[round_no] = {"prompts": idx, "version": self._steps_done}

    def _collect(self, round_no: int) -> Completions:
        if round_no in self._done:
            return self._done.pop(round_no)
        asked = time.monotonic()
        out, timing = self.producer.result(round_no)
        self.round_clock.setdefault(round_no, {}).update(
            asked_at=asked, collected_at=time.monotonic(), started_at=timing.started_at,
            finished_at=timing.finished_at, cpu_s=timing.cpu_s, run_queue_s=timing.run_queue_s,
            page_faults=timing.page_faults)
        self.timer.add("sample", timing.sample_s)  # in a child process: overlapped with training
        self.timer.add("wait_for_sample", timing.wait_for_sample_s)
        self.timer.add("wait_for_trainer", timing.wait_for_trainer_s)
        if timing.sampler_start_s:
            self.timer.add("sampler_start", timing.sampler_start_s)
        self._sample_seconds += timing.sample_s
        return out

    def _lagged_round(self) -> tuple[list[dict], list[tuple], dict]:
        """Round `self.round` of an asynchronous run: keep rounds up to round + lag submitted (never
        more: the queue is bounded), then collect this one."""
        self.round_clock.setdefault(self.round, {})["began_at"] = time.monotonic()
        weights = None
        for r in range(self.round, self.round + self.lag + 1):
            if r not in self._pending:
                if weights is None:
                    with self.timer.phase("push"):
                        weights = snapshot(self.policy)
                self._submit(r, weights)
        job = self._pending.pop(self.round)
        rows = [self.rows[i] for i in job["prompts"]]
        out = self._collect(self.round)  # this rank's share, sampled by its own producer
        groups = self._label_share(rows, self.shard.share(len(rows)), out, self.params.n)
        return rows, groups, {"online/policy_version": job["version"]}

    def _run_round(self) -> None:
        self.round += 1
        extra: dict = {}
        if self.lag:
            rows, groups, extra = self._lagged_round()
        else:
            rows = self._next_prompts()
            with self.timer.phase("push"):
                self.sampler.push_weights(self.policy)
            groups = self._sample_share(rows, self._round_params(self.round))
            self.sampler.sleep()  # the round is sampled: its engine's GPU memory goes to training until the next push
        prompts = [r["prompt"] for r in rows]
        n = self.params.n
        out_ids = [ids for g in groups for ids in g[0]]
        out_texts = [t for g in groups for t in g[1]]
        out_logps = [lp for g in groups for lp in g[2]]
        scores = [x for g in groups for x in g[3]]
        texts = [self.encoder.prompt_text(p) for p in prompts for _ in range(n)]
        self._sample_tokens += sum(len(ids) for ids in out_ids)  # the round's, over all ranks
        units, dropped = [], 0
        for i, p in enumerate(prompts):
            comps = [TokenCompletion(tuple(out_ids[k]), out_texts[k], tuple(out_logps[k]))
                     for k in range(i * n, (i + 1) * n)]
            u = units_from_group(self.objective, ScoredGroup(p, comps, scores[i * n:(i + 1) * n]), self.min_gap)
            dropped += not u
            units += u
        # groups whose scores all tie: DPO/KTO drop them (no pair); GRPO keeps them with advantage 0 (they still
        # weigh in the KL term and the token-mean normaliser, as in TRL), so they are counted, not skipped
        tied = sum(len(set(scores[i * n:(i + 1) * n])) == 1 for i in range(len(prompts)))
        self.rng.shuffle(units)
        self._queue = [units[i:i + self.batch_size] for i in range(0, len(units), self.batch_size)]
        # completion tokens (as collated: the sampled ids) per optimizer step, averaged over the round:
        # tokens x batch_size / units (TRL's dapo normaliser; exact when the round is one step)
        tokens = sum(len(c.ids) for u in units for c in _completions(u))
        per_step = float(tokens * self.batch_size) / len(units) if units else None
        self._round_info = {"online/round": self.round, "online/epoch": self.epoch,
                            "online/label_reward_mean": sum(scores) / len(scores),
                            "online/dropped_prompts": dropped, "online/tied_groups": tied, "online/units": len(units),
                            "online/empty_completions": sum(1 for t in out_texts if not t.strip()),
                            "online/round_tokens_per_step": per_step, **extra}
        version = {"policy_version": extra["online/policy_version"]} if extra else {}
        if self.samples_path is not None:
            self._write_samples(texts, out_texts, [len(ids) for ids in out_ids], scores, version)

    def _write_samples(self, prompts: list[str], completions: list[str], tokens: list[int], scores: list[float],
                       version: dict) -> None:
        """The round's samples appended to samples.jsonl. A failed write (a full disk) is one RunFailed line
        naming the file; the lines of this round that did get written are cut back on resume (to the
        checkpoint's round), like any other round after the checkpoint."""
        try:
            with open(self.samples_path, "a") as f:
                for k, text in enumerate(completions):
                    f.write(json.dumps({"round": self.round, "prompt": prompts[k], "completion": text,
                                        "tokens": tokens[k], "score": scores[k], **version}) + "\n")
        except OSError as e:
            raise cannot_write(self.samples_path, e) from e

    def next_step(self, step: int) -> StepData:
        self._steps_done = step - 1
        new_round = False
        if not self._queue:
            self._run_round()
            new_round = True
            if not self._queue:  # every prompt dropped by the threshold: log and skip this step
                return StepData([], new_round=True, info={**self._round_info, "online/skipped_round": 1})
        units = self._queue.pop(0)  # any count: ranks with a shorter share pad with fillers (micro_batches)
        info = dict(self._round_info)
        if self.lag:  # optimizer steps between the weights that sampled this step's units and the live ones
            info["online/staleness_steps"] = self._steps_done - info["online/policy_version"]
        return StepData(micro_batches(units, self.collate, self.micro, self.shard, self.length), new_round=new_round,
                        info=info, round_tokens_per_step=self._round_info.get("online/round_tokens_per_step"))

    def state_dict(self) -> dict:
        """Where the rounds stand: round and epoch, what is left of the prompt order, the current round's
        remaining queued units (PairExample / BinaryExample / GroupExample holding TokenCompletions; the
        checkpoint writes them as JSON), its info, the shuffle RNG and the sampling counters. The
        sampler's seed is derived from the round (seed * 100003 + round; each completion's from that, its
        prompt's index in the round and its sample index), so the round restores it."""
        state = {"n_prompts": len(self.rows), "round": self.round, "epoch": self.epoch, "order": list(self._order),
                 "queue": [list(batch) for batch in self._queue], "round_info": dict(self._round_info),
                 "rng": self.rng.getstate(), "sample_tokens": self._sample_tokens,
                 "sample_seconds": self._sample_seconds}
        if self.lag:  # the in-flight rounds, sampled: waits for them (a resumed run has no old weights to redo them)
            for r in sorted(self._pending):
                if r not in self._done:
                    self._done[r] = self._collect(r)
            state["pending"] = [{"round": r, "prompts": job["prompts"], "version": job["version"],
                                 "completions": vars(self._whole_round(self._done[r]))}
                                for r, job in sorted(self._pending.items())]
        return state

    def _whole_round(self, share: Completions) -> Completions:
        """Every rank's share of an in-flight round, joined in rank order (= prompt order: Shard.share gives
        contiguous blocks): the one-process round. A collective under DDP/FSDP: every rank calls state_dict
        (Checkpoints.save), rank 0 writes it."""
        parts = self.shard.gather(share)
        return Completions(share.n, [x for p in parts for x in p.token_ids], [x for p in parts for x in p.logps],
                           [x for p in parts for x in p.texts])

    def load_state_dict(self, state: dict) -> None:
        if state["n_prompts"] != len(self.rows):
            raise ValueError(f"the checkpoint was made with {state['n_prompts']} prompts, the data now has "
                             f"{len(self.rows)}")
        self.round, self.epoch = int(state["round"]), int(state["epoch"])
        self._order = [int(i) for i in state["order"]]
        self._queue = [list(batch) for batch in state["queue"]]
        self._round_info = dict(state["round_info"])
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self._sample_tokens, self._sample_seconds = int(state["sample_tokens"]), float(state["sample_seconds"])
        for job in state.get("pending", []):  # whole rounds: this rank keeps its share of each
            r = int(job["round"])
            self._pending[r] = {"prompts": [int(i) for i in job["prompts"]], "version": int(job["version"])}
            c, n = job["completions"], int(job["completions"]["n"])
            if len(c["texts"]) != n * len(job["prompts"]):
                raise ValueError(f"the checkpoint's in-flight round {r} has {len(c['texts'])} completions, not "
                                 f"{n} for each of its {len(job['prompts'])} prompts")
            rows = [k for a in self.shard.share(len(job["prompts"])) for k in range(a * n, (a + 1) * n)]
            self._done[r] = Completions(n, [list(c["token_ids"][k]) for k in rows], [list(c["logps"][k]) for k in rows],
                                        [c["texts"][k] for k in rows])

    def sample_tokens_per_s(self) -> float | None:
        return self._sample_tokens / self._sample_seconds if self._sample_seconds else None

    def close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()
        finally:
            self.sampler.close()


def _completions(unit) -> list:
    """The completions a unit trains on (their loss-mask tokens are the dapo normaliser's count)."""
    return objectives.for_unit(unit).completions(unit)
