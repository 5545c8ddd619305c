"""Figures of a generate result that compare rows: the decode ideal, the step against it, tokens against the resident.

Per row that ran: ``ideal_link_ms_per_token`` = the bytes a decode step streams / the pinned host-to-device rate its
process measured; ``ideal_ms_per_token`` = the larger of that and the resident decode step (the device's own time
per token, where a resident row ran; else the link term alone); ``x_ideal`` = the decode step over it.
``tokens_match_resident``: whether the row's greedy tokens equal the reference's (the compiled resident row, else the
eager one) over the tokens both produced (``tokens_compared``; ``first_mismatch`` is the first index that differs).
"""

from __future__ import annotations

from typing import Any

#: Rows whose tokens are the reference, in order of preference.
REFERENCES = ("resident_compiled", "resident_eager")
DERIVED = ("ideal_link_ms_per_token", "ideal_ms_per_token", "x_ideal", "tokens_match_resident", "tokens_reference",
           "tokens_compared", "first_mismatch", "x_faster_than_accelerate", "resident_ms_per_token")


def reference_row(rows: list[dict[str, Any]], model: str) -> dict[str, Any] | None:
    """The row whose tokens and decode step the others are compared with, for ``model``."""
    for kind in REFERENCES:
        for r in rows:
            if r.get("workload") == model and r.get("system") == kind and r.get("status") == "ok":
                return r
    return None


def ideal_link_ms(streamed_bytes: float, h2d_GBps: float) -> float:
    """Milliseconds to stream ``streamed_bytes`` at ``h2d_GBps``."""
    return streamed_bytes / (h2d_GBps * 1e9) * 1e3


def first_mismatch(tokens: list[list[int]], ref: list[list[int]]) -> tuple[int, int | None]:
    """(tokens compared per sequence, the first index where a sequence differs or None)."""
    n = min((len(t) for t in tokens + ref), default=0)
    if len(tokens) != len(ref):
        return n, 0
    for i in range(n):
        if any(a[i] != b[i] for a, b in zip(tokens, ref, strict=True)):
            return n, i
    return n, None


def derive(doc: dict[str, Any]) -> dict[str, Any]:
    """Add the derived figures to every row of ``doc`` (in place; computed afresh each time); returns ``doc``."""
    rows = doc.get("rows", [])
    for r in rows:
        for k in DERIVED:
            r.pop(k, None)
    for model in dict.fromkeys(r.get("workload") for r in rows):
        mine = [r for r in rows if r.get("workload") == model]
        ref = reference_row(mine, str(model))
        resident_ms = ref.get("decode_ms_per_token") if ref is not None else None
        accel = next((r for r in mine if r.get("system") == "accelerate" and r.get("status") == "ok"), None)
        for r in mine:
            if r.get("status") != "ok":
                continue
            decode = r.get("decode_ms_per_token")
            streamed, h2d = r.get("streamed_bytes_per_token"), r.get("h2d_GBps")
            if streamed is not None and h2d:
                r["ideal_link_ms_per_token"] = ideal_link_ms(float(streamed), float(h2d))
                ideal = max(resident_ms or 0.0, r["ideal_link_ms_per_token"])
                if resident_ms is not None:
                    r["resident_ms_per_token"] = resident_ms
                if ideal > 0:
                    r["ideal_ms_per_token"] = ideal
                    if decode:
                        r["x_ideal"] = decode / ideal
            if accel is not None and decode and accel.get("decode_ms_per_token"):
                r["x_faster_than_accelerate"] = accel["decode_ms_per_token"] / decode
            if ref is not None and r.get("tokens") is not None and ref.get("tokens") is not None:
                n, bad = first_mismatch(r["tokens"], ref["tokens"])
                r["tokens_reference"] = ref["label"]
                r["tokens_compared"] = n
                r["first_mismatch"] = bad
                r["tokens_match_resident"] = bad is None and n > 0
    return doc
