"""AOT launches of the paged MLA attention kernels (runtime/kernels/mla_decode.py, mla_prefill.py), in the form a
block graph calls them: the pool holds each sequence's context and the step's rows come dense (HAS_NEW), so a
plugin reads its inputs only.

An AOT plugin returns one kernel (tensorrt/plugin/_plugin_class.py, _TemplateAOTPlugin), so each form is two
plugins, as the JIT path is two launches: decode absorbed = the split kernel (with one split it normalizes and
writes o itself) then the merge; prefill decompressed = the decompression GEMM (its output, the per-sequence keys
and values, is the next plugin's input) then the attention. The kernels' parameters are already in TensorRT's
launch order (input pointers, int32 scalars, output pointers), the softmax scale is a constexpr and the fp8 pool's
scale a one-element tensor, so nothing else is passed.

The JIT tiles do not fit the 48 KiB of shared memory an AOT launch gets (ptx.AOT_SHARED_LIMIT; the decode
default needs 55 KiB in bf16): each launch shrinks until it fits — fewer stages, then fewer positions a step, then
fewer rows — and the compiled tiles are the ones the interpreter tests run (tests/test_aot_mla.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from k2trt.dtypes import FP8, torch_dtype
from k2trt.runtime.aot.linear import act_pointer
from k2trt.runtime.kernels import mla_decode, mla_prefill

POOL_POINTERS = {FP8: "fp8e4nv"}


def _blocks(n, size: int):
    """ceil(n / size) for an int or a TensorRT shape expression (which has + and // but no negation)."""
    return (n + (size - 1)) // size


def _pool_ptr(pool: str, act: str) -> str:
    """A pool holds the activation dtype or fp8 e4m3 (with its per-tensor scale)."""
    if pool != act and pool != FP8:
        raise ValueError(f"MLA AOT: a pool holds the activation dtype ({act}) or {FP8}, got {pool!r}")
    return POOL_POINTERS.get(pool) or act_pointer(act, "MLA")


def _shrink(launch, m_field: str, n_field: str, m_floor: int = 16, n_floor: int = 16):
    """Fewer stages, then half the positions a step (down to 16), then half the rows (down to 16)."""
    if launch.num_stages > 1:
        return replace(launch, num_stages=launch.num_stages - 1)
    if getattr(launch, n_field) > n_floor:
        return replace(launch, **{n_field: getattr(launch, n_field) // 2, "num_stages": 2})
    if getattr(launch, m_field) > m_floor:
        return replace(launch, **{m_field: getattr(launch, m_field) // 2, "num_stages": 2})
    return None


@dataclass(frozen=True)
class SplitLaunch:
    """mla_decode.split_kernel: grid (B, row blocks of Q·H, splits); scalars (Q, max_pages, pool_pages, splits);
    outputs the splits' partials (fp32) and, with one split (`direct`), o."""
    act: str
    pool: str
    heads: int
    latent: int
    rope: int
    page_tokens: int
    softmax_scale: float
    direct: bool
    block_m: int = mla_decode.DEFAULT_CONFIG.block_m
    block_n: int = mla_decode.DEFAULT_CONFIG.block_n
    num_warps: int = mla_decode.DEFAULT_CONFIG.num_warps
    num_stages: int = mla_decode.DEFAULT_CONFIG.num_stages

    kernel = mla_decode.split_kernel

    @property
    def label(self) -> str:
        return f"mla_split_{self.heads}x{self.latent + self.rope}"

    @property
    def config(self) -> mla_decode.MlaDecodeConfig:
        return mla_decode.MlaDecodeConfig(self.block_m, self.block_n, self.num_warps, self.num_stages)

    def _unused(self) -> tuple[str, ...]:
        """The output pointers this form never writes: constexpr None, so the compiled kernel has no such
        parameter and the plugin no such output (direct: the partials; split: o, which the merge writes)."""
        return ("part_acc_ptr", "part_ml_ptr") if self.direct else ("o_ptr",)

    def pointer_types(self) -> dict[str, str]:
        act = act_pointer(self.act, "MLA")
        types = {"q_ptr": act, "pool_ptr": _pool_ptr(self.pool, self.act), "kv_scale_ptr": "fp32",
                 "table_ptr": "i32", "len_ptr": "i32", "new_ptr": act, "n_new_ptr": "i32", "part_acc_ptr": "fp32",
                 "part_ml_ptr": "fp32", "o_ptr": act}
        return {k: v for k, v in types.items() if k not in self._unused()}

    def constexprs(self) -> dict:
        return {**mla_decode.split_constexprs(self.heads, self.latent, self.rope, self.page_tokens, self.config,
                                              self.direct, self.softmax_scale, torch_dtype(self.act),
                                              torch_dtype(self.pool), has_new=True),
                **{name: None for name in self._unused()}}

    def shrink(self):
        return _shrink(self, "block_m", "block_n")

    def config_key(self) -> tuple:
        return (self,)

    def grid(self, batch, n_q, n_splits):
        return (batch, _blocks(n_q * self.heads, self.block_m), n_splits)

    def extra_args(self, n_q, max_pages, pool_pages, n_splits) -> tuple:
        return (n_q, max_pages, pool_pages, n_splits)


@dataclass(frozen=True)
class MergeLaunch:
    """mla_decode.merge_kernel: one program per query row (B·Q·H); scalar: the split count."""
    act: str
    latent: int
    num_warps: int = mla_decode.DEFAULT_CONFIG.merge_warps
    num_stages: int = 1

    kernel = mla_decode.merge_kernel
    label = "mla_merge"

    def pointer_types(self) -> dict[str, str]:
        return {"part_acc_ptr": "fp32", "part_ml_ptr": "fp32", "o_ptr": act_pointer(self.act, "MLA")}

    def constexprs(self) -> dict:
        return {"DL": self.latent, "OUT": mla_decode.act_code(torch_dtype(self.act))}

    def shrink(self):
        return None

    def config_key(self) -> tuple:
        return (self,)

    def grid(self, rows):
        return (rows,)

    def extra_args(self, n_splits) -> tuple:
        return (n_splits,)


@dataclass(frozen=True)
class DecompressLaunch:
    """mla_prefill.decompress_kernel: grid (B, position blocks of the scratch, column blocks of H·(nope + v));
    scalars (T, max_pages, pool_pages, P, columns); output the keys' nope parts and the values [B, P, columns]."""
    act: str
    pool: str
    heads: int
    latent: int
    rope: int
    nope: int
    v: int
    page_tokens: int
    block_p: int = mla_prefill.DEFAULT_CONFIG.decompress_p
    block_n: int = mla_prefill.DEFAULT_CONFIG.decompress_n
    block_k: int = mla_prefill.DEFAULT_CONFIG.decompress_k
    num_warps: int = mla_prefill.DEFAULT_CONFIG.decompress_warps
    num_stages: int = 2

    kernel = mla_prefill.decompress_kernel

    @property
    def label(self) -> str:
        return f"mla_decompress_{self.heads}x{self.nope + self.v}x{self.latent}"

    @property
    def columns(self) -> int:
        return self.heads * (self.nope + self.v)

    def pointer_types(self) -> dict[str, str]:
        act = act_pointer(self.act, "MLA")
        return {"pool_ptr": _pool_ptr(self.pool, self.act), "kv_scale_ptr": "fp32", "table_ptr": "i32",
                "len_ptr": "i32", "n_new_ptr": "i32", "new_ptr": act, "w_ptr": act, "kv_ptr": act}

    def constexprs(self) -> dict:
        return dict(D=self.latent + self.rope, DL=self.latent, PAGE=self.page_tokens, BLOCK_P=self.block_p,
                    BLOCK_N=self.block_n, BLOCK_K=self.block_k, HAS_NEW=True,
                    **mla_decode.math_constexprs(torch_dtype(self.act), torch_dtype(self.pool)))

    def shrink(self):
        return _shrink(self, "block_p", "block_n")

    def config_key(self) -> tuple:
        return (self,)

    def grid(self, batch, positions):
        return (batch, _blocks(positions, self.block_p), _blocks(self.columns, self.block_n))

    def extra_args(self, n_q, max_pages, pool_pages, positions) -> tuple:
        return (n_q, max_pages, pool_pages, positions, self.columns)


@dataclass(frozen=True)
class AttendLaunch:
    """mla_prefill.attend_kernel: grid (B, H, query blocks); scalars (T, max_pages, pool_pages, P); output o."""
    act: str
    pool: str
    heads: int
    latent: int
    rope: int
    nope: int
    v: int
    page_tokens: int
    softmax_scale: float
    block_m: int = mla_prefill.DEFAULT_CONFIG.block_m
    block_n: int = mla_prefill.DEFAULT_CONFIG.block_n
    num_warps: int = mla_prefill.DEFAULT_CONFIG.num_warps
    num_stages: int = mla_prefill.DEFAULT_CONFIG.num_stages

    kernel = mla_prefill.attend_kernel

    @property
    def label(self) -> str:
        return f"mla_attend_{self.heads}x{self.nope + self.rope}"

    def pointer_types(self) -> dict[str, str]:
        act = act_pointer(self.act, "MLA")
        return {"q_ptr": act, "pool_ptr": _pool_ptr(self.pool, self.act), "kv_scale_ptr": "fp32", "table_ptr": "i32",
                "len_ptr": "i32", "n_new_ptr": "i32", "new_ptr": act, "kv_ptr": act, "o_ptr": act}

    def constexprs(self) -> dict:
        return dict(H=self.heads, NOPE=self.nope, DR=self.rope, DV=self.v, D=self.latent + self.rope,
                    DL=self.latent, PAGE=self.page_tokens, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
                    SM_SCALE=float(self.softmax_scale), HAS_NEW=True,
                    **mla_decode.math_constexprs(torch_dtype(self.act), torch_dtype(self.pool)))

    def shrink(self):
        return _shrink(self, "block_m", "block_n")

    def config_key(self) -> tuple:
        return (self,)

    def grid(self, batch, n_q):
        return (batch, self.heads, _blocks(n_q, self.block_m))

    def extra_args(self, n_q, max_pages, pool_pages, positions) -> tuple:
        return (n_q, max_pages, pool_pages, positions)


LAUNCHES = (SplitLaunch, MergeLaunch, DecompressLaunch, AttendLaunch)


PAGE_TOKENS = 64  # runtime/cache/pages.PAGE_TOKENS (a test holds them equal: the AOT layer sits below the cache)


def k2_shape() -> dict:
    """Kimi K2's attention as the launches take it: 64 heads, latent 512 + rope 64, nope 128, v 128, the cache's
    pages, its softmax scale."""
    from k2trt.config import kimi_k2

    cfg = kimi_k2()
    return dict(heads=cfg.num_attention_heads, latent=cfg.kv_lora_rank, rope=cfg.qk_rope_head_dim,
                nope=cfg.qk_nope_head_dim, v=cfg.v_head_dim, page_tokens=PAGE_TOKENS,
                softmax_scale=cfg.softmax_scale)


# float32 activations have no AOT form: the absorbed decode's 512-wide query and latent tiles alone take 64 KiB of
# shared memory in fp32 at the smallest tile (16 rows × 16 positions; 73,728 B compiled for sm_90), over the 48 KiB
# an AOT launch gets, and the score dot taken 128 columns at a time still needs 81,920 B (the weighted sum's own
# 16 × 512 latent tile stays). A float32 engine runs these plugins JIT, where Triton's launcher raises a kernel's
# shared-memory limit itself.
AOT_ACTIVATIONS = ("bfloat16", "float16")


def every_launch(acts=AOT_ACTIVATIONS) -> list:
    """The distinct launches of K2's attention plugins for each activation dtype, over a pool of that dtype and an
    fp8 one."""
    out = []
    for act in acts:
        if act not in AOT_ACTIVATIONS:
            raise ValueError(f"MLA AOT: no launch for {act} activations (AOT_ACTIVATIONS: {AOT_ACTIVATIONS})")
        for pool in (act, FP8):
            out += [x for x in launches(act, pool, **k2_shape()) if x not in out]
    return out


def launches(act: str, pool: str, heads: int, latent: int, rope: int, nope: int, v: int, page_tokens: int,
             softmax_scale: float) -> list:
    """Every launch one attention layer's plugins need for an activation and a pool dtype (both split-kernel
    forms: one split, and split then merge)."""
    return [SplitLaunch(act, pool, heads, latent, rope, page_tokens, softmax_scale, direct=True),
            SplitLaunch(act, pool, heads, latent, rope, page_tokens, softmax_scale, direct=False),
            MergeLaunch(act, latent),
            DecompressLaunch(act, pool, heads, latent, rope, nope, v, page_tokens),
            AttendLaunch(act, pool, heads, latent, rope, nope, v, page_tokens, softmax_scale)]

