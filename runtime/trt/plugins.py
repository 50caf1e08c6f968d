"""TensorRT plugins for the two node contracts of graphs/contracts.py, via `tensorrt.plugin` (quickly deployable
Python plugins).

The plugin *descriptions* — id, namespace, version, input/output names and dtypes, attribute names and types,
output shape rule, tactics — are plain data (`plugin_specs()`), derived from the contracts and checked by
tests/test_trt_glue.py without TensorRT. `register_plugins()` imports TensorRT and hands the functions below to
trtp.register / impl / autotune / aot_impl, annotated from those specs (TensorRT reads the annotations to tell
tensor inputs from attributes and validates every signature against the registered one).

Implementations:
  * Fp8BlockLinear — JIT (`impl`: Python at every enqueue, the Triton kernels of runtime/kernels) and AOT
    (`aot_impl`: one Triton kernel that quantizes activations in-kernel, runtime/trt/aot_linear.py, compiled to PTX
    at build time and embedded in the engine). The parser picks AOT only for nodes with the attribute `aot=1`
    (`k2trt build --aot-linear` adds it).
  * MoeFp8 — JIT only: routing alignment, activation quantization, two grouped GEMMs and a combine are several
    launches with scratch buffers, while an AOT plugin is exactly one kernel without workspace.
"""

from __future__ import annotations

import contextlib
import typing
from dataclasses import dataclass
from typing import Callable

import numpy as np

from k2trt.dtypes import BY_TRT
from k2trt.dtypes import dtype as dtype_info
from k2trt.graphs import contracts
from k2trt.graphs.contracts import NodeContract

# Node attributes TensorRT's ONNX parser consumes itself; they are not plugin fields.
PARSER_ATTRIBUTES = ("plugin_namespace", "plugin_version", "aot")
# tensorrt.plugin registers every plugin as version "1"; the exported nodes must say the same.
QDP_PLUGIN_VERSION = "1"

ATTRIBUTE_PY_TYPES = {"int": int, "float": float, "str": str}

# Fp8BlockLinear tactics: id -> the row count whose tile config (runtime/kernels/fp8_linear.linear_config) the AOT
# kernel is compiled with. TensorRT times each per profile and keeps the fastest (decode: small tiles).
LINEAR_TACTIC_ROWS = {1: 1, 2: 64, 3: 4096}


@dataclass(frozen=True)
class PortSpec:
    name: str
    dtypes: tuple[str, ...]  # contract dtype names
    follows_activation: bool  # its dtype is the activation dtype (one of ACTIVATION_DTYPES, same for all such ports)


@dataclass(frozen=True)
class PluginSpec:
    op_type: str
    namespace: str
    version: str
    inputs: tuple[PortSpec, ...]
    outputs: tuple[PortSpec, ...]
    attributes: tuple[tuple[str, str], ...]  # (name, "int" | "float" | "str"), in register order
    output_shape: Callable[[list], list]  # input shapes (ints or TensorRT shape exprs) -> the output's shape
    tactics: tuple[int, ...]  # custom tactics TensorRT times (empty: one default)
    aot: bool  # has an aot_impl
    impl_note: str

    @property
    def plugin_id(self) -> str:
        return f"{self.namespace}::{self.op_type}"

    @property
    def input_names(self) -> list[str]:
        return [p.name for p in self.inputs]

    @property
    def attribute_names(self) -> list[str]:
        return [a for a, _ in self.attributes]

    def type_combinations(self) -> list[str]:
        """AutoTuneCombination io_types strings: one per activation dtype (inputs then outputs)."""
        combos = []
        for act in contracts.ACTIVATION_DTYPES:
            types = []
            for p in self.inputs + self.outputs:
                dt = act if p.follows_activation else p.dtypes[0]
                types.append(autotune_type(dt))
            combos.append(",".join(types))
        return combos

    def layouts(self) -> str:
        return ",".join(["LINEAR"] * (len(self.inputs) + len(self.outputs)))


def _ports(ports) -> tuple[PortSpec, ...]:
    out = []
    for p in ports:
        act = tuple(p.dtypes) == tuple(contracts.ACTIVATION_DTYPES)
        if not act and len(p.dtypes) != 1:
            raise ValueError(f"port {p.name}: a plugin port is either the activation dtype or one fixed dtype")
        out.append(PortSpec(p.name, tuple(p.dtypes), act))
    return tuple(out)


