"""Repository rules: core stays vendor-neutral; every hook spec is documented and tested."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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


def annotation_text(annotation: Any) -> str:
    """An annotation as written in the spec (they are strings there: ``from __future__ import annotations``)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def spec_parameters(fn: Callable[..., Any]) -> list[tuple[str, str]]:
    """(name, annotation) of each parameter of a hook spec, in order."""
    return [(p.name, annotation_text(p.annotation)) for p in inspect.signature(fn).parameters.values()]


def version_added(doc: str) -> list[str]:
    """The versions named by ``.. versionadded::`` directives in a docstring."""
    return re.findall(r"^\s*\.\. versionadded:: (\S+)\s*$", doc, re.M)


def first_token(text: str) -> str:
    """The first word of ``text``, without trailing punctuation and backticks (to compare defaults)."""
    return text.split()[0].rstrip(".;,").strip("`") if text.split() else ""


def spec_default(doc: str) -> str | None:
    """The default an optional hook's docstring states (``Optional; default: X``), or None."""
    match = re.search(r"^\s*Optional; default: (.*)$", doc, re.M)
    return first_token(match.group(1)) if match else None


def field_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (what the generated reference shows)."""
    import ast
    import textwrap

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(body, ast.ClassDef)
    docs: dict[str, str] = {}
    for node, nxt in zip(body.body, body.body[1:], strict=False):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = nxt.value.value
    return docs


#: The generated hook reference: a mkdocstrings directive over the spec module.
HOOK_PAGE = ROOT / "docs" / "reference" / "hooks.md"
#: Documents that must not keep a hand-written copy of the hook reference.
NO_COPIES = (ROOT / "CONTRIBUTING.md", ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")))


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
    assert set(specs) == set(ALL_HOOKS), "magi_core.plugin.manager.OPTIONAL_HOOKS must list every optional hook spec"


@pytest.mark.parametrize("hook", sorted(hookspec_functions()))
def test_every_hookspec_has_a_docstring(hook: str) -> None:
    doc = inspect.getdoc(hookspec_functions()[hook])
    assert doc and doc.strip(), f"hook spec {hook} needs a one-line docstring"


def test_hook_reference_is_generated_from_the_spec() -> None:
    text = HOOK_PAGE.read_text(encoding="utf-8")
    assert re.search(r"^::: magi_core\.plugin\.spec\s*$", text, re.M), f"{HOOK_PAGE.name} must render the spec module"
    hidden = [pat[1:] for pat in re.findall(r'"(![^"]+)"', text)]
    shown = [h for h in hookspec_functions() if not any(re.search(pat, h) for pat in hidden)]
    assert sorted(shown) == sorted(hookspec_functions()), "the page's filters must not hide a hook spec"


def test_no_hand_written_copy_of_the_hook_reference() -> None:
    for doc in NO_COPIES:
        text = doc.read_text(encoding="utf-8")
        copies = re.findall(r"^#+ (magi_\w+)\s*$", text, re.M)
        assert not re.search(r"^## Hook reference", text, re.M) and not copies, \
            f"{doc.relative_to(ROOT)} repeats the hook reference ({copies}): link docs/reference/hooks.md instead"


def test_every_hookspec_is_named_by_a_test() -> None:
    missing = untested_hooks(hookspec_functions(), hook_test_files(ROOT))
    assert not missing, f"write a test that exercises (and names) these hooks: {sorted(missing)}"


def test_untested_hooks_detects_a_missing_test(tmp_path: Path) -> None:
    (tmp_path / "test_a.py").write_text("def test_x():\n    call('magi_probe')\n    call('magi_probe_extra')\n")
    assert untested_hooks(["magi_probe", "magi_range_pop"], [tmp_path / "test_a.py"]) == {"magi_range_pop"}


# -- the hook specs document themselves (the generated reference shows their docstrings) ------------------


@pytest.mark.parametrize("hook", sorted(hookspec_functions()))
def test_every_hookspec_documents_parameters_return_status_and_version(hook: str) -> None:
    fn = hookspec_functions()[hook]
    assert callable(fn)
    doc = inspect.getdoc(fn) or ""
    lines = doc.splitlines()
    assert len(lines) > 2 and lines[0].strip() and not lines[1].strip(), f"{hook}: a one-line summary, then a blank"
    assert set(re.findall(r":param (\w+):", doc)) == {n for n, _ in spec_parameters(fn)}, \
        f"{hook}: document each parameter (and only those) with ':param NAME:'"
    assert re.search(r"^:returns:", doc, re.M), f"{hook}: document the return value with ':returns:'"
    assert "Called" in doc, f"{hook}: say when magi-core calls it"
    required = hook in hookspecs.REQUIRED_HOOKS
    assert bool(re.search(r"^Required\.", doc, re.M)) == required, f"{hook}: say 'Required.' iff in REQUIRED_HOOKS"
    assert (spec_default(doc) is not None) == (not required), f"{hook}: optional hooks say 'Optional; default: X'"
    added = version_added(doc)
    assert len(added) == 1, f"{hook}: one '.. versionadded:: X.Y' (the spec version it appeared in)"
    major, _, minor = added[0].partition(".")
    current = hookspecs.HOOKSPEC_VERSION.split(".")
    assert major.isdigit() and minor.isdigit(), f"{hook}: versionadded {added[0]!r} is not major.minor"
    assert (int(major), int(minor)) <= (int(current[0]), int(current[1])), \
        f"{hook}: versionadded {added[0]} is newer than HOOKSPEC_VERSION {hookspecs.HOOKSPEC_VERSION}"
    assert getattr(fn, f"{hookspecs.PROJECT}_spec")["firstresult"], f"{hook}: the reference says all are firstresult"


def test_hookspec_version_is_1_2_and_each_minor_only_added_optional_hooks() -> None:
    assert hookspecs.HOOKSPEC_VERSION == "1.2"
    added = {name: version_added(inspect.getdoc(fn) or "") for name, fn in hookspec_functions().items()}
    assert {name for name, v in added.items() if v != ["1.0"]} == {
        "magi_capabilities", "magi_device_memory", "magi_limit_device_memory"}
    assert added["magi_capabilities"] == ["1.1"]
    assert added["magi_device_memory"] == added["magi_limit_device_memory"] == ["1.2"]
    # a minor version adds optional hooks only
    assert not {"magi_capabilities", "magi_device_memory", "magi_limit_device_memory"} & set(hookspecs.REQUIRED_HOOKS)
    assert version_added(inspect.getdoc(hookspecs.Capabilities) or "") == ["1.1"]
    assert version_added(inspect.getdoc(hookspecs.DeviceMemory) or "") == ["1.2"]


@pytest.mark.parametrize("cls", [hookspecs.ProbeResult, hookspecs.Capabilities, hookspecs.DeviceMemory],
                         ids=lambda c: c.__name__)
def test_result_fields_are_documented_in_the_spec(cls: type) -> None:
    fields = [f.name for f in dataclasses.fields(cls)]
    docs = field_docstrings(cls)
    undocumented = [n for n in fields if not docs.get(n, "").strip()]
    assert not undocumented, f"{cls.__name__} fields without a docstring under them in spec.py: {undocumented}"


def test_capabilities_default_is_the_safe_answer() -> None:
    assert hookspecs.Capabilities() == hookspecs.Capabilities(False, "eager", False, None)


def test_device_module_contract_is_documented_attribute_by_attribute() -> None:
    text = (ROOT / "docs" / "backends" / "writing.md").read_text(encoding="utf-8")
    match = re.search(r"^## The device-module contract$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, "docs/backends/writing.md needs a '## The device-module contract' section"
    table = match.group(1)
    for attr in (*hookspecs.DEVICE_MODULE_REQUIRED, *hookspecs.DEVICE_MODULE_EXPECTED):
        assert f"`{attr}(" in table, f"the device-module contract does not document {attr}"
    for phrase in ("torch.Stream", "enable_timing", "must not initialise the device", "`torch.cpu` does not conform"):
        assert phrase in table, phrase


def package_sources() -> list[Path]:
    """The Python files of magi_core and of the backends' packages (where messages and docstrings live)."""
    return [*sorted(CORE.rglob("*.py")), *sorted(ROOT.glob("backends/*/magi_backend_*/**/*.py"))]


