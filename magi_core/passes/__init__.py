"""FX passes that make a graph traced on the host run on the accelerator, and split it into offload units."""

from magi_core.passes.device_placement import PlacementReport, place_on_device
from magi_core.passes.split import split_into_units
from magi_core.passes.units import OffloadUnit, SplitGraph, WeightSlot

__all__ = ["OffloadUnit", "PlacementReport", "SplitGraph", "WeightSlot", "place_on_device", "split_into_units"]
