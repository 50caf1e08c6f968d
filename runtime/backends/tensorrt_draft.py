"""An EAGLE-3 draft on TensorRT: the draft's engines (built from `k2trt export --draft` graphs by `k2trt build`,
beside the target's) behind the draft-runner interface of runtime/backends/drafts.py.

Each engine runs through the target backend's machinery (its stream, alignment and profile checks); the draft's
weights are uploaded once, and its outputs land in buffers of their own (the target's hidden-state buffers are left
alone). The drafter keeps its caches and pending aux states on the device in the engines' dtype, so only a call's
token ids, rope tables and mask cross from the host, and only the drafted ids come back. TensorRT's profiles
start at one cache slot (P ≥ 1), so a call with no past (a sequence's first advance) gets one slot its mask never
lets a query see.
"""

from __future__ import annotations

import torch

from k2trt.config import K2Config
from k2trt.draft import Draft
from k2trt.errors import K2Error
from k2trt.export.trt_form import PREFILL_SUFFIX
from k2trt.graphs.blocks import decompress_from
from k2trt.graphs.mask import MASK_NEG
from k2trt.runtime.backends.tensorrt import OutputArena, output_shapes, upload_weights
from k2trt.runtime.tensorrt.profiles import check_call_shape

DRAFT_ENGINES = ("draft_fc", "draft_layer", "draft_head")
PREFILL = "draft_layer" + PREFILL_SUFFIX  # the MLA layout's decompressed form (export/draft_graphs.py)


class TrtDraftRunner:
    name = "tensorrt"

    def __init__(self, backend, draft: Draft, weights: dict[str, torch.Tensor], target: K2Config):
        """backend: the target's TrtBackend, its engines holding the draft's; weights: the draft's float tensors by
        normalized name, the embedding included (drafts.draft_weights)."""
        self.backend, self.cfg = backend, draft.config
        self.max_positions = backend.spec.max_prefill  # the profiles' T
        self.device, self.cache_dtype = backend.device, backend.act_dtype  # the drafter's caches stay on the GPU
        self.mla = self.cfg.layout == "mla"
        wanted = DRAFT_ENGINES + ((PREFILL,) if self.mla else ())
        missing = [k for k in wanted if k not in backend.engines]
        if missing:
            raise K2Error(f"the engines hold no {', '.join(missing)} for this draft: export with --draft and "
                          "build the engines from that export")
        self.decompress_from = decompress_from(self.cfg.attention_config(target)) if self.mla else None
        # the prefill form takes the layer's weights too: one upload serves both
        self.w = {kind: upload_weights(backend.engines[kind].entry, weights, backend.act_dtype, backend.device)
                  for kind in DRAFT_ENGINES}
        self.arena = OutputArena(backend.device)

    def _call(self, engine: str, kind: str, inputs: dict, dims: dict) -> list[torch.Tensor]:
        be = self.backend
        check_call_shape(be.spec, dims["B"], dims["T"], dims.get("P"))
        entry = be.engines[engine].entry
        outs = {name: self.arena.get(f"{engine}/{name}", shape, be.engines[engine].dtypes[name])
                for name, shape in output_shapes(entry, dims).items()}
        be._run(engine, dims["T"], inputs, self.w[kind], outs)
        return [outs[o["name"]].clone() for o in entry["outputs"]]  # the arena's buffers are reused next call

    def _in(self, x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self.backend._on_device(x, dtype or self.backend.act_dtype)

    def fc(self, aux: torch.Tensor) -> torch.Tensor:
        b, t = aux.shape[:2]
        return self._call("draft_fc", "draft_fc", {"aux": self._in(aux)}, {"B": b, "T": t})[0]

    def layer(self, input_ids, hidden, cos, sin, mask, parts: list[torch.Tensor]):
        b, t = input_ids.shape
        axis = 1 if self.mla else 2
        if parts[0].shape[axis] == 0:  # one slot no query sees: the profiles' P starts at 1
            parts = [p.new_zeros(*p.shape[:axis], 1, *p.shape[axis + 1:]) for p in parts]
            mask = torch.cat([torch.full((b, t, 1), MASK_NEG, dtype=mask.dtype), mask], dim=-1)
        p = parts[0].shape[axis]
        names = ("latent_cache",) if self.mla else ("past_k", "past_v")
        inputs = {"input_ids": self._in(input_ids, torch.int64), "hidden_states": self._in(hidden),
                  "rope_cos": self._in(cos), "rope_sin": self._in(sin),
                  "attention_mask": self._in(mask, torch.float32),
                  **{name: self._in(part) for name, part in zip(names, parts)}}
        engine = PREFILL if self.mla and t >= self.decompress_from else "draft_layer"
        out, *new = self._call(engine, "draft_layer", inputs, {"B": b, "T": t, "P": p})
        return out, new

    def head(self, out: torch.Tensor) -> torch.Tensor:
        b, t = out.shape[:2]
        return self._call("draft_head", "draft_head", {"hidden_states": self._in(out)}, {"B": b, "T": t})[0]
