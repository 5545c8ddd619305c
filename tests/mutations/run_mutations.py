"""Mutation check (issue 19): apply one plausible bug at a time to a scratch copy and run the tests that must catch it.

Not collected by pytest (no ``test_`` prefix). For each mutation: the repository is copied (without ``.git``,
``.tox`` and caches) to a temporary directory, one exact string replacement is made in the copy (the script
stops if the string is not found exactly ``count`` times, so a refactor cannot silently turn a mutation into a
no-op), and the named test files run there with the copy first on ``PYTHONPATH`` (the copy's ``magi_core`` and
its ``examples/privateuse1`` are imported: checked before each run). Suites run in the order given, as the tox
envs run them (``core``: the CPU backend; ``privateuse1``: the emulated magidev device with the stream-order
checker plugin), and stop at the first that fails. A mutation is *caught* when a suite exits with pytest's
"tests failed" status (1); any other status but 0 is reported as an error.

    python tests/mutations/run_mutations.py              # every mutation
    python tests/mutations/run_mutations.py a d          # some of them
    python tests/mutations/run_mutations.py --baseline   # the same suites on an unmutated copy: must pass
    python tests/mutations/run_mutations.py --list       # what each mutation does

Exit status 0 when every mutation asked for was caught (``--baseline``: when every suite passed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IGNORED = (".git", ".tox", "__pycache__", "*.egg-info", ".pytest_cache", ".hypothesis", ".mypy_cache",
           ".ruff_cache", ".venv", "dist", ".whl")

#: Environment of each suite (on top of the caller's, with MAGI_* cleared), as tox.ini sets it.
ENVS: dict[str, dict[str, str]] = {
    "core": {},
    "privateuse1": {"MAGI_BACKEND": "magidev", "MAGI_OFFLOAD_UNIT_COMPILER": "eager",
                    "MAGI_OFFLOAD_BANDWIDTH_PROBE_BYTES": "16MiB"},
}
#: Extra pytest arguments of each suite, as tox.ini runs it: the core env has no MUSA backend, so its ``emulated``
#: tests skip there (they run in the musa env); privateuse1 fails tests that leave stream-order violations.
PYTEST_ARGS: dict[str, tuple[str, ...]] = {"core": ("-m", "not emulated"),
                                           "privateuse1": ("-p", "torch_magidev.pytest_plugin")}

EXECUTOR_PU1 = ("tests/execute/test_executor.py", "tests/execute/test_executor_models.py",
                "tests/api/test_offload_api.py", "tests/compile/test_executor_device_inputs.py",
                "tests/compile/test_handle.py", "tests/execute/test_weight_updates.py",
                "tests/execute/test_transfer.py")


@dataclass(frozen=True)
class Mutation:
    """One plausible bug: replace ``old`` by ``new`` in ``path`` (``count`` occurrences), then run ``suites``."""

    key: str
    what: str
    path: str
    old: str
    new: str
    #: env name -> test paths, run in this order; the first failing suite catches the mutation.
    suites: tuple[tuple[str, tuple[str, ...]], ...]
    count: int = 1
    extra: tuple[tuple[str, str, str], ...] = field(default=())  # further (path, old, new) edits of the same bug


MUTATIONS: tuple[Mutation, ...] = (
    Mutation(
        "a", "executor: the per-weight release after its last use (record_stream on the compute stream) is dropped",
        "magi_core/execute/executor.py",
        "                release(env[w], compute)\n                env[w] = None\n",
        "                env[w] = None\n",
        (("core", ("tests/execute/test_transfer.py", "tests/execute/test_executor.py")), ("privateuse1", EXECUTOR_PU1)),
    ),
    Mutation(
        "b", "facade: Backend.record_stream does nothing",
        "magi_core/plugin/facade.py",
        "        if tensor.device.type == self.device_type and self.is_accelerator:\n"
        "            tensor.record_stream(stream)\n",
        "        return None\n",
        (("core", ("tests/execute/test_transfer.py",)), ("privateuse1", EXECUTOR_PU1)),
    ),
    Mutation(
        "c", "residency: a resident copy is not re-acquired when its host tensor is replaced (identity/pointer check "
        "skipped in ResidentSet.fill)",
        "magi_core/execute/residency.py",
        "            if h is not hosts[k] or h.data_ptr() != ptrs[k]:\n",
        "            if hosts[k] is None:\n",
        (("core", ("tests/execute/test_weight_updates.py", "tests/execute/test_executor_recording.py")),
         ("privateuse1", EXECUTOR_PU1)),
    ),
    Mutation(
        "d", "executor: a prefetch carried over from the previous call is reused without checking its host tensors",
        "magi_core/execute/executor.py",
        "            if c is not None and not changed.intersection(ws):",
        "            if c is not None:",
        (("core", ("tests/execute/test_weight_updates.py", "tests/execute/test_executor_recording.py")),
         ("privateuse1", EXECUTOR_PU1)),
    ),
    Mutation(
        "e", "manager: the facade ignores the backend's to-method aliases and uses ('to',)",
        "magi_core/plugin/manager.py",
        'aliases = tuple(raw_aliases) if raw_aliases else ("to",)',
        'aliases = ("to",)',
        (("core", ("tests/plugin/test_registry.py", "tests/passes/test_device_placement.py")),),
    ),
    Mutation(
        "f1", "materialize: a reader rank skips its full check of the shared file (every byte)",
        "magi_core/host/materialize/file_round.py",
        "differing = self._verify(arenas, total)",
        "differing = []",
        (("core", ("tests/host/test_host_distributed.py",)),),
    ),
    Mutation(
        "f2", "materialize: a reader rank skips its sampled check of the shared file (verify_shared='sampled')",
        "magi_core/host/materialize/file_round.py",
        "self._check_sampled(arenas, own_fps)",
        "pass",
        (("core", ("tests/host/test_host_distributed.py",)),),
    ),
    Mutation(
        "f3", "shm: a reader opens the shared file without checking its type, owner, mode and size",
        "magi_core/host/shm.py",
        "    if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077\n"
        "            or st.st_size != nbytes):\n",
        "    if False:\n",
        (("core", ("tests/host/test_host_shm.py",)),),
    ),
    Mutation(
        "f4", "shm: stale-file cleanup forgets to check the file's owner uid",
        "magi_core/host/shm.py",
        "if not stat.S_ISREG(lst.st_mode) or lst.st_uid != uid:",
        "if not stat.S_ISREG(lst.st_mode):",
        (("core", ("tests/host/test_host_shm.py",)),),
    ),
    Mutation(
        "f5", "shm: stale-file cleanup forgets to check the file's type (a symlink, a fifo)",
        "magi_core/host/shm.py",
        "if not stat.S_ISREG(lst.st_mode) or lst.st_uid != uid:",
        "if lst.st_uid != uid:",
        (("core", ("tests/host/test_host_shm.py",)),),
    ),
    Mutation(
        "h", "packing: batches alive at the same time may share bytes of the unit transfer's device buffer",
        "magi_core/plan/packing.py",
        "    return any(lo1 <= hi2 and lo2 <= hi1 for lo1, hi1 in a for lo2, hi2 in b)\n",
        "    return False\n",
        (("core", ("tests/execute/test_transfer.py",)), ("privateuse1", EXECUTOR_PU1)),
    ),
    Mutation(
        "i", "budget fit: a shrunk planning budget the planner refuses ends the fit (streaming everything, or an "
        "error) instead of bisecting back up",
        "magi_core/compile/runtime.py",
        "                if budget >= limit or failed is None:\n",
        "                if True:\n",
        (("core", ("tests/execute/test_executor.py",)),),
    ),
    Mutation(
        "g", "device placement: a lifted host scalar's .to(cpu) is rewritten to the device",
        "magi_core/passes/device_placement.py",
        "            return False  # a host scalar moved to the host: leave it\n",
        "            pass  # mutated: the host scalar's .to(cpu) is rewritten too\n",
        (("core", ("tests/passes/test_passes_properties.py",)),),
    ),
    Mutation(
        "j", "shared unit compiles: the structure key leaves out the input layouts (a unit reuses code compiled "
        "for other shapes, strides or dtypes)",
        "magi_core/execute/unit_compile.py",
        "        key = (tuple(parts), tuple(metas))\n",
        "        key = (tuple(parts), ())\n",
        (("core", ("tests/execute/test_unit_direct.py",)),),
    ),
    Mutation(
        "k", "pinning while filling: a piece is registered before every tensor in it is written (its pages could "
        "change after the runtime took them, or a tensor could straddle a piece)",
        "magi_core/host/pinning.py",
        "            if hi <= written_upto:\n",
        "            if hi <= a.nbytes:\n",
        (("core", ("tests/host/test_host_pin_ahead.py",)),),
    ),
    Mutation(
        "l", "pinning while filling: the pinning thread registers without making the caller's device current "
        "(CUDA registers for the current context: a rank on device 1 would pin for, and open a context on, "
        "device 0)",
        "magi_core/host/materialize/file_round.py",
        "            for a in mine], rank=call.rank, bind=bind)\n",
        "            for a in mine], rank=call.rank, bind=None)\n",
        (("core", ("tests/host/test_host_pin_ahead.py",)),),
    ),
    Mutation(
        "m", "unit transfer: one copy per host storage, whatever the registrations (an arena pinned in pieces, or "
        "up to a budget, is copied across a registration's bound: CUDA refuses it, invalid argument)",
        "magi_core/execute/transfer/unit.py",
        "        reg = self._registered\n",
        "        reg = RegisteredRanges()  # mutated: no registration known\n",
        (("privateuse1", ("tests/execute/test_transfer.py",)),),
    ),
    Mutation(
        "n", "load: a slot converted to the model's dtype counts as read in place, so its pages are not allocated "
        "first and a full filesystem meets its stores through the mapping (SIGBUS instead of ShmSpaceError)",
        "magi_core/host/loading/safetensors_source.py",
        "        return e is not None and e.info.dtype == dtype\n",
        "        return e is not None\n",
        (("core", ("tests/host/test_host_shm.py",)),),
    ),
    Mutation(
        "o", "residency: the address recorded for a resident copy is read from the parameter after the copy, not "
        "from the view copied, so a param.data rebound by another thread meanwhile leaves every later call stale",
        "magi_core/execute/residency.py",
        "        self._ptrs[k] = data.data_ptr()\n",
        "        self._ptrs[k] = h.data_ptr()\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "p", "planning: the bandwidth probe is broadcast from rank 0 again, so a rank's model call waits for the "
        "other ranks' (a hang when ranks call their models a different number of times)",
        "magi_core/compile/runtime.py",
        "                                                         broadcast=False))\n",
        "                                                         broadcast=True))\n",
        (("core", ("tests/host/test_host_distributed.py::test_ranks_call_their_models_independently",)),),
    ),
    Mutation(
        "q", "materialize: a problem of one rank's model is raised on that rank at once, before the first gather, "
        "so the other ranks wait in it until the process group's timeout",
        "magi_core/host/materialize/orchestrate.py",
        "        except MagiError as exc:\n            state_err, entries = exc, []\n",
        "        except MagiError:\n            raise\n",
        (("core", ("tests/host/test_host_distributed.py::test_a_problem_of_one_ranks_model_raises_on_every_rank",)),),
    ),
    Mutation(
        "r", "residency: a resident copy another runtime (input shape) made is taken as it is, so an edit followed by "
        "a new input shape computes with the copy made before the edit",
        "magi_core/execute/residency.py",
        "                if self._take(k, h, transfer, compute_stream):\n",
        "                if self._take(k, h, transfer, compute_stream) or True:\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "s", "transfer: copies read the weight itself, not a view taken when they are issued, so a .data rebound by "
        "another thread frees the bytes a queued copy (or a host unit) still reads",
        "magi_core/execute/transfer/base.py",
        "        sources = [h.detach() for h in hosts]\n",
        "        sources = list(hosts)\n",
        (("core", ("tests/execute/test_weight_updates.py",)),
         ("privateuse1", ("tests/execute/test_weight_updates.py",))),
    ),
    Mutation(
        "t", "passes: mutation tracking stops following indexing views, so a buffer written through buf[i].copy_() "
        "counts as a static weight and the write lands on a device copy",
        "magi_core/passes/weights.py",
        "        if user.target is operator.getitem:\n            return True\n",
        "        if user.target is operator.getitem:\n            return False\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
        extra=(("magi_core/passes/weights.py", '"view_as_real", "view_as_complex", "__getitem__",',
                '"view_as_real", "view_as_complex",'),),
    ),
    Mutation(
        "u", "exchange: the step agreement is keyed on the weights' identity without their data pointers, so a "
        "param.data rebound after planning is not agreed again",
        "magi_core/execute/transfer/exchange.py",
        "(id(args[w]), args[w].data_ptr()) for ws in batches for w in ws",
        "(id(args[w]),) for ws in batches for w in ws",
        (("core", ("tests/compile/test_exchange.py",)),),
    ),
    Mutation(
        "v", "unit transfer: batches issued at step start (before any unit's gate) are not ordered after the compute "
        "stream, so a fixed place may be overwritten while the previous step still reads it",
        "magi_core/execute/transfer/unit.py",
        "        if slot.gate:\n",
        "        if False:\n",
        (("core", ("tests/execute/test_executor_recording.py",)),),
    ),
    Mutation(
        "w", "executor: close() does not wait for the step running, so a release racing a call tears its state down "
        "mid-step (a raw shape error instead of the 'was released' one)",
        "magi_core/execute/executor.py",
        "        with self._lock:\n            self._close()\n",
        "        self._close()\n",
        (("core", ("tests/api/test_offload_api.py",)),),
    ),
    Mutation(
        "x", "planning: HEURISTIC keeps the latest-trigger plan whatever it holds, so copies queued ahead of compute "
        "take device memory without shortening the step",
        "magi_core/plan/heuristic.py",
        "            plan = fewest_copies_ahead(plan, profiles, bw, margin, bandwidth_Bps)\n",
        "            plan = plan\n",
        (("core", ("tests/plan/test_plan_footprint.py",)),),
    ),
    Mutation(
        "y", "load: a non-persistent buffer is taken from reset_parameters() without checking that the reset sets it "
        "(both meta copies pre-filled alike, so a reset that never writes the buffer leaves its fill as its value)",
        "magi_core/host/loading/buffers.py",
        "    for fill in (0, 255):\n",
        "    for fill in (0, 0):\n",
        (("core", ("tests/host/test_host_loading.py",)),),
    ),
    Mutation(
        "z", "exchange: copy-on-write host mappings are identified by file and offset, so a rank whose private pages "
        "were edited exchanges them with ranks holding the original bytes",
        "magi_core/compile/exchange.py",
        "if arena is None or arena.inode is None or arena.private or arena.mapping is None:",
        "if arena is None or arena.inode is None or arena.mapping is None:",
        (("core", ("tests/host/test_host_distributed.py::test_ep1_write_on_one_rank_never_reaches_another",
                   "tests/host/test_host_fork.py")),),
    ),
    Mutation(
        "aa", "fork: a forked child keeps the parent's writable shared mappings, so its in-place writes change the "
        "parent's weights",
        "magi_core/host/fork.py",
        "    if not entries:\n        return\n",
        "    if True:\n        return\n",
        (("core", ("tests/host/test_host_fork.py",)),),
    ),
    Mutation(
        "ab", "safetensors: overlapping byte ranges in a header are accepted, so one tensor loads another's bytes",
        "magi_core/host/loading/safetensors_source.py",
        "        if begin < pos:\n",
        "        if False:\n",
        (("core", ("tests/host/test_host_source_checks.py",)),),
    ),
    Mutation(
        "ac", "materialize: a rank whose weight source cannot be opened raises at once, before the first gather, so "
        "the other ranks wait in it until the process group's timeout",
        "magi_core/host/materialize/orchestrate.py",
        "        except (MagiError, OSError, TypeError, ValueError) as exc:\n            setup = exc\n",
        "        except (MagiError, OSError, TypeError, ValueError):\n            raise\n",
        (("core", ("tests/host/test_host_setup_errors.py",)),),
    ),
    Mutation(
        "ad", "unit split: a host value written in place counts as free, so what is computed from it moves to its "
        "first user, after the write, and reads the advanced value (a StaticCache's length)",
        "magi_core/passes/split.py",
        "                if not is_mutated(ph):\n                    sources.add(ph)\n",
        "                if True:\n                    sources.add(ph)\n",
        (("core", ("tests/passes/test_split.py",)),),
    ),
    Mutation(
        "ae", "budget: a graph in a warm-up call is left out of the copy buffer the model's graphs share, so a graph "
        "planned meanwhile keeps resident what the budget leaves no room for next to that buffer",
        "magi_core/compile/runtime.py",
        "        same = [r for r in on_device if shared_buf is not None",
        "        same = [r for r in on_device if r._planned and shared_buf is not None",
        (("core", ("tests/execute/test_executor.py::"
                   "test_a_graph_in_its_warm_up_call_keeps_its_copy_buffer_and_the_others_plan_around_it",)),
         ("privateuse1", ("tests/compile/test_device_fit.py",))),
    ),
    Mutation(
        "af", "shared copy buffer: kept once no plan needs one, next to the resident weights of plans that stream "
        "nothing",
        "magi_core/execute/transfer/shared.py",
        "        if need == self.nbytes:\n",
        "        if need == self.nbytes or need == 0:\n",
        (("privateuse1",
          ("tests/execute/test_executor.py::test_a_second_shape_whose_weights_are_all_resident_already_fits_any_budget",)),),
    ),
    Mutation(
        "ag", "two graphs: a graph planned first never reads resident the weights a later graph of the model keeps "
        "resident (it streams them every step)",
        "magi_core/compile/runtime.py",
        "                    r._replan = True\n",
        "                    r._replan = False\n",
        (("privateuse1", ("tests/compile/test_device_fit.py",)),),
    ),
    Mutation(
        "ah", "device placement: a fake constant is moved to the device with its real value (the emulated device "
        "cannot make a fake of an empty device tensor: DynamicCache's start fails)",
        "magi_core/passes/device_placement.py",
        "                    if getattr(t, \"constant\", None) is not None:",
        "                    if False:",
        (("privateuse1", ("tests/compile/test_generate.py",)),),
    ),
    Mutation(
        "ai", "fit the card: the least-memory plan's budget is not held within the room and below the fastest plan "
        "(fewer resident weights can need a larger copy buffer: llama8b held 11.7 GiB on a 12 GiB card)",
        "magi_core/compile/runtime.py",
        "            budget = min(budget, spare, full - 1)",
        "            budget = max(1, budget)",
        (("privateuse1", ("tests/compile/test_device_fit.py",)),),
        extra=(("magi_core/compile/runtime.py", "            if plan.predicted_step_ms <= target and holds < full:",
                "            if plan.predicted_step_ms <= target:"),),
    ),
    Mutation(
        "aj", "unit compile: sizes Dynamo made symbolic are compiled static (a growing KV cache's decode step gets "
        "code for one length)",
        "magi_core/execute/unit_compile.py",
        "    dynamic = _dynamic_placeholders(module)",
        "    dynamic = [False for _ in _dynamic_placeholders(module)]",
        (("core", ("tests/compile/test_generate.py",)),),
    ),
    Mutation(
        "ak", "runtime: a graph left warming up keeps its warm-up copy buffer while another graph of the model plans "
        "(DynamicCache's first-decode graph, run once, held its buffer's room next to the decode plan)",
        "magi_core/compile/runtime.py",
        "            self._idle_peers()\n",
        "",
        (("core",
          ("tests/execute/test_executor.py::test_a_graph_left_warming_up_holds_nothing_while_another_plans",)),),
    ),
    Mutation(
        "al", "transfer: a refresh's copy into a resident copy another executor owns is not recorded on the copy "
        "stream (the owner frees it after its own compute stream only)",
        "magi_core/execute/transfer/base.py",
        "            self._record_stream(dev, self.copy_stream)\n",
        "",
        (("privateuse1", ("tests/execute/test_executor.py::"
                          "test_resident_copies_one_shape_made_and_another_refreshed_are_freed_in_stream_order",)),),
    ),
    Mutation(
        "am", "submodule entries: an entry holds its handle strongly (the host weights keep the submodules alive, so "
        "the model, its registered ranges and files are never collected)",
        "magi_core/compile/submodules.py",
        "        self._handle = weakref.ref(handle)\n",
        "        self._strong = handle\n        self._handle = weakref.ref(handle)\n",
        (("core", ("tests/api/test_offload_api.py::test_an_offloaded_model_nobody_holds_is_collected",)),),
    ),
    Mutation(
        "an", "runtime: a graph that does not fit next to the model's other graphs never takes their memory back (the "
        "decode graph of generate fails where the prefill filled the budget first)",
        "magi_core/compile/runtime.py",
        "            if not self._evict_peers():\n                raise\n",
        "            if True:\n                raise\n",
        (("core", ("tests/execute/test_executor.py::"
                   "test_a_graph_that_does_not_fit_next_to_the_first_takes_its_memory_back",)),),
    ),
    Mutation(
        "aq", "runtime: a graph whose warm-up does not fit beside what the model's other graphs hold on the card never "
        "takes their memory back (a DeviceMemoryError where the card holds both graphs one after the other)",
        "magi_core/compile/runtime.py",
        "            if not self._evict_peers():\n                raise self._unfit\n",
        "            if True:\n                raise self._unfit\n",
        (("privateuse1", ("tests/compile/test_device_fit.py::"
                          "test_a_graph_with_no_room_left_on_the_card_takes_it_back_from_the_other",)),),
    ),
    Mutation(
        "ao", "runtime: a call that finds its planned graph suspended (its memory taken back meanwhile) runs without "
        "planning again",
        "magi_core/compile/runtime.py",
        "                if self._replan or self.executor.plan is None:\n",
        "                if self._replan:\n",
        (("core", ("tests/execute/test_executor.py::test_a_call_that_finds_its_graph_suspended_plans_it_again_and_runs",
                   )),),
    ),
    Mutation(
        "ap", "runtime: a graph that took the others' memory back plans without the room they need to stream (they "
        "cannot plan again within the budget)",
        "magi_core/compile/runtime.py",
        "    if runtime.phase == \"yielded\":\n        return runtime._stream_floor()\n",
        "",
        (("core", ("tests/execute/test_executor.py::"
                   "test_a_graph_that_does_not_fit_next_to_the_first_takes_its_memory_back",)),),
    ),
    Mutation(
        "ar", "plan: HEURISTIC keeps the streamed blocks where its residency ranking left them (side by side at the "
        "end of a stack, each waiting for the copy of the one before under a budget)",
        "magi_core/plan/heuristic.py",
        "    if not streamed:\n        return plan\n",
        "    return plan\n",
        (("core", ("tests/plan/test_spread.py",)),),
    ),
    Mutation(
        "as", "plan: spreading streamed blocks takes the spread plan even where it is slower",
        "magi_core/plan/heuristic.py",
        "    if _shorter(candidate.predicted_step_ms, plan.predicted_step_ms):\n        return candidate\n",
        "    return candidate\n",
        (("core", ("tests/plan/test_spread.py",)),),
    ),
    Mutation(
        "at", "plan: a plan as fast either way keeps its streamed blocks side by side, their copies queued several "
        "blocks ahead (a copy buffer of four layers where two hold the same step)",
        "magi_core/plan/heuristic.py",
        "    if not stalls and peak <= plan.notes[\"resident_bytes\"] + two:\n",
        "    if not stalls:\n",
        (("core", ("tests/plan/test_spread.py",)),),
    ),
    Mutation(
        "au", "plan: stacks of different sizes keep their streamed counts per size (a dual-stream DiT streams only "
        "single blocks, more copy time in their half of the step than it computes)",
        "magi_core/plan/heuristic.py",
        "            *(proportional_residency(profiles, cap, slack) for slack in SLACKS)]",
        "]",
        (("core", ("tests/plan/test_spread.py",)),),
    ),
    Mutation(
        "av", "compile: ratio 1 compiles the graph as one unit whatever the card (a card that cannot hold the model "
        "raises instead of degrading to the fastest plan that fits)",
        "magi_core/compile/backend.py",
        "        everything_resident = _whole_graph_fits(gm, example_inputs, backend, device)\n",
        "",
        (("privateuse1", ("tests/compile/test_device_fit.py",)),),
    ),
    Mutation(
        "aw", "compile: ranks that exchange weights decide alone whether ratio 1 compiles whole (one rank splits, "
        "another does not: their plans differ and every exchange step fails)",
        "magi_core/compile/backend.py",
        "            everything_resident = exchange.all_agree(everything_resident)\n",
        "            pass\n",
        (("core", ("tests/compile/test_exchange.py",)),),
    ),
    Mutation(
        "ax", "execute: every resident weight is checked for host edits before the first unit (the sampling delays "
        "every step instead of overlapping the device's work)",
        "magi_core/execute/executor.py",
        "        first_use = actions.resident_at\n",
        "        first_use = (tuple(actions.resident),) + ((),) * (self.n_units - 1)\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "ay", "execute: a resident weight's refresh fails after its check saw the edit, and the next call trusts the "
        "check (the stale device copy is used from then on)",
        "magi_core/execute/executor.py",
        "                    watch.force()  # what it saw changed may not be copied",
        "                    pass  # what it saw changed may not be copied",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "az", "execute: a plan's resident copies are made unit by unit, between the step's streamed buffers "
        "(long-lived blocks split the allocator's memory between short-lived ones)",
        "magi_core/execute/executor.py",
        "            made_now = frozenset() if resident.complete else resident.acquire(args, self.transfer, compute)\n",
        "            made_now: frozenset[int] = frozenset()\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "ba", "residency: a parameter rebound between calls whose copy another input shape already made is taken as "
        "it is (an edit through .data in between leaves this shape computing with the copy made before it)",
        "magi_core/execute/residency.py",
        "                self._take(k, h, transfer, compute_stream, stale=i in changed)\n",
        "                self._take(k, h, transfer, compute_stream, stale=False)\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "bb", "residency: whether every resident weight has a copy is asked by comparing each host tensor with None "
        "(a torch call per weight before every step's first unit)",
        "magi_core/execute/residency.py",
        "        return self._held == len(self.indices)\n",
        "        return None not in self._hosts\n",
        (("core", ("tests/execute/test_step_host_work.py",)),),
    ),
    Mutation(
        "bc", "residency: a copy replaced by a new host tensor stays recorded until the new copy is made (a failed "
        "copy leaves it released but held, and closing releases it twice)",
        "magi_core/execute/residency.py",
        "            self._hosts[k] = self._devs[k] = None  # released: a failed copy below leaves the position empty\n"
        "            self._held -= 1\n",
        "            self._held -= 0\n",
        (("core", ("tests/execute/test_weight_updates.py",)),),
    ),
    Mutation(
        "bd", "runtime: a graph whose memory another graph took back between its planning and its step runs the step "
        "anyway (ExecutorSuspended reaches the caller)",
        "magi_core/compile/runtime.py",
        "                return self._planned_step(args)\n            return self._warmup_call(args)\n",
        "                return self._planned_call(args)\n            return self._warmup_call(args)\n",
        (("core", ("tests/compile/test_threads.py",)),),
    ),
    Mutation(
        "be", "transfer: closing a model forgets the plan's buffer but keeps the host views its last copies read (a "
        "released model's mapping stays mapped)",
        "magi_core/execute/transfer/unit.py",
        "            self.shared = None\n        self._sources.drain()\n",
        "            self.shared = None\n",
        (("privateuse1", ("examples/privateuse1/tests/test_resident_release.py",)),),
    ),
    Mutation(
        "bf", "FractionCap: the device's size is mem_get_info's total alone (a cap that reports itself as the total "
        "makes the next cap a fraction of the cap, and refuses the lift)",
        "magi_core/plugin/device_memory.py",
        "            total = max(total, int(props(device_index).total_memory))\n",
        "            pass\n",
        (("core", ("tests/plugin/test_device_memory.py",)),),
    ),
    Mutation(
        "bg", "load: a model released without restore is filled again (its empty tensors load nothing)",
        "magi_core/host/materialize/orchestrate.py",
        "    if setup is None and was_released(model):\n",
        "    if False:\n",
        (("core", ("tests/host/test_host_loading.py",)),),
    ),
    Mutation(
        "bh", "load: an empty model tensor is not matched against the source's shape",
        "magi_core/host/loading/loader.py",
        "                if info is not None and tuple(info.shape) != tuple(e.size):\n",
        "                if False:\n",
        (("core", ("tests/host/test_host_loading.py",)),),
    ),
)


def copy_repo(dest: Path) -> None:
    """The working tree (tracked and untracked files, no caches or tox envs) under ``dest``."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(*IGNORED), symlinks=True)


