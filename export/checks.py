"""Checks run on every exported graph: onnx.checker (full), strict shape inference, and for TensorRT-bound
graphs the operator list TensorRT's ONNX parser supports (data from onnx-tensorrt) plus our plugin nodes."""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

import onnx

from k2trt.errors import K2Error
from k2trt.graphs import contracts

# Control flow is refused outright: TensorRT wants separate profiles, not If/Loop subgraphs.
FORBIDDEN = {"If", "Loop", "Scan"}
QDQ = {"QuantizeLinear", "DequantizeLinear"}


class GraphCheckError(K2Error):
    pass


@lru_cache(maxsize=1)
def trt_operator_table() -> dict:
    return json.loads(resources.files("k2trt.export").joinpath("data/trt_onnx_operators.json").read_text())


def check_onnx(model: onnx.ModelProto, label: str) -> None:
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # onnx raises several types; all mean the same to the user
        raise GraphCheckError(f"{label}: onnx.checker failed: {str(e).splitlines()[0]}") from None


def check_trt_operators(model: onnx.ModelProto, label: str) -> None:
    table = trt_operator_table()["operators"]
    constants = {i.name for i in model.graph.initializer}
    constants |= {o for n in model.graph.node if n.op_type == "Constant" for o in n.output}
    plugins = {c.op_type for c in contracts.TENSORRT}
    for node in model.graph.node:
        where = f"{label}: node {node.name!r} ({node.domain or 'ai.onnx'}::{node.op_type})"
        if node.domain == contracts.NAMESPACE:
            if node.op_type not in plugins:
                how = contracts.CONTRACTS[node.op_type].tensorrt if node.op_type in contracts.CONTRACTS else ""
                raise GraphCheckError(f"{where} is not one of our plugin nodes" + (f" (it is {how})" if how else ""))
            attrs = {a.name: a for a in node.attribute}
            ns = attrs.get("plugin_namespace")
            if ns is None or ns.s.decode() != contracts.NAMESPACE:
                raise GraphCheckError(f"{where} lacks plugin_namespace={contracts.NAMESPACE!r}")
            continue
        if node.domain not in ("", "ai.onnx"):
            raise GraphCheckError(f"{where}: domain {node.domain!r} is not parsed by TensorRT")
        if node.op_type in FORBIDDEN:
            raise GraphCheckError(f"{where}: control flow is not allowed in TensorRT-bound graphs")
        row = table.get(node.op_type)
        if row is None or not row["supported"]:
            raise GraphCheckError(f"{where} is not in TensorRT's ONNX operator support list")
        if node.op_type in QDQ and (len(node.input) < 2 or node.input[1] not in constants):
            raise GraphCheckError(f"{where}: TensorRT needs its scale to be a build-time constant")
