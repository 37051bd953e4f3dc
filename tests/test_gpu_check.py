"""The CPU-side logic of benchmarks/gpu_check.py (the GPU run itself needs a CUDA device)."""
import pytest
import torch

from benchmarks import gpu_check


def test_flops_peak_and_summary_line():
    # 1 layer, dim 4, seq 2, batch 1, vocab 8: matmuls 2*2*(12*16 + 32) = 896, attention 2*2*1*2*2*4/2 = 32
    assert gpu_check.step_flops(1, 4, 2, 1, 8) == 3 * (896 + 32)
    assert gpu_check.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert gpu_check.peak_flops("Some GPU") is None and gpu_check.peak_flops("Some GPU", 1e12) == 1e12
    line = gpu_check.summary_line("NVIDIA H100", torch.bfloat16, 8, 1024, 1024, 8, 0.040, 0.041, 989e12)
    assert line.startswith("gpu_check: device=NVIDIA H100 dtype=bfloat16") and "overhead=1.025" in line
    assert "mfu=" in line and "\n" not in line


def test_runs_end_to_end_on_cpu(capsys):
    pytest.importorskip("expecttest")
    gpu_check.main(["--device", "cpu", "--layers", "1", "--dim", "32", "--seq", "8", "--batch", "2",
                    "--rounds", "1", "--steps", "1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("gpu_check: device=cpu dtype=float32") and "overhead=" in out[0]
