"""The ``magi_offload`` torch.compile backend (entry point ``torch_dynamo_backends``).

``torch.compile(model, backend="magi_offload", options={...})`` calls :func:`magi_offload_backend` with
``options=`` as a keyword (torch 2.x passes non-empty ``options``, and ``mode`` when not "default", to
every registered backend). Options are :class:`~magi_core.config.OffloadConfig` fields, plus
``"config"`` (an ``OffloadConfig`` to start from). Precedence, lowest first: defaults < ``MAGI_OFFLOAD_*``
environment variables < the config's explicitly set fields < the option entries (the environment only fills
fields neither set; see :mod:`magi_core.config`).

Inputs must be on the host on this path: Dynamo fake-runs the model's code with its (host) weights before
any backend is called, so a device input fails inside Dynamo ("found two different devices"), and so does
every graph after a graph break (its inputs are device outputs). For device inputs use
:func:`magi_core.api.offload` (``magi_core.offload``), which hands Dynamo host proxies of device
tensors and compiles one graph; this backend's input preparation swaps the device tensors back in.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx

from magi_core.compile.device_branches import warn_device_branches
from magi_core.compile.device_room import device_room
from magi_core.compile.exchange import exchange_transfer
from magi_core.compile.runtime import OffloadRuntime
from magi_core.config import OffloadConfig, resolve_config
from magi_core.errors import ConfigError, MagiError
from magi_core.execute.executor import OffloadExecutor
from magi_core.passes.device_placement import place_on_device
from magi_core.passes.split import split_into_units
from magi_core.passes.weights import mutated_module_state, tensor_nbytes, weight_input_indices
from magi_core.plan.registry import check_policy
from magi_core.plugin.manager import get_backend

if TYPE_CHECKING:
    from magi_core.host import HostWeights
    from magi_core.plugin.facade import Backend

logger = logging.getLogger(__name__)

def config_from_options(options: Mapping[str, Any] | OffloadConfig | None) -> OffloadConfig:
    """The effective config from ``torch.compile`` options (``"config"`` key, fields) and the environment
    (option entries > the config's explicit fields > ``MAGI_OFFLOAD_*`` > defaults).

    A config resolved on the way in (what :func:`magi_core.offload` and
    :func:`~magi_core.api.compile_offloaded` pass, alone) is used as it is: it was resolved and its policy checked
    there. Anything else is resolved here, once, and its policy checked before any compile work.
    """
    base: OffloadConfig | None = None
    rest: dict[str, Any] | None = None
    if options is None or isinstance(options, OffloadConfig):
        base = options
    elif isinstance(options, Mapping):
        rest = dict(options)
        given = rest.pop("config", None)
        if given is not None and not isinstance(given, OffloadConfig):
            raise ConfigError(f"magi_offload option 'config' must be an OffloadConfig, got {type(given).__name__}")
        base = given
    else:
        raise ConfigError(f"magi_offload options must be a dict of OffloadConfig fields, got {type(options).__name__}")
    if base is not None and base._resolved and not rest:
        return base
    cfg = resolve_config(base, rest)
    check_policy(cfg.policy)
    return cfg


def build_runtime(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: OffloadConfig, host: HostWeights | None = None
) -> OffloadRuntime:
    """Place ``gm`` on the backend's device, split it into units and wrap the executor in its warm-up lifecycle."""
    written = mutated_module_state(gm)
    if written:
        raise MagiError(
            f"the offloaded forward writes to module state {', '.join(written)} (an in-place update of a buffer or "
            "parameter, e.g. a step counter, or BatchNorm in training mode). Offloading is for inference: those "
            "writes would reach a device copy, never the module. Call model.eval() for norm statistics, or keep "
            "mutable state outside the forward"
        )
    backend = get_backend()
    device = backend.device()
    warn_device_branches()
    place_on_device(gm, device, backend.to_method_aliases, example_inputs=example_inputs)
    exchange = exchange_transfer(config, backend, device, host)
    # everything resident by request: nothing streams, so the graph compiles whole (as torch.compile would), where
    # the device can hold it; where it cannot, units let the ratio degrade to the fastest plan that fits (ranks that
    # exchange weights decide together: their units must match)
    everything_resident = config.resident_ratio >= 1.0 and config.unit_bytes_cap is None
    if everything_resident:
        everything_resident = _whole_graph_fits(gm, example_inputs, backend, device)
        if exchange is not None:
            everything_resident = exchange.all_agree(everything_resident)
    split = split_into_units(gm, example_inputs, max_unit_bytes=config.unit_bytes_cap, one_unit=everything_resident)
    # the backend's capabilities decide "auto" and whether generated unit code is called directly
    transfer = exchange or config.transfer
    executor = OffloadExecutor(
        split, backend, device, unit_compiler=backend.resolve_unit_compiler(config.unit_compiler),
        direct_unit_calls=backend.allows_direct_unit_calls(config.direct_unit_calls), transfer=transfer,
    )
    runtime = OffloadRuntime(executor, config)
    logger.info(
        "magi offload: compiled a graph with %d inputs into %d units (%d weight bytes) on %s",
        len(example_inputs), executor.n_units, split.weight_bytes, device,
    )
    return runtime


def _whole_graph_fits(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], backend: Backend,
                      device: torch.device) -> bool:
    """Whether every weight of ``gm`` fits the device's free memory now, less the reserve. A graph of one unit
    streams that unit whole while it warms up, so it needs that room even where the model's other graphs keep its
    weights resident. True where the backend cannot say how much memory its device has."""
    room = device_room(backend, device, 0, 0)
    if room is None:
        return True
    weights = sum(tensor_nbytes(example_inputs[i]) for i in weight_input_indices(gm, example_inputs)
                  if isinstance(example_inputs[i], torch.Tensor))
    if weights <= room.spare:
        return True
    logger.info("magi offload: the graph's %d weight bytes do not fit %s (%s): it is split into units so that "
                "gpu_resident_weight_ratio=1 can degrade to the fastest plan that fits", weights, device,
                room.describe())
    return False


def magi_offload_backend(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    options: Mapping[str, Any] | OffloadConfig | None = None,
    mode: str | None = None,
    host: HostWeights | None = None,
    **kwargs: Any,
) -> OffloadRuntime:
    """torch.compile backend: run ``gm`` with its weights streamed from host memory to the accelerator.

    ``host``: the offloaded model's host weights (given by its handle), which say which weights ranks share.
    """
    if mode is not None:
        logger.warning("magi_offload ignores torch.compile(mode=%r); use options={...} instead", mode)
    if kwargs:
        logger.warning("magi_offload ignores unknown backend arguments %s", sorted(kwargs))
    return build_runtime(gm, example_inputs, config_from_options(options), host)
