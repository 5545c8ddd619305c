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


def hook_reference_entries(markdown: str) -> set[str]:
    """Hook names with a ``### name`` section under the ``## Hook reference`` heading."""
    return set(hook_reference_blocks(markdown))


def hook_reference_blocks(markdown: str) -> dict[str, str]:
    """``### name`` -> the text of that entry, for every entry under the ``## Hook reference`` heading."""
    match = re.search(r"^## Hook reference\s*$(.*?)(?=^## |\Z)", markdown, re.M | re.S)
    if match is None:
        return {}
    parts = re.split(r"^### (\w+)\s*$", match.group(1), flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts), 2)}


@dataclasses.dataclass
class Bullet:
    """One top-level ``- Field: text`` bullet of a reference entry, with its indented sub-bullets."""

    text: str
    items: list[str] = dataclasses.field(default_factory=list)


def entry_bullets(entry: str) -> dict[str, Bullet]:
    """Field name -> bullet, for the ``- Field: text`` bullets of one reference entry (continuations joined)."""
    bullets: dict[str, Bullet] = {}
    current: Bullet | None = None
    for line in entry.splitlines():
        top = re.match(r"^- ([A-Z][\w ]*?):\s*(.*)$", line)
        sub = re.match(r"^  - (.*)$", line)
        if top:
            current = bullets[top.group(1)] = Bullet(top.group(2).strip())
        elif current is not None and sub:
            current.items.append(sub.group(1).strip())
        elif current is not None and line.startswith("  ") and line.strip():
            if current.items:
                current.items[-1] += " " + line.strip()
            else:
                current.text += " " + line.strip()
        elif not line.strip():
            continue
        else:
            current = None
    return bullets


