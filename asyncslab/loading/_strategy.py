"""The one place a load's transfer is chosen (``LoadOptions.transfer``, resolved for the
device): direct reads into host slabs, staged reads then copies, or copies out of mapped
shards. Each is a :class:`~asyncslab.loading._sink.TransferStrategy` in a module of its own."""

from __future__ import annotations

import torch

from ._copy import Copier, CpuCopier, CudaCopier, HostCopier
from ._options import LoadOptions, resolve_transfer
from ._sink import TransferStrategy
from ._strategy_direct import Direct
from ._strategy_mapped import Mapped
from ._strategy_remote import Remote
from ._strategy_staged import Staged

__all__ = ["choose"]


def choose(
    options: LoadOptions, device: torch.device, *, objects: bool = False
) -> TransferStrategy:
    """A fresh strategy for one load (it holds that load's buffers or mappings);
    ``objects``: the shards are in object storage, read by ranged GETs."""
    name = resolve_transfer(options.transfer, device)
    if name == "direct" and not objects:
        return Direct(options)
    if device.type == "cuda":
        copier: Copier = CudaCopier(device, options.streams)
    else:
        copier = HostCopier() if objects else CpuCopier()
    if objects:
        return Remote(options, device, copier)
    if name == "staged":
        return Staged(options, device, copier)
    return Mapped(options, device, copier)
