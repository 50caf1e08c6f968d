"""Tiny EAGLE-3 drafts for the tiny target, one per published form (k2trt/draft.py): a Llama-layout draft as
AQ-MedAI writes it (LlamaForCausalLMEagle3, `midlayer.*`, a draft vocabulary of half the target's with d2t, the
target's embedding shared), an MLA-layout one as k-l-lambda writes it (Eagle3DeepseekV2ForCausalLM, `layers.0.*`,
the whole vocabulary and its own embedding), and the speculators format (vLLM's: transformer_layer_config, d2t, aux
ids written as layer outputs, so loading must move them). Seeded random weights: what they propose is noise, which
is what a draft that never agrees needs; the shapes and names are the published ones at the tiny's width."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from k2trt.atomic import atomic_write_text
from k2trt.config import K2Config
from k2trt.draft_config import LAYER, LAYOUTS, DraftConfig
from k2trt.errors import K2Error
from k2trt.safetensors_io import save_file
from k2trt.tiny.checkpoint import building

DRAFT_FORMATS = ("llama", "mla", "speculators")  # make-tiny --draft


def tiny_draft_config(target: K2Config, form: str) -> tuple[DraftConfig, dict]:
    """(the config, the config.json a publisher of that form writes) of the tiny target's draft."""
    n = target.num_hidden_layers
    h = target.hidden_size
    common = dict(hidden_size=h, target_hidden_size=h, intermediate_size=2 * h, num_attention_heads=4,
                  vocab_size=target.vocab_size, rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta)
    # the residual stream entering layers 2, n/2 and n - 1 — K2's [2, 30, 58] at the tiny's 4 layers: [2, 2, 3]
    # (a list starting at 1 would be read as layer outputs: k2trt/draft.py)
    inputs_to = (2, max(2, n // 2), n - 1)
    if form == "mla":
        cfg = DraftConfig(layout="mla", source_format="eagle3", draft_vocab_size=target.vocab_size,
                          aux_layer_ids=inputs_to, aux_ids_as_written=inputs_to, q_lora_rank=h // 2,
                          kv_lora_rank=h // 2, qk_rope_head_dim=target.qk_rope_head_dim,
                          qk_nope_head_dim=target.qk_nope_head_dim, v_head_dim=target.v_head_dim,
                          max_position_embeddings=target.max_position_embeddings, **common)
        raw = {"architectures": ["Eagle3DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", **common,
               "draft_vocab_size": cfg.draft_vocab_size, "q_lora_rank": cfg.q_lora_rank,
               "kv_lora_rank": cfg.kv_lora_rank, "qk_rope_head_dim": cfg.qk_rope_head_dim,
               "qk_nope_head_dim": cfg.qk_nope_head_dim, "v_head_dim": cfg.v_head_dim,
               "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(inputs_to)}}
        return cfg, raw
    llama = dict(num_key_value_heads=2, head_dim=h // 4)
    half = target.vocab_size // 2
    if form == "llama":
        cfg = DraftConfig(layout="llama", source_format="eagle3", draft_vocab_size=half, aux_layer_ids=inputs_to,
                          aux_ids_as_written=inputs_to, **llama, **common)
        raw = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **common, **llama,
               "draft_vocab_size": half, "eagle_aux_hidden_state_layer_ids": list(inputs_to)}
        return cfg, raw
    if form != "speculators":
        raise K2Error(f"make-tiny --draft: {form!r} is not one of {', '.join(DRAFT_FORMATS)}")
    written = tuple(i - 1 for i in inputs_to)  # written as layer outputs (first id 1): loading moves them up by one
    cfg = DraftConfig(layout="llama", source_format="speculators", draft_vocab_size=half, aux_layer_ids=inputs_to,
                      aux_ids_as_written=written, norm_before_residual=True, speculative_tokens=3, **llama, **common)
    layer = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **common, **llama}
    raw = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "transformer_layer_config": layer,
           "draft_vocab_size": half, "norm_before_residual": True, "target_hidden_size": h,
           "eagle_aux_hidden_state_layer_ids": list(written),
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"speculative_tokens": 3}]}}
    return cfg, raw


def tiny_draft_tensors(cfg: DraftConfig, form: str, seed: int) -> dict[str, torch.Tensor]:
    """Seeded bf16 weights under the names the form's publisher uses (normalized names: DraftConfig)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in cfg.tensor_shapes().items():
        if name.endswith("norm.weight"):
            t = 1.0 + 0.05 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[-1])
        stored = ("midlayer." + name[len(LAYER):]) if form == "llama" and name.startswith(LAYER) else name
        out[stored] = t.to(torch.bfloat16)
    if cfg.draft_vocab_size != cfg.vocab_size:  # a seeded subset of the vocabulary, in increasing order
        ids = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size].sort().values
        out["d2t"] = ids - torch.arange(cfg.draft_vocab_size)
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    if form == "mla":  # its own embedding; the others share the target's
        out["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g).to(torch.bfloat16)
    return out


def make_tiny_draft(out_dir: str | Path, form: str = "llama", target: K2Config | None = None, seed: int = 0,
                    *, force: bool = False) -> Path:
    """Write the tiny target's draft in `form` to out_dir (built beside it and renamed into place:
    checkpoint.building)."""
    cfg, raw = tiny_draft_config(target or K2Config.preset("tiny"), form)
    if cfg.layout not in LAYOUTS:
        raise K2Error(f"unknown draft layout {cfg.layout}")
    with building(out_dir, "k2trt make-tiny --draft", force) as tmp:
        save_file(tiny_draft_tensors(cfg, form, seed), tmp / "model.safetensors")
        atomic_write_text(tmp / "config.json", json.dumps(raw, indent=2) + "\n")
    return Path(out_dir)
