"""Hugging Face transformers' DeepseekV3ForCausalLM on our checkpoint: the baseline a Python user would pick.

The model is built from our config (K2Config.to_hf_dict) and loaded with the checkpoint's weights, FP8
dequantized to float32 by the same block-scale rule as ours (graphs/fp8.dequant_weight), INT4 experts by
graphs/int4.dequant_weight (tests/test_int4.py checks that rule against transformers' own loading of an INT4
directory through compressed-tensors); it runs with its own
defaults (attention and experts implementation, its own KV cache) and greedy decoding through `generate`.
transformers is an optional extra: `pip install 'k2trt[bench]'`.
"""

from __future__ import annotations

import time

import torch

from k2trt.config import K2Config
from k2trt.errors import MissingDependency
from k2trt.graphs import int4
from k2trt.graphs.fp8 import dequant_weight
from k2trt.runtime.generation.timings import Timings

INSTALL_HINT = "pip install 'k2trt[bench]'"
_EXPERTS = "mlp.experts."


def transformers_module():
    try:
        import transformers
    except ImportError:
        raise MissingDependency(f"transformers is not installed ({INSTALL_HINT})") from None
    return transformers


def _dequantized(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """FP8 weights times their block scales, INT4 ones unpacked times their group scales (stacked experts too),
    every other tensor as float32."""
    out = {}
    for name, t in tensors.items():
        if name.endswith((".weight_scale_inv", ".weight_scale")):
            continue
        if name.endswith(".weight_packed"):
            base = name.removesuffix("_packed")
            out[base] = int4.dequant_weight(t, tensors[f"{base}_scale"], torch.float32)
            continue
        scale = tensors.get(f"{name}_scale_inv")
        out[name] = dequant_weight(t, scale, torch.float32) if scale is not None else t.to(torch.float32)
    return out


def hf_layer_state(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's block weights (our suffix names, experts stacked) as transformers names them: the routed
    experts as `gate_up_proj` [E, 2I, d] (gate rows, then up rows) and `down_proj` [E, d, I]."""
    w = _dequantized(block)
    out = {k: v for k, v in w.items() if not k.startswith(_EXPERTS)}
    if f"{_EXPERTS}gate_proj.weight" in w:
        out[f"{_EXPERTS}gate_up_proj"] = torch.cat(
            [w[f"{_EXPERTS}gate_proj.weight"], w[f"{_EXPERTS}up_proj.weight"]], dim=1).contiguous()
        out[f"{_EXPERTS}down_proj"] = w[f"{_EXPERTS}down_proj.weight"]
    return out


def build_hf_model(weights):
    """DeepseekV3ForCausalLM in float32 with `weights`' tensors (a WeightSource), in eval mode."""
    tf = transformers_module()
    cfg: K2Config = weights.config
    hf_cfg = tf.DeepseekV3Config(**{k: v for k, v in cfg.to_hf_dict().items()
                                    if k not in ("auto_map", "quantization_config", "architectures")})
    hf_cfg.dtype = torch.float32
    with torch.device("meta"):
        model = tf.DeepseekV3ForCausalLM(hf_cfg)
    state = _dequantized(weights.globals())
    for i in range(cfg.num_hidden_layers):
        state.update({f"model.layers.{i}.{k}": v for k, v in hf_layer_state(weights.block_weights(i)).items()})
    model.load_state_dict(state, strict=True, assign=True)
    # the rotary tables are computed, not loaded: make that module again off the meta device
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg)
    return model.eval()


class _FirstTokenClock:
    """A transformers streamer that notes when the prompt's forward pass is done: `generate` puts the prompt
    first, then each new token, so the first put after the prompt ends prefill."""

    def __init__(self):
        self.puts, self.first_token_at = 0, None

    def put(self, value) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        pass


@torch.no_grad()
def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], Timings]:
    """Greedy generation of equal-length prompts with transformers' own cache: the new tokens of each prompt,
    and prefill (up to the first token) and decode (the rest) times."""
    ids = torch.tensor(prompts, dtype=torch.int64)
    clock = _FirstTokenClock()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, streamer=clock, pad_token_id=0)
    t1 = time.perf_counter()
    first = clock.first_token_at or t1
    b, n = ids.shape
    return out[:, n:].tolist(), Timings(prefill_s=first - t0, decode_s=t1 - first, prefill_tokens=b * n,
                                        decode_steps=new_tokens - 1, decode_tokens=b * (new_tokens - 1))
