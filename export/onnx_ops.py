"""OnnxOps: the ops vocabulary of graphs/ops.py recorded as ONNX nodes.

Running a block function of graphs/blocks.py with OnnxOps instead of TorchOps yields its graph: the math is
defined once. `Sym` stands for an ONNX value (name, element type, shape with named dynamic dims where known).
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from k2trt.dtypes import dtype as dtype_info
from k2trt.graphs import contracts
from k2trt.graphs.weight_prep import DEQUANT

INT64_MAX = np.iinfo(np.int64).max


def elem(dtype: str) -> int:
    """The ONNX element type of one of our dtype names."""
    return dtype_info(dtype).onnx


def plugin_attributes() -> dict[str, str]:
    """The attributes TensorRT's ONNX parser finds a custom node's plugin by (besides its op_type)."""
    return {"plugin_namespace": contracts.NAMESPACE, "plugin_version": contracts.PLUGIN_VERSION}


PREP_KEY = "k2trt.weight_prep"


def set_weight_prep(model: onnx.ModelProto, prep: dict) -> None:
    """Record in the graph which weight inputs are prepared from which checkpoint tensors (JSON metadata)."""
    for p in list(model.metadata_props):
        if p.key == PREP_KEY:
            model.metadata_props.remove(p)
    helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props}, PREP_KEY: json.dumps(prep)})


def weight_prep(model: onnx.ModelProto) -> dict:
    for p in model.metadata_props:
        if p.key == PREP_KEY:
            return json.loads(p.value)
    return {}


def names_read(nodes) -> set[str]:
    """Every value name the nodes read, their subgraphs' (If branches) included: a branch reads the outer
    graph's values by name."""
    used = set()
    for n in nodes:
        used.update(n.input)
        for a in n.attribute:
            for g in ([a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs)):
                used |= names_read(g.node)
    return used


def value_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto.Tensor]:
    """The tensor type of every graph input, intermediate value and output, after ONNX shape inference."""
    g = onnx.shape_inference.infer_shapes(model).graph
    return {v.name: v.type.tensor_type for v in list(g.input) + list(g.value_info) + list(g.output)}


def dims(t: onnx.TypeProto.Tensor) -> list:
    """A tensor type's shape: named dynamic dims as their names, the others as ints."""
    return [d.dim_param if d.dim_param else d.dim_value for d in t.shape.dim]


class Sym:
    """A value in the graph being recorded. Arithmetic records Add/Sub/Mul/Div nodes."""

    def __init__(self, ops: "OnnxOps", name: str, dtype: str, shape: list | None = None):
        self.ops, self.name, self.dtype, self.shape = ops, name, dtype, shape

    def _bin(self, op, other, reverse=False):
        other = self.ops.const_like(other, self) if not isinstance(other, Sym) else other
        a, b = (other, self) if reverse else (self, other)
        return self.ops.node(op, [a, b], a.dtype)

    def __add__(self, o):
        return self._bin("Add", o)

    def __radd__(self, o):
        return self._bin("Add", o, True)

    def __sub__(self, o):
        return self._bin("Sub", o)

    def __rsub__(self, o):
        return self._bin("Sub", o, True)

    def __mul__(self, o):
        return self._bin("Mul", o)

    def __rmul__(self, o):
        return self._bin("Mul", o, True)

    def __truediv__(self, o):
        return self._bin("Div", o)

    def __neg__(self):
        return self.ops.node("Neg", [self], self.dtype)


