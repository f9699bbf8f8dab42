"""A `save_to_disk` folder that lost a file (state.json, an Arrow shard, a split's files) is named as an incomplete
save_to_disk dataset, with what it lacks, not as "not found (hub download needs network)": the folder is there."""
from __future__ import annotations

import pytest

from humanline_cli.data.files import load_rows
from humanline_cli.errors import UserError

ROWS = [{"prompt": "1+1=", "chosen": "2", "rejected": "3"}] * 3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import datasets

    root = tmp_path_factory.mktemp("saved")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(root / "one"))
    datasets.DatasetDict({"train": ds, "test": ds}).save_to_disk(str(root / "dict"))
    return root


def _error(path) -> str:
    with pytest.raises(UserError) as e:
        load_rows(str(path))
    return str(e.value)


def test_a_complete_save_to_disk_folder_loads(saved):
    assert load_rows(str(saved / "one"))[0] == ROWS and load_rows(str(saved / "dict"), split="test")[0] == ROWS


@pytest.mark.parametrize("lost,named", [("state.json", "state.json"), ("dataset_info.json", "dataset_info.json"),
                                        ("data-00000-of-00001.arrow", "data-00000-of-00001.arrow")])
def test_a_dataset_folder_missing_a_file_names_it(saved, tmp_path, lost, named):
    import shutil

    d = tmp_path / "ds"
    shutil.copytree(saved / "one", d)
    (d / lost).unlink()
    assert _error(d) == f"data {str(d)!r} is a folder but not a complete save_to_disk dataset: it lacks {named}"


def test_a_dataset_dict_folder_names_the_split_that_lacks_a_file(saved, tmp_path):
    import shutil

    d = tmp_path / "dd"
    shutil.copytree(saved / "dict", d)
    (d / "train" / "state.json").unlink()
    assert _error(d) == (f"data {str(d)!r} is a folder but not a complete save_to_disk dataset: it lacks "
                         f"train/state.json")
