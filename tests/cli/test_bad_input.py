"""The bad-input promise, through the real CLI in subprocesses: exit code 2, exactly ONE stderr line
starting with `humanline: error:`, no traceback (unless HYDRA_FULL_ERROR=1 asks for it), no
summary.json, failed.json where a run dir was made, nothing changed in a previously complete run dir.
Also: Ctrl-C (exit 130, one line, failed.json), a sweep with a failed job (the others finish, one line
at the end), secrets masked in every file a run writes, remote code off by default and named when
needed. A failed model save leaving no temp dir and stale world build dirs cleaned: test_atomic_writes.py."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.errors import UserError
from tests.helpers.cli import FAST, TINY_WORLD, run_cli, tiny_world_cfg

CONF = Path(__file__).resolve().parents[2] / "conf"
BASE = [*TINY_WORLD, *(a for a in FAST if not a.startswith("threads="))]  # cases set threads themselves
SECRET = "SECRETVALUE123"


@pytest.fixture(scope="module")
def world(cache_dir) -> Path:
    from humanline_cli.world.cache import materialise

    return materialise(tiny_world_cfg(), cache_dir, progress=False)


@pytest.fixture(scope="module")
def models(world, tmp_path_factory) -> dict:
    """A truncated copy of the bundled policy, and a copy whose config.json asks for its own code."""
    root = tmp_path_factory.mktemp("models")
    truncated = root / "truncated"
    shutil.copytree(world / "policy", truncated)
    weights = truncated / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    remote = root / "remote"
    shutil.copytree(world / "policy", remote)
    cfg = json.loads((remote / "config.json").read_text())
    cfg["model_type"] = "humanline_custom"
    cfg["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig",
                       "AutoModelForCausalLM": "modeling_custom.CustomForCausalLM",
                       "AutoModelForSequenceClassification": "modeling_custom.CustomForScoring"}
    (remote / "config.json").write_text(json.dumps(cfg))
    return {"truncated": truncated, "remote": remote}


@pytest.fixture(scope="module")
def secret_run(world, tmp_path_factory) -> tuple[Path, object]:
    """A complete run given secrets on the command line (also the 'previously complete run dir')."""
    cwd = tmp_path_factory.mktemp("secret")
    run = cwd / "run"
    # the typed config has no secret-named keys (+wandb.api_key is refused, see CASES); Hydra's free-form
    # hydra.job.env_set is where a key goes on the command line, and Hydra writes it to hydra.yaml
    r = run_cli(["train", *BASE, "threads=1", "eval.max_new_tokens=7", "model.tokenizer=world://policy",
                 f"+hydra.job.env_set.WANDB_API_KEY={SECRET}", "+hydra.job.env_set.HF_TOKEN=SECRETVALUE456",
                 # secrets whose key names do not look secret: known by their shape (a URL's password, a prefix)
                 "judge.base_url=https://user:SECRETVALUE001@judge.example/v1",
                 "+hydra.job.env_set.DATABASE_URL=postgres://u:SECRETVALUE002@db:5432/x",
                 "+hydra.job.env_set.GITHUB_PAT=SECRETVALUE003", "+hydra.job.env_set.NOTE=hf_SECRETVALUE004abcdefghij",
                 f"hydra.run.dir={run}"], cwd=cwd, env_extra={"WANDB_MODE": "offline"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["status"] == "complete"
    return run, r


def _tree(path: Path) -> dict[str, str]:
    """Every file under path (hidden ones too) -> sha256 of its bytes."""
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("humanline: error:")]


# ---- the battery ----------------------------------------------------------------------------------
# (id, args, where the run goes, needle in the one error line, env)
#   where: "none"     a fresh run dir path that must never be created (bad input caught before work)
#          "complete" a copy of a complete run dir that must come out byte-identical
#          "failed"   a fresh run dir that must hold failed.json and no summary.json
CASES = [
    ("threads-not-int", ["threads=abc"], "complete",
     "config key 'threads': Value 'abc' of type 'str' could not be converted to Integer", {}),
    ("threads-negative", ["threads=-1"], "complete", "config key 'threads' must be >= 1, got -1", {}),
    ("min-gap-not-float", ["threads=1", "data.min_gap=abc"], "none",
     "config key 'data.min_gap': Value 'abc' of type 'str' could not be converted to Float", {}),
    ("limit-not-int", ["threads=1", "data.limit=abc"], "none",
     "config key 'data.limit': Value 'abc' of type 'str' could not be converted to Integer", {}),
    ("top-p-not-float", ["threads=1", "eval.top_p=abc"], "complete",
     "config key 'eval.top_p': Value 'abc' of type 'str' could not be converted to Float", {}),
    ("top-p-out-of-range", ["threads=1", "eval.top_p=2"], "none", "config key 'eval.top_p' must be in (0, 1], got 2.0",
     {}),
    ("online-n-zero", ["threads=1", "data=online", "data.n=0"], "complete", "config key 'data.n' must be > 0, got 0",
     {}),
    ("sweep-typo-key", ["-m", "threads=1", "train.lrr=1"], "complete",
     "config key 'train.lrr': Key 'lrr' not in 'TrainConfig'", {}),
    ("sweep-bad-point", ["-m", "threads=1", "train.lr=1e-3,abc"], "none",
     "sweep point train.lr=abc: config key 'train.lr': Value 'abc' of type 'str' could not be converted to Float", {}),
    ("humanline-twice", ["threads=1", "+humanline=true", "humanline=false"], "complete",
     "humanline is set more than once (+humanline=true or humanline=false, not both)", {}),
    ("unknown-objective", ["threads=1", "objective=foo"], "none",
     f"unknown objective 'foo' (choose from: {', '.join(sorted(PROPERTIES))})", {}),
    ("wandb-api-key-is-not-a-wandb-key", ["threads=1", f"+wandb.api_key={SECRET}"], "complete",
     "unknown config key 'wandb.api_key' (Key 'api_key' not in 'WandbConfig')", {}),
    ("run-dir-in-proc", ["threads=1", "hydra.run.dir=/proc/humanline-x"], "none",
     "cannot write the run dir /proc/humanline-x: cannot create directories in /proc: No such file or directory", {}),
    ("run-dir-under-a-file", ["threads=1", "hydra.run.dir={file}/sub"], "none",
     "cannot write the run dir {file}/sub: {file} is a file, not a directory", {}),
    ("sweep-dir-in-proc", ["-m", "threads=1", "hydra.sweep.dir=/proc/humanline-y"], "none",
     "cannot write the run dir /proc/humanline-y: cannot create directories in /proc", {}),
    ("truncated-weights", ["threads=1", "model.name_or_path={truncated}", "check_model_task=warn"], "failed",
     "cannot load model from {truncated}: corrupted or truncated weights file {truncated}/model.safetensors "
     "(Error while deserializing header: incomplete metadata, file not fully covered)", {}),
    ("model-needs-remote-code", ["threads=1", "model.name_or_path={remote}", "check_model_task=warn"], "failed",
     "model {remote} needs its own code to load (config.json auto_map); if you trust it, set "
     "model.trust_remote_code=true", {}),
    ("judge-needs-remote-code", ["threads=1", "task.judge.kind=model", "task.judge.name_or_path={remote}"], "failed",
     "reward model {remote} needs its own code to load (config.json auto_map); if you trust it, set "
     "task.judge.trust_remote_code=true", {}),
    ("missing-data-file", ["threads=1", "data.path={missing}"], "failed", "data file {missing} does not exist", {}),
    ("full-error-config", ["threads=1", "train.lrr=1"], "none", "train.lrr", {"HYDRA_FULL_ERROR": "1"}),
    ("full-error-data", ["threads=1", "data.path={missing}"], "failed", "data file {missing} does not exist",
     {"HYDRA_FULL_ERROR": "1"}),
    ("nan-loss", ["threads=1", "train.lr=1e10", "train.warmup_ratio=0"], "failed",
     "run failed ({run}): loss is nan at step", {}),
]
SLOW = {"nan-loss"}  # trains (the others stop before the first step)


@pytest.mark.parametrize("name,args,where,needle,env",
                         [pytest.param(*c, id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW else []) for c in CASES])
def test_bad_input_promise(name, args, where, needle, env, world, models, secret_run, tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory\n")
    run = tmp_path / "run"
    if where == "complete":
        shutil.copytree(secret_run[0], run, symlinks=True)
    before = _tree(run) if where == "complete" else None
    fill = {"file": a_file, "truncated": models["truncated"], "remote": models["remote"],
            "missing": tmp_path / "missing.jsonl", "run": run}
    args = [a.format(**fill) for a in args]
    needle = needle.format(**fill)
    key = "hydra.sweep.dir" if "-m" in args else "hydra.run.dir"
    if not any(a.startswith(key) for a in args):
        args.append(f"{key}={run}")
    r = run_cli(["train", *BASE, *args], cwd=tmp_path, env_extra={"WANDB_MODE": "offline", **env})

    assert r.returncode == 2, r.stderr[-3000:]
    errors = _error_lines(r.stderr)
    assert len(errors) == 1, r.stderr[-3000:]
    assert needle in errors[0], errors[0]
    if env.get("HYDRA_FULL_ERROR") != "1":
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert SECRET not in r.stderr + r.stdout
    match where:
        case "none":
            assert not run.exists()
        case "complete":
            assert _tree(run) == before  # byte for byte, .hydra and the model included
        case "failed":
            assert (run / "failed.json").is_file()
            assert json.loads((run / "failed.json").read_text())["status"] == "failed"
            assert not list(run.rglob("summary.json"))
            assert not (run / "model").exists() and not (run / "model.tmp").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into a chmod 500 dir")
def test_read_only_run_dir_is_one_line(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        r = run_cli(["train", *BASE, "threads=1", f"hydra.run.dir={ro}/run"], cwd=tmp_path)
    finally:
        ro.chmod(0o700)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert _error_lines(r.stderr) == [f"humanline: error: cannot write the run dir {ro}/run: cannot create directories "
                                      f"in {ro}: Permission denied (set hydra.run.dir=...)"]
    assert list(ro.iterdir()) == []


def test_output_dir_problem_checks_an_existing_dir_without_writing(tmp_path, monkeypatch):
    from hydra import initialize_config_module

    from humanline_cli.cli.overrides import output_dir_problem

    monkeypatch.chdir(tmp_path)
    with initialize_config_module(config_module="conf", version_base="1.3"):
        assert output_dir_problem([f"hydra.run.dir={tmp_path}/new/deeper"], multirun=False) is None
        assert not (tmp_path / "new").exists()  # the probe leaves nothing behind
        assert list(tmp_path.iterdir()) == []
        (tmp_path / "f").write_text("x")
        assert output_dir_problem([f"hydra.run.dir={tmp_path}/f"], multirun=False) == (
            f"cannot write the run dir {tmp_path}/f: it is a file, not a directory (set hydra.run.dir=...)")
        assert output_dir_problem([f"hydra.sweep.dir={tmp_path}/f/x"], multirun=True) == (
            f"cannot write the run dir {tmp_path}/f/x: {tmp_path}/f is a file, not a directory "
            f"(set hydra.sweep.dir=...)")


# ---- Ctrl-C ---------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ctrl_c_mid_training_is_one_line_exit_130_and_failed_json(world, tmp_path):
    run = tmp_path / "run"
    args = ["train", *[a for a in BASE if not a.startswith("train.steps=")], "train.steps=5000", "threads=1",
            "train.save_model=false", f"hydra.run.dir={run}"]
    env = {**os.environ, "WANDB_MODE": "offline"}
    # SIGINT as a terminal's foreground job has it: a shell that started pytest in the background leaves it
    # ignored (POSIX), children inherit that, and this Ctrl-C would then do nothing
    p = subprocess.Popen([sys.executable, "-m", "humanline_cli", *args], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    metrics = run / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and p.poll() is None:
        if metrics.is_file() and metrics.read_text().count("\n") >= 3:
            break
        time.sleep(0.1)
    assert p.poll() is None, "the run ended before it could be interrupted"
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)

    assert p.returncode == 130, err[-3000:]
    assert "Traceback" not in err and _error_lines(err) == []
    lines = [ln for ln in err.splitlines() if ln.startswith("humanline:")]
    assert len(lines) == 1, err[-3000:]
    m = re.fullmatch(r"humanline: interrupted at step (\d+) \(failed\.json written\)", lines[0])
    assert m, lines[0]
    logged = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    assert logged == list(range(1, len(logged) + 1))  # log_every=1
    assert logged[-1] <= int(m[1]) <= logged[-1] + 1 < 5000  # the step it was in: the last logged or the next
    failed = json.loads((run / "failed.json").read_text())
    assert failed["status"] == "failed" and failed["error"].startswith("KeyboardInterrupt")
    assert not (run / "summary.json").exists()


def test_an_interruption_carries_its_step():
    """Ctrl-C inside the training loop (StepMarker) becomes Interrupted("at step N"); elsewhere the job
    says before or after training. No frame is read."""
    import signal

    from humanline_cli.errors import Interrupted
    from humanline_cli.train.signals import StepMarker, interrupted_where

    before = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Interrupted) as e, StepMarker() as at:
            for step in range(1, 10):
                at.step = step
                if step == 7:
                    raise KeyboardInterrupt
        # from the first Ctrl-C on, further ones are ignored: the run's ending (the progress bar's last line, the
        # failure record) is not cut short by the second one torch's agent forwards to every rank
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)
    assert isinstance(e.value, KeyboardInterrupt) and interrupted_where(e.value) == "at step 7"
    # a second Ctrl-C (torch's agent forwards one to every rank) raised while the first unwinds keeps its step
    first = e.value
    with pytest.raises(KeyboardInterrupt) as e:
        try:
            raise first
        except KeyboardInterrupt:
            raise KeyboardInterrupt from None  # `from None` hides the context from tracebacks, not __context__
    assert type(e.value) is KeyboardInterrupt and interrupted_where(e.value) == "at step 7"
    with pytest.raises(KeyboardInterrupt) as e:
        raise KeyboardInterrupt
    assert interrupted_where(e.value) == "before training"
    assert interrupted_where(e.value, trained=True) == "after training"
    # Ctrl-C while the loop unwinds from a peer's failure, outside the marker: the marker still names the step
    marker = StepMarker()
    with pytest.raises(RuntimeError), marker:
        marker.step = 4
        raise RuntimeError("Connection closed by peer")
    assert interrupted_where(e.value, at=marker) == "at step 4"
    assert interrupted_where(e.value, at=StepMarker()) == "before training"  # a new job's marker says nothing


# ---- a sweep with a failed job ----------------------------------------------------------------------

@pytest.mark.slow
def test_sweep_runs_every_job_and_names_the_failed_one(world, tmp_path):
    good = tmp_path / "good.jsonl"
    shutil.copy(world / "offline_pairs.jsonl", good)
    missing = tmp_path / "missing.jsonl"
    sweep = tmp_path / "sweep"
    r = run_cli(["train", "-m", *BASE, "threads=1", "train.save_model=false", f"data.path={missing},{good}",
                 "+hydra.job.env_set.HF_TOKEN=SECRETVALUE789", f"hydra.sweep.dir={sweep}"], cwd=tmp_path,
                env_extra={"WANDB_MODE": "offline"})
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    job0, job1 = sweep / "0_arithmetic_dpo_offline_none", sweep / "1_arithmetic_dpo_offline_none"
    assert _error_lines(r.stderr) == [
        f"humanline: error: 1 of 2 sweep jobs failed in {sweep}: {job0.name} (each job's error is above)"]
    assert f"humanline: sweep job {job0.name} failed: data file {missing} does not exist" in r.stderr.splitlines()
    assert (job0 / "failed.json").is_file() and not (job0 / "summary.json").exists()
    summary = json.loads((job1 / "summary.json").read_text())  # the job after the failed one still ran
    assert summary["status"] == "complete" and summary["steps"] == 3
    assert [p for p in sweep.rglob("*") if p.is_file() and b"SECRETVALUE" in p.read_bytes()] == []
    swept = OmegaConf.load(sweep / "multirun.yaml").hydra
    assert "+hydra.job.env_set.HF_TOKEN=***" in swept.overrides.hydra and swept.job.env_set.HF_TOKEN == "***"


def test_sweep_job_failure_in_a_launcher_process_is_one_compact_hydra_line(tmp_path, monkeypatch, capsys):
    """joblib/submitit run jobs in other processes: the failure goes back through Hydra, which runs
    the other jobs, then prints this exception as one line (CompactHydraException) and exits 1 (-> 2)."""
    from hydra.errors import CompactHydraException

    from humanline_cli.cli.train import Sweep, _sweep_job_failed

    elsewhere = Sweep(pid=-1)  # a job in another process than the one that started the sweep
    job = tmp_path / "3_arithmetic_dpo_offline_none"
    with pytest.raises(CompactHydraException) as e:
        _sweep_job_failed(elsewhere, job, "data file x.jsonl does not exist")
    assert str(e.value) == f"humanline: error: sweep job {job} failed: data file x.jsonl does not exist"
    assert capsys.readouterr().err == f"humanline: sweep job {job.name} failed: data file x.jsonl does not exist\n"
    here = Sweep()  # in-process (the basic launcher): recorded, no raise
    _sweep_job_failed(here, job, "boom")
    assert here.failed == [(job, "boom")] and elsewhere.failed == []


# ---- secrets ----------------------------------------------------------------------------------------

def test_secrets_are_masked_in_every_file_a_run_writes(secret_run):
    run, r = secret_run
    hits = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and b"SECRETVALUE" in p.read_bytes()]
    assert hits == []  # .hydra/*, resolved_config.json, wandb's run file and logs, metrics, model ...
    assert "SECRETVALUE" not in r.stderr + r.stdout
    hydra = OmegaConf.load(run / ".hydra" / "hydra.yaml").hydra
    assert OmegaConf.to_container(hydra.job.env_set) == {"WANDB_API_KEY": "***", "HF_TOKEN": "***",
                                                         "DATABASE_URL": "postgres://u:***@db:5432/x",
                                                         "GITHUB_PAT": "***", "NOTE": "***"}
    saved = json.loads((run / "resolved_config.json").read_text())
    assert saved["judge"]["base_url"] == "https://user:***@judge.example/v1"  # the user and host stay
    assert "+hydra.job.env_set.WANDB_API_KEY=***" in hydra.overrides.hydra
    assert "+hydra.job.env_set.HF_TOKEN=***" in hydra.overrides.hydra
    assert "eval.max_new_tokens=7" in hydra.job.override_dirname  # harmless keys stay as they were
    cfg = OmegaConf.load(run / ".hydra" / "config.yaml")
    assert cfg.eval.max_new_tokens == 7 and cfg.model.tokenizer == "world://policy"
    overrides = OmegaConf.to_container(OmegaConf.load(run / ".hydra" / "overrides.yaml"))
    assert "eval.max_new_tokens=7" in overrides and "model.tokenizer=world://policy" in overrides
    (wandb_file,) = run.glob("wandb/offline-run-*/run-*.wandb")  # wandb's config and recorded command line
    data = wandb_file.read_bytes()
    assert b'"max_new_tokens":7' in data and b"eval.max_new_tokens=7" in data
    assert b"+hydra.job.env_set.WANDB_API_KEY=***" in data and b"+hydra.job.env_set.HF_TOKEN=***" in data


# ---- remote code --------------------------------------------------------------------------------------

def test_ultrafeedback_and_paper_experiment_keep_remote_code_off():
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="conf", version_base="1.3"):
        cfg = compose("train", overrides=["task=ultrafeedback"])
    assert cfg.task.labeller.trust_remote_code is False and cfg.task.judge.trust_remote_code is False
    assert cfg.task.labeller.name_or_path == "RLHFlow/ArmoRM-Llama3-8B-v0.1"
    exp = OmegaConf.load(CONF / "experiment" / "paper_instruction_following.yaml")
    assert exp.task.labeller.trust_remote_code is False and exp.task.judge.trust_remote_code is False
    for path in (CONF / "task" / "ultrafeedback.yaml", CONF / "experiment" / "paper_instruction_following.yaml"):
        assert "trust_remote_code: true" not in path.read_text()


@pytest.mark.parametrize("key,hint", [
    ("reward", "set reward.trust_remote_code=true"),
    ("task.labeller", "set task.labeller.trust_remote_code=true"),
    (None, "task.judge.trust_remote_code=true, task.labeller.trust_remote_code=true or reward.trust_remote_code=true"),
])
def test_reward_model_remote_code_error_names_the_key(models, key, hint):
    from humanline_cli.rewards.scorers import make_scorer

    with pytest.raises(UserError) as e:
        make_scorer({"kind": "model", "name_or_path": str(models["remote"])}, key=key)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"reward model {models['remote']} needs its own code to load")
    assert msg.endswith(hint) or msg.endswith(hint + ")")


def test_policy_and_tokenizer_errors_are_one_line(models, tmp_path):
    import torch

    from humanline_cli.models import load_policy, load_tokenizer

    with pytest.raises(UserError) as e:
        load_policy(str(models["truncated"]), torch.device("cpu"))
    assert str(e.value) == (f"cannot load model from {models['truncated']}: corrupted or truncated weights file "
                            f"{models['truncated']}/model.safetensors (Error while deserializing header: "
                            f"incomplete metadata, file not fully covered)")
    converted = tmp_path / "smollm2-0123456789abcdef"  # a damaged converted packaged model: we convert it again
    shutil.copytree(models["truncated"], converted)
    (converted / "packaged.json").write_text("{}\n")
    with pytest.raises(UserError) as e:
        load_policy(str(converted), torch.device("cpu"))
    assert str(e.value).endswith(f"file not fully covered); remove {converted} and the next run converts it again")
    pickled = tmp_path / "pickled"  # a model saved the old way: pytorch_model.bin only
    shutil.copytree(models["truncated"], pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    with pytest.raises(UserError) as e:
        load_policy(str(pickled), torch.device("cpu"))
    assert str(e.value) == (f"cannot load model from {pickled}: its weights are pickle files only (pytorch_model.bin), "
                            f"which are never loaded (unpickling can run code); convert them to safetensors, e.g. "
                            f"model.save_pretrained(dir, safe_serialization=True) where you trust the files")
    broken = tmp_path / "tok"
    shutil.copytree(models["truncated"], broken)
    (broken / "tokenizer.json").write_text('{"version": "1.0", "model": ')  # cut off mid-file
    with pytest.raises(UserError) as e:
        load_tokenizer(str(broken))
    assert str(e.value).startswith(f"cannot load tokenizer from {broken}: ") and "\n" not in str(e.value)
