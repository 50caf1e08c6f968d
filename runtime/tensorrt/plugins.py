"""TensorRT plugins for the nodes of the TensorRT-bound graphs (graphs/contracts.TENSORRT), via `tensorrt.plugin`
(quickly deployable Python plugins): Fp8BlockLinear, the four MoE stages and the two INT4 MoE GEMMs. Each is one
kernel, so each has

  * a JIT implementation (`impl`: Python at every enqueue, the Triton kernels of runtime/kernels launched from
    torch on TensorRT's stream) — for debugging, and for TensorRT 10.6–10.8;
  * an AOT implementation (`aot_impl`: the same kernel compiled to PTX at build time and embedded in the engine,
    runtime/aot/) — the engine then runs without Python (trtexec, C++, Triton Inference Server).

Which one a node uses is decided by the node's `aot` attribute, which `k2trt build` writes on every node
(runtime/engines/builder.with_aot_attribute): with both implementations registered and neither the attribute nor a
PREFER_*_PYTHON_PLUGINS network flag, TensorRT's plugin creator refuses the node (tensorrt/plugin/_lib.py,
_TemplatePluginCreator.create_plugin; the parser reads `aot` in onnx-tensorrt importerUtils.cpp createPlugin).

Attributes are declared as 1-element NumPy arrays, not `int`: the ONNX parser hands an INT attribute over as a
kINT32 field of length 1 (onnx-tensorrt loadFields), and the creator converts a field with `annotation(f.data)` for
built-in annotations — `int(array([1]))`, a TypeError since NumPy 2.4 — but with `f.data.astype(dtype)` for
`numpy.typing.NDArray[dtype]` ones (_lib.py create_plugin). The same path runs when an engine with JIT plugins is
deserialized (fields serialized by _plugin_class.get_fields_to_serialize). `attribute(value)` reads element 0.

The plugin descriptions (names, ports, attributes, tactics) are plain data derived from the contracts and tested
without TensorRT (tests/test_trt_glue.py, against a stand-in that follows TensorRT's source).
"""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from k2trt.dtypes import BY_ONNX, BY_TRT
from k2trt.dtypes import dtype as dtype_info
from k2trt.graphs import contracts
from k2trt.graphs.contracts import NodeContract

# Node attributes TensorRT's ONNX parser consumes itself; they are not plugin fields.
PARSER_ATTRIBUTES = ("plugin_namespace", "plugin_version", "aot")
# tensorrt.plugin registers every plugin as version "1"; the exported nodes must say the same.
QDP_PLUGIN_VERSION = "1"
# How a contract attribute type is annotated for tensorrt.plugin (see the module docstring).
ATTRIBUTE_ANNOTATIONS = {"int": npt.NDArray[np.int32], "float": npt.NDArray[np.float32], "str": str}
# TensorRT versions: tensorrt.plugin appeared in 10.6, aot_impl (and the parser's `aot` attribute) in 10.9
# (TensorRT CHANGELOG.md; python/packaging/bindings_wheel/tensorrt/plugin history).
AOT_PLUGINS_SINCE = "10.9"


@dataclass(frozen=True)
class PluginSpec:
    contract: NodeContract
    tactics: tuple[int, ...]  # custom tactics TensorRT times, for JIT and AOT alike (empty: one default)

    @property
    def op_type(self) -> str:
        return self.contract.op_type

    @property
    def namespace(self) -> str:
        return contracts.NAMESPACE

    @property
    def version(self) -> str:
        return contracts.PLUGIN_VERSION

    @property
    def plugin_id(self) -> str:
        return self.contract.plugin_id

    @property
    def input_names(self) -> list[str]:
        return [p.name for p in self.contract.inputs]

    @property
    def output_names(self) -> list[str]:
        return [p.name for p in self.contract.outputs]

    @property
    def attribute_names(self) -> list[str]:
        return self.contract.attribute_names()

    def layouts(self) -> str:
        return ",".join(["LINEAR"] * (len(self.contract.inputs) + len(self.contract.outputs)))


def plugin_specs() -> dict[str, PluginSpec]:
    """op_type -> PluginSpec, for every node of the TensorRT-bound graphs (tactics: runtime/aot/nodes.py)."""
    from k2trt.runtime.aot.nodes import AOT_NODES

    return {c.op_type: PluginSpec(c, AOT_NODES[c.op_type].tactics) for c in contracts.TENSORRT}


# ---- attributes, types, shapes ---------------------------------------------------------------------------

