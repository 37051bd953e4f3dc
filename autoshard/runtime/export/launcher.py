'''The run.py an export gets: a launcher of a few lines that calls this runtime's runner.

An export does not carry a copy of the runner: its run.py checks that plan.json is the format
it was written for, that the installed autoshard reads that format (:data:`VERSION`), and calls
:func:`autoshard.runtime.export.main`. A mismatch is one line, ``run.py: error: ... (hint:
export again with this autoshard)``, exit code 2. Exports of format 1 carried a full copy of the
runner, which imported its pipelined half from ``autoshard.passes``; :func:`old_runner_import`
gives such a run.py the same one line instead of an ImportError traceback.

Example::

    (out / "run.py").write_text(run_py_source())
'''
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .plan_file import VERSION

# The exported run.py. Kept under 60 lines: it is read by whoever opens the export directory.
RUN_PY = '''"""run.py of an autoshard export: run the per-rank program under torchrun.

    torchrun --nproc-per-node=N run.py [--check] [--steps K] [...]     (run.py --help: every option)

The runner is the installed autoshard's (autoshard.runtime.export: the core alone, no planner).
This file checks that plan.json is the export format that runner reads, then hands over to it.
"""
import json
import os
import sys
import time
from pathlib import Path

VERSION = {version}  # the export format this run.py was written with (plan.json's "version")
ROOT = Path(__file__).resolve().parent


def fail(why):
    """One line per node, exit code 2 (the node's other processes wait for it to be printed)."""
    if os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"run.py: error: {{why}} (hint: export again with this autoshard)", file=sys.stderr, flush=True)
    else:
        time.sleep(2.0)
    sys.exit(2)


try:
    found = json.loads((ROOT / "plan.json").read_text()).get("version", VERSION)
except (OSError, ValueError, AttributeError):
    found = VERSION  # missing or corrupted: the runner names the problem
if found != VERSION:
    fail(f"{{ROOT / 'plan.json'}} has export format version {{found!r}}; this run.py was written for {{VERSION}}")
try:
    from autoshard.runtime.export import VERSION as READS, main
except ImportError as e:
    fail(f"the installed autoshard has no export runner ({{e}}); this export needs format version {{VERSION}}")
if READS != VERSION:
    fail(f"this export has format version {{VERSION}}; the installed autoshard reads version {{READS}}")
sys.exit(main(root=ROOT))
'''

OLD_RUNNERS = ("export_runner", "export_pipeline_runner")  # where format 1's run.py found the runner


def run_py_source() -> str:
    """The text of an export's run.py (for this runtime's :data:`VERSION`).

    Example::

        (out / "run.py").write_text(run_py_source())
    """
    return RUN_PY.format(version=VERSION)


def old_runner_import(package: str, name: str):
    """``autoshard.passes.__getattr__``: the runner's old names. Under an export's run.py (a full
    copy of the runner, export format 1) it ends the process with one line and exit code 2, as
    the runner does for a usage error; anywhere else it is an AttributeError naming the new place.

    Example::

        def __getattr__(name):           # in autoshard/passes/__init__.py
            return old_runner_import(__name__, name)
    """
    if name not in OLD_RUNNERS:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    main = Path(getattr(sys.modules.get("__main__"), "__file__", None) or "")
    if main.name == "run.py" and (main.parent / "plan.json").is_file():
        if os.environ.get("LOCAL_RANK", "0") == "0":  # one message per node, as the runner prints
            print(f"run.py: error: {main} is a copy of the runner of an older autoshard (export format 1), which "
                  f"this autoshard runs from its core instead (hint: export again with this autoshard)",
                  file=sys.stderr, flush=True)
        else:  # torchrun stops the node at the first exit: give local rank 0 time to print
            time.sleep(2.0)
        raise SystemExit(2)
    raise AttributeError(f"module {package!r} has no attribute {name!r}: the export runner is "
                         f"autoshard.runtime.export")