def _linear_out_shape(shapes: list) -> list:
    x, w = shapes[0], shapes[1]
    return [x[i] for i in range(len(x) - 1)] + [w[0]]  # [B, T, N], N = weight rows


def _like_x(shapes: list) -> list:
    return [shapes[0][i] for i in range(len(shapes[0]))]


def _spec(c: NodeContract, output_shape, tactics, aot, note) -> PluginSpec:
    return PluginSpec(c.op_type, contracts.NAMESPACE, contracts.PLUGIN_VERSION, _ports(c.inputs), _ports(c.outputs),
                      tuple((a.name, a.type) for a in c.attributes), output_shape, tuple(tactics), aot, note)


def plugin_specs() -> dict[str, PluginSpec]:
    """op_type -> PluginSpec, for every node contract."""
    specs = {
        "Fp8BlockLinear": _spec(contracts.FP8_BLOCK_LINEAR, _linear_out_shape, tuple(LINEAR_TACTIC_ROWS), True,
                                "JIT (Triton via torch at enqueue) and AOT (one in-kernel-quantizing Triton kernel, "
                                "PTX in the engine) — AOT for nodes with aot=1"),
        "MoeFp8": _spec(contracts.MOE_FP8, _like_x, (), False,
                        "JIT only: several kernels plus scratch buffers; an AOT plugin is a single kernel"),
    }
    if set(specs) != set(contracts.CONTRACTS):
        raise AssertionError("every node contract needs a plugin spec")
    return specs


# ---- tensors --------------------------------------------------------------------------------------------

def autotune_type(dtype: str) -> str:
    """The type name AutoTuneCombination takes: trt.DataType's member name (tensorrt/plugin/_utils.py
    _str_to_data_type accepts those, plus FP32/FP16 as aliases)."""
    return dtype_info(dtype).trt


def interface_typestr(dtype: str) -> str:
    """The __cuda_array_interface__ typestr a buffer of `dtype` travels as. TensorRT's own interface raises for
    BF16 and FP8, and NumPy has neither: those travel as the unsigned integer of the same size and are re-viewed."""
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

    dtype = BY_TRT[t.dtype.name].name
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
# Parameter names are the contract's port and attribute names: TensorRT matches them to the node.

def fp8_block_linear_desc(x, weight, weight_scale_inv, activation_quant):
    return _output_desc("Fp8BlockLinear", x, (x, weight, weight_scale_inv))


def fp8_block_linear_autotune(x, weight, weight_scale_inv, outputs):
    return _combinations("Fp8BlockLinear")


def fp8_block_linear_impl(x, weight, weight_scale_inv, activation_quant, outputs, stream, tactic):
    # JIT: the runtime kernel picks its own tiles from the actual row count, so the tactic is not needed here.
    from k2trt.runtime.kernels.fp8_linear import fp8_block_linear

    with _on_stream(stream):
        fp8_block_linear(as_torch(x), as_torch(weight), as_torch(weight_scale_inv), int(activation_quant),
                         out=as_torch(outputs[0]))


def fp8_block_linear_aot_impl(x, weight, weight_scale_inv, activation_quant, outputs, tactic):
    import tensorrt.plugin as trtp

    from k2trt.runtime.trt import aot_linear

    n, k = (_constant(weight.shape_expr[i], f"weight dim {i}") for i in (0, 1))
    act = BY_TRT[x.dtype.name].name
    plan = aot_linear.plan_for(act, n, k, int(activation_quant), int(tactic))
    plan, name, ptx, block_x, shared = aot_linear.compile_plan(plan)
    rows = x.shape_expr[0]
    for i in range(1, x.ndim - 1):
        rows = rows * x.shape_expr[i]
    params = trtp.KernelLaunchParams()
    params.grid_x = plan.grid_x(rows)
    params.block_x = block_x
    params.shared_mem = shared
    extra = trtp.SymIntExprs(1)
    extra[0] = trtp.SymInt32(rows)  # the kernel's M, after the input pointers (aot_linear.KERNEL_SCALAR_ARGS)
    return name, ptx, params, extra


def moe_fp8_desc(x, topk_ids, topk_weights, gate_weight, gate_scale_inv, up_weight, up_scale_inv, down_weight,
                 down_scale_inv, activation_quant):
    return _output_desc("MoeFp8", x, (x, topk_ids, topk_weights, gate_weight, gate_scale_inv, up_weight,
                                      up_scale_inv, down_weight, down_scale_inv))


