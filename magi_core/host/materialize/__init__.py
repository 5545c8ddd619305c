"""Stream a model's weights into shared host memory, share each tensor across the ranks that hold it, pin in waves.

See :func:`materialize` (:mod:`.orchestrate`: the steps in order); one round of files (steps 3-5) is
:mod:`.file_round`; what one call shares across its steps, and what the ranks tell each other, :mod:`.call`; the
weights it leaves, and the process's registries of them, :mod:`.weights`.

The weights come from the model's own tensors, or from a weight source (a model built on the meta device:
:mod:`magi_core.host.loading`). Order of work on every rank (collectives are on a gloo group,
so they never touch the device):

1. check the shm directory, group the tensors into slots (one per storage), match them with the weight source
   (missing / unexpected / mis-shaped tensors), give each slot a claim: its provenance when it comes from a
   source, else a sampled fingerprint; gather (node key, owner, slot signatures and claims, problems); a
   problem on any rank raises on every rank
2. decide, identically on every rank, per slot: which ranks of the node hold one copy of it together (equal
   signature and claim), which member writes it (spread over the members), and whether the others must compare
   it with their own values (:func:`magi_core.host.topology.plan_sharing`). Each set of members gets one file per
   dtype, created by its lowest rank
3. creators create their files exclusively (0600, ``flock``-ed until unlinked): sparse where the kernel has
   ``MADV_POPULATE_WRITE`` (each writer thread allocates what it fills, or lets the read system call that fills
   a slot allocate it, with a clear error on a full filesystem either way), else with the space reserved;
   gather status (no room: every rank raises, nothing was changed)
4. every member maps its files; each slot's writer copies its own values (or reads the source) into it and
   swaps the mapping into the module at once (the original is freed there); gather status (under
   copy_on_write a file several ranks map is written through a temporary shared mapping and the modules get
   copy-on-write views)
5. the other members compare every byte of their own values with the copy (before swapping anything in);
   gather; files unlinked. A member that differs: with ``on_mismatch="copy"`` (default) it writes a copy of
   its own in a second round (3-5 with files of one rank); with ``"error"`` every rank raises naming the
   tensors (and every rank's model is put back as it was)
6. pin in waves of ``concurrency`` ranks per node; then read_only: protect the shared mappings,
   copy_on_write: report a pin that copied the shared pages. An arena only this rank maps (one rank per node,
   a copy of its own) is pinned in pieces while step 4 fills it (:class:`pinning.PinAhead`), unless a pin
   budget is set; step 6 pins what is left

Host memory per node is the bytes of the distinct tensors: each is held once per distinct content.

Isolation (``HostOptions.shared_writes``): a write on one rank never reaches another. "read_only" (default):
the shared mapping is ``mprotect``-ed read-only after pinning (CUDA refuses to register a read-only range with
default flags; one registered before stays valid), so a write is a SIGSEGV that kills the process (torch does
not check), but one copy per node stays true under pinning. "copy_on_write": every rank maps a shared file
``MAP_PRIVATE`` (the writer too, after copying in through a temporary shared mapping), so an in-place write
changes that rank's pages only; registering such a mapping with CUDA copies every page (CUDA registers for
writing), which materialising reports. A process forked from a rank (a DataLoader or multiprocessing worker) maps the
writable shared arenas copy-on-write (:func:`magi_core.host.fork.track_for_fork`): its writes stay its own.
"""

from __future__ import annotations

from magi_core.host.materialize.call import ProgressCallback
from magi_core.host.materialize.orchestrate import materialize
from magi_core.host.materialize.weights import Arena, HostLocation, HostWeights

__all__ = ["Arena", "HostLocation", "HostWeights", "ProgressCallback", "materialize"]
