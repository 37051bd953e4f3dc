"""Pipeline timelines as Chrome / Perfetto trace JSON (chrome://tracing, ui.perfetto.dev).

A timeline is ``{row: [(action, start s, end s), ...]}``: the predicted one has a row per
pipeline rank (``autoshard.cost.pipeline.schedule_timeline``), a measured one a row per rank
(each rank's ``PipelineRank.measured()``). Both ``plan.timeline`` and an exported pipelined
``run.py --timeline`` write them with :func:`chrome_trace`; this module is in the core layer so
that run.py, which runs with the runtime alone, writes the same format.

Example::

    rows = {r: pipe.measured() for r, pipe in enumerate(pipes)}
    json.dumps(measured_trace(rows, mesh, "pp"))     # one thread per rank, "rank 2 (pp 1)"
"""
from __future__ import annotations


def chrome_trace(rows: dict, names: dict | None = None) -> dict:
    """A Chrome / Perfetto trace (``{"traceEvents": [...]}``) of ``{row: [(action, start s,
    end s)]}``: one thread per row (a rank), one complete event per action, in row order.

    Example::

        chrome_trace({0: [(Action("F", 0, 0), 0.0, 0.5)]})["traceEvents"][1]["dur"]   # 500000.0
    """
    events = []
    t0 = min((s for items in rows.values() for _, s, _ in items), default=0.0)
    for row, items in sorted(rows.items()):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": row,
                       "args": {"name": (names or {}).get(row, f"rank {row}")}})
        for a, s, e in items:
            events.append({"name": str(a), "cat": a.kind, "ph": "X", "pid": 0, "tid": row, "ts": (s - t0) * 1e6,
                           "dur": (e - s) * 1e6, "args": {"kind": a.kind, "mb": a.mb, "stage": a.stage}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def measured_trace(rows: dict, mesh, axis: str) -> dict:
    """:func:`chrome_trace` of a measured step, ``{rank: [(action, start, end)]}``, each row
    named by its rank and pipeline coordinate (``"rank 2 (pp 1)"``).

    Example::

        measured_trace({r: pipe.measured() for r, pipe in enumerate(pipes)}, mesh, "pp")
    """
    return chrome_trace(rows, {r: f"rank {r} ({axis} {mesh.coords(r)[axis]})" for r in rows})