def annotation_text(annotation: Any) -> str:
    """An annotation as written in the spec (they are strings there: ``from __future__ import annotations``)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def spec_parameters(fn: Callable[..., Any]) -> list[tuple[str, str]]:
    """(name, annotation) of each parameter of a hook spec, in order."""
    return [(p.name, annotation_text(p.annotation)) for p in inspect.signature(fn).parameters.values()]


def spec_signature(name: str, fn: Callable[..., Any]) -> str:
    """``name(param: type, ...) -> return`` as the hook reference prints it."""
    sig = inspect.signature(fn)
    params = ", ".join(f"{n}: {a}" for n, a in spec_parameters(fn))
    return f"{name}({params}) -> {annotation_text(sig.return_annotation)}"


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


def documented_items(items: Iterable[str]) -> list[tuple[str, str]]:
    """(name, type) of sub-bullets written like ``- `ptr` (`int`): meaning``."""
    out = []
    for item in items:
        match = re.match(r"^`(\w+)` \(`([^`]+)`\): \S", item)
        out.append((match.group(1), match.group(2)) if match else ("?", item))
    return out


def reference_problems(hook: str, fn: Callable[..., Any], entry: str, required: bool) -> list[str]:
    """What in a hook reference entry disagrees with the hook spec ``fn`` (empty when it matches)."""
    problems: list[str] = []
    fields = entry_bullets(entry)
    for field in ("Signature", "Required", "Added in", "Parameters", "Returns", "Called", "Semantics"):
        if field not in fields or not fields[field].text and not fields[field].items:
            problems.append(f"{hook}: no '- {field}:' bullet")
    if problems:
        return problems
    want = spec_signature(hook, fn)
    if fields["Signature"].text != f"`{want}`":
        problems.append(f"{hook}: Signature is {fields['Signature'].text}, the spec says `{want}`")
    params = spec_parameters(fn)
    if params:
        got = documented_items(fields["Parameters"].items)
        if got != params:
            problems.append(f"{hook}: Parameters document {got}, the spec has {params} (as `name` (`type`): ...)")
    elif fields["Parameters"].text != "none." or fields["Parameters"].items:
        problems.append(f"{hook}: Parameters should read 'none.' (the spec takes no arguments)")
    req = fields["Required"].text
    if required and req != "yes.":
        problems.append(f"{hook}: Required should read 'yes.' (it is in REQUIRED_HOOKS), got {req!r}")
    if not required:
        match = re.match(r"^no\. Default: (.+)$", req)
        doc_default = spec_default(inspect.getdoc(fn) or "")
        if match is None:
            problems.append(f"{hook}: Required should read 'no. Default: ...' (optional hook), got {req!r}")
        elif first_token(match.group(1)) != doc_default:
            problems.append(f"{hook}: Default {match.group(1)!r} differs from the spec's {doc_default!r}")
    added = version_added(inspect.getdoc(fn) or "")
    if fields["Added in"].text != f"spec {added[0] if added else '?'}.":
        problems.append(f"{hook}: Added in is {fields['Added in'].text!r}, the spec says versionadded {added}")
    return problems


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


# -- the hook reference agrees with the spec: signature, parameters, required or optional, version ----

CONTRIBUTING = ROOT / "CONTRIBUTING.md"


def test_hook_reference_lists_exactly_the_hookspecs() -> None:
    documented = hook_reference_entries(CONTRIBUTING.read_text(encoding="utf-8"))
    stale = documented - set(hookspec_functions())
    assert not stale, f"CONTRIBUTING.md's hook reference documents hooks the spec does not have: {sorted(stale)}"


@pytest.mark.parametrize("hook", sorted(hookspec_functions()))
def test_hook_reference_entry_matches_the_spec(hook: str) -> None:
    entry = hook_reference_blocks(CONTRIBUTING.read_text(encoding="utf-8")).get(hook, "")
    fn = hookspec_functions()[hook]
    assert callable(fn)
    problems = reference_problems(hook, fn, entry, hook in hookspecs.REQUIRED_HOOKS)
    assert not problems, "CONTRIBUTING.md's hook reference disagrees with magi_core/plugin/spec.py:\n" + \
        "\n".join(problems)


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


def test_device_memory_fields_are_documented_in_spec_and_reference() -> None:
    fields = [(f.name, annotation_text(f.type)) for f in dataclasses.fields(hookspecs.DeviceMemory)]
    source = inspect.getsource(hookspecs.DeviceMemory)
    undocumented = [n for n, _ in fields if not re.search(rf"#:.*\n(?:\s*#:.*\n)*\s*{n}:", source)]
    assert not undocumented, f"DeviceMemory fields without a '#:' comment in spec.py: {undocumented}"
    entry = hook_reference_blocks(CONTRIBUTING.read_text(encoding="utf-8"))["magi_device_memory"]
    assert documented_items(entry_bullets(entry)["Returns"].items) == fields, \
        "CONTRIBUTING.md's magi_device_memory 'Returns' bullet must list DeviceMemory's fields as `name` (`type`): ..."


def test_capabilities_fields_are_documented_in_spec_and_reference() -> None:
    fields = [(f.name, annotation_text(f.type)) for f in dataclasses.fields(hookspecs.Capabilities)]
    source = inspect.getsource(hookspecs.Capabilities)
    undocumented = [n for n, _ in fields if not re.search(rf"#:.*\n(?:\s*#:.*\n)*\s*{n}:", source)]
    assert not undocumented, f"Capabilities fields without a '#:' comment in spec.py: {undocumented}"
    entry = hook_reference_blocks(CONTRIBUTING.read_text(encoding="utf-8"))["magi_capabilities"]
    returns = entry_bullets(entry)["Returns"]
    assert documented_items(returns.items) == fields, \
        "CONTRIBUTING.md's magi_capabilities 'Returns' bullet must list Capabilities' fields as `name` (`type`): ..."
    assert hookspecs.Capabilities() == hookspecs.Capabilities(False, "eager", False, None)  # the safe default


def test_device_module_contract_is_documented_attribute_by_attribute() -> None:
    text = CONTRIBUTING.read_text(encoding="utf-8")
    match = re.search(r"^### The device-module contract$(.*?)(?=^### |^## )", text, re.M | re.S)
    assert match, "CONTRIBUTING.md needs a '### The device-module contract' section"
    table = match.group(1)
    for attr in (*hookspecs.DEVICE_MODULE_REQUIRED, *hookspecs.DEVICE_MODULE_EXPECTED):
        assert f"`{attr}(" in table, f"the device-module contract does not document {attr}"
    for phrase in ("torch.Stream", "enable_timing", "must not initialise the device", "`torch.cpu` does not conform"):
        assert phrase in table, phrase


def test_probe_result_fields_are_documented_in_spec_and_reference() -> None:
    fields = [(f.name, annotation_text(f.type)) for f in dataclasses.fields(hookspecs.ProbeResult)]
    source = inspect.getsource(hookspecs.ProbeResult)
    undocumented = [n for n, _ in fields if not re.search(rf"#:.*\n(?:\s*#:.*\n)*\s*{n}:", source)]
    assert not undocumented, f"ProbeResult fields without a '#:' comment in spec.py: {undocumented}"
    entry = hook_reference_blocks(CONTRIBUTING.read_text(encoding="utf-8"))["magi_probe"]
    returns = entry_bullets(entry)["Returns"]
    assert documented_items(returns.items) == fields, \
        "CONTRIBUTING.md's magi_probe 'Returns' bullet must list ProbeResult's fields as `name` (`type`): ..."


def test_reference_checker_catches_each_kind_of_drift() -> None:
    fn = hookspec_functions()["magi_host_register"]
    assert callable(fn)
    good = (
        "- Signature: `magi_host_register(ptr: int, nbytes: int) -> None`\n- Required: yes.\n"
        "- Added in: spec 1.0.\n- Parameters:\n  - `ptr` (`int`): address\n  - `nbytes` (`int`): bytes,\n"
        "    continued\n- Returns: None.\n- Called: when pinning.\n- Semantics: pin.\n"
    )
    assert reference_problems("magi_host_register", fn, good, required=True) == []
    drifts = {
        "Signature": good.replace("nbytes: int) -> None", "size: int) -> None"),
        "Parameters": good.replace("`nbytes` (`int`)", "`size` (`int`)"),
        "Required": good.replace("Required: yes.", "Required: no. Default: no-op."),
        "Added in": good.replace("spec 1.0.", "spec 1.1."),
        "Called": good.replace("- Called: when pinning.\n", ""),
    }
    for field, text in drifts.items():
        problems = reference_problems("magi_host_register", fn, text, required=True)
        assert any(field in p for p in problems), (field, problems)
    pop = hookspec_functions()["magi_range_pop"]
    assert callable(pop)
    lean = good.replace("magi_host_register(ptr: int, nbytes: int)", "magi_range_pop()").replace(
        "- Parameters:\n  - `ptr` (`int`): address\n  - `nbytes` (`int`): bytes,\n    continued\n",
        "- Parameters: none.\n")
    optional = lean.replace("Required: yes.", "Required: no. Default: no-op.")
    assert reference_problems("magi_range_pop", pop, optional, required=False) == []
    wrong_default = lean.replace("Required: yes.", "Required: no. Default: `(\"to\",)`.")
    assert any("Default" in p for p in reference_problems("magi_range_pop", pop, wrong_default, required=False))


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


def test_readme_says_how_to_install_until_the_name_is_settled() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^## Install$(.*?)(?=^## )", readme, re.M | re.S)
    assert match, "README.md needs an '## Install' section"
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