def attribute(value) -> int | float | str:
    """A plugin attribute as TensorRT hands it over (a 1-element array for int and float) -> the Python value.
    A STRING attribute arrives with its NUL terminator: the parser copies it as a C string (onnx-tensorrt
    onnxOpImporters.cpp copyField(std::string): `push_back('\\0')`, length included) and the creator decodes every
    byte (_lib.py create_plugin: `f.data.tobytes().decode("utf-8")`)."""
    if isinstance(value, str):
        return value[:-1] if value.endswith("\0") else value
    flat = np.asarray(value).reshape(-1)
    if flat.size != 1:
        raise ValueError(f"expected a single-value plugin attribute, got {flat.size} values")
    return flat[0].item()


def our_dtype(trt_dtype) -> str:
    """Our dtype name of a trt.DataType."""
    return BY_TRT[trt_dtype.name].name


def trt_type_name(dtype: str) -> str:
    """The name tensorrt.plugin's type strings use for our dtype (trt.DataType's member name, which
    tensorrt/plugin/_utils._str_to_data_type resolves with getattr)."""
    name = dtype_info(dtype).trt
    if name is None:
        raise ValueError(f"TensorRT has no data type for {dtype}")
    return name


def io_dtypes(op_type: str, act: str | None, activation_quant: int) -> list[str]:
    """Every input's then every output's dtype for a graph computing in `act` with the given FP8 mode."""
    c = contracts.CONTRACTS[op_type]
    return [p.dtype_for(act, activation_quant) for p in c.inputs + c.outputs]


def _activation_of(op_type: str, dtypes: list[str], attrs: dict) -> str | None:
    """The activation dtype a node computes in: its first activation input's (MoeDown, MlaDecodeMerge: their
    out_dtype attribute); None for a node with no activations (MoeAlign)."""
    if op_type in ("MoeDown", "MlaDecodeMerge"):
        return BY_ONNX[int(attrs["out_dtype"])].name
    c = contracts.CONTRACTS[op_type]
    return next((dt for port, dt in zip(c.inputs, dtypes) if port.dtypes == contracts.ACTIVATION_DTYPES), None)


def check_input_dtypes(op_type: str, dtypes: list[str], attrs: dict) -> str | None:
    """Refuse inputs whose dtypes the contract does not allow; -> the activation dtype (None: the node has none)."""
    c = contracts.CONTRACTS[op_type]
    act = _activation_of(op_type, dtypes, attrs)
    if act is not None and act not in contracts.ACTIVATION_DTYPES:
        raise ValueError(f"{c.plugin_id}: activation dtype {act} is not one of {contracts.ACTIVATION_DTYPES}")
    aq = int(attrs.get("activation_quant", contracts.W8A8))
    want = io_dtypes(op_type, act, aq)[:len(c.inputs)]
    for port, got, expected in zip(c.inputs, dtypes, want):
        if got != expected:
            raise ValueError(f"{c.plugin_id}: input {port.name} is {got}, expected {expected}")
    return act


