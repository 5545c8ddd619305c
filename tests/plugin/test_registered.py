"""The process's record of registered host ranges: bounds, crossings and regions agree with the ranges held."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from magi_core.plugin.registered import RegisteredRanges

_OPS = st.lists(st.tuples(st.booleans(), st.integers(0, 40), st.integers(1, 12)), max_size=25)


@given(_OPS, st.integers(0, 60), st.integers(1, 30))
def test_crossed_and_region_match_the_ranges_held(ops: list[tuple[bool, int, int]], lo: int, n: int) -> None:
    rec = RegisteredRanges()
    held: list[tuple[int, int]] = []
    version = rec.version
    for add, ptr, size in ops:
        if add:
            rec.add(ptr, size)
            held.append((ptr, size))
        else:
            gone = [h for h in held if h[0] == ptr]
            rec.remove(ptr)  # no-op when nothing starts there
            if gone:
                held.remove(gone[-1])
        assert (rec.version != version) == (add or bool(gone))
        version = rec.version
    bounds = sorted({p for p, _ in held} | {p + s for p, s in held})
    assert list(rec.bounds()) == bounds
    assert rec.held() == {p: max(s for q, s in held if q == p) for p, _ in held}
    hi = lo + n
    assert rec.crossed(lo, hi) == any(lo < b < hi for b in bounds)
    # two addresses share a region exactly when no bound lies in (a, b]
    for a, b in ((lo, hi - 1), (lo, lo)):
        assert (rec.region(a) == rec.region(b)) == (not any(a < x <= b for x in bounds))
