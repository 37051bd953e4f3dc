"""Graph passes: capture, named dims, op rules, SPMD rewrite (imported as ``autoshard.passes``)."""
from autoshard.runtime.export.launcher import old_runner_import


def __getattr__(name):
    # The export runner lived here until it moved into the core (autoshard.runtime.export); the
    # run.py of an older export imports it from here and gets one line instead of a traceback.
    return old_runner_import(__name__, name)
