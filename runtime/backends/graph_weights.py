"""One layer's weight inputs for a graph of the export manifest, made from a weight source's tensors.

The manifest entry lists the graph's weight inputs and, for those that are prepared, the preparation and its
sources (graphs/weight_prep.py); every other weight input is the checkpoint tensor itself in its graph dtype
(graphs/weights.as_graph_input)."""

from __future__ import annotations

import torch

from k2trt.errors import K2Error
from k2trt.export_manifest import parse_expert_range
from k2trt.graphs.weight_prep import preparation
from k2trt.graphs.weights import as_graph_input


def _source_of(name: str) -> str:
    ranged = parse_expert_range(name)
    return name if ranged is None else ranged[0]


def source_names(entry: dict) -> list[str]:
    """The weight-source tensors a graph's weight inputs are made from."""
    names = []
    for name in entry["weights"]:
        for s in entry["prep"].get(name, {"from": [_source_of(name)]})["from"]:
            if s not in names:
                names.append(s)
    return names


def graph_weights(entry: dict, source: dict, dtype: torch.dtype, device=None) -> dict[str, torch.Tensor]:
    """The weight inputs of `entry`'s graph for one layer. Sources move to `device` first, so preparation
    (dequantizing, transposing, interleaving) runs there."""
    move = (lambda t: t) if device is None else (lambda t: t.to(device))  # noqa: E731

    def get(name: str) -> torch.Tensor:
        if name not in source:
            raise K2Error(f"weight {name!r} is missing from the weights of {entry['kind']}")
        return move(source[name])

    out, stacked = {}, {}
    for name in entry["weights"]:
        p = entry["prep"].get(name)
        ranged = parse_expert_range(name)
        if p is not None:
            out[name] = preparation(p["op"]).apply([get(s) for s in p["from"]], dtype)
        elif ranged is not None:  # experts [first, stop) of a stacked tensor: a view of it, uploaded once
            whole, first, stop = ranged
            if whole not in stacked:
                stacked[whole] = as_graph_input(get(whole), dtype)
            out[name] = stacked[whole][first:stop]
        else:
            out[name] = as_graph_input(get(name), dtype)
    return out
