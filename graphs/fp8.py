"""FP8 e4m3 block-scaled linears, as DeepSeek-V3's inference/kernel.py defines them, in plain torch.

Two modes:
  * weight dequant (W8A16): `w = fp8 × scale[block]`, then an ordinary GEMM in the compute dtype;
  * W8A8: activations quantized per token per 128 channels (`s = max(amax, 1e-4) / 448`), then
    `C[m,n] = Σ_kb dot(A[m,kb], B[n,kb]) · a_s[m,kb] · b_s[n//128, kb]` with fp32 accumulation.
fp8 arithmetic does not run on CPU, but fp8 casts do and every fp8 value is exact in fp32, so both modes
are emulated exactly (up to fp32 summation order) by casting to fp32.

These functions are the reference for the Triton kernels and the plugins.
"""

from __future__ import annotations

import torch

BLOCK = 128  # the FP8 weight block (weight_block_size; config.py accepts only [128, 128]) and activation group
FP8_MAX = 448.0
ACT_SCALE_FLOOR = 1e-4

# activation_quant attribute values of the FP8 nodes
WEIGHT_DEQUANT = 0  # W8A16
PER_TOKEN_GROUP = 1  # W8A8, 1x128 activation groups


def cdiv(a: int, b: int) -> int:
    """Ceiling division of integers (block counts: partial edge blocks count as one)."""
    return -(-a // b)


def expand_block_scales(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[ceil(rows/128), ceil(cols/128)] block scales -> one scale per element [rows, cols] (partial edges cut)."""
    full = scale.repeat_interleave(BLOCK, dim=-2).repeat_interleave(BLOCK, dim=-1)
    return full[..., :rows, :cols]


def dequant_weight(weight: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fp8 [.., N, K] × its 128×128 block scale -> dtype. Works for stacked experts [E, N, K] too."""
    n, k = weight.shape[-2:]
    w = weight.to(torch.float32) * expand_block_scales(scale_inv.to(torch.float32), n, k)
    return w.to(dtype)


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [.., N, K] -> (fp8 weight, fp32 block scales [.., ceil(N/128), ceil(K/128)]), amax/448 per block."""
    n, k = w.shape[-2:]
    nb, kb = cdiv(n, BLOCK), cdiv(k, BLOCK)
    pad = torch.zeros(*w.shape[:-2], nb * BLOCK, kb * BLOCK, dtype=torch.float32)
    pad[..., :n, :k] = w.float()
    blocks = pad.unflatten(-2, (nb, BLOCK)).unflatten(-1, (kb, BLOCK))  # [.., nb, 128, kb, 128]
    amax = blocks.abs().amax(dim=(-3, -1))  # [.., nb, kb]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (pad / expand_block_scales(scale, nb * BLOCK, kb * BLOCK)).clamp(-FP8_MAX, FP8_MAX)
    return q[..., :n, :k].to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantize_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[.., K] -> (fp8 [.., K], fp32 scales [.., K/128]): per token, per 128-channel group (act_quant)."""
    k = x.shape[-1]
    if k % BLOCK:
        raise ValueError(f"W8A8 needs the input dimension to be a multiple of {BLOCK}, got {k}")
    g = x.float().unflatten(-1, (k // BLOCK, BLOCK))
    s = g.abs().amax(dim=-1).clamp(min=ACT_SCALE_FLOOR) / FP8_MAX
    q = (g / s.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return q.flatten(-2), s


def dequant_activation(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (q.float().unflatten(-1, (s.shape[-1], BLOCK)) * s.unsqueeze(-1)).flatten(-2)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     activation_quant: int = WEIGHT_DEQUANT) -> torch.Tensor:
    """y = x · Wᵀ for an FP8 block-scaled weight [N, K]; y has x's dtype, accumulation in fp32."""
    if activation_quant == PER_TOKEN_GROUP:
        return fp8_block_linear_quantized(*quantize_activation(x), weight, scale_inv, x.dtype)
    if activation_quant != WEIGHT_DEQUANT:
        raise ValueError(f"activation_quant must be {WEIGHT_DEQUANT} or {PER_TOKEN_GROUP}, got {activation_quant}")
    # DeepSeek's weight-dequant path runs the GEMM in the compute dtype (bf16 on GPU).
    w = dequant_weight(weight, scale_inv, torch.float32)
    if x.dtype != torch.float32:
        w = w.to(x.dtype).float()
    return (x.float() @ w.T).to(x.dtype)


def fp8_block_linear_quantized(q: torch.Tensor, s: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                               dtype: torch.dtype) -> torch.Tensor:
    """The W8A8 linear on activations already quantized (q fp8 [.., K], s [.., K/128]): y in `dtype`."""
    w = dequant_weight(weight, scale_inv, torch.float32)
    return (dequant_activation(q, s) @ w.T).to(dtype)
