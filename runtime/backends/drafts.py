"""What computes an EAGLE-3 draft's three pieces (fc, its decoder layer, head) for the drafter
(runtime/generation/eagle.py) — one interface, as the target's backends have: the draft's math itself
(`TorchDraftRunner`), its exported graphs (export/draft_graphs.py) on ONNX Runtime (`OrtDraftRunner`), or its
TensorRT engines (runtime/backends/tensorrt_draft.py). Each backend says which runner it gives a draft
(`Backend.draft_runner`): its own graphs or engines where its export holds the draft's, else none, and the drafter
computes on the math.

  fc(aux [B, T, 3 × target H])                                   -> hidden [B, T, H]
  layer(input_ids [B, T], hidden, cos, sin, mask, cache parts)   -> (out [B, T, H], the new positions' parts)
  head(out [B, T, H])                                            -> logits [B, T, draft vocab] float32

Cache parts are the Llama layout's (k, v) [B, kv heads, P, head dim] or the MLA layout's (latent,) [B, P, lat];
every tensor is where the runner computes (`device`), the caches in its `cache_dtype` — the drafter keeps them
there.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from k2trt.config import K2Config
from k2trt.draft import Draft
from k2trt.errors import K2Error
from k2trt.graphs import eagle
from k2trt.graphs.ops import TorchOps

EMBEDDING = "embed_tokens.weight"  # the layer's embedding input: the draft's own or the target's (shared)


def draft_weights(draft: Draft, target_embedding: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The draft's float tensors by normalized name, the embedding its own or the target's."""
    w = {name: t for name, t in draft.tensors.items() if t.dtype.is_floating_point}
    if EMBEDDING not in w:
        if target_embedding is None:
            raise K2Error(f"{draft.root}: the draft shares the target's embedding, and none was given")
        w[EMBEDDING] = target_embedding
    return w


class TorchDraftRunner:
    """The draft's math (graphs/eagle.py) with the torch reference's ops, in float32."""

    name = "torch"
    max_positions = None  # new positions one call may take: any
    device, cache_dtype = torch.device("cpu"), torch.float32  # where the drafter keeps its caches, and how

    def __init__(self, draft: Draft, target_embedding: torch.Tensor | None, target: K2Config | None):
        self.cfg = draft.config
        self.attn_cfg = self.cfg.attention_config(target) if self.cfg.layout == "mla" else None
        self.w = {name: t.float() for name, t in draft_weights(draft, target_embedding).items()}
        self.ops = TorchOps("float32")

    def fc(self, aux: torch.Tensor) -> torch.Tensor:
        return eagle.draft_fc(self.ops, self.cfg, aux, self.w)

    def layer(self, input_ids, hidden, cos, sin, mask, parts: list[torch.Tensor]):
        embeds = self.w[EMBEDDING][input_ids]
        if self.attn_cfg is not None:
            out, latent_new = eagle.draft_layer_mla(self.ops, self.cfg, self.attn_cfg, embeds, hidden, cos, sin,
                                                    mask, parts[0], self.w)
            return out, [latent_new]
        out, k_new, v_new = eagle.draft_layer(self.ops, self.cfg, embeds, hidden, cos, sin, mask, *parts, self.w)
        return out, [k_new, v_new]

    def head(self, out: torch.Tensor) -> torch.Tensor:
        return eagle.draft_head(self.ops, self.cfg, out, self.w)


class OrtDraftRunner:
    """The draft's exported graphs (ort/draft_fc, ort/draft_layer, ort/draft_head of an export directory) on ONNX
    Runtime, its weights made initializers once (one layer: nothing to rebind per call)."""

    name = "onnxruntime"
    max_positions = None
    device, cache_dtype = torch.device("cpu"), torch.float32  # the graphs are float32 on the host

    def __init__(self, export_dir: Path, manifest: dict, draft: Draft, target_embedding: torch.Tensor | None,
                 threads: int | None = None):
        import onnx

        from k2trt.dtypes import torch_dtype
        from k2trt.export_manifest import graph_file
        from k2trt.runtime.backends.graph_weights import graph_weights
        from k2trt.runtime.backends.ort import _ort, bind_weights, session_options

        ort = _ort()
        act = torch_dtype(manifest["act_dtype"])
        source = draft_weights(draft, target_embedding)
        opts = session_options(threads)
        self.sessions, self.inputs, self.outputs = {}, {}, {}
        self.session_s = 0.0
        for kind in ("draft_fc", "draft_layer", "draft_head"):
            key = f"ort/{kind}"
            path = graph_file(export_dir, manifest, key)  # a missing or changed graph: one line
            entry = manifest["graphs"][key]
            model = bind_weights(onnx.load(str(path)), graph_weights(entry, source, act))
            try:
                self.sessions[kind] = ort.InferenceSession(model.SerializeToString(), opts,
                                                           providers=["CPUExecutionProvider"])
            except Exception as e:  # ORT raises its own exception types for every kind of bad file
                raise K2Error(f"{export_dir}/{key}: ONNX Runtime cannot load it ({str(e).splitlines()[0]})") from None
            self.inputs[kind] = [i["name"] for i in entry["inputs"] if i["name"] not in entry["weights"]]
            self.outputs[kind] = [o["name"] for o in entry["outputs"]]

    def _run(self, kind: str, *values: torch.Tensor) -> list[torch.Tensor]:
        feeds = {name: v.contiguous().numpy() for name, v in zip(self.inputs[kind], values)}
        t0 = time.perf_counter()
        outs = self.sessions[kind].run(self.outputs[kind], feeds)
        self.session_s += time.perf_counter() - t0
        return [torch.from_numpy(o) for o in outs]

    def fc(self, aux: torch.Tensor) -> torch.Tensor:
        return self._run("draft_fc", aux.float())[0]

    def layer(self, input_ids, hidden, cos, sin, mask, parts: list[torch.Tensor]):
        out, *new = self._run("draft_layer", input_ids.long(), hidden, cos, sin, mask, *parts)
        return out, new

    def head(self, out: torch.Tensor) -> torch.Tensor:
        return self._run("draft_head", out)[0]


def holds_draft(manifest: dict | None, draft: Draft) -> bool:
    """Whether an export's (or engine directory's) manifest holds this draft's graphs (same config, by
    fingerprint)."""
    return bool(manifest) and (manifest.get("draft") or {}).get("fingerprint") == draft.config.fingerprint()
