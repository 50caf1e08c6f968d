"""What a checkpoint's `quantization_config` says about each weight: FP8 e4m3 with 128×128 block scales (Kimi K2),
compressed-tensors `pack-quantized` INT4 with group scales (K2-Thinking, K2.5, K2.6: the routed experts), or bf16.

The format is decided per module from the config, never assumed: `Quantization.module_format(name, cls)` answers
for one module (its name as the checkpoint stores it, its class as the reference modeling code has it). For
compressed-tensors the schema is the library's own (`compressed_tensors.quantization.QuantizationConfig`, which
validates the JSON) and so is the matching of `targets` and `ignore` (`compressed_tensors.utils.match.match_name`:
exact names, or `re:` regular expressions matched from the start of the name; a target may also name a class).
Everything the config says that k2trt cannot compute — another bit width, asymmetric zero points, activation
quantization, another storage format, a group size the kernels do not take — is a one-line ConfigError naming
the field, raised when the config is read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from k2trt.errors import K2Error

FP8_BLOCK = "fp8_block"
INT4_GROUP = "int4_group"
BF16 = "bf16"

CT_METHOD = "compressed-tensors"
PACK_QUANTIZED = "pack-quantized"
INT4_BITS = 4
PACK_FACTOR = 32 // INT4_BITS  # int4 values per int32 word (compressed-tensors' pack_to_int32)
# The kernels read a group's scale once per run of `group_size` input channels and unpack whole int32 words: a group
# is a whole number of words, and at most one 128-channel K step (graphs/int4.py, runtime/kernels/moe_int4.py).
MAX_GROUP_SIZE = 128

# The module classes of the reference modeling code (modeling_deepseek.py) that a `targets` entry may name
LINEAR = "Linear"


class QuantizationError(K2Error, ValueError):
    """A quantization_config k2trt cannot read, or one that asks for arithmetic k2trt does not do."""


@dataclass(frozen=True)
class WeightFormat:
    kind: str  # FP8_BLOCK | INT4_GROUP | BF16
    group_size: int | None = None  # INT4_GROUP: input channels per scale
    source: str = ""  # the config entry that decided it, for error messages

    def describe(self) -> str:
        if self.kind == INT4_GROUP:
            return f"int4 (group {self.group_size})"
        return {FP8_BLOCK: "fp8 e4m3 (128x128 blocks)", BF16: "bf16"}[self.kind]

    def same(self, other: "WeightFormat") -> bool:
        return (self.kind, self.group_size) == (other.kind, other.group_size)


@dataclass(frozen=True)
class _Group:
    name: str
    targets: tuple[str, ...]
    format: WeightFormat


@dataclass(frozen=True)
class Quantization:
    """The parsed quantization_config (method None: no quantization_config, every weight bf16)."""

    method: str | None = "fp8"
    weight_block_size: tuple[int, int] = (128, 128)  # fp8
    groups: tuple[_Group, ...] = ()  # compressed-tensors, in config order
    ignore: tuple[str, ...] = ()
    raw_json: str | None = None  # the config.json object as given (sorted JSON), written back unchanged

    @property
    def raw(self) -> dict | None:
        return None if self.raw_json is None else json.loads(self.raw_json)

    def to_hf_dict(self) -> dict | None:
        if self.raw_json is not None:
            return self.raw
        if self.method == "fp8":
            return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": list(self.weight_block_size)}
        return None

    def module_format(self, name: str, cls: str) -> WeightFormat:
        """The storage format of one module's weight. name: as the checkpoint stores it (with any layout prefix);
        cls: LINEAR for the projections and lm_head, else the module's class in the reference code."""
        if self.method is None:
            return WeightFormat(BF16, source="no quantization_config")
        if self.method == "fp8":
            # Kimi K2's FP8 checkpoint quantizes every Linear of attention and the MLPs; lm_head stays bf16
            fp8 = cls == LINEAR and not name.endswith("lm_head")
            return WeightFormat(FP8_BLOCK, source="quantization_config (fp8)") if fp8 else WeightFormat(BF16)
        from compressed_tensors.utils.match import match_name

        def hit(patterns) -> str | None:
            return next((p for p in patterns if p == cls or match_name(name, p)), None)

        for g in self.groups:
            target = hit(g.targets)
            if target is not None:
                ignored = hit(self.ignore)
                if ignored is not None:
                    return WeightFormat(BF16, source=f"quantization_config.ignore {ignored!r}")
                return g.format
        return WeightFormat(BF16, source="no quantization_config target")


def parse_quantization(q: Any, source: str) -> Quantization:
    """quantization_config of a config.json (None: absent) -> Quantization, or one QuantizationError."""
    if q is None:
        return Quantization(method=None)
    if not isinstance(q, dict):
        raise QuantizationError(f"{source}: quantization_config must be an object")
    method = q.get("quant_method")
    if method == "fp8":
        return _parse_fp8(q, source)
    if method == CT_METHOD:
        return _parse_compressed_tensors(q, source)
    raise QuantizationError(f"{source}: quantization_config.quant_method {method!r} is not one k2trt reads "
                            f"(fp8, {CT_METHOD})")


