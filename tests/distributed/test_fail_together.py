"""A start-up phase that fails on one rank fails on every rank, with that rank's one line."""

from __future__ import annotations

from tests.distributed.harness import run_on_ranks


def test_a_failure_on_one_rank_reaches_every_rank():
    results = run_on_ranks(2, _one_rank_fails, timeout_s=120)
    for out in results:
        assert out["rank"] == 1 and out["exit_code"] == 2, out
        assert out["message"] == "no such file: data/x.idx (rank 1, while opening the dataset)"
    # rank 0's own result arrives only where nothing failed
    assert [out["result"] for out in run_on_ranks(2, _nobody_fails)] == [0, 1]


def test_a_rank0_phase_shares_its_error_and_a_bug_keeps_its_type():
    for out in run_on_ranks(2, _rank0_phase_fails, timeout_s=120):
        assert out["rank"] == 0 and out["exit_code"] == 1, out
        assert out["message"].startswith("KeyError: 'plan'"), out


def _one_rank_fails() -> dict:
    import torch.distributed as dist

    from dcp.train.agree import RankFailure, agree

    def open_dataset() -> None:
        if dist.get_rank() == 1:
            raise FileNotFoundError("no such file: data/x.idx")

    try:
        agree("opening the dataset", open_dataset)
    except RankFailure as exc:
        return {"rank": exc.rank, "exit_code": exc.exit_code, "message": str(exc)}
    raise AssertionError("no rank failed")


def _nobody_fails() -> dict:
    import torch.distributed as dist

    from dcp.train.agree import agree

    return {"result": agree("counting", dist.get_rank)}


def _rank0_phase_fails() -> dict:
    from dcp.train.agree import RankFailure, agree

    def read_records() -> None:
        raise KeyError("plan")

    try:
        agree("reading records", read_records, only_rank0=True)
    except RankFailure as exc:
        return {"rank": exc.rank, "exit_code": exc.exit_code, "message": str(exc)}
    raise AssertionError("no rank failed")