def output_shapes(op_type: str, shapes: list, attrs: dict) -> list[list]:
    """Each output's shape from the input shapes (ints or TensorRT shape expressions: only + * // are used)."""
    s = dict(zip([p.name for p in contracts.CONTRACTS[op_type].inputs], shapes))
    if op_type == "Fp8BlockLinear":
        return [[*s["x"][:-1], s["weight"][0]]]
    if op_type == "MoeAlign":
        return [[_product(s["topk_ids"])], [int(attrs["num_experts"]) + 1]]
    if op_type == "MoeGateUp":
        n, inter = s["sorted_pairs"][0], s["gate_weight"][1]
        return [[n, inter], [n, (inter + 127) // 128]]
    if op_type == "MoeDown":
        return [[s["h"][0], s["down_weight"][1]]]
    if op_type == "MoeCombine":
        return [[*s["topk_weights"][:-1], s["pair_out"][1]]]
    if op_type == "MoeGateUpInt4":
        return [[s["sorted_pairs"][0], s["gate_weight_packed"][1]]]
    if op_type == "MoeDownInt4":
        return [[s["h"][0], s["down_weight_packed"][1]]]
    if op_type == "MlaDecodeSplit":
        b, t, heads, _ = s["q_full"]
        splits = decode_splits(b, t, heads, s["page_table"][1], int(attrs["page_tokens"]))
        return [[b, t, heads, splits, int(attrs["latent_dim"])], [b, t, heads, splits, 2]]
    if op_type == "MlaDecodeMerge":
        return [list(s["part_acc"][:3]) + [s["part_acc"][4]]]
    if op_type == "MlaDecompress":
        b, t = s["latent_new"][:2]
        columns = int(attrs["heads"]) * (int(attrs["nope_dim"]) + int(attrs["v_head_dim"]))
        return [[b, s["page_table"][1] * int(attrs["page_tokens"]) + t, columns]]
    if op_type == "MlaAttend":
        return [[*s["q"][:3], int(attrs["v_head_dim"])]]
    raise KeyError(op_type)


# The decode's context splits (flash-decoding) as a function of the shapes, as TensorRT needs an output's size:
# mla_decode.num_splits' rule — the grid about twice an H100's SMs, no split shorter than SPLIT_POSITIONS, at most
# MAX_SPLITS — with the row blocks counted at the AOT tiles' height (16 rows; the kernel takes any count at run
# time, so this only sizes the work). Ints give ints (the cases, the tests); shape expressions give expressions.
SPLIT_ROWS = 16
SPLIT_POSITIONS = 16


def decode_splits(batch, n_q, heads: int, max_pages, page_tokens: int):
    from k2trt.runtime.kernels.mla_decode import MAX_SPLITS, SM_COUNT_SM90

    if all(isinstance(v, int) for v in (batch, n_q, max_pages)):
        cdiv, minimum, maximum = (lambda a, b: -(-a // b)), min, max
    else:
        import tensorrt.plugin as trtp

        cdiv, minimum, maximum = trtp.cdiv, trtp.min, trtp.max
    programs = batch * cdiv(n_q * heads, SPLIT_ROWS)
    fill = cdiv(2 * SM_COUNT_SM90, programs)
    longest = cdiv(max_pages * page_tokens, SPLIT_POSITIONS)
    return maximum(minimum(minimum(fill, longest), MAX_SPLITS), 1)


def _product(dims):
    out = dims[0]
    for d in dims[1:]:
        out = out * d
    return out


# ---- torch views of TensorRT's buffers (JIT) -----------------------------------------------------------------

def interface_typestr(dtype: str) -> str:
    """The __cuda_array_interface__ typestr a buffer of `dtype` travels as. TensorRT's own interface raises for
    BF16 and FP8 (tensorrt/plugin/_tensor.py Tensor.__cuda_array_interface__), and NumPy has neither: those travel
    as the unsigned integer of the same size and are re-viewed."""
    d = dtype_info(dtype)
    return np.dtype(d.numpy).str if d.numpy is not None else np.dtype(f"u{d.itemsize}").str


def cuda_array_interface(ptr: int, shape, strides, dtype: str) -> dict:
    """A __cuda_array_interface__ (v3) for a TensorRT buffer, with an item-size-equivalent typestr.
    strides are in elements (as tensorrt.plugin gives them); None means contiguous."""
    typestr, itemsize = interface_typestr(dtype), dtype_info(dtype).itemsize
    return {"shape": tuple(int(s) for s in shape), "typestr": typestr, "data": (int(ptr), False), "version": 3,
            "strides": None if strides is None else tuple(int(s) * itemsize for s in strides)}


class _CudaBuffer:
    def __init__(self, iface: dict):
        self.__cuda_array_interface__ = iface


def as_torch(t):
    """A tensorrt.plugin Tensor as a torch CUDA tensor sharing its memory, in the matching torch dtype."""
    import torch

    dtype = our_dtype(t.dtype)
    strides = getattr(t, "strides", None)
    view = torch.as_tensor(_CudaBuffer(cuda_array_interface(t.data_ptr, tuple(t.shape), strides, dtype)),
                           device="cuda")
    return view.view(dtype_info(dtype).torch)


@contextlib.contextmanager
def _on_stream(stream: int):
    import torch

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        yield


# ---- the plugin functions (annotated and registered by register_plugins) -----------------------------------
# Parameter names are the contract's port and attribute names: TensorRT matches them to the node. impl and
# aot_impl take every attribute, in register order: _TemplateAOTPlugin.get_launch_params passes all of them.

def _descs(op_type: str, inputs, attrs: dict):
    """register: check the input dtypes, then one TensorDesc per output."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    act = check_input_dtypes(op_type, [our_dtype(t.dtype) for t in inputs], attrs)
    aq = int(attrs.get("activation_quant", contracts.W8A8))
    out_types = io_dtypes(op_type, act, aq)[len(inputs):]
    shapes = output_shapes(op_type, [t.shape_expr for t in inputs], attrs)
    descs = tuple(trtp.from_shape_expr(tuple(shape), dtype=getattr(trt.DataType, trt_type_name(dt)))
                  for shape, dt in zip(shapes, out_types))
    return descs[0] if len(descs) == 1 else descs


def _combination(op_type: str, inputs, outputs):
    """autotune: the one type combination the (strongly typed) network has, LINEAR layouts, the op's tactics."""
    import tensorrt.plugin as trtp

    spec = plugin_specs()[op_type]
    types = ",".join(t.dtype.name for t in list(inputs) + list(outputs))
    return [trtp.AutoTuneCombination(types, spec.layouts(), list(spec.tactics) or None)]


def _aot_launch(launch, grid, extra):
    """aot_impl's return value: the launch compiled for this build's target (shrunk to fit, if need be), its launch
    grid — grid(launch as compiled) -> (grid_x[, grid_y[, grid_z]]) — and the extra int32 scalars."""
    import tensorrt.plugin as trtp

    from k2trt.runtime.aot import ptx as aot

    launch, kernel = aot.compile_launch(launch)
    params = trtp.KernelLaunchParams()
    xyz = grid(launch)  # (x, y) or (x, y, z); a launch's grid is 1-, 2- or 3-D
    params.grid_x, params.grid_y = xyz[0], xyz[1] if len(xyz) > 1 else 1
    if len(xyz) > 2:
        params.grid_z = xyz[2]
    params.block_x = kernel.block_x
    params.shared_mem = kernel.shared
    args = trtp.SymIntExprs(len(extra))
    for i, e in enumerate(extra):
        args[i] = trtp.SymInt32(e)
    return kernel.name, kernel.ptx, params, args


def _moe_aot(launch, num_pairs, num_tokens):
    import tensorrt.plugin as trtp

    return _aot_launch(launch, lambda p: p.grid(num_pairs, num_tokens, minimum=trtp.min),
                       launch.extra_args(num_pairs, num_tokens))


def _constant(expr, what: str) -> int:
    if expr.is_fake or not expr.is_constant:
        raise ValueError(f"AOT needs a static {what} (weights have static shapes)")
    return int(expr.constant_value())


def _node_launch(op_type: str, descs: dict, attrs: dict, act: str | None, tactic):
    """The launch runtime/aot/nodes.py's row makes for this node: static sizes read from its input
    descriptors' constant dims and its attributes."""
    from k2trt.runtime.aot.nodes import AOT_NODES

    def dim(name, axis):
        d = descs[name]
        return _constant(d.shape_expr[axis if axis >= 0 else d.ndim + axis], f"{name} dim {axis}")

    row = AOT_NODES[op_type]
    aq = int(attribute(attrs["activation_quant"])) if "activation_quant" in attrs else contracts.W8A8
    return row.launch(act, aq, int(tactic), row.sizes_of(dim, lambda a: attribute(attrs[a])))


def _rows(desc):
    """B·T of a [B, T, ...] tensor as a shape expression."""
    return _product([desc.shape_expr[i] for i in range(desc.ndim - 1)])


# Fp8BlockLinear
def fp8_block_linear_desc(x, weight, weight_scale_inv, activation_quant):
    return _descs("Fp8BlockLinear", (x, weight, weight_scale_inv), {"activation_quant": attribute(activation_quant)})


def fp8_block_linear_autotune(x, weight, weight_scale_inv, outputs):
    return _combination("Fp8BlockLinear", (x, weight, weight_scale_inv), outputs)


def fp8_block_linear_impl(x, weight, weight_scale_inv, activation_quant, outputs, stream, tactic):
    from k2trt.runtime.kernels.fp8_linear import fp8_block_linear, tactic_config

    n, k = weight.shape[0], weight.shape[1]
    aq = attribute(activation_quant)
    with _on_stream(stream):
        xt = as_torch(x)
        fp8_block_linear(xt, as_torch(weight), as_torch(weight_scale_inv), aq, out=as_torch(outputs[0]),
                         config=tactic_config(int(tactic), n, k, xt.dtype, aq))


def fp8_block_linear_aot_impl(x, weight, weight_scale_inv, activation_quant, outputs, tactic):
    launch = _node_launch("Fp8BlockLinear", {"weight": weight}, {"activation_quant": activation_quant},
                          our_dtype(x.dtype), tactic)
    rows = _rows(x)
    return _aot_launch(launch, lambda p: (p.grid_x(rows), 1), (rows,))  # extra: the kernel's M


# MoeAlign
def moe_align_desc(topk_ids, num_experts):
    return _descs("MoeAlign", (topk_ids,), {"num_experts": attribute(num_experts)})


def moe_align_autotune(topk_ids, outputs):
    return _combination("MoeAlign", (topk_ids,), outputs)


def moe_align_impl(topk_ids, num_experts, outputs, stream):
    from k2trt.runtime.kernels.moe import moe_align

    with _on_stream(stream):
        moe_align(as_torch(topk_ids), attribute(num_experts), as_torch(outputs[0]), as_torch(outputs[1]))


def moe_align_aot_impl(topk_ids, num_experts, outputs, tactic):
    pairs = _product(list(topk_ids.shape_expr))
    return _moe_aot(_node_launch("MoeAlign", {}, {"num_experts": num_experts}, None, tactic), pairs, None)


# MoeGateUp
def moe_gate_up_desc(x, sorted_pairs, expert_offsets, gate_weight, gate_scale_inv, up_weight, up_scale_inv,
                     activation_quant):
    return _descs("MoeGateUp", (x, sorted_pairs, expert_offsets, gate_weight, gate_scale_inv, up_weight,
                                up_scale_inv), {"activation_quant": attribute(activation_quant)})


def moe_gate_up_autotune(x, sorted_pairs, expert_offsets, gate_weight, gate_scale_inv, up_weight, up_scale_inv,
                         outputs):
    return _combination("MoeGateUp", (x, sorted_pairs, expert_offsets, gate_weight, gate_scale_inv, up_weight,
                                      up_scale_inv), outputs)


def moe_gate_up_impl(x, sorted_pairs, expert_offsets, gate_weight, gate_scale_inv, up_weight, up_scale_inv,
                     activation_quant, outputs, stream, tactic):
    from k2trt.runtime.kernels.moe import moe_gate_up

    with _on_stream(stream):
        xt = as_torch(x)
        moe_gate_up(xt.reshape(-1, xt.shape[-1]), as_torch(sorted_pairs), as_torch(expert_offsets),
                    as_torch(gate_weight), as_torch(gate_scale_inv), as_torch(up_weight), as_torch(up_scale_inv),
                    attribute(activation_quant), int(tactic), as_torch(outputs[0]), as_torch(outputs[1]))


def moe_gate_up_aot_impl(x, sorted_pairs, expert_offsets, gate_weight, gate_scale_inv, up_weight, up_scale_inv,
                         activation_quant, outputs, tactic):
    launch = _node_launch("MoeGateUp", {"gate_weight": gate_weight}, {"activation_quant": activation_quant},
                          our_dtype(x.dtype), tactic)
    return _moe_aot(launch, sorted_pairs.shape_expr[0], _rows(x))


# MoeDown
def moe_down_desc(h, h_scale, sorted_pairs, expert_offsets, down_weight, down_scale_inv, activation_quant,
                  out_dtype):
    return _descs("MoeDown", (h, h_scale, sorted_pairs, expert_offsets, down_weight, down_scale_inv),
                  {"activation_quant": attribute(activation_quant), "out_dtype": attribute(out_dtype)})


def moe_down_autotune(h, h_scale, sorted_pairs, expert_offsets, down_weight, down_scale_inv, outputs):
    return _combination("MoeDown", (h, h_scale, sorted_pairs, expert_offsets, down_weight, down_scale_inv), outputs)


def moe_down_impl(h, h_scale, sorted_pairs, expert_offsets, down_weight, down_scale_inv, activation_quant,
                  out_dtype, outputs, stream, tactic):
    from k2trt.runtime.kernels.moe import moe_down

    with _on_stream(stream):
        out = as_torch(outputs[0])
        moe_down(as_torch(h), as_torch(h_scale), as_torch(sorted_pairs), as_torch(expert_offsets),
                 as_torch(down_weight), as_torch(down_scale_inv), attribute(activation_quant), out.dtype,
                 int(tactic), out)


def moe_down_aot_impl(h, h_scale, sorted_pairs, expert_offsets, down_weight, down_scale_inv, activation_quant,
                      out_dtype, outputs, tactic):
    act = BY_ONNX[int(attribute(out_dtype))].name
    launch = _node_launch("MoeDown", {"down_weight": down_weight}, {"activation_quant": activation_quant}, act, tactic)
    return _moe_aot(launch, h.shape_expr[0], None)


# MoeCombine
def moe_combine_desc(pair_out, topk_weights):
    return _descs("MoeCombine", (pair_out, topk_weights), {})


def moe_combine_autotune(pair_out, topk_weights, outputs):
    return _combination("MoeCombine", (pair_out, topk_weights), outputs)


def moe_combine_impl(pair_out, topk_weights, outputs, stream):
    from k2trt.runtime.kernels.moe import moe_combine

    with _on_stream(stream):
        y = as_torch(outputs[0])
        moe_combine(as_torch(pair_out), as_torch(topk_weights), out=y.view(-1, y.shape[-1]))


def moe_combine_aot_impl(pair_out, topk_weights, outputs, tactic):
    launch = _node_launch("MoeCombine", {"pair_out": pair_out, "topk_weights": topk_weights}, {},
                          our_dtype(pair_out.dtype), tactic)
    return _moe_aot(launch, None, _rows(topk_weights))


# MoeGateUpInt4 (W4A16: no activation quantization, so no h_scale)
def moe_gate_up_int4_desc(x, sorted_pairs, expert_offsets, gate_weight_packed, gate_weight_scale, up_weight_packed,
                          up_weight_scale, group_size):
    return _descs("MoeGateUpInt4", (x, sorted_pairs, expert_offsets, gate_weight_packed, gate_weight_scale,
                                    up_weight_packed, up_weight_scale), {"group_size": attribute(group_size)})


def moe_gate_up_int4_autotune(x, sorted_pairs, expert_offsets, gate_weight_packed, gate_weight_scale,
                              up_weight_packed, up_weight_scale, outputs):
    return _combination("MoeGateUpInt4", (x, sorted_pairs, expert_offsets, gate_weight_packed, gate_weight_scale,
                                          up_weight_packed, up_weight_scale), outputs)


def moe_gate_up_int4_impl(x, sorted_pairs, expert_offsets, gate_weight_packed, gate_weight_scale, up_weight_packed,
                          up_weight_scale, group_size, outputs, stream, tactic):
    from k2trt.runtime.kernels.moe_int4 import moe_gate_up_int4

    with _on_stream(stream):
        xt = as_torch(x)
        moe_gate_up_int4(xt.reshape(-1, xt.shape[-1]), as_torch(sorted_pairs), as_torch(expert_offsets),
                         as_torch(gate_weight_packed), as_torch(gate_weight_scale), as_torch(up_weight_packed),
                         as_torch(up_weight_scale), attribute(group_size), int(tactic), as_torch(outputs[0]))


def moe_gate_up_int4_aot_impl(x, sorted_pairs, expert_offsets, gate_weight_packed, gate_weight_scale,
                              up_weight_packed, up_weight_scale, group_size, outputs, tactic):
    launch = _node_launch("MoeGateUpInt4", {"gate_weight_packed": gate_weight_packed}, {"group_size": group_size},
                          our_dtype(x.dtype), tactic)
    return _moe_aot(launch, sorted_pairs.shape_expr[0], _rows(x))


# MoeDownInt4
def moe_down_int4_desc(h, sorted_pairs, expert_offsets, down_weight_packed, down_weight_scale, group_size):
    return _descs("MoeDownInt4", (h, sorted_pairs, expert_offsets, down_weight_packed, down_weight_scale),
                  {"group_size": attribute(group_size)})


def moe_down_int4_autotune(h, sorted_pairs, expert_offsets, down_weight_packed, down_weight_scale, outputs):
    return _combination("MoeDownInt4", (h, sorted_pairs, expert_offsets, down_weight_packed, down_weight_scale),
                        outputs)


def moe_down_int4_impl(h, sorted_pairs, expert_offsets, down_weight_packed, down_weight_scale, group_size, outputs,
                       stream, tactic):
    from k2trt.runtime.kernels.moe_int4 import moe_down_int4

    with _on_stream(stream):
        moe_down_int4(as_torch(h), as_torch(sorted_pairs), as_torch(expert_offsets), as_torch(down_weight_packed),
                      as_torch(down_weight_scale), attribute(group_size), int(tactic), as_torch(outputs[0]))


def moe_down_int4_aot_impl(h, sorted_pairs, expert_offsets, down_weight_packed, down_weight_scale, group_size,
                           outputs, tactic):
    launch = _node_launch("MoeDownInt4", {"down_weight_packed": down_weight_packed}, {"group_size": group_size},
                          our_dtype(h.dtype), tactic)
    return _moe_aot(launch, h.shape_expr[0], None)


# The paged attention's four stages (kv_scale: the pool's one-element float32 scale, an input like the others).
_MLA_POOL = "kv_pool, kv_scale, page_table, ctx_lens"


def _mla_aot(op_type: str, descs: dict, attrs: dict, act: str, tactic, grid, extra):
    """aot_impl of an MLA stage: grid(launch) and extra(launch) on the launch as compiled."""
    launch = _node_launch(op_type, descs, attrs, act, tactic)
    return _aot_launch(launch, grid, extra(launch))


def _pool_pages(kv_pool, page_tokens):
    return kv_pool.shape_expr[0] // int(attribute(page_tokens))


# MlaDecodeSplit
def mla_decode_split_desc(q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new, softmax_scale,
                          page_tokens, latent_dim, heads):
    return _descs("MlaDecodeSplit", (q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new),
                  {"page_tokens": attribute(page_tokens), "latent_dim": attribute(latent_dim)})


def mla_decode_split_autotune(q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new, outputs):
    return _combination("MlaDecodeSplit", (q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new),
                        outputs)


def mla_decode_split_impl(q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new, softmax_scale,
                          page_tokens, latent_dim, heads, outputs, stream):
    from k2trt.runtime.kernels.mla_decode import decode_split

    with _on_stream(stream):
        decode_split(*(as_torch(t) for t in (q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new)),
                     as_torch(outputs[0]), as_torch(outputs[1]), softmax_scale=attribute(softmax_scale),
                     page_tokens=attribute(page_tokens), latent_dim=attribute(latent_dim))


def mla_decode_split_aot_impl(q_full, kv_pool, kv_scale, page_table, ctx_lens, latent_new, n_new, softmax_scale,
                              page_tokens, latent_dim, heads, outputs, tactic):
    b, t = q_full.shape_expr[0], q_full.shape_expr[1]
    max_pages, splits = page_table.shape_expr[1], outputs[0].shape_expr[3]
    attrs = {"softmax_scale": softmax_scale, "page_tokens": page_tokens, "latent_dim": latent_dim, "heads": heads}
    return _mla_aot("MlaDecodeSplit", {"kv_pool": kv_pool}, attrs, our_dtype(q_full.dtype), tactic,
                    lambda p: p.grid(b, t, splits),
                    lambda p: p.extra_args(t, max_pages, _pool_pages(kv_pool, page_tokens), splits))


# MlaDecodeMerge
def mla_decode_merge_desc(part_acc, part_ml, out_dtype):
    return _descs("MlaDecodeMerge", (part_acc, part_ml), {"out_dtype": attribute(out_dtype)})


def mla_decode_merge_autotune(part_acc, part_ml, outputs):
    return _combination("MlaDecodeMerge", (part_acc, part_ml), outputs)


def mla_decode_merge_impl(part_acc, part_ml, out_dtype, outputs, stream):
    from k2trt.runtime.kernels.mla_decode import decode_merge

    with _on_stream(stream):
        decode_merge(as_torch(part_acc), as_torch(part_ml), as_torch(outputs[0]))


def mla_decode_merge_aot_impl(part_acc, part_ml, out_dtype, outputs, tactic):
    rows = _product([part_acc.shape_expr[i] for i in range(3)])
    splits = part_acc.shape_expr[3]
    return _mla_aot("MlaDecodeMerge", {"part_acc": part_acc}, {}, BY_ONNX[int(attribute(out_dtype))].name, tactic,
                    lambda p: p.grid(rows), lambda p: p.extra_args(splits))


# MlaDecompress
def mla_decompress_desc(kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv_b, page_tokens, latent_dim,
                        heads, nope_dim, rope_dim, v_head_dim):
    return _descs("MlaDecompress", (kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv_b),
                  {"page_tokens": attribute(page_tokens), "heads": attribute(heads),
                   "nope_dim": attribute(nope_dim), "v_head_dim": attribute(v_head_dim)})


def mla_decompress_autotune(kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv_b, outputs):
    return _combination("MlaDecompress", (kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv_b), outputs)


def mla_decompress_impl(kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv_b, page_tokens, latent_dim,
                        heads, nope_dim, rope_dim, v_head_dim, outputs, stream):
    from k2trt.runtime.kernels.mla_prefill import prefill_decompress

    with _on_stream(stream):
        prefill_decompress(*(as_torch(t) for t in (kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new,
                                                   kv_b, outputs[0])),
                           page_tokens=attribute(page_tokens), latent_dim=attribute(latent_dim))


def mla_decompress_aot_impl(kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv_b, page_tokens,
                            latent_dim, heads, nope_dim, rope_dim, v_head_dim, outputs, tactic):
    b, t = latent_new.shape_expr[0], latent_new.shape_expr[1]
    max_pages, positions = page_table.shape_expr[1], outputs[0].shape_expr[1]
    attrs = {"page_tokens": page_tokens, "latent_dim": latent_dim, "heads": heads, "nope_dim": nope_dim,
             "v_head_dim": v_head_dim}
    return _mla_aot("MlaDecompress", {"kv_pool": kv_pool}, attrs, our_dtype(latent_new.dtype), tactic,
                    lambda p: p.grid(b, positions),
                    lambda p: p.extra_args(t, max_pages, _pool_pages(kv_pool, page_tokens), positions))


# MlaAttend
def mla_attend_desc(q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv, softmax_scale, page_tokens,
                    latent_dim, heads, nope_dim, rope_dim, v_head_dim):
    return _descs("MlaAttend", (q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv),
                  {"v_head_dim": attribute(v_head_dim)})


def mla_attend_autotune(q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv, outputs):
    return _combination("MlaAttend", (q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv), outputs)


def mla_attend_impl(q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv, softmax_scale, page_tokens,
                    latent_dim, heads, nope_dim, rope_dim, v_head_dim, outputs, stream):
    from k2trt.runtime.kernels.mla_prefill import prefill_attend

    with _on_stream(stream):
        prefill_attend(*(as_torch(t) for t in (q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv,
                                               outputs[0])),
                       softmax_scale=attribute(softmax_scale), page_tokens=attribute(page_tokens),
                       latent_dim=attribute(latent_dim))


def mla_attend_aot_impl(q, kv_pool, kv_scale, page_table, ctx_lens, n_new, latent_new, kv, softmax_scale,
                        page_tokens, latent_dim, heads, nope_dim, rope_dim, v_head_dim, outputs, tactic):
    b, t = q.shape_expr[0], q.shape_expr[1]
    max_pages, positions = page_table.shape_expr[1], kv.shape_expr[1]
    attrs = {"softmax_scale": softmax_scale, "page_tokens": page_tokens, "latent_dim": latent_dim, "heads": heads,
             "nope_dim": nope_dim, "v_head_dim": v_head_dim}
    return _mla_aot("MlaAttend", {"kv_pool": kv_pool}, attrs, our_dtype(q.dtype), tactic,
                    lambda p: p.grid(b, t),
                    lambda p: p.extra_args(t, max_pages, _pool_pages(kv_pool, page_tokens), positions))


# op_type -> (register, impl, autotune, aot_impl)
PLUGIN_FUNCTIONS = {
    "Fp8BlockLinear": (fp8_block_linear_desc, fp8_block_linear_impl, fp8_block_linear_autotune,
                       fp8_block_linear_aot_impl),
    "MoeAlign": (moe_align_desc, moe_align_impl, moe_align_autotune, moe_align_aot_impl),
    "MoeGateUp": (moe_gate_up_desc, moe_gate_up_impl, moe_gate_up_autotune, moe_gate_up_aot_impl),
    "MoeDown": (moe_down_desc, moe_down_impl, moe_down_autotune, moe_down_aot_impl),
    "MoeCombine": (moe_combine_desc, moe_combine_impl, moe_combine_autotune, moe_combine_aot_impl),
    "MoeGateUpInt4": (moe_gate_up_int4_desc, moe_gate_up_int4_impl, moe_gate_up_int4_autotune,
                      moe_gate_up_int4_aot_impl),
    "MoeDownInt4": (moe_down_int4_desc, moe_down_int4_impl, moe_down_int4_autotune, moe_down_int4_aot_impl),
    "MlaDecodeSplit": (mla_decode_split_desc, mla_decode_split_impl, mla_decode_split_autotune,
                       mla_decode_split_aot_impl),
    "MlaDecodeMerge": (mla_decode_merge_desc, mla_decode_merge_impl, mla_decode_merge_autotune,
                       mla_decode_merge_aot_impl),
    "MlaDecompress": (mla_decompress_desc, mla_decompress_impl, mla_decompress_autotune, mla_decompress_aot_impl),
    "MlaAttend": (mla_attend_desc, mla_attend_impl, mla_attend_autotune, mla_attend_aot_impl),
}


# ---- registration ----------------------------------------------------------------------------------------

def expected_signatures(spec: PluginSpec) -> dict[str, list[str]]:
    """Parameter lists tensorrt.plugin accepts for each function (_validate.py; impl and aot_impl with every
    attribute, which get_launch_params requires of aot_impl)."""
    ins, attrs = spec.input_names, spec.attribute_names
    impl = ins + attrs + ["outputs", "stream"] + (["tactic"] if spec.tactics else [])
    return {"register": ins + attrs, "impl": impl, "autotune": ins + ["outputs"],
            "aot_impl": ins + attrs + ["outputs", "tactic"]}


def _annotate(spec: PluginSpec, trtp) -> None:
    desc, impl, autotune, aot = PLUGIN_FUNCTIONS[spec.op_type]
    ann = {n: trtp.TensorDesc for n in spec.input_names}
    ann.update({a.name: ATTRIBUTE_ANNOTATIONS[a.type] for a in spec.contract.attributes})
    ann["return"] = (trtp.TensorDesc if len(spec.output_names) == 1
                     else typing.Tuple[tuple(trtp.TensorDesc for _ in spec.output_names)])
    desc.__annotations__ = ann
    # aot_impl must declare its return type (tensorrt.plugin refuses it otherwise)
    aot.__annotations__ = {"return": typing.Tuple[typing.Union[str, bytes], typing.Union[str, bytes],
                                                  trtp.KernelLaunchParams, trtp.SymExprs]}


_REGISTERED: set[str] = set()


def register_plugins() -> dict[str, str]:
    """Register every plugin with tensorrt.plugin (once per process); returns op_type -> "jit+aot" | "jit".
    Must run before an ONNX graph with our nodes is parsed and before an engine with JIT plugins is deserialized."""
    from k2trt.runtime.tensorrt.environment import import_tensorrt_plugin

    _, trtp = import_tensorrt_plugin()
    has_aot = hasattr(trtp, "aot_impl")  # TensorRT >= 10.9
    modes = {}
    for op_type, spec in plugin_specs().items():
        desc, impl, autotune, aot = PLUGIN_FUNCTIONS[op_type]
        modes[op_type] = "jit+aot" if has_aot else "jit"
        if op_type in _REGISTERED:
            continue
        _annotate(spec, trtp)
        trtp.register(spec.plugin_id)(desc)
        trtp.impl(spec.plugin_id)(impl)
        trtp.autotune(spec.plugin_id)(autotune)
        if has_aot:
            trtp.aot_impl(spec.plugin_id)(aot)
        _REGISTERED.add(op_type)
    return modes