def apply(copy: Path, m: Mutation) -> None:
    """Make the mutation's edits in the copy; refuse when a string is not found exactly as often as expected."""
    for path, old, new, count in ((m.path, m.old, m.new, m.count), *((p, o, n, 1) for p, o, n in m.extra)):
        f = copy / path
        text = f.read_text()
        found = text.count(old)
        if found != count:
            raise SystemExit(f"mutation {m.key}: expected {count} occurrence(s) of the string in {path}, found "
                             f"{found}; update tests/mutations/run_mutations.py to the current code")
        f.write_text(text.replace(old, new))


def env_for(copy: Path, name: str) -> dict[str, str]:
    """The caller's environment with MAGI_* cleared, the copy first on PYTHONPATH and the suite's variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAGI_")}
    paths = [str(copy), str(copy / "examples" / "privateuse1")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.update({"PYTHONDONTWRITEBYTECODE": "1", "HYPOTHESIS_PROFILE": "ci"})
    env.update(ENVS[name])
    return env


def check_imports(copy: Path, env: dict[str, str]) -> None:
    """Fail loudly unless the copy's magi_core and torch_magidev are the ones imported."""
    code = "import magi_core, torch_magidev; print(magi_core.__file__); print(torch_magidev.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=copy, capture_output=True, text=True)
    files = out.stdout.split()
    if out.returncode or len(files) != 2 or not all(Path(f).resolve().is_relative_to(copy.resolve()) for f in files):
        raise SystemExit(f"the copy's packages are not the ones imported from {copy}: {out.stdout}{out.stderr}")


