"""A checkpoint records the run that wrote it (its comparable config, the micro-batch train.micro_batch_size=auto
chose), and a resume checks that record whatever happened to resolved_config.json: a deleted or corrupt saved config
never lets a run continue under another config, and a resume splits every step as the checkpointed run did."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from humanline_cli.errors import RunDirConflict
from humanline_cli.train import checkpoint as C
from humanline_cli.train import rundir as R

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread

CONFIG = {"seed": 0, "objective": {"name": "dpo", "beta": 0.1},
          "train": {"steps": 4, "lr": 1e-5, "micro_batch_size": "auto", "checkpoint_every": 2}}


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    """A 4-step run with checkpoints at steps 2 and 4, each recording CONFIG and micro-batch 2 (written once)."""
    from tests.helpers.training import offline_parts, run_train, train_spec

    run = tmp_path_factory.mktemp("recorded") / "run"
    ckpts = C.Checkpoints(run, 2, keep=2, record=R.run_record(CONFIG, 2))
    run_train(run, offline_parts(lora=False, moving=False), train_spec(4, False, every=2), checkpoints=ckpts)
    (run / R.RESOLVED).write_text(json.dumps(CONFIG))
    return run


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _other(**train) -> dict:
    cfg = copy.deepcopy(CONFIG)
    cfg["objective"]["beta"] = 0.5
    cfg["train"].update(train)
    return cfg


def test_the_checkpoint_records_the_config_and_the_micro_batch(recorded_run):
    state = C.read_state(recorded_run / "checkpoints" / "step_4")
    assert state["run"] == {"config": R.comparable(CONFIG), "micro_batch_size": 2, "micro_auto": True}
    assert "checkpoint_every" not in state["run"]["config"]["train"]  # what never changes results is left out
    assert R.recorded_micro_batch(recorded_run / "checkpoints" / "step_4") == 2
    assert C.verify(recorded_run / "checkpoints" / "step_4") is None  # the record is under the checksums


@pytest.mark.parametrize("damage", ["deleted", "corrupt"])
def test_a_resume_under_another_config_is_refused_without_resolved_config(recorded_run, tmp_path, damage):
    run = _copy(recorded_run, tmp_path / "run")
    if damage == "deleted":
        (run / R.RESOLVED).unlink()
    else:
        (run / R.RESOLVED).write_text('{"seed": 0, "objec')
    before = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    with pytest.raises(RunDirConflict) as e:
        R.prepare_run_dir(run, _other(), resume=True, say=lambda msg: None)
    assert (f"{run} holds a checkpoint (checkpoints/step_4) written with another config "
            f"(objective.beta: 0.1 -> 0.5); resume=false starts over") in str(e.value)
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == before  # nothing rewound or written


def test_the_same_config_resumes_and_says_what_it_checked(recorded_run, tmp_path):
    run = _copy(recorded_run, tmp_path / "run")
    (run / R.RESOLVED).write_text("not json")
    said = []
    assert R.prepare_run_dir(run, copy.deepcopy(CONFIG), resume=True, say=said.append) == 4
    assert said == [f"{run / R.RESOLVED} cannot be read: the config is checked against checkpoints/step_4's own "
                    f"record instead"]
    assert json.loads((run / R.RESOLVED).read_text()) == CONFIG  # rewritten whole


def test_a_checkpoint_changed_under_a_kept_resolved_config_is_refused(recorded_run, tmp_path):
    """resolved_config.json says the new config (written by a later refused-or-edited attempt), the checkpoint says
    the old: the checkpoint it would continue decides."""
    run = _copy(recorded_run, tmp_path / "run")
    (run / R.RESOLVED).write_text(json.dumps(_other()))
    with pytest.raises(RunDirConflict, match=r"checkpoints/step_4\) written with another config "
                                             r"\(objective\.beta: 0\.1 -> 0\.5\)"):
        R.prepare_run_dir(run, _other(), resume=True, say=lambda msg: None)


def test_an_old_checkpoint_without_a_record_and_no_saved_config_is_refused(recorded_run, tmp_path):
    run = _copy(recorded_run, tmp_path / "run")
    for step in (2, 4):  # as an older humanline wrote them: no "run" in state.json, checksums to match
        path = run / "checkpoints" / f"step_{step}"
        state = json.loads((path / "state.json").read_text())
        del state["run"]
        (path / "state.json").write_text(json.dumps(state))
        (path / C.CHECKSUMS).write_text(json.dumps(C.checksums(path)))
    (run / R.RESOLVED).unlink()
    with pytest.raises(RunDirConflict) as e:
        R.prepare_run_dir(run, copy.deepcopy(CONFIG), resume=True, say=lambda msg: None)
    assert str(e.value).startswith(f"{run / R.RESOLVED} is missing and {run / 'checkpoints' / 'step_4'} records no "
                                   f"config, so the run's config cannot be checked before resuming")


def test_a_resume_trains_the_micro_batch_the_checkpoint_records(tmp_path):
    """auto's choice depends on the host's free memory: the resumed run takes the checkpoint's, not a new one."""
    from humanline_cli.config import compose_train, resolve
    from humanline_cli.train.job import resumed_split

    spec = resolve(compose_train(["train.batch_size=8", "train.micro_batch_size=auto"]))
    assert spec.train.micro_auto and spec.train.micro_batch_size == 8  # auto starts from the whole share
    assert resumed_split(spec, tmp_path) is spec  # no checkpoint: the memory fit chooses
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / "state.json").write_text(json.dumps({"step": 3, "run": R.run_record(spec.config, 2)}))
    resumed = resumed_split(spec, tmp_path)
    assert (resumed.train.micro_batch_size, resumed.train.micro_auto) == (2, False)
    assert resumed.notes[-1] == ("train.micro_batch_size=auto: 2, the micro-batch the resumed checkpoint was "
                                 "trained with")
    assert R.run_record(resumed.config, resumed.train.micro_batch_size)["micro_auto"]  # recorded again as auto
    fixed = resolve(compose_train(["train.batch_size=8", "train.micro_batch_size=4"]))
    assert resumed_split(fixed, tmp_path) is fixed  # a size set by hand is the user's
    (step / "state.json").write_text(json.dumps({"step": 3, "run": R.run_record(fixed.config, 4)}))
    assert resumed_split(spec, tmp_path) is spec  # recorded as set by hand: not auto's choice
