"""A stand-in for TensorRT's Python plugin machinery and the ONNX parser's plugin path, modelled on TensorRT's own
source, not on our reading of its API:

  * tensorrt.plugin: NVIDIA/TensorRT python/packaging/bindings_wheel/tensorrt/plugin/ — _lib.py (register, impl,
    aot_impl, autotune; _TemplatePluginCreator.create_plugin), _validate.py (every signature rule), _utils.py
    (_str_to_data_type, field types), _autotune.py (AutoTuneCombination), _tensor.py (shape expressions,
    KernelLaunchParams, SymIntExprs), _plugin_class.py (what TensorRT calls at build time, with which arguments);
  * the ONNX parser: onnx-tensorrt onnxOpImporters.cpp (FallbackPluginImporter: the creator is found by op_type,
    plugin_version default "1", plugin_namespace; loadFields: only the creator's field names are read, an INT
    attribute becomes a kINT32 field of length 1) and importerUtils.cpp (createPlugin: the node's `aot` attribute
    makes the request STRICT_AOT / STRICT_JIT and overrides the network's PREFER_* flags; both flags at once are
    refused; the creator gets the op_type as the plugin name);
  * the flag values of NvInfer.h NetworkDefinitionCreationFlag, 10.x and 11.x (they moved in 11.0).

Read at TensorRT OSS v10.15, v10.16 and v11.1 (python/packaging/bindings_wheel/tensorrt/plugin is the same in 10.16
and 11.1 but for a sample's signature) and onnx-tensorrt 10.1-GA and dd0a3a9.

It is a model of the rules, not a reimplementation: tensors are descriptions, kernels do not run here — a test
launches an AOT plan under Triton's interpreter with the grid and arguments this stand-in computed.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import types
import typing
import warnings

import numpy as np


class DataType(enum.Enum):  # trt.DataType members (their names are what type strings spell)
    FLOAT = 0
    HALF = 1
    INT8 = 2
    INT32 = 3
    BOOL = 4
    UINT8 = 5
    FP8 = 6
    BF16 = 7
    INT64 = 8


class TensorFormat(enum.Enum):
    LINEAR = 0
    CHW32 = 1
    HWC = 2


class QuickPluginCreationRequest(enum.Enum):  # NvInferPythonPlugin.h
    UNKNOWN = 0
    PREFER_JIT = 1
    PREFER_AOT = 2
    STRICT_JIT = 3
    STRICT_AOT = 4


class NetworkDefinitionCreationFlag:  # NvInfer.h v10.16 NetworkDefinitionCreationFlag (kEXPLICIT_BATCH = 0 deprecated)
    STRONGLY_TYPED = 1
    PREFER_JIT_PYTHON_PLUGINS = 2
    PREFER_AOT_PYTHON_PLUGINS = 3


class NetworkDefinitionCreationFlag11:  # NvInfer.h v11.1: kSTRONGLY_TYPED = 0 deprecated and ignored, the others moved
    STRONGLY_TYPED = 0
    PREFER_JIT_PYTHON_PLUGINS = 1
    PREFER_AOT_PYTHON_PLUGINS = 2


def creation_flags(major: int):
    return NetworkDefinitionCreationFlag11 if major >= 11 else NetworkDefinitionCreationFlag


class TensorRTError(Exception):
    """What the parser reports for a node (ParserError's desc)."""

    def __init__(self, node: str, desc: str):
        super().__init__(f"{node}: {desc}")
        self.node, self.desc = node, desc


def str_to_data_type(name: str) -> DataType:
    """_utils._str_to_data_type: "FP32"/"FP16" aliases, else getattr(trt.DataType, name). An unknown name raises
    AttributeError: TensorRT's `except KeyError` never catches what getattr raises."""
    if name == "FP32":
        return DataType.FLOAT
    if name == "FP16":
        return DataType.HALF
    return getattr(DataType, name)


# ---- shape expressions (_tensor.py) -----------------------------------------------------------------------

# An IExprBuilder exists only inside get_output_shapes / get_launch_params: _plugin_class.py sets
# SymIntExpr._exprBuilder on entry and, since TensorRT 10.15, back to None on exit (_plugin_class.py v10.15 lines
# 147 and 437). Before 10.15 it stays set to the builder of a call that has finished ("stale").
_BUILDER = {"active": False, "stale": False}


@contextlib.contextmanager
def expression_builder():
    """As inside a shape call: ints become constant expressions (a test computing a grid rule directly)."""
    _BUILDER.update(active=True, stale=False)
    try:
        yield
    finally:
        _BUILDER.update(active=False, stale=False)


class SymIntExpr:
    """_tensor.py SymIntExpr: + - * // with ints or expressions, no reflected operators; an int becomes a constant
    through the active IExprBuilder, or a fake expression without one. Non-constant ones refuse constant_value()
    and bool()."""

    def __init__(self, value=None):
        if isinstance(value, SymIntExpr):
            self._fake, self.value, self.constant = value._fake, value.value, value.constant
        elif isinstance(value, int) and not isinstance(value, bool):
            if _BUILDER["stale"]:
                raise RuntimeError("SymIntExpr._exprBuilder belongs to a finished shape call (TensorRT < 10.15 "
                                   "never resets it: _plugin_class.py get_output_shapes / get_launch_params)")
            self._fake, self.value, self.constant = not _BUILDER["active"], value, True
        elif value is None:
            self._fake, self.value, self.constant = True, None, True
        else:
            raise TypeError(f"{type(self).__name__} of {type(value).__name__}")

    @property
    def is_constant(self) -> bool:
        if self._fake:
            raise RuntimeError("Not accessible for fake 'ShapeExpr's. Check is_fake to determine accessibility.")
        return self.constant

    def constant_value(self) -> int:
        if not self.is_constant:
            raise RuntimeError("Not accessible for non-constant shape expressions.")
        return self.value

    def _op(self, other, fn):
        if isinstance(other, int) and not isinstance(other, bool):
            other = SymIntExpr(other)
        if not isinstance(other, SymIntExpr):
            raise TypeError(f"unsupported operand {type(other).__name__}")
        if self._fake or other._fake:
            return type(self)()
        return _expr(fn(self.value, other.value), self.constant and other.constant, type(self))

    def __add__(self, o):
        return self._op(o, lambda a, b: a + b)

    def __sub__(self, o):
        return self._op(o, lambda a, b: a - b)

    def __mul__(self, o):
        return self._op(o, lambda a, b: a * b)

    def __floordiv__(self, o):
        return self._op(o, lambda a, b: a // b)

    def __bool__(self):
        if self._fake or not self.constant:
            raise RuntimeError("Cannot evaluate symbolic expression as boolean.")
        return bool(self.value)


class SymInt32(SymIntExpr):
    """What an extra launch argument must be (get_launch_params: isinstance(arg, SymInt32))."""

    def resolved(self) -> int:
        if self._fake or self.value is None:
            raise RuntimeError("a fake expression reached the launch parameters")
        return self.value


class ShapeExpr(SymInt32):
    """_tensor.py ShapeExpr (a SymInt32): fake ones (get_output_data_types) refuse is_constant."""

    @property
    def is_fake(self) -> bool:
        return self._fake


def _expr(value: int, constant: bool, cls=ShapeExpr) -> SymIntExpr:
    e = cls.__new__(cls)
    e._fake, e.value, e.constant = False, value, constant
    return e


def _top_level(first, second, fn):
    """_top_level.py cdiv / max / min: both ints are refused."""
    if isinstance(first, int):
        if isinstance(second, int):
            raise ValueError("Both arguments cannot be 'int's")
        first = ShapeExpr(first)
    return first._op(second, fn)


def cdiv(a, b):
    return _top_level(a, b, lambda x, y: -(-x // y))


def minimum(a, b):
    return _top_level(a, b, min)


def maximum(a, b):
    return _top_level(a, b, max)


class SymExprs:
    """_tensor.py SymExprs: a fixed-length iterable; a plain int stored into it becomes a SymInt32 (_from_scalar)."""

    def __init__(self, length: int):
        self._length, self._exprs = length, [None] * length

    def __iter__(self):
        return iter(self._exprs)

    def __len__(self):
        return self._length

    def __getitem__(self, i):
        return self._exprs[i]

    def __setitem__(self, i, e):
        if i >= self._length:
            raise IndexError("Index out of range")
        self._exprs[i] = e if isinstance(e, SymIntExpr) else self._scalar(e)

    def _scalar(self, e):
        if not isinstance(e, int):
            raise ValueError(f"Unsupported type: '{type(e)}'")
        return SymInt32(e)


class SymIntExprs(SymExprs):
    """_tensor.py SymIntExprs.__setitem__: a plain int becomes a SymIntExpr — not a SymInt32, so get_launch_params
    refuses it as an extra argument ("Extra args must be a 'tensorrt.plugin.SymInt32'")."""

    def _scalar(self, e):
        if not isinstance(e, int):
            raise ValueError(f"Value should be int or SymIntExpr. Got '{type(e)}'")
        return SymIntExpr(e)


class ShapeExprs(SymExprs):
    """_tensor.py ShapeExprs: a tensor's shape; ints stored become ShapeExprs."""

    @classmethod
    def of(cls, exprs) -> "ShapeExprs":
        out = cls(len(exprs))
        out._exprs = [e if isinstance(e, ShapeExpr) else ShapeExpr(e) for e in exprs]
        return out

    def _scalar(self, e):
        if not isinstance(e, int):
            raise ValueError(f"Value should be int or ShapeExpr. Got '{type(e)}'")
        return ShapeExpr(e)


class KernelLaunchParams:
    _FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_mem")

    def __init__(self):
        for f in self._FIELDS:
            self.__dict__[f] = SymInt32(0 if f == "shared_mem" else 1)

    def __setattr__(self, name, value):
        if name not in self._FIELDS:
            raise AttributeError(f"KernelLaunchParams object has no attribute '{name}'")
        self.__dict__[name] = SymInt32(value)


class TensorDesc:
    def __init__(self, shape_expr=None, dtype: DataType | None = None):
        self.shape_expr = shape_expr if isinstance(shape_expr, SymExprs) else ShapeExprs.of(list(shape_expr or []))
        self.dtype = dtype

    @property
    def ndim(self) -> int:
        return len(self.shape_expr)


def from_shape_expr(shape_expr, dtype: DataType) -> TensorDesc:
    """_top_level.py from_shape_expr: a tuple becomes ShapeExprs.from_tuple; anything else is kept as it is, so
    TensorRT fails when it reads a list's entries (`._expr`, `_clone`): only a tuple or a ShapeExprs works."""
    if isinstance(shape_expr, tuple):
        return TensorDesc(ShapeExprs.of(list(shape_expr)), dtype)
    if isinstance(shape_expr, ShapeExprs):
        return TensorDesc(shape_expr, dtype)
    raise TypeError(f"from_shape_expr of a {type(shape_expr).__name__}: TensorRT reads a tuple or ShapeExprs only")


class AutoTuneCombination:
    """_autotune.py: "type0,type1,..." with '|' (dependent) or '*' (independent) alternatives — never both in one
    entry — layouts "LINEAR" by default (one entry for all or one per I/O), custom tactics positive integers."""

    def __init__(self, io_types: str, layouts: str | None = None, tactics=None):
        self.io_types = [s.strip() for s in io_types.split(",")]
        self.layouts = [s.strip() for s in (layouts or "LINEAR").split(",")]
        if len(self.layouts) > 1 and len(self.layouts) != len(self.io_types):
            raise AssertionError("layouts and io_types differ in length")
        if len(self.layouts) == 1:
            self.layouts = self.layouts * len(self.io_types)
        if tactics is not None and any(not isinstance(t, int) or t <= 0 for t in tactics):
            raise ValueError("custom tactics must be positive integers")
        self.tactics = tactics

    def combinations(self) -> list[tuple[tuple, tuple]]:
        def expand(entries):
            for e in entries:  # _autotune.py _gen_onesided_combinations
                if "|" in e and "*" in e:
                    raise ValueError(f"Type/Format '{e}' contains both '|' and '*'")
            n = max(len(e.split("|")) for e in entries)
            if any(1 < len(e.split("|")) != n for e in entries):
                raise ValueError(f"Type/Format combinations {entries} contain illegal dependent lengths")
            combos = [[e.split("|")[min(i, len(e.split("|")) - 1)].split("*")[0] for e in entries]
                      for i in range(n)]
            for j, e in enumerate(entries):
                for alt in e.split("*")[1:]:
                    combos += [c[:j] + [alt] + c[j + 1:] for c in list(combos)]
            return combos

        return [(tuple(str_to_data_type(t) for t in ts), tuple(getattr(TensorFormat, f) for f in fs))
                for ts in expand(self.io_types) for fs in expand(self.layouts)]


# ---- registration (_lib.py, _validate.py) --------------------------------------------------------------------

SERIALIZABLE_BUILTIN_TYPES = (int, float, bytes, bool, str)
SERIALIZABLE_NP_DTYPES = (np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, bool,
                          np.bool_)
DISALLOWED_ATTR_NAMES = {"outputs", "stream", "tactic"}
BUILTIN_FIELD_TYPE = {int: "INT64", float: "FLOAT64", bool: "INT8"}  # _utils._built_in_to_plugin_field_type
NUMPY_FIELD_TYPE = {np.dtype("int32"): "INT32", np.dtype("int16"): "INT16", np.dtype("int8"): "INT8",
                    np.dtype("bool"): "INT8", np.dtype("int64"): "INT64", np.dtype("float32"): "FLOAT32",
                    np.dtype("float64"): "FLOAT64", np.dtype("float16"): "FLOAT16"}


def _numpy_dtype(annotation):
    """_utils._infer_numpy_type of numpy.typing.NDArray[dtype], or None for anything else."""
    if typing.get_origin(annotation) is not np.ndarray:
        return None
    args = typing.get_args(annotation)
    inner = typing.get_args(args[1]) if len(args) >= 2 else ()
    if not inner:
        raise AttributeError("annotate numpy array attributes as numpy.typing.NDArray[dtype]")
    return inner[0]


class PluginDef:
    def __init__(self, plugin_id: str):
        self.plugin_id = plugin_id
        self.register_func = self.impl_func = self.aot_impl_func = self.autotune_func = None
        self.input_tensor_names: list[str] = []
        self.input_attrs: dict[str, object] = {}
        self.field_types: dict[str, str] = {}
        self.impl_attr_names = self.aot_impl_attr_names = self.autotune_attr_names = None
        self.num_outputs = 0
        self.expects_tactic = False


def _schema(names: list[str], tail: list[str]) -> str:
    return "(" + ", ".join(names + tail) + ")"


def _validate_attr_subset(fn, pdef: PluginDef, role: str) -> list[str]:
    """Annotations are optional, but an annotated attribute must match the registered annotation; returns the
    attribute names in the function, which must appear in register order (checked by the schema)."""
    attrs = []
    for name, param in inspect.signature(fn).parameters.items():
        if name in pdef.input_attrs:
            if param.annotation is not inspect.Parameter.empty and param.annotation != pdef.input_attrs[name]:
                raise ValueError(f"Attribute '{name}' has a type annotation different from the one specified at "
                                 f"registration ({role}).")
            attrs.append(name)
        elif name not in ("outputs", "stream", "tactic") and name not in pdef.input_tensor_names:
            raise ValueError(f"Unexpected argument '{name}' specified in {role} function.")
    return [n for n in pdef.input_attrs if n in attrs]


class TensorRTPlugin:
    """The `tensorrt.plugin` module: decorators, descriptors, and the registry they fill."""

    TensorDesc = TensorDesc
    KernelLaunchParams = KernelLaunchParams
    SymExprs = SymExprs
    SymIntExprs = SymIntExprs
    SymInt32 = SymInt32
    AutoTuneCombination = AutoTuneCombination
    from_shape_expr = staticmethod(from_shape_expr)
    cdiv = staticmethod(cdiv)
    min = staticmethod(minimum)
    max = staticmethod(maximum)

    def __init__(self, version: str = "10.16"):
        self.version = tuple(int(v) for v in version.split(".")[:2])
        self.registry: dict[str, PluginDef] = {}

    def register(self, plugin_id: str):
        def decorator(fn):
            ns, name = plugin_id.split("::")
            if "." in ns or "." in name or ns in {"", "trt", "tensorrt", "std"}:  # _validate.py RESERVED_NAMESPACES
                raise ValueError(f"invalid plugin id {plugin_id}")
            if plugin_id in self.registry:
                raise ValueError(f"'{plugin_id}' already has a definition")
            pdef = PluginDef(plugin_id)
            saw_attr = False
            sig = inspect.signature(fn)
            for idx, (pname, param) in enumerate(sig.parameters.items()):
                # _validate.py _parse_register_inputs: no *args, **kwargs or positional-only parameters
                if param.kind not in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY):
                    raise ValueError(f"Argument {pname} is not a positional-or-keyword or keyword-only arg")
                ann = param.annotation
                if ann is inspect.Parameter.empty:
                    raise ValueError(f"Argument {pname} does not have a type annotation.")
                if param.default is not inspect.Parameter.empty:
                    raise ValueError(f"Argument {pname} has a default value. Default values are not supported yet.")
                if inspect.isclass(ann) and issubclass(ann, TensorDesc):
                    if saw_attr:
                        raise ValueError("TensorDescs args and attribute args cannot be interspersed.")
                    pdef.input_tensor_names.append(pname)
                    continue
                if idx == 0:
                    raise ValueError("TensorDescs args should come first, followed by attributes.")
                if pname in DISALLOWED_ATTR_NAMES:
                    raise ValueError(f"'{pname}' is not allowed as a plugin attribute name.")
                np_dtype = _numpy_dtype(ann)
                if ann in SERIALIZABLE_BUILTIN_TYPES:
                    pdef.field_types[pname] = "CHAR" if ann is str else ("UNKNOWN" if ann is bytes
                                                                         else BUILTIN_FIELD_TYPE[ann])
                elif np_dtype is not None and np_dtype in SERIALIZABLE_NP_DTYPES:
                    pdef.field_types[pname] = NUMPY_FIELD_TYPE[np.dtype(np_dtype)]
                else:
                    raise ValueError(f"Attribute '{pname}' of type {ann} is not a supported serializable type.")
                saw_attr = True
                pdef.input_attrs[pname] = ann
            ret = sig.return_annotation
            if ret is inspect.Parameter.empty:
                raise ValueError("No return annotation found for register function.")
            if typing.get_origin(ret) is tuple:
                if not all(inspect.isclass(a) and issubclass(a, TensorDesc) for a in typing.get_args(ret)):
                    raise ValueError("Return types can only be TensorDesc or Tuple[TensorDesc].")
                pdef.num_outputs = len(typing.get_args(ret))
            elif inspect.isclass(ret) and issubclass(ret, TensorDesc):
                pdef.num_outputs = 1
            else:
                raise ValueError("Return types can only be TensorDesc or Tuple[TensorDesc].")
            pdef.register_func = fn
            self.registry[plugin_id] = pdef
            return fn
        return decorator

    def _pdef(self, plugin_id: str) -> PluginDef:
        if plugin_id not in self.registry:
            raise ValueError(f"Plugin {plugin_id} is not registered.")
        return self.registry[plugin_id]

    def _checked(self, plugin_id: str, fn, role: str, tail: list[str]) -> tuple[PluginDef, list[str]]:
        """The function's parameters must be the inputs, a subset of the attributes in register order, then
        `tail` (_validate.py builds the same expected schema string and compares)."""
        pdef = self._pdef(plugin_id)
        attrs = _validate_attr_subset(fn, pdef, role)
        want = _schema(pdef.input_tensor_names + attrs, tail)
        if _schema(list(inspect.signature(fn).parameters), []) != want:
            raise ValueError(f"Signature of the {role} function does not match the expected schema: {want}")
        return pdef, attrs

    def impl(self, plugin_id: str):
        def decorator(fn):
            tactic = "tactic" in inspect.signature(fn).parameters
            pdef, attrs = self._checked(plugin_id, fn, "impl", ["outputs", "stream"] + (["tactic"] if tactic else []))
            pdef.impl_func, pdef.impl_attr_names, pdef.expects_tactic = fn, attrs, tactic
            return fn
        return decorator

    def aot_impl(self, plugin_id: str):
        def decorator(fn):
            pdef, attrs = self._checked(plugin_id, fn, "aot_impl", ["outputs", "tactic"])
            ret = inspect.signature(fn).return_annotation
            if ret is inspect.Parameter.empty:
                raise ValueError("No return annotation found for aot_impl function.")
            args = typing.get_args(ret)
            if typing.get_origin(ret) is not tuple or len(args) != 4:
                raise ValueError(f"Return annotation is {ret}.")
            for a in args[:2]:
                alts = typing.get_args(a) if typing.get_origin(a) in (typing.Union, types.UnionType) else (a,)
                if any(t not in (str, bytes) for t in alts):
                    raise ValueError("kernel name and PTX must be annotated str or bytes")
            if not (issubclass(args[2], KernelLaunchParams) and issubclass(args[3], SymExprs)):
                raise ValueError("aot_impl must return KernelLaunchParams and SymExprs")
            pdef.aot_impl_func, pdef.aot_impl_attr_names = fn, attrs
            return fn
        return decorator

    def autotune(self, plugin_id: str):
        def decorator(fn):
            pdef, attrs = self._checked(plugin_id, fn, "autotune", ["outputs"])
            pdef.autotune_func, pdef.autotune_attr_names = fn, attrs
            return fn
        return decorator

    # ---- _TemplatePluginCreator.create_plugin ------------------------------------------------------------
    def field_names(self, plugin_id: str) -> dict[str, str]:
        """The creator's getFieldNames(): attribute name -> declared field type."""
        return dict(self._pdef(plugin_id).field_types)

    def create_plugin(self, plugin_id: str, fields: dict[str, np.ndarray],
                      request: QuickPluginCreationRequest | None):
        pdef = self._pdef(plugin_id)
        attrs = {}
        for name, data in fields.items():
            if name not in pdef.input_attrs:
                raise AssertionError(f"Unexpected attribute {name} provided to create_plugin.")
            ann = pdef.input_attrs[name]
            np_dtype = _numpy_dtype(ann)
            if np_dtype is not None:
                attrs[name] = data.astype(np_dtype)
            elif ann is str:
                attrs[name] = data.tobytes().decode("utf-8")
            else:
                # `attr_type_annot(f.data)` on the field's array: int(array([v])) is a TypeError on NumPy >= 2.4 and
                # a DeprecationWarning before; an error either way here, as it is on the NumPy TensorRT meets now
                with warnings.catch_warnings():
                    warnings.simplefilter("error", DeprecationWarning)
                    attrs[name] = ann(data)
        jit_defined, aot_defined = pdef.impl_func is not None, pdef.aot_impl_func is not None
        if request is None:  # no creation request (deserializing a JIT plugin): always the JIT plugin
            return Plugin(pdef, attrs, True, self.version)
        if request == QuickPluginCreationRequest.STRICT_AOT:
            if not aot_defined:
                raise ValueError(f"AOT implementation requested, but not defined for '{plugin_id}'.")
            jit = False
        elif request == QuickPluginCreationRequest.STRICT_JIT:
            if not jit_defined:
                raise ValueError(f"JIT implementation requested, but not defined for '{plugin_id}'.")
            jit = True
        elif aot_defined and jit_defined:
            if request == QuickPluginCreationRequest.PREFER_AOT:
                jit = False
            elif request == QuickPluginCreationRequest.PREFER_JIT:
                jit = True
            else:
                raise ValueError(f"Plugin '{plugin_id}' has both AOT and JIT implementations. "
                                 "NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS or "
                                 "NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS should be specified.")
        elif aot_defined or jit_defined:
            jit = jit_defined
        else:
            raise ValueError(f"Plugin '{plugin_id}' does not have either a AOT or JIT implementation.")
        return Plugin(pdef, attrs, jit, self.version)


class JitOnlyTensorRTPlugin(TensorRTPlugin):
    """TensorRT 10.6–10.8: tensorrt.plugin without aot_impl (_export.IS_AOT_ENABLED is False)."""

    @property
    def aot_impl(self):
        raise AttributeError("aot_impl")


def dim(value: int, dynamic: bool = False) -> ShapeExpr:
    """A network dimension as TensorRT hands it to get_output_shapes: a build-time constant, or a dynamic one
    (not constant; `value` is what this stand-in evaluates it to)."""
    return _expr(value, not dynamic)


class Plugin:
    """What _TemplateJITPlugin / _TemplateAOTPlugin do with our functions while TensorRT builds (and loads)."""

    def __init__(self, pdef: PluginDef, attrs: dict, jit: bool, version: tuple = (10, 16)):
        self.pdef, self.attrs, self.jit, self.version = pdef, attrs, jit, version
        self.kind = "jit" if jit else "aot"
        self.input_descs: list[TensorDesc] = []
        self.output_descs: list[TensorDesc] = []

    def _register(self, descs):
        out = self.pdef.register_func(*descs, **self.attrs)
        out = out if isinstance(out, tuple) else (out,)
        if len(out) != self.pdef.num_outputs:
            raise ValueError(f"{self.pdef.plugin_id}: {len(out)} outputs, {self.pdef.num_outputs} registered")
        return out

    def output_types(self, input_types: list[DataType], ranks: list[int]) -> list[DataType]:
        """get_output_data_types: register with fake shape expressions."""
        descs = [TensorDesc([ShapeExpr() for _ in range(r)], t) for t, r in zip(input_types, ranks)]
        return [d.dtype for d in self._register(descs)]

    def _shape_call(self, fn):
        """A call with an IExprBuilder: reset after it since 10.15, left behind before (_plugin_class.py)."""
        _BUILDER.update(active=True, stale=False)
        try:
            return fn()
        finally:
            _BUILDER.update(active=False, stale=self.version < (10, 15))

    def output_shapes(self, inputs: list[TensorDesc]) -> list[list[ShapeExpr]]:
        """get_output_shapes: register with the network's shape expressions."""
        def run():
            self.input_descs = inputs
            self.output_descs = list(self._register(inputs))
        self._shape_call(run)
        return [list(d.shape_expr) for d in self.output_descs]

    def supported(self) -> dict[tuple, set]:
        """get_supported_format_combinations: autotune with the input and output descriptors."""
        val = [self.attrs[k] for k in self.pdef.autotune_attr_names or []]
        combos = self.pdef.autotune_func(*self.input_descs, *val, tuple(self.output_descs))
        out: dict[tuple, set] = {}
        for c in combos:
            for key in c.combinations():
                out.setdefault(key, set()).update(c.tactics or ())
        return out

    def tactics_for(self, types: tuple) -> list[int]:
        """TensorRT needs the network's own (strongly typed) I/O types among the combinations."""
        for (ts, fs), tactics in self.supported().items():
            if ts == types and all(f == TensorFormat.LINEAR for f in fs):
                return sorted(tactics) or [0]
        raise TensorRTError(self.pdef.plugin_id, f"no supported format combination for types {types}")

    def launch(self, tactic: int) -> dict:
        """_TemplateAOTPlugin.get_launch_params: aot_impl(*inputs, *every attribute, outputs, tactic)."""
        if self.jit:
            raise AssertionError("launch parameters are for AOT plugins")
        val = list(self.attrs.values())
        name, ptx, params, extra = self._shape_call(lambda: self.pdef.aot_impl_func(
            *self.input_descs, *val, tuple(self.output_descs), tactic))
        if not isinstance(name, (str, bytes)) or not isinstance(ptx, (str, bytes)):
            raise TypeError("Kernel name and PTX must be 'str' or 'bytes'.")
        if not isinstance(params, KernelLaunchParams):
            raise TypeError("Launch params must be a 'tensorrt.plugin.KernelLaunchParams'.")
        if not isinstance(extra, SymExprs):
            raise TypeError("Extra args must be a 'tensorrt.plugin.SymIntExprs'.")
        for a in extra:  # _plugin_class.py get_launch_params, per argument
            if not isinstance(a, SymInt32):
                raise TypeError(f"Extra args must be a 'tensorrt.plugin.SymInt32'.  Got: {type(a)}.")
        return {"name": name, "ptx": ptx, "extra": [a.resolved() for a in extra],
                **{f: getattr(params, f).resolved() for f in KernelLaunchParams._FIELDS}}

    def impl_arguments(self) -> list:
        """_TemplateJITPlugin.enqueue calls impl(*inputs, *[attrs of impl_attr_names], outputs, stream[, tactic])."""
        return [self.attrs[k] for k in self.pdef.impl_attr_names]

    def fields_to_serialize(self) -> dict[str, np.ndarray]:
        """get_fields_to_serialize (JIT engines): the impl's attributes, arrays as they are, builtins np.array([v])."""
        out = {}
        for k in self.pdef.impl_attr_names:
            v = self.attrs[k]
            out[k] = v if isinstance(v, np.ndarray) else (np.frombuffer(v.encode(), np.int8) if isinstance(v, str)
                                                          else np.array([v]))
        return out


# ---- the ONNX parser's plugin path (onnx-tensorrt) -------------------------------------------------------------

def _field(attr) -> np.ndarray:
    """loadFields: INT -> kINT32 [v], FLOAT -> kFLOAT32 [v], STRING -> kCHAR with its NUL terminator (copyField),
    INTS -> kINT32, FLOATS -> kFLOAT32."""
    from onnx import AttributeProto

    if attr.type == AttributeProto.INT:
        return np.array([attr.i], dtype=np.int32)
    if attr.type == AttributeProto.FLOAT:
        return np.array([attr.f], dtype=np.float32)
    if attr.type == AttributeProto.STRING:  # copyField(std::string) appends '\0' to the field's data
        return np.frombuffer(attr.s + b"\0", dtype=np.int8)
    if attr.type == AttributeProto.INTS:
        return np.array(list(attr.ints), dtype=np.int32)
    if attr.type == AttributeProto.FLOATS:
        return np.array(list(attr.floats), dtype=np.float32)
    raise TensorRTError(attr.name, f"Attributes of type {attr.type} are unsupported in plugin fields")


def parse_plugin_node(trtp: TensorRTPlugin, node, network_flags: int = 0, domain_fallback: bool = False) -> Plugin:
    """FallbackPluginImporter + loadFields + createPlugin for one node. `plugin_namespace` defaults to "" (onnx-tensorrt
    onnxOpImporters.cpp FallbackPluginImporter, `attrs.get<std::string>("plugin_namespace", "")`; 10.1-GA line 6443),
    which no tensorrt.plugin plugin can have (RESERVED_NAMESPACES); later parsers retry with the node's domain after
    a miss (onnxOpImporters.cpp at dd0a3a9, "Fallback check to the node's domain") — `domain_fallback`. The flag
    numbers are those of the stand-in's TensorRT major version (creation_flags)."""
    attrs = {a.name: a for a in node.attribute}
    version = attrs["plugin_version"].s.decode() if "plugin_version" in attrs else "1"
    namespace = attrs["plugin_namespace"].s.decode() if "plugin_namespace" in attrs else ""
    plugin_id = f"{namespace}::{node.op_type}"
    if plugin_id not in trtp.registry and domain_fallback:
        plugin_id = f"{node.domain}::{node.op_type}"
    if plugin_id not in trtp.registry or version != "1":
        raise TensorRTError(node.name, "Plugin not found, are the plugin name, version, and namespace correct?")
    fields = {name: _field(attrs[name]) for name in trtp.field_names(plugin_id) if name in attrs}
    if "aot" in attrs:
        request = (QuickPluginCreationRequest.STRICT_AOT if attrs["aot"].i
                   else QuickPluginCreationRequest.STRICT_JIT)
    else:
        flags = creation_flags(trtp.version[0])
        prefer_aot = bool(network_flags & (1 << flags.PREFER_AOT_PYTHON_PLUGINS))
        prefer_jit = bool(network_flags & (1 << flags.PREFER_JIT_PYTHON_PLUGINS))
        if prefer_aot and prefer_jit:
            raise TensorRTError(node.name, "Both kPREFER_AOT_PYTHON_PLUGINS and kPREFER_JIT_PYTHON_PLUGINS "
                                           "cannot be specified at the same time.")
        request = (QuickPluginCreationRequest.PREFER_JIT if prefer_jit else
                   QuickPluginCreationRequest.PREFER_AOT if prefer_aot else QuickPluginCreationRequest.UNKNOWN)
    try:
        return trtp.create_plugin(plugin_id, fields, request)
    except Exception as e:  # the parser reports the creator's failure as the node's error
        raise TensorRTError(node.name, f"{type(e).__name__}: {e}") from e
