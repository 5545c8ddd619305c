"""HostOptions are checked on construction as strictly as OffloadConfig: a ConfigError naming the field for a wrong
type (booleans given as strings, strings or non-integral floats for counts), NaN and infinity, values out of range,
and values outside a field's fixed set (with a "did you mean"); byte sizes also take "1GiB"-style strings."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from host_workers.common import shm_dir_fixture  # noqa: F401  (fixture)
from safetensors.torch import save_file
from torch import nn

from magi_core.errors import ConfigError
from magi_core.host import HostOptions, materialize
from magi_core.plugin.cpu import registered_ranges

BAD: list[tuple[str, Any, str]] = [
    # booleans: a string is never a boolean ('false' used to turn shared memory *off*, 'no' to pin)
    ("skip_shm", "false", "pass False"),
    ("skip_shm", "true", "pass True"),
    ("pin", "no", "pass False"),
    ("pin", 1, "True or False"),
    ("pin", None, "True or False"),
    ("progress", "yes", "pass True"),
    ("cleanup_stale", 0, "True or False"),
    ("_unsafe_share_across_ranks", "1", "True or False"),
    # counts: whole numbers only, never NaN, inf, strings or booleans
    ("pin_concurrency", 2.5, "whole number >= 1"),
    ("pin_concurrency", math.nan, "whole number >= 1"),
    ("pin_concurrency", math.inf, "whole number >= 1"),
    ("pin_concurrency", "2", "whole number >= 1"),
    ("pin_concurrency", True, "whole number >= 1"),
    ("pin_concurrency", 0, "whole number >= 1"),
    ("ep_size", 1.5, "whole number >= 1"),
    ("ep_size", "2", "whole number >= 1"),
    ("load_threads", math.nan, "whole number >= 1"),
    ("load_threads", "4", "whole number >= 1"),
    ("fingerprint_samples", 0.5, "whole number >= 1"),
    ("fingerprint_samples", None, "whole number >= 1"),
    ("alignment", 100, "power of two >= 64"),
    ("alignment", 256.5, "power of two >= 64"),
    ("alignment", "256", "power of two >= 64"),
    # byte sizes
    ("pin_budget_bytes", math.nan, "number of bytes >= 0"),
    ("pin_budget_bytes", math.inf, "number of bytes >= 0"),
    ("pin_budget_bytes", -1, "number of bytes >= 0"),
    ("pin_budget_bytes", "lots", "not a byte size"),
    ("pin_budget_bytes", "1.5B", "not a whole number of bytes"),
    ("pin_budget_bytes", [1], "number of bytes"),
    ("staging_bytes", math.nan, "number of bytes >= 4096"),
    ("staging_bytes", 1024, "number of bytes >= 4096"),
    ("staging_bytes", "1KiB", "number of bytes >= 4096"),
    ("staging_bytes", False, "number of bytes >= 4096"),
    # fixed sets of values: the valid ones named, the closest suggested
    ("on_mismatch", "eror", "did you mean 'error'?"),
    ("on_mismatch", "ignore", "'copy'"),
    ("on_mismatch", None, "'copy'"),
    ("verify_shared", "ful", "did you mean 'full'?"),
    ("verify_shared", 1, "'sampled'"),
    ("shared_writes", "copy-on-write", "did you mean 'copy_on_write'?"),
    ("shared_writes", "readonly", "did you mean 'read_only'?"),
    ("shared_writes", True, "'read_only'"),
    # paths
    ("shm_dir", 5, "directory path"),
    ("shm_dir", "", "directory path"),
    ("shm_dir", b"/dev/shm", "directory path"),
]


@pytest.mark.parametrize(("field", "value", "expect"), BAD, ids=[f"{f}={v!r}" for f, v, _ in BAD])
def test_a_bad_value_is_a_config_error_naming_the_field(field: str, value: Any, expect: str) -> None:
    with pytest.raises(ConfigError) as err:
        HostOptions(**{field: value})
    msg = str(err.value)
    assert f"HostOptions.{field}=" in msg and expect in msg, msg


def test_good_values_are_normalised() -> None:
    opts = HostOptions(pin_budget_bytes="1GiB", staging_bytes="64 KiB", load_threads=4.0, pin_concurrency=2,
                       ep_size=2.0, on_mismatch=" Error ", verify_shared="SAMPLED", shared_writes="Copy_On_Write",
                       shm_dir=Path("/dev/shm"), alignment=512.0, skip_shm=False, progress=None)
    assert opts.pin_budget_bytes == 1 << 30 and opts.staging_bytes == 64 << 10
    assert opts.load_threads == 4 and isinstance(opts.load_threads, int) and opts.ep_size == 2
    assert (opts.on_mismatch, opts.verify_shared, opts.shared_writes) == ("error", "sampled", "copy_on_write")
    assert opts.shm_dir == "/dev/shm" and opts.alignment == 512 and isinstance(opts.alignment, int)
    assert HostOptions(pin_budget_bytes=0, staging_bytes=4096.0).staging_bytes == 4096
    assert HostOptions() == HostOptions(on_mismatch="copy", verify_shared="full", shared_writes="read_only")


def test_resolve_keeps_the_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment fills None fields through the strict parsers; the result is checked again."""
    for var in ("MAGI_EP_SIZE", "MAGI_SKIP_SHM", "MAGI_PIN_CONCURRENCY", "MAGI_PIN_BUDGET_GB", "MAGI_SHM_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MAGI_PIN_CONCURRENCY", "2.5")
    with pytest.raises(ConfigError, match="MAGI_PIN_CONCURRENCY"):
        HostOptions().resolve()
    monkeypatch.setenv("MAGI_PIN_CONCURRENCY", "2")
    monkeypatch.setenv("MAGI_PIN_BUDGET_GB", "0.5")
    opts = HostOptions(staging_bytes="8KiB").resolve()
    assert opts.pin_concurrency == 2 and opts.pin_budget_bytes == 1 << 29 and opts.staging_bytes == 8192
    monkeypatch.setenv("MAGI_SKIP_SHM", "nan")
    with pytest.raises(ConfigError, match="MAGI_SKIP_SHM"):
        HostOptions().resolve()


def test_materialize_arguments_are_checked_too(shm_dir: str, tmp_path: Path) -> None:
    """strict='false' used to load strictly, and options of another type failed with an AttributeError."""
    model = nn.Linear(2, 2)
    save_file({"weight": torch.ones(2, 2), "bias": torch.ones(2)}, str(tmp_path / "m.safetensors"))
    for kwargs, expect in (({"strict": "false"}, "strict='false'"), ({"rename": "model."}, "rename='model.'"),
                           ({"options": {"pin": False}}, "takes a magi_core.host.HostOptions, got dict")):
        meta = nn.Linear(2, 2, device="meta")
        with pytest.raises(ConfigError, match=re.escape(expect)):
            materialize(meta, **{"source": tmp_path / "m.safetensors", **kwargs})
        assert meta.weight.is_meta
    with pytest.raises(ConfigError, match="on_progress=3"):
        materialize(model, on_progress=3)  # type: ignore[arg-type]
    assert os.listdir(shm_dir) == [] and registered_ranges() == {}
