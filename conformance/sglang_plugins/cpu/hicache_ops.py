"""What SGLang's HiCache host tier (``--enable-hierarchical-cache``) needs from a GPU, on CPU.

SGLang 0.5.23's host pools (``mem_cache/pool_host``) are plain host tensors; two steps of
them are GPU-only:

* ``pool_host.common._cuda_host_register``: every host pool (KV and Mamba) registers its
  buffer with ``cudaHostRegister`` through ``torch.cuda.cudart()`` ("Found no NVIDIA driver"
  on this CPU).  Registration pins pages for faster DMA; without a device there is nothing to
  pin for, so the stand-in leaves the buffer as allocated (the same bytes, unregistered);
  0.5.11-0.5.13 register inside ``memory_pool_host.alloc_with_host_register``, whose stand-in
  returns the allocator's buffer unregistered.
* the copies of the ``direct`` io backend (``sgl_kernel.kvcacheio``): ``transfer_kv_direct``
  (``layer_first``), ``transfer_kv_all_layer_direct_lf_pf`` (device layer-first -> host
  page-first, the write-back) and ``transfer_kv_per_layer_direct_pf_lf`` (host page-first ->
  device layer-first, the load), used by the KV pool (``pool_host.mha``) and the Mamba pool
  (``pool_host.mamba``, which accepts only the page-first layouts); both modules import them
  only on CUDA/HIP/XPU (a NameError on CPU).  The stand-ins are indexed torch copies with
  sgl-kernel's argument conventions: a host page-first buffer is ``[pages, layers,
  page_size, ...]``, one host buffer means one component (Mamba, MLA), two mean K and V.

One number is sized for a GPU server's host: before it allocates a host pool, SGLang keeps
``HICACHE_HOST_MEMORY_RESERVE_BYTES`` (10 GiB) of the host's available memory free and
refuses to start otherwise ("Not enough host memory available").  The twins' host pools take
megabytes, and a 2-core runner with 7-24 GiB beside other servers often has less than 10 GiB
available, so a HiCache cell died at start-up for the machine's sake, not SGLang's.  The CPU
plugin sets the reserve to :data:`HOST_MEMORY_RESERVE_BYTES` (512 MiB) in every module that
binds it (``how="override"``); the check itself, and what SGLang sizes the pool to, stay SGLang's.

The ``sglang-cpu`` HiCache cells run with ``--hicache-io-backend direct`` (SGLang's own
option; SGLang itself then takes the ``page_first_direct`` layout) so no other transfer
kernel is reached; what is written back, when, and what is loaded on a host hit stays
SGLang's (``HiCacheController``, the hybrid radix tree).
"""

from __future__ import annotations

from typing import Sequence

import torch

from conformance.sglang_plugins.cpu.spec import Binding


def cuda_host_register(buffer: torch.Tensor, registration_granularity_bytes: int | None = None) -> None:
    """``_cuda_host_register`` on CPU: host memory needs no registration without a device."""
    return None


def alloc_unregistered(dims, dtype: torch.dtype, device: str, pin_memory: bool, allocator) -> torch.Tensor:  # noqa: ANN001
    """0.5.11-0.5.13's ``memory_pool_host.alloc_with_host_register`` on CPU: the allocator's
    buffer, without the ``cudaHostRegister`` a pinned pool asks ``torch.cuda.cudart()`` for."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def transfer_kv_direct(
    src_layers: Sequence[torch.Tensor],
    dst_layers: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """sgl-kernel's ``transfer_kv_direct``: ``dst[l][dst_indices] = src[l][src_indices]`` per layer."""
    if len(src_layers) != len(dst_layers):
        raise ValueError(f"transfer_kv_direct: {len(src_layers)} source layers, {len(dst_layers)} destination layers")
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"transfer_kv_direct: {src_indices.numel()} source indices, {dst_indices.numel()} destination indices")
    if src_indices.numel() == 0:
        return
    for src, dst in zip(src_layers, dst_layers):
        rows = src.index_select(0, src_indices.to(src.device, torch.long))
        dst.index_copy_(0, dst_indices.to(dst.device, torch.long), rows.to(dst.device, dst.dtype))


