"""One step of the model over a contiguous range of cache slots: what the scheduler decides (StepPlan, plain
integers, small enough to send to every pipeline stage) and what every block of the step shares (StepTensors,
computed from the plan wherever the step runs).

Each sequence of a step brings its own number of new tokens at its own positions: sequence b writes positions
starts[b] .. starts[b] + len(tokens[b]) - 1 of its slot. Shorter sequences are right-padded to the step's width
T; padded positions are never written to the cache, never attended to, and never sampled. So a sequence computes
the same thing whatever else shares its step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from k2trt.config import K2Config
from k2trt.graphs.mask import MASK_NEG
from k2trt.graphs.rope import rope_tables
from k2trt.runtime.sampling import SamplingParams

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class Admit:
    slot: int
    sampling: SamplingParams


@dataclass(frozen=True)
class Release:
    slot: int


@dataclass(frozen=True)
class Move:
    src: int
    dst: int


@dataclass(frozen=True)
class Swap:
    a: int
    b: int


SlotOp = Admit | Release | Move | Swap


@dataclass
class StepPlan:
    first: int  # the step's sequences are slots first .. first + B - 1
    tokens: list[list[int]]  # new token ids of each sequence (at least one each)
    starts: list[int]  # positions already in each sequence's cache
    sample: list[bool]  # whether to sample a token after this step (not for a prompt chunk that is not its last)
    rows: int  # cache slots allocated for this step (every stage resizes to rows x capacity)
    capacity: int  # positions per slot
    kind: str = DECODE  # PREFILL or DECODE, for the timings
    ops: list[SlotOp] = field(default_factory=list)  # slot bookkeeping applied, in order, before the step

    @property
    def batch(self) -> int:
        return len(self.tokens)

    @property
    def width(self) -> int:
        return max((len(t) for t in self.tokens), default=0)

    def validate(self) -> None:
        n = self.batch
        if not (len(self.starts) == len(self.sample) == n) or any(not t for t in self.tokens):
            raise ValueError("a step plan needs tokens, starts and sample flags for each of its sequences")
        if any(s + len(t) > self.capacity for s, t in zip(self.starts, self.tokens)) or self.first + n > self.rows:
            raise ValueError("a step plan writes past the cache's slots or capacity")


class RopeTable:
    """cos/sin of every position up to the largest asked for, computed once and gathered per step."""

    def __init__(self, cfg: K2Config):
        self.cfg = cfg
        self.cos = self.sin = torch.empty(0, cfg.qk_rope_head_dim // 2)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > self.cos.shape[0]:
            n = max(need, 2 * self.cos.shape[0], 64)
            self.cos, self.sin = (t[0] for t in rope_tables(self.cfg, torch.arange(n).unsqueeze(0)))
        return self.cos[positions], self.sin[positions]


@dataclass
class StepTensors:
    input_ids: torch.Tensor  # [B, T] int64, right-padded with 0
    rope_cos: torch.Tensor  # [B, T, rope/2]
    rope_sin: torch.Tensor
    mask: torch.Tensor  # [B, T, P + T] float32
    valid: torch.Tensor  # [B, T] bool: real (not padding) positions
    cache_rows: torch.Tensor  # flat cache rows (slot * P + position) of the valid positions, in valid order
    last: torch.Tensor  # [B] index of each sequence's last real position


def step_tensors(plan: StepPlan, rope: RopeTable, device, act_dtype: torch.dtype) -> StepTensors:
    b, t, cap = plan.batch, plan.width, plan.capacity
    lengths = torch.tensor([len(x) for x in plan.tokens])
    starts = torch.tensor(plan.starts)
    ids = torch.zeros(b, t, dtype=torch.int64)
    for i, x in enumerate(plan.tokens):
        ids[i, :len(x)] = torch.tensor(x)
    offs = torch.arange(t)
    valid = offs[None, :] < lengths[:, None]  # [B, T]
    positions = starts[:, None] + offs[None, :]  # [B, T]
    # keys: the P cache slots (written below `start`), then the T new positions (real ones only), causal
    slot_pos = torch.arange(cap)
    key_pos = torch.cat([slot_pos.expand(b, cap), positions], dim=1)  # [B, P + T]
    key_ok = torch.cat([slot_pos[None, :] < starts[:, None], valid], dim=1)
    allowed = key_ok[:, None, :] & (key_pos[:, None, :] <= positions[:, :, None])
    mask = torch.where(allowed, torch.zeros((), dtype=torch.float32), torch.tensor(MASK_NEG, dtype=torch.float32))
    cos, sin = rope(positions)
    rows = ((plan.first + torch.arange(b))[:, None] * cap + positions)[valid]
    return StepTensors(ids.to(device), cos.to(device, act_dtype), sin.to(device, act_dtype), mask.to(device),
                       valid.to(device), rows.to(device), (lengths - 1).to(device))