class OnnxOps:
    def __init__(self, act_dtype: str = "float32", opset: int = 21, branches: bool = True, large: bool = False):
        self.act_dtype = act_dtype
        self.opset = opset
        self.branches = branches  # choose_by_dim as an If (ONNX Runtime); False: one form only (TensorRT)
        self.large = large  # without branches: the large form (prefill: attention decompressed), else the small
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []
        self._ids = itertools.count()
        self._consts: dict = {}
        self.prep: dict[str, dict] = {}  # prepared weight inputs: name -> {"op", "from": [source inputs]}
        self._prepared: dict[str, Sym] = {}

    # ---- graph plumbing ---------------------------------------------------------------------------
    def _fresh(self, hint: str) -> str:
        return f"{hint}_{next(self._ids)}"

    def _resolve(self, dtype: str) -> str:
        return self.act_dtype if dtype == "act" else dtype

    def input(self, name: str, dtype: str, shape: list) -> Sym:
        dtype = self._resolve(dtype)
        self.inputs.append(helper.make_tensor_value_info(name, elem(dtype), shape))
        return Sym(self, name, dtype, list(shape))

    def output(self, sym: Sym, name: str, shape: list) -> None:
        self.nodes.append(helper.make_node("Identity", [sym.name], [name], name=f"out_{name}"))
        self.outputs.append(helper.make_tensor_value_info(name, elem(sym.dtype), shape))

    def node(self, op: str, ins: list, out_dtype, n_out: int = 1, domain: str = "", **attrs):
        names = [i.name if isinstance(i, Sym) else i for i in ins]
        dtypes = out_dtype if isinstance(out_dtype, (list, tuple)) else [out_dtype] * n_out
        outs = [self._fresh(op.lower()) for _ in range(n_out)]
        self.nodes.append(helper.make_node(op, names, outs, name=self._fresh(op), domain=domain, **attrs))
        syms = [Sym(self, o, d) for o, d in zip(outs, dtypes)]
        return syms[0] if n_out == 1 else syms

    def const(self, value, dtype: str) -> Sym:
        dtype = self._resolve(dtype)
        arr = np.asarray(value, dtype=dtype_info(dtype).numpy or np.float32)  # bf16 goes through float32
        key = (dtype, arr.shape, arr.tobytes())
        if key not in self._consts:
            name = self._fresh("const")
            if dtype == "bfloat16":
                t = helper.make_tensor(name, TensorProto.BFLOAT16, arr.shape, arr.astype(np.float32).ravel().tolist())
            else:
                t = numpy_helper.from_array(arr, name)
            self.initializers.append(t)
            self._consts[key] = Sym(self, name, dtype, list(arr.shape))
        return self._consts[key]

    def const_like(self, value, like: Sym) -> Sym:
        return self.const(value, like.dtype)

    def ints(self, values) -> Sym:
        return self.const(np.asarray(values, dtype=np.int64), "int64")

    def annotate(self, sym: Sym, shape: list) -> Sym:
        """Record the type and shape of a custom node's output, so shape inference continues past it."""
        self.value_info.append(helper.make_tensor_value_info(sym.name, elem(sym.dtype), shape))
        sym.shape = shape
        return sym

    def model(self, name: str, ir_version: int = 10) -> onnx.ModelProto:
        used = names_read(self.nodes)
        inputs = [i for i in self.inputs if i.name in used]  # e.g. an FP8 weight only its prepared form reads
        graph = helper.make_graph(self.nodes, name, inputs, self.outputs, self.initializers,
                                  value_info=self.value_info)
        opsets = [helper.make_opsetid("", self.opset),
                  helper.make_opsetid(contracts.NAMESPACE, contracts.DOMAIN_VERSION)]
        m = helper.make_model(graph, opset_imports=opsets, producer_name="k2trt")
        m.ir_version = ir_version
        set_weight_prep(m, self.prep)
        return m

    # ---- shape --------------------------------------------------------------------------------------
    def reshape(self, x, shape):
        return self.node("Reshape", [x, self.ints(shape)], x.dtype)

    def transpose(self, x, perm):
        return self.node("Transpose", [x], x.dtype, perm=list(perm))

    def unsqueeze(self, x, axis):
        return self.node("Unsqueeze", [x, self.ints([axis])], x.dtype)

    def split(self, x, sizes, axis):
        return self.node("Split", [x, self.ints(list(sizes))], x.dtype, n_out=len(sizes), axis=axis)

    def split_at(self, x, n, axis):
        head = self.node("Slice", [x, self.ints([0]), n, self.ints([axis])], x.dtype)
        tail = self.node("Slice", [x, n, self.ints([INT64_MAX]), self.ints([axis])], x.dtype)
        return head, tail

    def dim(self, x, axis):
        return self.node("Shape", [x], "int64", start=axis, end=axis + 1)

    def concat(self, xs, axis):
        return self.node("Concat", list(xs), xs[0].dtype, axis=axis)

    def at_least(self, a, b):
        return self.node("GreaterOrEqual", [a, b], "bool")

    def choose(self, cond, then, otherwise):
        """An If on cond() (a one-element bool computed from shapes), its branches recorded from then() and
        otherwise() (their nodes read the outer graph's values by name; their constants join the outer graph's
        initializers). Without branches only one is recorded, then() if `large` else otherwise(): TensorRT-bound
        graphs hold no control flow (export/checks.py), so each form is a graph (and an engine) of its own."""
        if not self.branches:
            return then() if self.large else otherwise()
        graphs, result = [], None
        for hint, record in (("then", then), ("else", otherwise)):
            outer, self.nodes = self.nodes, []
            result = record()
            body, self.nodes = self.nodes, outer
            out = self._fresh(f"{hint}_out")
            body.append(helper.make_node("Identity", [result.name], [out], name=self._fresh("Identity")))
            graphs.append(helper.make_graph(body, self._fresh(hint), [],
                                            [helper.make_tensor_value_info(out, elem(result.dtype), None)]))
        flag = self.node("Squeeze", [cond()], "bool")  # If takes a single element; a Shape slice gives [1]
        return self.node("If", [flag], result.dtype, then_branch=graphs[0], else_branch=graphs[1])

    # ---- elementwise / reductions -------------------------------------------------------------------
    def cast(self, x, dtype):
        dtype = self._resolve(dtype)
        if x.dtype == dtype:
            return x
        return self.node("Cast", [x], dtype, to=elem(dtype))

    def rsqrt(self, x):
        return self.node("Reciprocal", [self.node("Sqrt", [x], x.dtype)], x.dtype)

    def sigmoid(self, x):
        return self.node("Sigmoid", [x], x.dtype)

    def silu(self, x):
        return x * self.sigmoid(x)

    def reduce_mean(self, x, axis, keepdims=True):
        return self.node("ReduceMean", [x, self.ints([axis])], x.dtype, keepdims=int(keepdims))

    def reduce_sum(self, x, axis, keepdims=True):
        return self.node("ReduceSum", [x, self.ints([axis])], x.dtype, keepdims=int(keepdims))

    def softmax(self, x, axis):
        return self.node("Softmax", [x], x.dtype, axis=axis)

    def zeros_like(self, x):
        return x * 0.0

    # ---- matmul / gather ----------------------------------------------------------------------------
    def matmul(self, a, b):
        return self.node("MatMul", [a, b], a.dtype)

    def linear(self, x, w):
        return self.matmul(x, self.transpose(w, [1, 0]))

    def gather_rows(self, table, ids):
        return self.node("Gather", [table, ids], table.dtype, axis=0)

    def topk(self, x, k, axis=-1):
        v, i = self.node("TopK", [x, self.ints([k])], [x.dtype, "int64"], n_out=2, axis=axis, largest=1, sorted=1)
        return v, i

    def gather_elements(self, x, idx, axis):
        return self.node("GatherElements", [x, idx], x.dtype, axis=axis)

    def scatter_elements(self, data, idx, updates, axis):
        return self.node("ScatterElements", [data, idx, updates], data.dtype, axis=axis)

    # ---- FP8 --------------------------------------------------------------------------------------
    def dequant_fp8(self, w, scale_inv):
        """The dequantized weight as a graph input of its own, prepared once per layer when weights are bound.
        TensorRT needs DequantizeLinear scales to be build-time constants, and a weightless graph has none:
        so the weight enters already dequantized (as TensorRT-LLM keeps MLA's W_UK/W_UV), and the
        preparation is recorded for the manifest."""
        name = f"{w.name}.{DEQUANT.name}"
        if name not in self._prepared:
            self.prep[name], shape = DEQUANT.record([w.name, scale_inv.name], [w.shape, scale_inv.shape])
            self._prepared[name] = self.input(name, "act", list(shape))
        return self._prepared[name]

    def _custom(self, contract: contracts.NodeContract, ins, out_shape, activation_quant: int):
        y = self.node(contract.op_type, ins, ins[0].dtype, domain=contracts.NAMESPACE, **plugin_attributes(),
                      activation_quant=int(activation_quant))
        return self.annotate(y, out_shape)

    def fp8_linear(self, x, w, scale_inv, activation_quant):
        return self._custom(contracts.FP8_BLOCK_LINEAR, [x, w, scale_inv], ["B", "T", w.shape[0]], activation_quant)

    def moe_fp8(self, x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s, activation_quant):
        ins = [x, topk_ids, topk_weights, gate_w, gate_s, up_w, up_s, down_w, down_s]
        return self._custom(contracts.MOE_FP8, ins, ["B", "T", down_w.shape[1]], activation_quant)

    def moe_combine(self, pair_out, topk_weights):
        """MoeCombine recorded as it is: a TensorRT plugin already (the ONNX Runtime form lowers it)."""
        y = self.node(contracts.MOE_COMBINE.op_type, [pair_out, topk_weights], pair_out.dtype,
                      domain=contracts.NAMESPACE, **plugin_attributes())
        return self.annotate(y, ["B", "T", pair_out.shape[-1]])

    def moe_int4(self, x, topk_ids, topk_weights, gate_p, gate_s, up_p, up_s, down_p, down_s, group_size):
        ins = [x, topk_ids, topk_weights, gate_p, gate_s, up_p, up_s, down_p, down_s]
        y = self.node(contracts.MOE_INT4.op_type, ins, x.dtype, domain=contracts.NAMESPACE, **plugin_attributes(),
                      group_size=int(group_size))
        return self.annotate(y, ["B", "T", down_p.shape[1]])

    def mla_paged_decode(self, q_full, kv_pool, page_table, ctx_lens, latent_new, n_new, softmax_scale: float,
                         page_tokens: int, latent_dim: int, heads: int):
        """MlaPagedDecode recorded as it is (the ONNX Runtime form lowers it, TensorRT will expand it)."""
        ins = [q_full, kv_pool, page_table, ctx_lens, latent_new, n_new]
        y = self.node(contracts.MLA_PAGED_DECODE.op_type, ins, q_full.dtype, domain=contracts.NAMESPACE,
                      **plugin_attributes(), softmax_scale=float(softmax_scale), page_tokens=int(page_tokens),
                      latent_dim=int(latent_dim))
        return self.annotate(y, ["B", "T", int(heads), int(latent_dim)])

    def mla_paged_prefill(self, q, kv_pool, page_table, ctx_lens, latent_new, n_new, kv_b, softmax_scale: float,
                          page_tokens: int, latent_dim: int, heads: int, nope_dim: int, rope_dim: int,
                          v_head_dim: int):
        """MlaPagedPrefill recorded as it is (the ONNX Runtime form lowers it)."""
        ins = [q, kv_pool, page_table, ctx_lens, latent_new, n_new, kv_b]
        y = self.node(contracts.MLA_PAGED_PREFILL.op_type, ins, q.dtype, domain=contracts.NAMESPACE,
                      **plugin_attributes(), softmax_scale=float(softmax_scale), page_tokens=int(page_tokens),
                      latent_dim=int(latent_dim), heads=int(heads), nope_dim=int(nope_dim),
                      rope_dim=int(rope_dim), v_head_dim=int(v_head_dim))
        return self.annotate(y, ["B", "T", int(heads), int(v_head_dim)])