def moe_fp8_autotune(x, topk_ids, topk_weights, gate_weight, gate_scale_inv, up_weight, up_scale_inv, down_weight,
                     down_scale_inv, outputs):
    return _combinations("MoeFp8")


def moe_fp8_impl(x, topk_ids, topk_weights, gate_weight, gate_scale_inv, up_weight, up_scale_inv, down_weight,
                 down_scale_inv, activation_quant, outputs, stream):
    from k2trt.runtime.kernels.moe import moe_fp8

    with _on_stream(stream):
        gate = as_torch(gate_weight)
        # TensorRT times plugins on uninitialized buffers while building; an out-of-range expert id would make
        # the dispatch scatter fault and poison the CUDA context. Router ids are always in range, so this is a no-op
        # at inference (one tiny elementwise kernel).
        ids = as_torch(topk_ids).clamp(0, gate.shape[0] - 1)
        moe_fp8(as_torch(x), ids, as_torch(topk_weights), gate, as_torch(gate_scale_inv), as_torch(up_weight),
                as_torch(up_scale_inv), as_torch(down_weight), as_torch(down_scale_inv),
                activation_quant=int(activation_quant), out=as_torch(outputs[0]))


# op_type -> (register, impl, autotune, aot_impl or None)
PLUGIN_FUNCTIONS = {
    "Fp8BlockLinear": (fp8_block_linear_desc, fp8_block_linear_impl, fp8_block_linear_autotune,
                       fp8_block_linear_aot_impl),
    "MoeFp8": (moe_fp8_desc, moe_fp8_impl, moe_fp8_autotune, None),
}


def _output_desc(op_type: str, like, inputs):
    import tensorrt.plugin as trtp

    spec = plugin_specs()[op_type]
    dims = spec.output_shape([t.shape_expr for t in inputs])
    return trtp.from_shape_expr(tuple(dims), dtype=like.dtype)


def _combinations(op_type: str):
    import tensorrt.plugin as trtp

    spec = plugin_specs()[op_type]
    return [trtp.AutoTuneCombination(types, spec.layouts(), list(spec.tactics) or None)
            for types in spec.type_combinations()]


def _constant(expr, what: str) -> int:
    if expr.is_fake or not expr.is_constant:
        raise ValueError(f"Fp8BlockLinear AOT needs a static {what} (weights have static shapes)")
    return int(expr.constant_value())


# ---- registration ----------------------------------------------------------------------------------------

def expected_signatures(spec: PluginSpec) -> dict[str, list[str]]:
    """Parameter lists tensorrt.plugin accepts for each function (its documented schemas)."""
    ins, attrs = spec.input_names, spec.attribute_names
    impl = ins + attrs + ["outputs", "stream"] + (["tactic"] if spec.tactics else [])
    sigs = {"register": ins + attrs, "impl": impl, "autotune": ins + ["outputs"]}
    if spec.aot:
        sigs["aot_impl"] = ins + attrs + ["outputs", "tactic"]
    return sigs


def _annotate(spec: PluginSpec, trtp) -> None:
    desc, impl, autotune, aot = PLUGIN_FUNCTIONS[spec.op_type]
    ann = {n: trtp.TensorDesc for n in spec.input_names}
    ann.update({a: ATTRIBUTE_PY_TYPES[t] for a, t in spec.attributes})
    ann["return"] = (trtp.TensorDesc if len(spec.outputs) == 1
                     else typing.Tuple[tuple(trtp.TensorDesc for _ in spec.outputs)])
    desc.__annotations__ = ann
    if aot is not None:
        # aot_impl must declare its return type (tensorrt.plugin refuses it otherwise)
        aot.__annotations__ = {"return": typing.Tuple[typing.Union[str, bytes], typing.Union[str, bytes],
                                                      trtp.KernelLaunchParams, trtp.SymExprs]}


_REGISTERED: set[str] = set()


def register_plugins() -> dict[str, str]:
    """Register every plugin with tensorrt.plugin (once per process); returns op_type -> "jit" | "jit+aot".
    Must run before an ONNX graph with our nodes is parsed and before an engine with them is deserialized."""
    from k2trt.runtime.trt.environment import import_tensorrt_plugin

    _, trtp = import_tensorrt_plugin()
    modes = {}
    for op_type, spec in plugin_specs().items():
        desc, impl, autotune, aot = PLUGIN_FUNCTIONS[op_type]
        has_aot = spec.aot and hasattr(trtp, "aot_impl")  # AOT plugins need TensorRT >= 10.10
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
