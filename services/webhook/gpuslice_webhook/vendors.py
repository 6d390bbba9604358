"""What admission writes into a pod asking for another vendor's cards, as HAMi's
webhook writes it (its ``MutateAdmission`` of each vendor in ``pkg/device``).

The vendor's device plugin and kubelet read the pod as stored, so what it asks
for is stated where they look:

* Moore Threads: its plugin advertises ``sgpu-core`` and ``sgpu-memory`` as
  node resources, which kubelet accounts per container; whole cards (a count
  above 1, or no memory) are stated as the count's total of 16 cores and 96
  units (48 GiB) a card, and a count above 1 as the pod annotation
  ``mthreads.com/request-gpu-num``, which its plugin reads;
* Ascend: the memory resource holds the vNPU template the request was rounded
  up to (or the whole card's ``memoryAllocatable``), in the resource's unit;
  where ``memoryFactor`` does not divide it the stated amount is left, which
  reads as the same template;
* Metax sGPU: ``metax-tech.com/sgpu-qos-policy`` unset is ``best-effort``
  (the online class, which HAMi leaves without, is refused before this).

Each amount reads back as the same request (:mod:`gpuslice_common.vendorrequests`),
so admitting a pod twice changes nothing the second time.
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuslice_common import vendorrequests
from gpuslice_common.config import VendorResources
from gpuslice_common.models import ContainerGpuRequest, PodGpuRequest

__all__ = ["container_limits", "pod_annotations"]


def container_limits(vendor: VendorResources, request: ContainerGpuRequest) -> dict[str, int]:
    """The amounts of ``vendor``'s resources the container's limits must hold."""
    whole = request.count > 1 or request.memory.mib is None
    if vendor.rules == "mthreads" and vendor.memory and vendor.cores and whole:
        return {
            vendor.cores: request.count * vendor.max_cores,
            vendor.memory: request.count * vendorrequests.MTHREADS_WHOLE_UNITS,
        }
    if vendor.rules == "ascend" and vendor.memory:
        mib = request.memory.mib
        if mib is not None and mib % vendor.memory_factor == 0:
            return {vendor.memory: mib // vendor.memory_factor}
    return {}


def pod_annotations(
    vendor: VendorResources, request: PodGpuRequest, annotations: Mapping[str, str]
) -> dict[str, str]:
    """The pod annotations ``vendor``'s plugin reads, as they must be."""
    if vendor.rules == "mthreads":
        count = max(c.count for c in request.containers)  # one container asks (check_pod)
        if count > 1:
            return {vendorrequests.MTHREADS_GPU_NUM: str(count)}
    if vendor.rules == "metax-sgpu":
        return {vendorrequests.METAX_QOS: vendorrequests.metax_qos(annotations)}
    return {}
