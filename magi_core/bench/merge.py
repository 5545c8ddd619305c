"""Merge several ``magi bench`` result documents of one machine into one (runs split across processes or GPUs).

A full grid on a large model can take longer than one process may run (a device lent in 10-minute calls),
so it is run in parts, e.g. one model per GPU of one host. Merging keeps, per configuration (model, tokens,
system, policy, ratio, budget), the first completed run in the order given, else the first record of it
(a skip with its reason). Each run keeps the pinned H2D bandwidth of its own process (``h2d_GBps``), which
the ideal is computed from; derived figures are recomputed.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from magi_core.errors import MagiError

#: Fields :func:`magi_core.bench.analysis.derive` computes; dropped so that merging recomputes them.
DERIVED = ("ideal_ms", "ideal_basis", "ratio_to_ideal", "speedup_vs", "copy_GBps", "pinned_over_weights")
#: Environment fields that must agree for runs to be comparable.
SAME_ENV = ("hardware", "torch", "magi_core", "python")


def run_key(r: dict[str, Any]) -> tuple[Any, ...]:
    """What identifies one configuration across documents."""
    return (r["workload"], r["tokens"], r["system"], r.get("policy"), r.get("ratio"), r.get("budget_fraction"))


def merge(docs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One document holding the runs of ``docs`` (same hardware and versions), first completed run per configuration.

    Raises :class:`MagiError` when the documents come from different hardware, software or backends.
    """
    if not docs:
        raise MagiError("nothing to merge: pass at least one magi bench result document")
    first = docs[0]
    for d in docs[1:]:
        for field in SAME_ENV:
            if d["env"].get(field) != first["env"].get(field):
                raise MagiError(f"cannot merge bench results with different {field}: {first['env'].get(field)!r} "
                                f"vs {d['env'].get(field)!r}; merge runs of one machine and software only")
        if d["env"]["backend"]["name"] != first["env"]["backend"]["name"]:
            raise MagiError("cannot merge bench results of different backends; merge runs of one backend only")
        if d.get("schema") != first.get("schema"):
            raise MagiError(f"cannot merge bench result schemas {first.get('schema')} and {d.get('schema')}")
    out = copy.deepcopy(first)
    out["runs"], out["workloads"], out["notes"] = [], {}, []
    slots: dict[tuple[Any, ...], int] = {}
    for i, d in enumerate(docs):
        for name, w in d["workloads"].items():
            out["workloads"].setdefault(name, copy.deepcopy(w))
        out["notes"] += [n for n in d.get("notes", []) if n not in out["notes"]]
        for r in d["runs"]:
            r = {k: v for k, v in copy.deepcopy(r).items() if k not in DERIVED}
            if r.get("host_overhead_estimated"):
                r.pop("host_overhead_us_per_unit", None)
                r.pop("host_overhead_estimated", None)
            r.setdefault("h2d_GBps", d["h2d_GBps"])
            r["part"] = i
            key = run_key(r)
            if key not in slots:
                slots[key] = len(out["runs"])
                out["runs"].append(r)
            elif out["runs"][slots[key]].get("status") != "ok" and r.get("status") == "ok":
                out["runs"][slots[key]] = r
    out["parts"] = [{"date": d["env"]["date"], "h2d_GBps": d["h2d_GBps"], "options": d.get("options"),
                     "time_budget_s": d.get("time_budget_s")} for d in docs]
    out["h2d_GBps"] = max(d["h2d_GBps"] for d in docs)  # the plot's ideal line: the fastest process's
    out["time_budget_s"] = None
    out["env"]["date"] = min(d["env"]["date"] for d in docs)
    out["notes"].append(
        f"merged from {len(docs)} magi bench processes on this machine (see 'parts'; each run's 'part' and "
        "'h2d_GBps' say which process ran it and the bandwidth its ideal uses); max rel err is against the "
        "resident eager run of the same process"
    )
    out.pop("targets", None)
    return out
