"""Every ```python block of README.md and the user-facing pages of docs/ runs as printed, on the CPU backend.

The blocks of one page run in order in one namespace (a page may build on its earlier blocks), in a fresh working
directory, with a private shared-memory directory (nothing may be left there, nothing left registered). A block that
cannot run here (it needs CUDA, several ranks under torchrun, or files that are not in the repository) is preceded by
``<!-- no-run: reason -->``; such opt-outs must say why and stay few.
"""

from __future__ import annotations

import gc
import os
import re
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parent.parent
#: Pages whose python blocks must run: the README, the home page and the user guide.
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
#: The most opted-out blocks allowed over all pages.
MAX_OPT_OUTS = 4

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(?P<reason>.*?)\s*-->\s*$")


def python_blocks(markdown: str) -> list[tuple[int, str, str | None]]:
    """``(line, source, opt-out reason or None)`` for each fenced ```python block of ``markdown``."""
    blocks = []
    for match in FENCE.finditer(markdown):
        if match.group("lang") != "python":
            continue
        before = markdown[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        opt = NO_RUN.search(before)
        line = markdown.count("\n", 0, match.start()) + 1
        blocks.append((line, textwrap.dedent(match.group("body")), opt.group("reason") if opt else None))
    return blocks


def _release_all(namespace: dict[str, object]) -> None:
    import magi_core

    for value in list(namespace.values()):
        if isinstance(value, torch.nn.Module):
            magi_core.release(value)
    namespace.clear()


@pytest.fixture
def page_env(shm_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fresh working directory and a fresh Dynamo for each page; offloaded models released after it."""
    monkeypatch.chdir(tmp_path)
    for var in [v for v in os.environ if v.startswith("MAGI_OFFLOAD_")]:
        monkeypatch.delenv(var)
    environ = dict(os.environ)
    torch._dynamo.reset()
    yield tmp_path
    torch._dynamo.reset()
    gc.collect()
    os.environ.clear()  # a page may set variables of its own (configuration.md): put the environment back
    os.environ.update(environ)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_snippets_run(page: Path, page_env: Path) -> None:
    blocks = [b for b in python_blocks(page.read_text(encoding="utf-8")) if b[2] is None]
    namespace: dict[str, object] = {"__name__": f"snippets_{page.stem}"}
    try:
        for line, source, _ in blocks:
            code = compile(source, f"{page.relative_to(ROOT)}:{line}", "exec")
            exec(code, namespace)
    finally:
        _release_all(namespace)


def test_opt_outs_are_few_and_say_why() -> None:
    opted = [(page.name, line, reason) for page in PAGES
             for line, _, reason in python_blocks(page.read_text(encoding="utf-8")) if reason is not None]
    assert all(reason for _, _, reason in opted), f"a no-run comment must give its reason: {opted}"
    assert len(opted) <= MAX_OPT_OUTS, f"too many blocks opted out of running ({len(opted)}): {opted}"


def test_every_page_with_code_runs_some() -> None:
    assert python_blocks((ROOT / "README.md").read_text(encoding="utf-8")), "README.md lost its quick start"
    for page in PAGES:
        for _, source, _reason in python_blocks(page.read_text(encoding="utf-8")):
            assert source.strip(), f"{page.name}: an empty python block"


def test_block_extraction_reads_fences_and_opt_outs() -> None:
    text = ("intro\n\n```python\nx = 1\n```\n\n<!-- no-run: needs CUDA -->\n```python\ny = 2\n```\n\n"
            "```bash\nls\n```\n\n1. step\n\n    ```python\n    z = 3\n    ```\n")
    blocks = python_blocks(text)
    assert [(src, reason) for _, src, reason in blocks] == [("x = 1\n", None), ("y = 2\n", "needs CUDA"),
                                                            ("z = 3\n", None)]
    assert blocks[0][0] == 3


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md"])
def test_relative_links_resolve(doc: str) -> None:
    """The files outside the site link into it by path: each target exists (the site's own links are checked by
    ``mkdocs build --strict``)."""
    text = (ROOT / doc).read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    targets = [t.split("#")[0] for t in links if "://" not in t and not t.startswith("#")]
    assert targets, f"{doc} links nothing"
    missing = sorted({t for t in targets if not (ROOT / t).exists()})
    assert not missing, f"{doc} links files that do not exist: {missing}"


def test_api_reference_renders_the_public_api() -> None:
    """Each name of ``magi_core.__all__`` is on the API reference page, rendered from its docstring."""
    import magi_core

    page = (ROOT / "docs" / "reference" / "api.md").read_text(encoding="utf-8")
    rendered = set(re.findall(r"^::: magi_core\.(\w+)\s*$", page, re.M))
    errors = re.search(r"^::: magi_core\.errors\s*$.*?members: \[([^\]]*)\]", page, re.M | re.S)
    rendered |= {n.strip() for n in errors.group(1).split(",")} if errors else set()
    missing = sorted(set(magi_core.__all__) - rendered - {"__version__"})
    assert not missing, f"add '::: magi_core.NAME' to docs/reference/api.md for: {missing}"
