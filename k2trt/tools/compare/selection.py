"""What `k2trt compare` compares: which blocks, and on which prompts."""

from __future__ import annotations

from pathlib import Path

import torch

from k2trt.errors import K2Error

DEFAULT_PROMPTS = ("The quick brown fox jumps over the lazy dog.", "Kimi K2 is a mixture of experts")

Block = tuple[str, int | None]  # (kind, layer); layer None for the embedding and the head


def default_layers(cfg) -> list[Block]:
    """The embedding, the first dense block, the first, a middle and the last MoE block, the head."""
    dense = [i for i in range(cfg.num_hidden_layers) if not cfg.is_moe_layer(i)]
    moe = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
    layers = dense[:1] + sorted({moe[0], moe[len(moe) // 2], moe[-1]} if moe else set())
    return [("embedding", None)] + [(cfg.layer_kind(i), i) for i in layers] + [("head", None)]


def parse_layers(spec: str | None, cfg) -> list[Block]:
    if not spec:
        return default_layers(cfg)
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if item in ("embedding", "head"):
            pair = (item, None)
        elif item.isdigit() and int(item) < cfg.num_hidden_layers:
            pair = (cfg.layer_kind(int(item)), int(item))
        else:
            raise K2Error(f"--layers: {item!r} is not embedding, head or a layer index 0..{cfg.num_hidden_layers - 1}")
        if pair not in out:
            out.append(pair)
    return out


def prompt_ids(model_dir: Path, texts: list[str] | None, cfg) -> list[list[int]]:
    """`texts` (default DEFAULT_PROMPTS) tokenized when the checkpoint has a tokenizer; without one, fixed
    pseudo-random ids of two different lengths (so the batch is still ragged)."""
    from k2trt.runtime.text.tokenizer import RANKS_FILE, KimiTokenizer

    if (Path(model_dir) / RANKS_FILE).exists():
        tok = KimiTokenizer.from_dir(model_dir)
        texts = texts or list(DEFAULT_PROMPTS)
        ids = [tok.encode(t) for t in texts]
        for t, i in zip(texts, ids):
            if not i:
                raise K2Error(f"--prompt {t!r} encodes to no tokens")
        return ids
    if texts:
        raise K2Error(f"--prompt needs a tokenizer, and {model_dir} has none ({RANKS_FILE})")
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in (12, 7)]
