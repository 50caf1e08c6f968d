"""The pass both TensorRT expansions are (export/split_moe.py, export/split_attention.py): a copy of a recorded graph
in which each custom node a subclass names is replaced by the stage nodes its method records, every other node kept
in order, the stages' new values annotated so shape inference continues past them."""

from __future__ import annotations

import copy
from typing import Callable

import onnx
from onnx import helper

from k2trt.export.onnx_ops import plugin_attributes, value_types
from k2trt.graphs import contracts


class NodeExpansion:
    def __init__(self, model: onnx.ModelProto):
        self.model = copy.deepcopy(model)
        self.types = value_types(self.model)
        self.nodes: list[onnx.NodeProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []

    def expansions(self) -> dict[str, Callable[[onnx.NodeProto], None]]:
        """op_type -> the method recording what replaces such a node."""
        raise NotImplementedError

    def stage(self, contract: contracts.NodeContract, name: str, inputs: list[str], outputs: list, **attrs):
        """One stage node. A new output is (value name, element type, shape), annotated so shape inference
        continues past it; a plain name is a value annotated already (the expanded node's own output)."""
        names = [o if isinstance(o, str) else o[0] for o in outputs]
        self.nodes.append(helper.make_node(contract.op_type, inputs, names, name=name, domain=contracts.NAMESPACE,
                                           **plugin_attributes(), **attrs))
        self.value_info += [helper.make_tensor_value_info(*o) for o in outputs if not isinstance(o, str)]
        return names

    def finish(self, graph: onnx.GraphProto) -> None:
        """After the nodes are replaced (split_moe: stacked expert inputs become their range inputs)."""

    def run(self) -> onnx.ModelProto:
        expand = self.expansions()
        for node in self.model.graph.node:
            if node.domain == contracts.NAMESPACE and node.op_type in expand:
                expand[node.op_type](node)
            else:
                self.nodes.append(node)
        g = self.model.graph
        del g.node[:]
        g.node.extend(self.nodes)
        g.value_info.extend(self.value_info)
        self.finish(g)
        return self.model