def _parse_fp8(q: dict, source: str) -> Quantization:
    if q.get("fmt", "e4m3") != "e4m3":
        raise QuantizationError(f"{source}: quantization_config.fmt {q.get('fmt')!r} is not supported (only e4m3)")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise QuantizationError(f"{source}: quantization_config.activation_scheme {q.get('activation_scheme')!r} "
                                f"is not supported (only dynamic)")
    bs = q.get("weight_block_size", [128, 128])
    if not isinstance(bs, list) or len(bs) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) for b in bs):
        raise QuantizationError(f"{source}: quantization_config.weight_block_size must be two integers, got {bs!r}")
    if tuple(bs) != (128, 128):
        raise QuantizationError(f"{source}: quantization_config.weight_block_size {bs} is not supported "
                                f"(only [128, 128])")
    return Quantization(method="fp8", weight_block_size=tuple(bs))


def _field(loc) -> str:
    """A pydantic error location as the config.json field it names (validator names dropped)."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and ("[" in p or "(" in p))]
    out = "quantization_config"
    for p in parts:
        out += f"[{p}]" if p.isdigit() else f".{p}"
    return out


def _check_patterns(patterns, field: str, source: str) -> tuple[str, ...]:
    for i, p in enumerate(patterns):
        if p.startswith("re:"):
            try:
                re.compile(p.removeprefix("re:"))
            except re.error as e:
                raise QuantizationError(f"{source}: {field}[{i}] {p!r} is not a regular expression Python "
                                        f"compiles ({e})") from None
    return tuple(patterns)


def _parse_compressed_tensors(q: dict, source: str) -> Quantization:
    try:
        import pydantic
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        raise QuantizationError(f"{source}: a compressed-tensors checkpoint needs the compressed-tensors package "
                                f"(pip install compressed-tensors)") from None
    try:
        cfg = QuantizationConfig.model_validate(q)
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        raise QuantizationError(f"{source}: {_field(err['loc'])}: {err['msg']}") from None
    except Exception as e:  # the library's own validators raise ValueError / NotImplementedError / KeyError
        raise QuantizationError(f"{source}: quantization_config: {str(e).splitlines()[0]}") from None

    fmt = cfg.format
    if fmt != PACK_QUANTIZED:
        raise QuantizationError(f"{source}: quantization_config.format {fmt!r} is not supported (k2trt reads "
                                f"{PACK_QUANTIZED!r}: int4 weights packed into int32)")
    if cfg.kv_cache_scheme is not None:
        raise QuantizationError(f"{source}: quantization_config.kv_cache_scheme: a quantized KV cache is not "
                                f"supported (k2trt keeps the latent cache in the activation dtype)")
    for key in ("sparsity_config", "transform_config"):
        if q.get(key):
            raise QuantizationError(f"{source}: quantization_config.{key} is not supported (it must be empty)")
    ignore = _check_patterns(cfg.ignore or [], "quantization_config.ignore", source)
    groups = []
    for name, scheme in cfg.config_groups.items():
        where = f"quantization_config.config_groups.{name}"
        targets = _check_patterns(scheme.targets, f"{where}.targets", source)
        if scheme.format is not None and scheme.format != PACK_QUANTIZED:
            raise QuantizationError(f"{source}: {where}.format {scheme.format!r} is not supported "
                                    f"(only {PACK_QUANTIZED!r})")
        for act in ("input_activations", "output_activations"):
            if getattr(scheme, act) is not None:
                raise QuantizationError(f"{source}: {where}.{act}: activation quantization is not supported "
                                        f"(K2's INT4 experts are W4A16: weights only, as the model was trained)")
        groups.append(_Group(name, targets, _int4_format(scheme.weights, f"{where}.weights", source)))
    if not groups:
        raise QuantizationError(f"{source}: quantization_config.config_groups is empty")
    return Quantization(method=CT_METHOD, groups=tuple(groups), ignore=ignore,
                        raw_json=json.dumps(q, sort_keys=True))


def _int4_format(w, where: str, source: str) -> WeightFormat:
    def refuse(field: str, got, why: str):
        raise QuantizationError(f"{source}: {where}.{field} {got!r}: {why}")

    if w is None:
        raise QuantizationError(f"{source}: {where}: a group without weight quantization is not supported")
    if w.type != "int":
        refuse("type", w.type, "only int weights are supported")
    if w.num_bits != INT4_BITS:
        refuse("num_bits", w.num_bits, f"only {INT4_BITS}-bit weights are supported")
    if not w.symmetric:
        refuse("symmetric", w.symmetric, "asymmetric zero points are not supported (only symmetric int4)")
    if w.strategy != "group":
        refuse("strategy", w.strategy, "only the group strategy is supported")
    if w.dynamic:
        refuse("dynamic", w.dynamic, "only static weight scales are supported")
    if w.actorder not in (None, "weight", "static"):
        refuse("actorder", w.actorder, "activation reordering with g_idx is not supported")
    g = w.group_size
    if g is None or g <= 0 or g % PACK_FACTOR or g > MAX_GROUP_SIZE or MAX_GROUP_SIZE % g:
        refuse("group_size", g, f"the kernels take a group size that divides {MAX_GROUP_SIZE} and is a multiple "
                                f"of {PACK_FACTOR} (K2-Thinking uses 32)")
    if w.scale_dtype is not None and str(w.scale_dtype) not in ("torch.bfloat16", "bfloat16"):
        refuse("scale_dtype", str(w.scale_dtype), "only bfloat16 scales are supported")
    return WeightFormat(INT4_GROUP, g, source=where)