def test_docs_pages_and_readme_sections_named_by_the_package_exist() -> None:
    """A message or docstring that sends the reader to a docs page or a README section names one that exists."""
    readme = set(re.findall(r"^#+ (.+?)\s*$", (ROOT / "README.md").read_text(encoding="utf-8"), re.M))
    missing: list[str] = []
    for path in package_sources():
        text = path.read_text(encoding="utf-8")
        where = path.relative_to(ROOT)
        missing += [f"{where}: {page}" for page in set(re.findall(r"\bdocs/[\w./-]+\.md\b", text))
                    if not (ROOT / page).is_file()]
        missing += [f"{where}: README section {s!r}" for s in re.findall(r"README's (\w[\w ]*?) section", text)
                    if s not in readme]
        missing += [f"{where}: the hook reference is docs/reference/hooks.md"
                    for _ in re.findall(r"CONTRIBUTING\.md, hook reference", text)]
    assert not missing, missing


def api_reference_classes() -> list[type]:
    """The classes docs/reference/api.md renders with their attributes (mkdocstrings shows a docstring written
    under an attribute; it does not read ``#:`` comments)."""
    from magi_core import Backend, OffloadConfig
    from magi_core.compile.handle import OffloadHandle, RuntimeStats
    from magi_core.host import HostOptions

    return [Backend, OffloadConfig, HostOptions, OffloadHandle, RuntimeStats]


