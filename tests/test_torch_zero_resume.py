"""A ZeroRedundancyOptimizer checkpoint consolidated at step 5 of a 2-rank job resumes in a 3-rank job exactly
as an uninterrupted run continues."""
from __future__ import annotations

import re

import torch

from conftest import run_mpi


def test_checkpoint_from_two_ranks_resumes_on_three(tmp_path) -> None:
    ckpt, resumed, full = tmp_path / "ckpt.pt", tmp_path / "resumed.pt", tmp_path / "full.pt"
    first = run_mpi("torch_zero_resume.py", 2, args=["first", str(ckpt), "-"], timeout=180)
    saved = torch.load(ckpt, weights_only=False)
    params = [p for p in saved["model"].values()]
    # The consolidated dict is torch's ordinary per-parameter format, whole-shaped, whatever the job size.
    assert [saved["optimizer"]["state"][i]["exp_avg"].shape for i in range(len(params))] == \
        [p.shape for p in params]
    total = sum(p.numel() for p in params)
    # Each rank held the two AdamW moments of only its half of the (padded) parameters.
    assert sorted(re.findall(r"state_elements=(\d+)", first.stdout)) == [str(2 * -(-total // 2))] * 2

    run_mpi("torch_zero_resume.py", 3, args=["resume", str(ckpt), str(resumed)], timeout=180)
    run_mpi("torch_zero_resume.py", 2, args=["full", "-", str(full)], timeout=180)
    for a, b in zip(torch.load(resumed), torch.load(full)):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    assert any(not torch.equal(a, p) for a, p in zip(torch.load(full), params))  # training went on
