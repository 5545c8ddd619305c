"""Repository rules: core stays vendor-neutral; every hook spec is documented and tested."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from magi_core.plugin import spec as hookspecs
from magi_core.plugin.manager import ALL_HOOKS

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "magi_core"
#: Vendor-specific device API that must never appear under magi_core/ (device code lives in backends/).
FORBIDDEN = ("torch.cuda", '"cuda"', "'cuda'", ".cuda(", ".is_cuda", "cudaHost", "libcudart")
SKIP_SUFFIXES = (".pyc", ".so", ".png")


def forbidden_hits(root: Path) -> list[str]:
    """``path:line: pattern`` for every forbidden pattern in any text file under ``root``."""
    hits: list[str] = []
    for path in sorted(root.rglob("*")):
        if not path.is_file() or "__pycache__" in path.parts or path.suffix in SKIP_SUFFIXES:
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            hits.extend(f"{path.relative_to(root)}:{lineno}: {pat}" for pat in FORBIDDEN if pat in line)
    return hits


def hookspec_functions() -> dict[str, object]:
    """Every hook spec declared in :mod:`magi_core.plugin.spec` (functions carrying pluggy's spec marker)."""
    return {
        name: fn
        for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
        if getattr(fn, f"{hookspecs.PROJECT}_spec", None) is not None
    }


def hook_reference_entries(markdown: str) -> set[str]:
    """Hook names with a ``### name`` section under the ``## Hook reference`` heading."""
    match = re.search(r"^## Hook reference\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if match is None:
        return set()
    return set(re.findall(r"^### (\w+)\s*$", match.group(1), re.M))


def hook_test_files(root: Path) -> Iterable[Path]:
    """Files that count as tests: ``test_*.py`` under tests/ and backends/*/tests, and magi_core/testing."""
    yield from (p for p in (root / "tests").rglob("test_*.py") if p.name != "test_meta.py")
    yield from root.glob("backends/*/tests/**/test_*.py")
    yield from (root / "magi_core" / "testing").rglob("*.py")


def untested_hooks(names: Iterable[str], files: Iterable[Path]) -> set[str]:
    """Hook names that no test file mentions."""
    remaining = set(names)
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        remaining = {n for n in remaining if not re.search(rf"\b{n}\b", text)}
    return remaining


def test_core_names_no_vendor_device_api() -> None:
    hits = forbidden_hits(CORE)
    assert hits == [], "vendor device API under magi_core/ (move it to backends/ or use get_backend()):\n" + \
        "\n".join(hits)


def test_forbidden_scan_detects_each_pattern(tmp_path: Path) -> None:
    for i, pat in enumerate(FORBIDDEN):
        (tmp_path / f"m{i}.py").write_text(f"x = 1\ny = {pat}\n")
    hits = forbidden_hits(tmp_path)
    assert sorted(h.split(": ", 1)[1] for h in hits) == sorted(FORBIDDEN)
    assert all(":2:" in h for h in hits)


def test_hookspecs_exist_and_match_registry() -> None:
    specs = hookspec_functions()
    assert set(hookspecs.REQUIRED_HOOKS) <= set(specs)
    assert set(specs) == set(ALL_HOOKS), "registry.OPTIONAL_HOOKS must list every optional hook spec"


@pytest.mark.parametrize("hook", sorted(hookspec_functions()))
def test_every_hookspec_has_a_docstring(hook: str) -> None:
    doc = inspect.getdoc(hookspec_functions()[hook])
    assert doc and doc.strip(), f"hook spec {hook} needs a one-line docstring"


def test_every_hookspec_is_in_the_hook_reference() -> None:
    documented = hook_reference_entries((ROOT / "CONTRIBUTING.md").read_text(encoding="utf-8"))
    missing = set(hookspec_functions()) - documented
    assert not missing, f"add a '### NAME' section to CONTRIBUTING.md's hook reference for: {sorted(missing)}"


def test_hook_reference_parser_needs_the_section() -> None:
    assert hook_reference_entries("## Hook reference\n\n### magi_probe\n\n## Other\n### magi_x\n") == {"magi_probe"}
    assert hook_reference_entries("### magi_probe\n") == set()


def test_every_hookspec_is_named_by_a_test() -> None:
    missing = untested_hooks(hookspec_functions(), hook_test_files(ROOT))
    assert not missing, f"write a test that exercises (and names) these hooks: {sorted(missing)}"


def test_untested_hooks_detects_a_missing_test(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_x():\n    call('magi_probe')\n    call('magi_probe_extra')\n")
    assert untested_hooks(["magi_probe", "magi_range_pop"], [tmp_path / "test_a.py"]) == {"magi_range_pop"}