def run_suite(copy: Path, name: str, tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    """pytest ``tests`` in the copy under env ``name``: (exit status, seconds, the last lines of its output)."""
    env = env_for(copy, name)
    check_imports(copy, env)
    argv = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *PYTEST_ARGS[name], *tests]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(argv, env=env, cwd=copy, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, time.monotonic() - t0, "timed out"
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return proc.returncode, time.monotonic() - t0, "\n".join(failed[:3] or lines[-1:])


def check(m: Mutation | None, suites: tuple[tuple[str, tuple[str, ...]], ...], timeout: float, keep: bool) -> bool:
    """Run one mutation (None: the baseline) and print a report line per suite; True when it came out right."""
    copy = Path(tempfile.mkdtemp(prefix=f"magi-mut-{m.key if m else 'base'}-")) / "repo"
    try:
        copy_repo(copy)
        if m is not None:
            apply(copy, m)
        for name, tests in suites:
            rc, seconds, tail = run_suite(copy, name, tests, timeout)
            label = m.key if m else "baseline"
            verdict = ("passed" if rc == 0 else f"FAILED (exit {rc})") if m is None else (
                "caught" if rc == 1 else "missed" if rc == 0 else f"ERROR (exit {rc})")
            print(f"{label:8} {name:11} {verdict:16} {seconds:6.1f}s  {' '.join(tests)}", flush=True)
            if tail and (m is None and rc != 0 or m is not None and rc == 1):
                print("         " + tail.replace("\n", "\n         "), flush=True)
            if m is None and rc != 0:
                return False
            if m is not None and rc != 0:
                return rc == 1
        return m is None
    finally:
        if keep:
            print(f"         kept {copy}")
        else:
            shutil.rmtree(copy.parent, ignore_errors=True)


def main() -> int:
    """Command line: run the mutations asked for (all by default) and report caught / missed."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("keys", nargs="*", help="mutations to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--baseline", action="store_true", help="run the suites on an unmutated copy instead")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copies")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per suite (default 900)")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.keys or m.key in args.keys]
    unknown = set(args.keys) - {m.key for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s) {sorted(unknown)}; known: {[m.key for m in MUTATIONS]}")
    if args.list:
        for m in chosen:
            print(f"{m.key:3} {m.what}\n    {m.path}; " + "; ".join(f"{e}: {' '.join(t)}" for e, t in m.suites))
        return 0
    if args.baseline:
        suites = tuple(dict.fromkeys((e, t) for m in chosen for e, t in m.suites))
        return 0 if check(None, suites, args.timeout, args.keep) else 1
    results = {m.key: check(m, m.suites, args.timeout, args.keep) for m in chosen}
    missed = [k for k, ok in results.items() if not ok]
    print(f"{len(results) - len(missed)}/{len(results)} mutations caught" + (f"; not caught: {missed}" if missed
                                                                              else ""))
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
