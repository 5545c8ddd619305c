"""Device inputs for offloaded forwards: host proxies for Dynamo, and the map that swaps the real tensors back in.

Dynamo fake-runs the user's eager code while tracing; a device input times a host weight fails there
("found two different devices"), before any backend is called. :func:`~magi_core.api.offload`
therefore calls the compiled forward through :class:`OffloadedForward`, which replaces every device tensor
in the arguments by a cached, never-filled host *proxy* of the same shape, stride and dtype, and records
``{id(proxy): device_tensor}`` in a thread-local substitution map for the duration of the call. Dynamo traces
and guards on host tensors (consistent with the host weights); the executor's input preparation
(:mod:`.inputs`) takes the device tensor for any graph input whose id is in the current map. Device tensors
are never copied to the host, proxies never read. Pass-through outputs come back as the device tensors.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from magi_core.errors import MagiError

if TYPE_CHECKING:
    from magi_core.compile.handle import OffloadHandle

_local = threading.local()

ProxyKey = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]


def current_substitutions() -> dict[int, torch.Tensor] | None:
    """The substitution map of the offloaded call running on this thread (``None`` outside one)."""
    return getattr(_local, "subs", None)


@contextmanager
def substituting(subs: dict[int, torch.Tensor]) -> Iterator[None]:
    """Make ``subs`` (``id(proxy) -> device tensor``) this thread's substitution map inside the block."""
    prev = getattr(_local, "subs", None)
    _local.subs = subs
    try:
        yield
    finally:
        _local.subs = prev


class ProxyPool:
    """Host proxies by (shape, stride, dtype), created once and reused across calls; never filled.

    ``fill_value`` (tests only) fills each new proxy, e.g. with NaN to show that nothing ever reads one.
    """

    def __init__(self, fill_value: float | None = None) -> None:
        self._pool: dict[ProxyKey, list[torch.Tensor]] = {}
        self._fill = fill_value

    def take(self, t: torch.Tensor, used: dict[ProxyKey, int]) -> torch.Tensor:
        """The next proxy for ``t``'s layout not yet ``used`` in this call (distinct inputs get distinct proxies)."""
        key: ProxyKey = (tuple(t.shape), tuple(t.stride()), t.dtype)
        n = used.get(key, 0)
        used[key] = n + 1
        proxies = self._pool.setdefault(key, [])
        if n == len(proxies):
            p = torch.empty_strided(key[0], key[1], dtype=key[2], device="cpu")
            if self._fill is not None:
                p.fill_(self._fill)
            proxies.append(p)
        return proxies[n]

    def proxies(self) -> list[torch.Tensor]:
        """Every proxy made so far."""
        return [p for ps in self._pool.values() for p in ps]

    def __len__(self) -> int:
        return sum(len(ps) for ps in self._pool.values())


def replace_device_tensors(
    value: Any,
    is_device: Callable[[torch.Tensor], bool],
    pool: ProxyPool,
    subs: dict[int, torch.Tensor],
    seen: dict[int, torch.Tensor],
    used: dict[ProxyKey, int],
) -> Any:
    """``value`` with every device tensor (recursively through tuples, lists and dicts) replaced by a host proxy.

    Records ``id(proxy) -> device tensor`` in ``subs``; the same device tensor twice gets the same proxy (``seen``).
    """
    if isinstance(value, torch.Tensor):
        if not is_device(value):
            return value
        p = seen.get(id(value))
        if p is None:
            p = pool.take(value, used)
            seen[id(value)] = p
            subs[id(p)] = value
        return p
    if isinstance(value, (list, tuple, dict)):
        return _map_container(value, lambda v: replace_device_tensors(v, is_device, pool, subs, seen, used))
    return value


def restore_device_tensors(value: Any, subs: dict[int, torch.Tensor]) -> Any:
    """``value`` with every proxy in ``subs`` (recursively) replaced by its device tensor: pass-through outputs."""
    if isinstance(value, torch.Tensor):
        return subs.get(id(value), value)
    if isinstance(value, (list, tuple, dict)):
        return _map_container(value, lambda v: restore_device_tensors(v, subs))
    return value


def _map_container(value: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(value, dict):
        out = {k: fn(v) for k, v in value.items()}
        return out if type(value) is dict else _rebuild(value, out)
    items = [fn(v) for v in value]
    if isinstance(value, list):
        return items if type(value) is list else _rebuild(value, items)
    if hasattr(value, "_fields"):  # namedtuple
        return type(value)(*items)
    return tuple(items) if type(value) is tuple else _rebuild(value, items)


def _rebuild(value: Any, content: Any) -> Any:
    try:
        return type(value)(content)
    except TypeError:
        return content


GRAPH_BREAK_HELP = (
    "magi offload() compiles the model's forward as ONE graph (fullgraph=True): device inputs reach it as "
    "host proxies and its weights live on the host, so any code that ran eagerly between graphs would compute "
    "on proxies or mix device intermediates with host weights. Dynamo found a graph break in the forward of "
    "{model}. Fix: remove the break (see Dynamo's reason below), or move the part that cannot compile out of "
    "this module's forward and run it before/after the call (torch.compiler.disable inside the forward is a "
    "graph break too), or offload() the submodules that do compile to one graph. "
    "Dynamo said:\n{reason}"
)


class OffloadedForward:
    """The host-side forward :func:`~magi_core.api.offload` installs: device inputs in, proxies to Dynamo.

    ``compiled`` is the Dynamo-compiled ``_call_impl``; ``is_device`` says which tensors to replace (device
    tensors of the active backend). Graph breaks surface as a :class:`~magi_core.errors.MagiError`.
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        is_device: Callable[[torch.Tensor], bool],
        model_name: str = "the model",
        pool: ProxyPool | None = None,
        handle: OffloadHandle | None = None,
    ) -> None:
        self.compiled = compiled
        #: The handle that owns what this forward compiles (its runtimes, the model's host weights).
        self.handle = handle
        self.is_device = is_device
        self.model_name = model_name
        self.pool = pool if pool is not None else ProxyPool()
        #: Calls that had at least one device input replaced by a proxy.
        self.substituted_calls = 0
        #: Held by the first call (Dynamo compiles then): callers racing it wait instead of compiling again.
        self._first_call = threading.Lock()
        self._called = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Replace device inputs by proxies, run the compiled forward with the substitution map set, restore."""
        if self.handle is not None and self.handle.released:
            self.handle.check_usable()
        if not self._called:
            with self._first_call:
                out = self._call(args, kwargs)
                self._called = True
                return out
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        subs: dict[int, torch.Tensor] = {}
        seen: dict[int, torch.Tensor] = {}
        used: dict[ProxyKey, int] = {}
        pool, is_device = self.pool, self.is_device
        pargs = replace_device_tensors(args, is_device, pool, subs, seen, used)
        pkwargs = replace_device_tensors(kwargs, is_device, pool, subs, seen, used)
        try:
            if not subs:
                return self.compiled(*args, **kwargs)
            self.substituted_calls += 1
            with substituting(subs):
                out = self.compiled(*pargs, **pkwargs)
            return restore_device_tensors(out, subs)
        except torch._dynamo.exc.Unsupported as e:
            raise MagiError(GRAPH_BREAK_HELP.format(model=self.model_name, reason=e)) from e
