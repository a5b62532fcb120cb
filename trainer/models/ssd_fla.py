"""The Mamba-2 scan (SSD) through flash-linear-attention's Triton kernels, for the trainer on CUDA.

`mamba2.ssd_scan` is the chunked scan in float32 torch einsums: on one H200 it is 39% of a
Nemotron-3-shaped step for 0.9% of its FLOPs (docs/gpu.md). This module runs the same scan through
a maintained kernel library instead, `fla-core`'s `chunk_simple_gla` (forward and backward in Triton).

SSD is simple gated linear attention. Per head, within one document,

    y_t = sum_{s <= t} (C_t . B_s) exp(A (dt_{s+1} + ... + dt_t)) dt_s x_s  +  D x_t,

and fla computes ``o_t = sum_{s <= t} scale (q_t . k_s) exp(G_t - G_s) v_s`` with ``G`` the running sum of a
per-token, per-head log decay ``g``, restarting at every sequence of ``cu_seqlens``. So ``q = C``, ``k = B``
(each group's B and C repeated over its heads: fla's simple GLA keeps one state per q/k head),
``v = x dt``, ``g = A dt``, ``scale = 1``, and the ``D`` skip is added after. Packed documents become
``cu_seqlens`` (the state restarts at each); context parallelism needs nothing more, because the mixer
scans whole documents of its head share (`Mamba2Mixer._scan_context_parallel`).

Precision: ``q``, ``k`` and ``v`` go in the compute dtype (bfloat16 under autocast), ``g`` and the decay sums
in float32, the state in float32 inside the kernels; the result is within bf16 rounding of the float32
reference (`tests/gpu/test_mamba_scan_gpu.py`).

`trainer.mamba_scan` chooses: "auto" (fla on CUDA where its kernels can train, else the torch reference, with a
warning when fla is installed but cannot: on Hopper GPUs with Triton < 3.7.1 fla refuses the scan's backward),
"fla" (refused in one line where it cannot run), "torch".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.util import find_spec

import torch
from torch import nn

from agentrl.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["document_bounds", "ssd_scan_gla", "fla_chunk_gla", "fla_installed", "fla_import_error", "use_mamba_scan"]

GLA = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``gla(q, k, v, g, cu_seqlens) -> o``: simple GLA over ``(1, T, H, .)`` inputs with scale 1."""


def document_bounds(doc_T: torch.Tensor) -> torch.Tensor:
    """``cu_seqlens`` (int64, on ``doc_T``'s device): 0, the end of each document of the row, in order."""
    _, lengths = torch.unique_consecutive(doc_T, return_counts=True)
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int64)


def ssd_scan_gla(x_THP: torch.Tensor, dt_TH: torch.Tensor, A_H: torch.Tensor, B_TGN: torch.Tensor,
                 C_TGN: torch.Tensor, D_H: torch.Tensor, doc_T: torch.Tensor, *, dtype: torch.dtype,
                 gla: GLA | None = None) -> torch.Tensor:
    """`mamba2.ssd_scan`'s result through a simple-GLA kernel (`fla_chunk_gla` unless ``gla`` is given);
    ``q``, ``k``, ``v`` in ``dtype``; returns ``y (T, H, P)`` in float32."""
    heads = x_THP.shape[1]
    per_group = heads // B_TGN.shape[1]
    x, dt = x_THP.float(), dt_TH.float()
    q = C_TGN.repeat_interleave(per_group, dim=1).to(dtype)
    k = B_TGN.repeat_interleave(per_group, dim=1).to(dtype)
    v = (x * dt[..., None]).to(dtype)
    g = A_H.float()[None, :] * dt
    o = (gla or fla_chunk_gla)(q[None].contiguous(), k[None].contiguous(), v[None].contiguous(),
                               g[None].contiguous(), document_bounds(doc_T))
    return o[0].float() + x * D_H.float()[:, None]


def fla_chunk_gla(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> torch.Tensor:
    """fla's chunked simple GLA (Triton, CUDA), over the sequences of ``cu_seqlens``, scale 1."""
    from fla.ops.simple_gla import chunk_simple_gla

    out, _ = chunk_simple_gla(q, k, v, g, scale=1.0, cu_seqlens=cu_seqlens)
    return out


def fla_installed() -> bool:
    """Whether `fla` (the fla-core distribution) is installed, without importing it."""
    return find_spec("fla") is not None


def fla_import_error() -> str | None:
    """Why fla's simple-GLA kernels cannot train here, or None: the import fails, or fla refuses their backward.

    fla-core 0.6.0 raises in the gated backward (``chunk_bwd_dqkwg``) on Hopper GPUs with Triton >= 3.4.0 and
    < 3.7.1, whose results it found wrong (fla issue #640). Its tilelang backend of that kernel does not help
    here: it refuses simple GLA's backward, whose states stay float32 beside bf16 q (``h.dtype != q.dtype``).
    Seen on an H100 with the lent image's Triton 3.6.0: the scan's forward ran, its backward stopped. The same
    condition, asked before the run starts.
    """
    try:
        import fla.ops.simple_gla  # noqa: F401
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except Exception as exc:  # noqa: BLE001 - any failure of the import is the reason
        return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
    if IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1:
        import triton

        return (f"fla refuses its gated backward on Hopper GPUs with Triton {triton.__version__} (wrong results "
                "below 3.7.1, fla issue #640); bring Triton >= 3.7.1")
    return None


def use_mamba_scan(model: nn.Module, setting: str, *, device_type: str) -> str:
    """Point every Mamba-2 mixer of ``model`` at the scan ``setting`` (`trainer.mamba_scan`) chooses on
    ``device_type``; returns "fla", "torch", or "" for a model without Mamba-2 layers.

    Refuses, in one line, "fla" off CUDA or without fla-core installed.
    """
    mixers = [module for module in model.modules() if hasattr(module, "scan_kernel")]  # `mamba2.Mamba2Mixer`s
    if setting == "fla":
        if device_type != "cuda":
            raise ConfigError(f"trainer.mamba_scan='fla': fla's Triton kernels run on CUDA only, and this trainer "
                              f"runs on {device_type}; set trainer.mamba_scan='auto' or 'torch'")
        if not fla_installed():
            raise ConfigError("trainer.mamba_scan='fla' needs fla-core; install the train extra: "
                              "pip install 'agentrl[train]'")
    if not mixers:
        return ""
    chosen = "torch"
    if setting == "fla" or (setting == "auto" and device_type == "cuda" and fla_installed()):
        error = fla_import_error()
        if error is None:
            chosen = "fla"
        elif setting == "fla":
            raise ConfigError(f"trainer.mamba_scan='fla': fla's kernels cannot train here ({error}); "
                              "set trainer.mamba_scan='torch'")
        else:
            logger.warning("trainer.mamba_scan='auto': the torch scan, since fla's kernels cannot train here (%s)",
                           error)
    for mixer in mixers:
        mixer.scan_kernel = chosen
    return chosen
