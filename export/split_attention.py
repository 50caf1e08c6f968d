"""The TensorRT-bound form of the paged attention nodes: each expanded into its two kernels (as split_moe.py
expands the routed experts), since an AOT plugin is exactly one kernel.

  MlaPagedDecode(q_full, pool, table, lens, new, n_new)      -> MlaDecodeSplit(q_full, pool, 1, table, lens, new,
                                                                               n_new) -> part_acc, part_ml
                                                               MlaDecodeMerge(part_acc, part_ml) -> o_lat
  MlaPagedPrefill(q, pool, table, lens, new, n_new, kv_b)    -> MlaDecompress(pool, 1, table, lens, n_new, new,
                                                                              kv_b) -> kv
                                                               MlaAttend(q, pool, 1, table, lens, n_new, new, kv)
                                                                 -> o

(graphs/contracts.MLA_STAGES.) The "1" is kv_scale, a one-element float32 constant: the graphs' pools hold the
activation dtype. The intermediates are graph tensors sized from the shapes alone: the decode's partials
[B, T, H, S, L] with S from B, T and the page table's width (runtime/tensorrt/plugins.decode_splits), the
prefill's decompressed rows [B, max_pages · page_tokens + T, H · (nope + v)] — TensorRT plans them as activation
memory, so the prefill engine's profile bounds max_pages.

The pool is an input the plugins only read: enqueue gets its inputs `const` (NvInferRuntime.h, IPluginV3OneRuntime
::enqueue, `void const* const* inputs`), so the step's rows stay latent_new, an output, and the runtime writes
them into the pool after the block — no output aliases the pool.
"""

from __future__ import annotations

import onnx
from onnx import helper

from k2trt.export.node_expansion import NodeExpansion
from k2trt.export.onnx_ops import dims
from k2trt.graphs import contracts

SPLITS_DIM = "S"  # the decode's context splits, as the value annotations name it


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute
            if a.name not in ("plugin_namespace", "plugin_version")}


class _Split(NodeExpansion):
    def kv_scale(self, p: str) -> str:
        name = p + "kv_scale"
        self.nodes.append(helper.make_node("Constant", [], [name], name=name, value=helper.make_tensor(
            name, onnx.TensorProto.FLOAT, [1], [1.0])))
        return name

    def decode(self, node: onnx.NodeProto) -> None:
        q_full, pool, table, lens, new, n_new = node.input
        a = _attrs(node)
        b, t, heads, latent = dims(self.types[node.output[0]])
        if not isinstance(heads, int):
            raise ValueError(f"{node.name}: MlaPagedDecode needs a static head count, got {heads}")
        p = f"{node.name}/"
        f32 = onnx.TensorProto.FLOAT
        part_acc, part_ml = self.stage(
            contracts.MLA_DECODE_SPLIT, p + "split", [q_full, pool, self.kv_scale(p), table, lens, new, n_new],
            [(p + "part_acc", f32, [b, t, heads, SPLITS_DIM, latent]),
             (p + "part_ml", f32, [b, t, heads, SPLITS_DIM, 2])], heads=heads, **a)
        self.stage(contracts.MLA_DECODE_MERGE, p + "merge", [part_acc, part_ml], list(node.output),
                   out_dtype=self.types[q_full].elem_type)

    def prefill(self, node: onnx.NodeProto) -> None:
        q, pool, table, lens, new, n_new, kv_b = node.input
        a = _attrs(node)
        b, t = dims(self.types[new])[:2]
        pages = dims(self.types[table])[1]
        p = f"{node.name}/"
        scale = self.kv_scale(p)
        columns = a["heads"] * (a["nope_dim"] + a["v_head_dim"])
        stage_a = {k: v for k, v in a.items() if k != "softmax_scale"}
        (kv,) = self.stage(contracts.MLA_DECOMPRESS, p + "decompress", [pool, scale, table, lens, n_new, new, kv_b],
                           [(p + "kv", self.types[q].elem_type, [b, f"{pages}*{a['page_tokens']}+{t}", columns])],
                           **stage_a)
        self.stage(contracts.MLA_ATTEND, p + "attend", [q, pool, scale, table, lens, n_new, new, kv],
                   list(node.output), **a)

    def expansions(self):
        return {contracts.MLA_PAGED_DECODE.op_type: self.decode, contracts.MLA_PAGED_PREFILL.op_type: self.prefill}


def split_attention(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every MlaPagedDecode node replaced by MlaDecodeSplit and MlaDecodeMerge, and every
    MlaPagedPrefill node by MlaDecompress and MlaAttend."""
    return _Split(model).run()