def comment_documented_attributes(cls: type) -> list[str]:
    """Public attributes of ``cls`` (fields, or ``self.x`` set in a method) documented by a ``#:`` comment above."""
    lines = inspect.getsource(cls).splitlines()
    found: list[str] = []
    for i, line in enumerate(lines):
        if not line.lstrip().startswith("#:"):
            continue
        nxt = next((x for x in lines[i + 1:] if not x.lstrip().startswith("#")), "")
        match = re.match(r"\s*(?:self\.)?([A-Za-z]\w*)\s*[:=]", nxt)
        if match:
            found.append(match.group(1))
    return found


@pytest.mark.parametrize("cls", api_reference_classes(), ids=lambda c: c.__name__)
def test_api_reference_attributes_are_documented_under_them(cls: type) -> None:
    commented = comment_documented_attributes(cls)
    assert not commented, f"{cls.__name__}: move the '#:' comments of {commented} into docstrings under them"
    if cls.__name__ in ("RuntimeStats", "Backend", "HostOptions"):  # rendered field by field
        docs = field_docstrings(cls)
        public = [f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")]
        assert not [n for n in public if not docs.get(n, "").strip()], f"{cls.__name__}: fields without a docstring"


def test_comment_documented_attributes_finds_public_ones_only() -> None:
    class Probe:
        #: shown nowhere
        a: int = 0
        #: private
        _b: int = 0
        c: int = 0
        """rendered"""

        def __init__(self) -> None:
            #: shown nowhere either
            self.d = 1

    assert comment_documented_attributes(Probe) == ["a", "d"]


def test_field_docstrings_reads_the_string_under_each_field() -> None:
    @dataclasses.dataclass
    class Probe:
        a: int
        """the a"""
        b: int = 0
        c: str = ""
        """the c"""

    assert field_docstrings(Probe) == {"a": "the a", "c": "the c"}


# -- packages install the right thing --------------------------------------------------------------------------

BACKEND_DIRS = sorted(p.parent for p in (ROOT / "backends").glob("*/pyproject.toml"))
#: Versions of the unrelated project that holds the name "magi-core" on PyPI (pip index versions, 2026).
FOREIGN_MAGI_CORE = ("0.3.1", "0.4.0", "0.4.1", "0.4.2", "0.4.3", "0.4.4")


def _pyproject(path: Path) -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((path / "pyproject.toml").read_text(encoding="utf-8"))


def test_backends_require_the_magi_core_line_of_their_spec_major_only() -> None:
    from packaging.requirements import Requirement

    import magi_core

    assert BACKEND_DIRS, "expected backend packages under backends/"
    for d in BACKEND_DIRS:
        reqs = [Requirement(r) for r in _pyproject(d)["project"]["dependencies"]]
        core = [r for r in reqs if r.name == "magi-core"]
        assert len(core) == 1, f"{d.name}: one magi-core requirement expected"
        spec = core[0].specifier
        assert str(spec) in ("<0.2,>=0.1", ">=0.1,<0.2"), f"{d.name}: magi-core{spec}, want >=0.1,<0.2"
        assert spec.contains(magi_core.__version__), f"{d.name}: magi-core {magi_core.__version__} must satisfy it"
        assert not any(spec.contains(v) for v in FOREIGN_MAGI_CORE), f"{d.name}: the unrelated PyPI project fits"
    # the 0.1 line is hook-spec major 1: a new major means a new magi-core line and new backend pins
    assert magi_core.__version__.startswith("0.1.") and hookspecs.HOOKSPEC_VERSION.split(".")[0] == "1"


def test_install_page_says_how_to_install_until_the_name_is_settled() -> None:
    page = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    match = re.search(r"^## Install$(.*?)(?=^## )", page, re.M | re.S)
    assert match, "docs/index.md needs an '## Install' section"
    text = " ".join(match.group(1).split())
    assert "unrelated project" in text and "magi-core>=0.1,<0.2" in text and "python -m build --wheel" in text


def test_license_is_apache_2_and_ships_with_every_package() -> None:
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    for d in (ROOT, *BACKEND_DIRS):
        project = _pyproject(d)["project"]
        assert project["license"] == "Apache-2.0"
        assert project.get("license-files") == ["LICENSE"], f"{d}: license-files = ['LICENSE']"
        assert (d / "LICENSE").read_text(encoding="utf-8") == text, f"{d}/LICENSE must be the same Apache-2.0 text"


def _imports(source: str) -> set[str]:
    import ast

    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _can_build_sdists() -> str | None:
    """Why the sdists cannot be built here without fetching anything (None when they can)."""
    import importlib.metadata
    import importlib.util

    if importlib.util.find_spec("build") is None:
        return "needs `build` (pip install build)"
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return "needs setuptools"
    return None if major >= 77 else "needs setuptools>=77 (license-files) to build without isolation"


@pytest.mark.skipif(_can_build_sdists() is not None, reason=str(_can_build_sdists()))
def test_sdists_carry_only_tests_that_can_run_from_the_sdist(tmp_path: Path) -> None:
    import shutil
    import subprocess
    import sys
    import tarfile

    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", "*.pyc")
    sources = {"magi_core": ROOT, **{d.name: d for d in BACKEND_DIRS}}
    members: dict[str, dict[str, bytes]] = {}
    for name, src in sources.items():
        work = tmp_path / "src" / name
        work.mkdir(parents=True)
        for entry in src.iterdir():  # copy: building writes egg-info next to the sources
            if entry.name in ("pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "tests") or \
                    entry.name.startswith(("magi_core", "magi_backend_")) and entry.is_dir():
                (shutil.copytree(entry, work / entry.name, ignore=ignore) if entry.is_dir()
                 else shutil.copy2(entry, work / entry.name))
        out = tmp_path / "dist" / name
        run = subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), str(work)],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
        (sdist,) = out.glob("*.tar.gz")
        with tarfile.open(sdist) as tar:
            members[name] = {m.name.split("/", 1)[1]: (tar.extractfile(m).read() if m.isfile() else b"")
                             for m in tar.getmembers() if "/" in m.name}
    for name, files in members.items():
        assert "LICENSE" in files, f"{name}: the sdist lacks LICENSE"
        tests = {f: body for f, body in files.items() if f.startswith("tests/") and f.endswith(".py")}
        local = {Path(f).stem for f in tests}
        own = {"magi_core", "magi_backend_cuda", "magi_backend_musa"} & {p.split("/")[0] for p in files}
        for f, body in tests.items():
            missing = {m for m in _imports(body.decode()) if m not in local and m not in own and
                       m not in ("pytest", "torch", "magi_core", "hypothesis", "importlib_metadata")
                       and __import__("importlib").util.find_spec(m) is None}
            assert not missing, f"{name} sdist: {f} imports {missing}, which the sdist does not carry"
    assert not any(f.startswith("tests/") for f in members["magi_core"]), "magi-core's tests need the checkout"
    assert not any(f.startswith("tests/") for f in members["musa"]), "the MUSA tests need the emulation in the checkout"
    assert {"tests/test_cuda_backend.py", "tests/test_cuda_conformance.py"} <= set(members["cuda"])
