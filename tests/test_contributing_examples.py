"""The backend author's guide runs as printed: its backend example executes and loads, and the paths it names exist.

The guide is ``docs/backends/writing.md``; CONTRIBUTING.md links to it, and the names and paths both name must exist.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
import sys
import textwrap
import types
from pathlib import Path

import pluggy
import pytest
from helpers.fake_backends import select_and_list, write_dist

from magi_core.plugin import REQUIRED_HOOKS, Capabilities, HostRegisterError, ProbeResult, spec
from magi_core.plugin.manager import OPTIONAL_HOOKS

ROOT = Path(__file__).resolve().parent.parent
CONTRIBUTING = ROOT / "CONTRIBUTING.md"
#: The backend author's guide, whose examples must run as printed.
GUIDE = ROOT / "docs" / "backends" / "writing.md"
#: Heading (its start) of a section (``section`` reads it; the guide is one page of its own).
WRITING = "Writing a backend"
#: The documents whose magi_core names and repository paths must exist.
DOCUMENTS = (CONTRIBUTING, GUIDE)
#: The module of the vendor extension the example imports; it must not exist for the example's probe.
VENDOR_EXTENSION = "torch_mydev"
#: Top-level folders of this repository that the documents may name paths under.
REPO_DIRS = ("magi_core", "tests", "benchmarks", "backends", "docs")


def section(markdown: str, heading: str) -> str:
    """The text of the ``## <heading>...`` section, up to the next ``## `` heading ("" when absent)."""
    match = re.search(rf"^## {re.escape(heading)}.*?$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    return match.group(1) if match else ""


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced ``language`` blocks in ``text`` (indented list-item fences included), dedented."""
    fence = re.compile(rf"^([ \t]*)```{re.escape(language)}[ \t]*\n(.*?)^\1```[ \t]*$", re.M | re.S)
    return [textwrap.dedent(body) for _, body in fence.findall(text)]


def writing_section() -> str:
    """The backend author's guide, ``docs/backends/writing.md``."""
    return GUIDE.read_text(encoding="utf-8") if GUIDE.exists() else ""


def python_examples() -> list[str]:
    """Every ```python block of the backend author's guide."""
    return code_blocks(writing_section(), "python")


def run_example(source: str, name: str) -> types.ModuleType:
    """Execute ``source`` as a fresh module called ``name`` (as importing the backend package would)."""
    module = types.ModuleType(name)
    module.__file__ = f"<docs/backends/writing.md: {name}>"
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def backend_example() -> str:
    """The python example that implements the required hooks (the backend module, with its probe)."""
    found = [src for src in python_examples() if "def magi_probe" in src]
    assert len(found) == 1, f"expected one backend module among the guide's python examples, found {len(found)}"
    return found[0]


def entry_point_example() -> tuple[str, str]:
    """(backend name, module) from the ``magi.backends`` entry point of the section's ```toml block."""
    tomllib = pytest.importorskip("tomllib")
    blocks = code_blocks(writing_section(), "toml")
    assert len(blocks) == 1, "expected one ```toml block (the entry point) in docs/backends/writing.md"
    eps = tomllib.loads(blocks[0])["project"]["entry-points"][spec.ENTRY_POINT_GROUP]
    assert len(eps) == 1
    return next(iter(eps.items()))


@pytest.fixture
def no_vendor_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``import torch_mydev`` fail, as on any machine without the (fictional) vendor extension."""
    monkeypatch.setitem(sys.modules, VENDOR_EXTENSION, None)


# -- the examples -------------------------------------------------------------------------------

def test_the_section_has_examples() -> None:
    assert writing_section(), f"{GUIDE.relative_to(ROOT)} is missing or empty"
    assert python_examples(), f"{GUIDE.relative_to(ROOT)} has no ```python block"
    assert str(GUIDE.relative_to(ROOT)) in CONTRIBUTING.read_text(encoding="utf-8"), "CONTRIBUTING.md links the guide"


def test_examples_import_magi_core_only_through_magi_core_plugin() -> None:
    for source in python_examples():
        for node in ast.walk(ast.parse(source)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            wrong = [n for n in names if n.split(".")[0] == "magi_core" and n != "magi_core.plugin"]
            assert not wrong, f"import magi-core names from magi_core.plugin (the one import for authors), not {wrong}"


@pytest.mark.usefixtures("no_vendor_extension")
def test_every_python_example_runs_as_printed() -> None:
    for i, source in enumerate(python_examples()):
        run_example(source, f"contributing_example_{i}")


@pytest.mark.usefixtures("no_vendor_extension")
def test_backend_example_implements_the_spec_and_reports_unavailable() -> None:
    backend = run_example(backend_example(), "magi_backend_mydev")
    pm = pluggy.PluginManager(spec.PROJECT)
    pm.add_hookspecs(spec)
    pm.register(backend)  # pluggy validates every implementation against the spec
    implemented = {h for h in (*REQUIRED_HOOKS, *OPTIONAL_HOOKS) if getattr(pm.hook, h).get_hookimpls()}
    assert set(REQUIRED_HOOKS) <= implemented
    assert not [hc.name for hc in pm.get_hookcallers(backend) or () if not hc.has_spec()], "unknown hook names"

    probe = backend.magi_probe()
    assert isinstance(probe, ProbeResult)
    assert probe.available is False
    assert probe.reason and VENDOR_EXTENSION in probe.reason
    assert isinstance(probe.priority, int) and probe.version
    assert pm.hook.magi_probe() == probe
    assert tuple(backend.magi_hookspec_versions()) == (spec.HOOKSPEC_VERSION.split(".")[0],)
    # spec 1.1: the example declares the safe capabilities explicitly, with a reason a user can act on
    caps = backend.magi_capabilities()
    assert isinstance(caps, Capabilities) and not caps.inductor and not caps.direct_unit_calls and caps.reason
    # the range table refuses bad input before it reaches the (absent) vendor runtime
    with pytest.raises(HostRegisterError, match="invalid range"):
        backend.magi_host_register(ptr=0, nbytes=4096)
    with pytest.raises(HostRegisterError) as info:
        backend.magi_host_unregister(ptr=4096)
    assert info.value.code == 713


@pytest.mark.skipif(importlib.util.find_spec(VENDOR_EXTENSION) is not None, reason=f"{VENDOR_EXTENSION} exists here")
def test_backend_example_loads_through_its_entry_point(tmp_path: Path) -> None:
    name, module = entry_point_example()
    write_dist(tmp_path, f"magi-backend-{name}", {module: backend_example()}, {name: module})
    out, _ = select_and_list([tmp_path])
    rec = out["backends"][name]
    assert rec["load_error"] is None and rec["probe_error"] is None
    assert rec["missing_required_hooks"] == [] and rec["unknown_hooks"] == []
    assert "magi_capabilities" not in rec["missing_optional_hooks"]
    assert rec["hookspec_versions"] == ["1"]
    assert rec["available"] is False and VENDOR_EXTENSION in rec["why_unavailable"]
    assert out["selected"] == "cpu"


def test_code_block_extraction_handles_list_item_fences() -> None:
    text = "1. step\n\n   ```python\n   x = 1\n\n   if x:\n       y = 2\n   ```\n\n```toml\na = 1\n```\n"
    assert code_blocks(text, "python") == ["x = 1\n\nif x:\n    y = 2\n"]
    assert code_blocks(text, "toml") == ["a = 1\n"]
    assert section("# T\n## Writing a backend, step by step\nbody\n## Next\nrest\n", WRITING) == "\nbody\n"


# -- every path CONTRIBUTING.md and the guide name exists ----------------------------------------

def dotted_names(markdown: str) -> set[str]:
    """Every ``magi_core.x.y`` name in ``markdown``."""
    return set(re.findall(r"\bmagi_core(?:\.[A-Za-z_]\w*)+", markdown))


def file_paths(markdown: str) -> set[str]:
    """Every repository path in ``markdown`` under one of :data:`REPO_DIRS` (placeholders such as <x> left out)."""
    dirs = "|".join(REPO_DIRS)
    found = re.findall(rf"(?<![\w/.-])((?:{dirs})/[\w./<>*-]*)", markdown)
    return {p.rstrip(".") for p in found if not re.search(r"[<>*]", p)}


def resolves(name: str) -> bool:
    """True when ``name`` is an importable module, or an attribute reached from the longest such prefix."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_magi_core_name_resolves(doc: Path) -> None:
    names = dotted_names(doc.read_text(encoding="utf-8"))
    assert names, f"expected {doc.name} to name magi_core modules"
    stale = sorted(n for n in names if not resolves(n))
    assert not stale, f"{doc.name} names magi_core modules or attributes that do not exist: {stale}"


@pytest.mark.parametrize("doc", DOCUMENTS, ids=lambda p: p.name)
def test_every_repository_path_exists(doc: Path) -> None:
    paths = file_paths(doc.read_text(encoding="utf-8"))
    assert any(p.startswith("magi_core/") and p.endswith(".py") for p in paths)
    stale = sorted(p for p in paths if not (ROOT / p).exists())
    assert not stale, f"{doc.name} names paths that do not exist: {stale}"


def test_path_checks_catch_stale_names() -> None:
    text = "see `magi_core/hookspecs.py`, magi_core.registry.get_backend and magi_core.plugin.spec.NOPE; " \
        "results in benchmarks/results/<date>.json and magi_core/plugin/spec.py."
    assert dotted_names(text) == {"magi_core.registry.get_backend", "magi_core.plugin.spec.NOPE"}
    assert not resolves("magi_core.registry.get_backend") and not resolves("magi_core.plugin.spec.NOPE")
    assert resolves("magi_core.plugin.spec.HOOKSPEC_VERSION") and resolves("magi_core.get_backend")
    assert file_paths(text) == {"magi_core/hookspecs.py", "magi_core/plugin/spec.py"}