def _page_starts(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    return indices[::page_size].to(torch.long)


def _tokens(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Every token of the pages whose first token ``indices`` names (a page is contiguous)."""
    starts = _page_starts(indices, page_size)
    return (starts[:, None] + torch.arange(page_size, device=starts.device)).reshape(-1)


def _check(src_indices: torch.Tensor, dst_indices: torch.Tensor, page_size: int, what: str) -> None:
    if src_indices.numel() != dst_indices.numel() or src_indices.numel() % page_size:
        raise ValueError(f"{what}: {src_indices.numel()} source and {dst_indices.numel()} destination indices, page size {page_size}")


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Device layer-first (one tensor per layer, K layers then V layers) -> host page-first."""
    _check(src_indices, dst_indices, page_size, "transfer_kv_all_layer_direct_lf_pf")
    if src_indices.numel() == 0:
        return
    num_layers = len(src_ptrs) // len(dst_ptrs)
    tokens = _tokens(src_indices, page_size)
    pages = _page_starts(dst_indices, page_size) // page_size
    for part, host in enumerate(dst_ptrs):
        for layer in range(num_layers):
            src = src_ptrs[part * num_layers + layer]
            rows = src.index_select(0, tokens.to(src.device)).reshape(pages.numel(), page_size, *src.shape[1:])
            host[:, layer].index_copy_(0, pages.to(host.device), rows.to(host.device, host.dtype))


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: Sequence[torch.Tensor],
    dst_ptrs: Sequence[torch.Tensor],
    src_indices: torch.Tensor,
    dst_indices: torch.Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """Host page-first (layer ``layer_id``) -> the device layer tensor(s) of that layer."""
    _check(src_indices, dst_indices, page_size, "transfer_kv_per_layer_direct_pf_lf")
    if src_indices.numel() == 0:
        return
    num_layers = len(dst_ptrs) // len(src_ptrs)
    pages = _page_starts(src_indices, page_size) // page_size
    tokens = _tokens(dst_indices, page_size)
    for part, host in enumerate(src_ptrs):
        for j in range(num_layers):
            dst = dst_ptrs[part * num_layers + j]
            rows = host[:, layer_id + j].index_select(0, pages.to(host.device)).reshape(-1, *host.shape[3:])
            dst.index_copy_(0, tokens.to(dst.device), rows.to(dst.device, dst.dtype))


TORCH_OPS: tuple = ()
#: Where the host pools that call the direct copies live: ``pool_host.mha`` / ``pool_host.mamba``
#: from 0.5.18, ``memory_pool_host`` before (0.5.17 keeps its Mamba host pool there).
HOST_POOL_MODULES = ("pool_host.mha", "pool_host.mamba", "memory_pool_host")

_DIRECT_COPIES = (
    ("transfer_kv_direct", transfer_kv_direct, "layer_first copy"),
    ("transfer_kv_all_layer_direct_lf_pf", transfer_kv_all_layer_direct_lf_pf, "write-back, device -> host page-first"),
    ("transfer_kv_per_layer_direct_pf_lf", transfer_kv_per_layer_direct_pf_lf, "load, host page-first -> device"),
)

#: The host memory a HiCache server on CPU keeps free beyond its host pools (SGLang: 10 GiB).
HOST_MEMORY_RESERVE_BYTES = 512 * 1024**2

#: Where SGLang binds its host-memory reserve: its home (0.5.15+) and the modules that import it by name.
RESERVE_HOMES = tuple(f"sglang.srt.mem_cache.{m}.HICACHE_HOST_MEMORY_RESERVE_BYTES" for m in ("pool_host.base", "memory_pool_host", "pool_host.mha"))

BINDINGS = (
    Binding(
        RESERVE_HOMES[0],
        HOST_MEMORY_RESERVE_BYTES,
        "override",
        "the host memory SGLang keeps free beyond its HiCache host pools (10 GiB, sized for a GPU server)",
        alternates=RESERVE_HOMES[1:],
        required=False,  # a release without the reserve allocates its host pools without that check
    ),
    Binding(
        "sglang.srt.mem_cache.pool_host.common._cuda_host_register",
        cuda_host_register,
        "replace",
        "cudaHostRegister of every HiCache host pool buffer (torch.cuda.cudart())",
        required=False,  # releases without a host-register step allocate the pools in torch
    ),
    Binding(
        "sglang.srt.mem_cache.memory_pool_host.alloc_with_host_register",
        alloc_unregistered,
        "replace",
        "the host pools' allocation with cudaHostRegister (torch.cuda.cudart()), 0.5.11-0.5.13",
        required=False,  # later releases register in pool_host.common._cuda_host_register
    ),
    *(
        Binding(
            f"sglang.srt.mem_cache.{module}.{name}",
            impl,
            "bind",
            f"HiCache {what} of the direct io backend ({module}), imported only on CUDA/HIP/XPU",
            required=False,  # a release has the host pools in some of these modules
        )
        for module in HOST_POOL_MODULES
        for name, impl, what in _DIRECT_COPIES
    ),
)
