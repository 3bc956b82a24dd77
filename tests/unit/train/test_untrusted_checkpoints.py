"""Every entry point that reads a checkpoint someone else may have written refuses a pickle
payload in place of its shared state, runs none of it, and names the file in one line:
init.from_checkpoint (reached while the config loads, so also by tools.memory_budget --config),
dcp-to-hf, and the resume checks."""

from __future__ import annotations

from pathlib import Path

import pytest

from dcp.checkpoint.hf import hf_to_dcp
from dcp.schema import load_config
from dcp.train.config import PretrainConfig
from dcp.train.resume import check_checkpoint_owner
from tests.hf_models import make_hf_model
from tests.payload import plant_payload
from tools import convert_checkpoint, memory_budget

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def hostile(tmp_path) -> tuple[Path, Path]:
    """(a DCP checkpoint whose shared.json is a pickle that runs code when unpickled, the marker
    that code makes)."""
    checkpoint = hf_to_dcp(make_hf_model("llama", tmp_path / "hf"), tmp_path / "dcp")
    marker = tmp_path / "pwned"
    plant_payload(checkpoint, "shared.json", marker)
    return checkpoint, marker


def test_init_from_checkpoint_refuses_the_payload_while_the_config_loads(hostile):
    checkpoint, marker = hostile
    with pytest.raises(ValueError, match=rf"{checkpoint / 'shared.json'}: not UTF-8 text"):
        load_config(PretrainConfig, None, [f"init.from_checkpoint={checkpoint}"])
    assert not marker.exists()


def test_memory_budget_refuses_the_payload(hostile, capsys):
    checkpoint, marker = hostile
    config = str(REPO / "pretrain/configs/tiny_cpu.yaml")
    assert memory_budget.main(["--config", config, f"init.from_checkpoint={checkpoint}"]) == 2
    err = capsys.readouterr().err
    assert f"{checkpoint / 'shared.json'}: not UTF-8 text" in err and len(err.splitlines()) == 1
    assert not marker.exists()


def test_dcp_to_hf_refuses_the_payload(hostile, tmp_path, capsys):
    checkpoint, marker = hostile
    assert convert_checkpoint.main(["dcp-to-hf", str(checkpoint), str(tmp_path / "out")]) == 2
    assert f"{checkpoint / 'shared.json'}: not UTF-8 text" in capsys.readouterr().err
    assert not marker.exists()


def test_a_checkpoint_directory_belongs_to_the_run_that_wrote_it():
    old, new = {"name": "first"}, {"name": "second"}
    check_checkpoint_owner(old, old, path="ckpt/step_000008", allow=())
    check_checkpoint_owner({}, new, path="ckpt/step_000008", allow=())  # no name recorded
    with pytest.raises(ValueError, match="written by run 'first', this run is 'second'") as err:
        check_checkpoint_owner(old, new, path="ckpt/step_000008", allow=())
    assert "init.from_checkpoint=ckpt/step_000008" in str(err.value)
    check_checkpoint_owner(old, new, path="ckpt/step_000008", allow=("name",))  # taken over
