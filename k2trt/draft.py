"""EAGLE-3 drafts of the K2 family as they are published, read into one form.

Three ways a draft's config.json describes it, two layouts of its one decoder layer:
  * "eagle3" with `architectures: ["LlamaForCausalLMEagle3"]` (AQ-MedAI/Kimi-K2-Instruct-eagle3, lightseekorg's
    kimi-k2.x-eagle3): a Llama layer — q/k/v/o projections, SwiGLU MLP;
  * "eagle3" with `architectures: ["Eagle3DeepseekV2ForCausalLM"]` (k-l-lambda/Kimi-K2.5-Eagle3, the -mla drafts):
    an MLA layer — q_a/q_b, kv_a_proj_with_mqa, kv_b, o — in the target's latent layout;
  * "speculators" (vLLM's speculators format: `speculators_model_type: "eagle3"`, the Llama layer's config in
    `transformer_layer_config`).
Whatever the source, the tensors are named as `layers.0.*` (`midlayer.*` is its other spelling), beside `fc`
[hidden, 3 × target hidden] over the target's residual stream at three depths, `norm`, `lm_head` [draft vocab,
hidden] (never shared), `d2t` [draft vocab] (an offset: target id = draft id + d2t[draft id]; absent when the draft
speaks the target's whole vocabulary), and `embed_tokens` (absent: the target's embedding is shared). The layer's
first projections read concat(input_layernorm(embed(token)), hidden_norm(hidden)): 2 × hidden inputs.

The aux ids — which residual-stream tensors `fc` reads — come in two conventions: "input to layer i" (vLLM's, as
written: [2, 30, 58] for K2's 61 layers) and "output of layer i" ([1, 29, 57]), the same tensors. Checkpoints do not
say which; as SGLang decides, a list whose first id is 1 is taken as layer outputs and moved up by one.
`DraftConfig.aux_layer_ids` is always "the residual stream entering layer i" (`aux_ids_as_written` keeps the file's).
Absent, they are vLLM's default for the target: (2, n // 2, n − 3).

Every damaged or unsupported draft is one line (DraftError) naming the file and the field or tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from k2trt.config import K2Config
from k2trt.draft_config import LAYER, DraftConfig, DraftError, parse_draft_config
from k2trt.errors import K2Error
from k2trt.files import read_json_object
from k2trt.safetensors_io import SafetensorsFile

LAYER_SPELLINGS = ("midlayer.", "model.layers.0.", "layers.0.")  # as files name the one decoder layer
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass
class Draft:
    """A loaded draft: its config, its tensors by normalized name (float ones as stored), the target ids of its
    vocabulary (int64 [draft vocab]), and whether it shares the target's embedding."""
    config: DraftConfig
    root: Path
    tensors: dict[str, torch.Tensor]
    target_ids: torch.Tensor

    @property
    def shares_embedding(self) -> bool:
        return "embed_tokens.weight" not in self.tensors


def normalized_name(name: str) -> str:
    for spelling in LAYER_SPELLINGS:
        if name.startswith(spelling):
            return LAYER + name[len(spelling):]
    return name[len("model."):] if name.startswith("model.") else name


def _files(root: Path) -> list[Path]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise DraftError(f"{root}: no .safetensors file (a draft checkpoint holds its weights in one)")
    return files


def load_draft(path: str | Path, target: K2Config) -> Draft:
    """A draft checkpoint directory (or owner/name from the Hugging Face cache: k2trt.hub) for `target`, every
    tensor checked against its config; DraftError otherwise."""
    from k2trt.hub import resolve_model

    root = resolve_model(str(path))
    if not root.is_dir():
        raise DraftError(f"{root}: not a draft checkpoint directory")
    cfg = parse_draft_config(read_json_object(root / "config.json", "a draft checkpoint needs its config",
                                              DraftError), str(root / "config.json"), target)
    tensors: dict[str, torch.Tensor] = {}
    for file in _files(root):
        try:
            st = SafetensorsFile(file)
        except K2Error as e:  # a damaged file: the reader's one line, as the draft's
            raise DraftError(str(e)) from None
        for name in st.names():
            key = normalized_name(name)
            if key.endswith(("weight_scale_inv", "weight_scale", "weight_packed")):
                raise DraftError(f"{file}: {name} is a quantized tensor; k2trt runs bf16 drafts")
            if key in tensors:
                raise DraftError(f"{file}: {name} is stored twice (as {key})")
            tensors[key] = st.tensor(name)
    _check_tensors(cfg, root, tensors)
    target_ids = _target_ids(cfg, root, tensors)
    return Draft(cfg, root, tensors, target_ids)


def _check_tensors(cfg: DraftConfig, root: Path, tensors: dict[str, torch.Tensor]) -> None:
    for name, shape in cfg.tensor_shapes().items():
        t = tensors.get(name)
        if t is None:
            raise DraftError(f"{root}: tensor {name} is missing")
        if tuple(t.shape) != shape:
            raise DraftError(f"{root}: tensor {name} is {list(t.shape)}, the config says {list(shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise DraftError(f"{root}: tensor {name} is {t.dtype}, expected bfloat16, float16 or float32")
    embed = tensors.get("embed_tokens.weight")
    if embed is not None and tuple(embed.shape) != (cfg.vocab_size, cfg.hidden_size):
        raise DraftError(f"{root}: tensor embed_tokens.weight is {list(embed.shape)}, expected "
                         f"{[cfg.vocab_size, cfg.hidden_size]}")
    if embed is None and cfg.hidden_size != cfg.target_hidden_size:
        raise DraftError(f"{root}: no embed_tokens.weight, and the target's embedding ({cfg.target_hidden_size} "
                         f"wide) cannot be shared with a draft {cfg.hidden_size} wide")
    for i in range(3):
        norm = tensors.get(f"fc_norm.{i}.weight")  # EAGLE3.1: one RMSNorm per aux chunk
        if norm is not None and tuple(norm.shape) != (cfg.target_hidden_size,):
            raise DraftError(f"{root}: tensor fc_norm.{i}.weight is {list(norm.shape)}, expected "
                             f"[{cfg.target_hidden_size}]")


def _target_ids(cfg: DraftConfig, root: Path, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """Target id of each draft id: draft id + d2t[draft id]; the identity for a draft of the whole vocabulary."""
    d2t = tensors.get("d2t")
    ids = torch.arange(cfg.draft_vocab_size, dtype=torch.int64)
    if d2t is None:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise DraftError(f"{root}: no d2t, but draft_vocab_size {cfg.draft_vocab_size} is not the vocabulary's "
                             f"{cfg.vocab_size} (d2t maps draft ids to target ids)")
        return ids
    if tuple(d2t.shape) != (cfg.draft_vocab_size,) or d2t.dtype.is_floating_point:
        raise DraftError(f"{root}: tensor d2t is {d2t.dtype} {list(d2t.shape)}, expected integers "
                         f"[{cfg.draft_vocab_size}]")
    target = ids + d2t.to(torch.int64)
    if int(target.min()) < 0 or int(target.max()) >= cfg.vocab_size:
        raise DraftError(f"{root}: d2t maps draft ids outside the vocabulary 0..{cfg.vocab_size - 1}")
    if torch.unique(target).numel() != target.numel():
        raise DraftError(f"{root}: d2t maps two draft ids to the same target id")
    return target
