"""Planning only: the 8B Llama-shaped model on the meta device plans and prints without
allocating parameter memory."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_8b_meta_plans_under_4gb():
    # A fresh process, so peak RSS is this plan's alone.
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "plan_8b.py")], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "8.03B parameters" in text
    assert "layers.31.mlp.down_proj.weight" in text and "S(1)@tp" in text and "Collectives" in text
    rss = float(re.search(r"peak RSS\s+([\d.]+) GB", text).group(1))
    assert rss < 4.0, rss
