"""`k2trt doctor` (`make doctor`): does the TensorRT path work on this machine? What a user runs first.

One line per step — pass, FAIL with the first error, or skip when a step it needs failed:
  1. TensorRT and CUDA: the versions of TensorRT, the driver's CUDA (and the newest PTX it loads), the GPU,
     torch and Triton;
  2. plugin registration: every plugin of the TensorRT-bound graphs with tensorrt.plugin, JIT and AOT;
  3. one engine per plugin: a graph of one plugin node whose FP8 weights are network inputs that only the plugin
     reads (does the builder accept that?), built, run, and compared with the torch reference
     (runtime/tensorrt/plugin_cases.py); then one MoeGateUp with K2-size expert weights (5.6e9 elements each, over
     2^31): taken, or refused — said in one line — with the per-expert-range fallback checked instead;
  4. the tiny model's four block engines, built with their prefill and decode profiles — exported in float32
     and W8A16, the convention ONNX Runtime computes in, with a tiny EAGLE-3 draft's engines beside them — so that
  5. 8 greedy tokens from the engines equal the ONNX Runtime backend's, and
  6. 12 greedy tokens with the draft proposing on its engines equal those without it.
Without TensorRT or a CUDA GPU it says which is missing in one line (exit 2); a failed step makes it exit 1.
About a minute on a GPU machine, most of it compiling the AOT kernels and building the engines.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from k2trt.errors import K2Error, MissingDependency

PROMPT = [11, 22, 33, 44, 55]  # token ids of the tiny vocabulary
NEW_TOKENS = 8


def missing_dependencies() -> list[str]:
    """What the TensorRT path needs and this machine lacks, one phrase each."""
    from k2trt.runtime.tensorrt import environment

    missing = []
    try:
        environment.import_tensorrt()
    except MissingDependency as e:
        missing.append(str(e))
    try:
        environment.require_cuda()
    except MissingDependency as e:
        missing.append(str(e))
    return missing


@dataclass
class Step:
    name: str
    run: Callable[[dict], str]  # state -> the pass line's detail; raises on failure
    needs: tuple[str, ...] = ()


def first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


def run_steps(steps: list[Step], state: dict, write=print) -> int:
    """Run steps in order, one line each; -> the number that failed (skipped ones not counted)."""
    failed, skipped = [], []
    for step in steps:
        blocked = [n for n in step.needs if n in failed or n in skipped]
        if blocked:
            write(f"  skip  {step.name} (needs: {', '.join(blocked)})")
            skipped.append(step.name)
            continue
        t0 = time.perf_counter()
        try:
            detail = step.run(state)
        except Exception as e:  # noqa: BLE001 - a diagnostic: every failure is reported as its first line
            write(f"  FAIL  {step.name}: {first_line(e)}")
            failed.append(step.name)
            continue
        write(f"  pass  {step.name}: {detail} ({time.perf_counter() - t0:.1f} s)")
    return len(failed)


# ---- the steps ---------------------------------------------------------------------------------------------

def _environment(state: dict) -> str:
    import torch
    import triton

    from k2trt.runtime.engines import builder as build
    from k2trt.runtime.tensorrt import environment

    env = environment.current_environment()
    state["env"] = env
    refused = environment.check_tensorrt(env["tensorrt_version"], env["tensorrt_cuda"],
                                         environment.driver_cuda_version())
    if refused:
        raise K2Error(refused)
    target = build.configure_aot_target(env) if state["plugins"] == "aot" else None
    ptx = "" if target is None or target.ptx_version is None else \
        f", AOT kernels as PTX {environment.ptx_text(target.ptx_version)}"
    wheel = "" if env["tensorrt_cuda"] is None else f" (tensorrt-cu{env['tensorrt_cuda']})"
    return (f"TensorRT {env['tensorrt_version']}{wheel}; {env['gpu_name']} (sm {env['compute_capability']}); "
            f"driver CUDA {env['cuda_driver']}{ptx}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
            f"Triton {triton.__version__}")


def _registration(state: dict) -> str:
    from k2trt.runtime.engines import builder as build
    from k2trt.runtime.tensorrt.plugins import register_plugins

    modes = register_plugins()
    build.check_plugin_modes(modes, state["plugins"] == "aot", state["env"]["tensorrt_version"])
    return f"{len(modes)} plugins ({', '.join(modes)}), " + \
        ("JIT and AOT" if set(modes.values()) == {"jit+aot"} else "JIT only")


def first_error_logger(trt):
    """A TensorRT logger that keeps the first error (for the step's line) and prints nothing."""

    class FirstError(trt.ILogger):
        def __init__(self):
            trt.ILogger.__init__(self)
            self.first = None

        def log(self, severity, msg):
            if self.first is None and severity in (trt.ILogger.Severity.ERROR, trt.ILogger.Severity.INTERNAL_ERROR):
                self.first = msg

    return FirstError()


def one_node_engine(trt, logger, case, aot: bool) -> list[str]:
    """Build the case's one-node graph into an engine, run it once, -> its mismatches with the reference."""
    import torch

    from k2trt.runtime.engines import builder as build
    from k2trt.runtime.tensorrt.plugin_cases import mismatches, one_node_model

    model = one_node_model(case)
    build.set_aot_attribute(model, aot)
    builder = trt.Builder(logger)
    network, _parser = build.parse_network(trt, builder, logger, model.SerializeToString(), case.label)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, t in case.inputs.items():
        if any(isinstance(d, str) for d in case.dims[name]):  # dynamic in the graph: a profile of its own shape
            profile.set_shape(name, tuple(t.shape), tuple(t.shape), tuple(t.shape))
    config.add_optimization_profile(profile)
    blob = builder.build_serialized_network(network, config)
    if blob is None:
        raise K2Error(f"TensorRT could not build the engine: {logger.first or 'no error logged'}")
    engine = trt.Runtime(logger).deserialize_cuda_engine(blob)
    if engine is None:
        raise K2Error(f"TensorRT could not deserialize the engine: {logger.first or 'no error logged'}")
    ctx = engine.create_execution_context()
    inputs = {n: t.cuda().contiguous() for n, t in case.inputs.items()}
    outputs = {n: torch.full(t.shape, -7).to(t.dtype).cuda() for n, t in case.expected.items()}
    for n, t in inputs.items():
        ctx.set_input_shape(n, tuple(t.shape))
    for n, t in {**inputs, **outputs}.items():
        ctx.set_tensor_address(n, t.data_ptr())
    stream = torch.cuda.Stream()
    if not ctx.execute_async_v3(stream.cuda_stream):
        raise K2Error(f"TensorRT could not enqueue the engine: {logger.first or 'no error logged'}")
    stream.synchronize()
    return mismatches(case, outputs)


def _one_node_step(case) -> Callable[[dict], str]:
    def run(state: dict) -> str:
        import torch

        from k2trt.runtime.tensorrt.environment import import_tensorrt

        trt = import_tensorrt()
        logger = first_error_logger(trt)
        problems = one_node_engine(trt, logger, case, state["plugins"] == "aot")
        if problems:
            raise K2Error(f"differs from the reference: {problems[0]}")
        fp8 = sum(1 for t in case.inputs.values() if t.dtype == torch.float8_e4m3fn)
        return f"built ({state['plugins']}, {fp8} FP8 network inputs), ran, matches the reference"
    return run


def _large_inputs(state: dict) -> str:
    """A MoeGateUp engine whose expert weights are K2's size (5.6e9 elements each); where TensorRT refuses that,
    one line saying so, and the fallback — per-expert-range weight inputs, one range of 128 experts — checked."""
    import torch

    from k2trt.runtime.tensorrt.environment import import_tensorrt
    from k2trt.runtime.tensorrt.plugin_cases import K2_EXPERTS, K2_RANGE, large_case

    trt = import_tensorrt()
    aot = state["plugins"] == "aot"

    def attempt(num_experts: int) -> str | None:
        case = large_case(num_experts)
        need = 2 * case.elements + (1 << 30)  # the gate and up weights, fp8, and room for TensorRT
        free = torch.cuda.mem_get_info()[0]
        if free < need:
            raise K2Error(f"needs {need / 2**30:.1f} GiB of free GPU memory for {case.label}, "
                          f"this GPU has {free / 2**30:.1f} GiB free")
        logger = first_error_logger(trt)
        weights = case.device_inputs("cuda")
        try:
            problems = one_node_engine(trt, logger, case.node_case(weights), aot)
        except K2Error as e:
            return first_line(e)
        finally:
            del weights
            torch.cuda.empty_cache()
        return f"differs from the reference: {problems[0]}" if problems else None

    refused = attempt(K2_EXPERTS)
    if refused is None:
        return f"{K2_EXPERTS} x 2048 x 7168 expert weights (5.6e9 elements, over 2^31) taken, ran, match"
    fallback = attempt(K2_RANGE)
    if fallback is not None:
        raise K2Error(f"K2-size expert weights refused ({refused}); per-expert-range inputs fail too: {fallback}")
    return (f"TensorRT refuses 5.6e9-element plugin inputs ({refused}); per-expert-range inputs of {K2_RANGE} "
            "experts work: export K2 with --expert-ranges 3")


def _block_engines(state: dict) -> str:
    from k2trt.config import K2Config
    from k2trt.export.exporter import export
    from k2trt.graphs.fp8 import WEIGHT_DEQUANT
    from k2trt.runtime.engines import builder as build
    from k2trt.runtime.tensorrt.environment import import_tensorrt
    from k2trt.runtime.tensorrt.profiles import ProfileSpec

    from k2trt.draft import load_draft
    from k2trt.tiny.draft import make_tiny_draft

    work = state["work"]
    cfg = K2Config.preset("tiny")
    state["draft"] = make_tiny_draft(work / "draft", "llama")
    export(cfg, work / "onnx", "float32", WEIGHT_DEQUANT, log=lambda *a: None,
           draft=load_draft(state["draft"], cfg))
    lines = []
    logger = first_error_logger(import_tensorrt())
    spec = ProfileSpec(max_batch=2, max_seq=64, max_prefill=16, opt_batch=1, opt_prefill=8, opt_seq=32)
    try:
        build.build_engines(work / "onnx", work / "engines", spec, plugins=state["plugins"], log=lines.append,
                            logger=logger)
    except K2Error as e:
        raise K2Error(f"{first_line(e)}: {logger.first}" if logger.first else first_line(e)) from None
    times = [line.split(": ", 1)[1] for line in lines if " MiB in " in line]
    return (f"embedding, dense_block, moe_block, head, and the attention kinds' prefill forms (pages read in place), "
            f"with prefill and decode profiles, and the draft's fc, layer and head ({'; '.join(times)})")


def _tokens(state: dict) -> str:
    from k2trt.config import K2Config
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.backends.ort import OrtBackend
    from k2trt.runtime.backends.tensorrt import TrtBackend
    from k2trt.tiny.synthetic import RandomWeights

    work = state["work"]
    cfg = K2Config.preset("tiny")
    weights = RandomWeights(cfg, seed=0)
    tokens = {}
    for name, backend in (("tensorrt", TrtBackend(work / "engines", weights, export_dir=work / "onnx")),
                          ("onnxruntime", OrtBackend(work / "onnx", weights))):
        (result,), _ = Generator(backend, cfg).generate([PROMPT], NEW_TOKENS)
        tokens[name] = result.token_ids
    if tokens["tensorrt"] != tokens["onnxruntime"]:
        at = next(i for i, (a, b) in enumerate(zip(tokens["tensorrt"], tokens["onnxruntime"])) if a != b)
        raise K2Error(f"token {at} differs: TensorRT {tokens['tensorrt']}, ONNX Runtime {tokens['onnxruntime']}")
    return f"{NEW_TOKENS} tokens equal to ONNX Runtime's {tokens['onnxruntime']}"


DRAFT_TOKENS = 12


def draft_tokens_agree(backend, weights, draft_dir: Path) -> str:
    """Greedy tokens on `backend` with the EAGLE-3 draft at draft_dir proposing on the backend's own engines, against
    the same backend without it; raises K2Error where they differ or nothing was proposed."""
    from k2trt.runtime.generation.eagle import make_drafter
    from k2trt.runtime.generation.executor import StageExecutor
    from k2trt.runtime.generation.generator import Generator
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.scheduler import Scheduler
    from k2trt.runtime.generation.speculation import SpeculativeConfig

    cfg = weights.config
    (plain,), _ = Generator(backend, cfg).generate([PROMPT], DRAFT_TOKENS)
    spec = SpeculativeConfig(method="eagle3", model=str(draft_dir), num_speculative_tokens=3)
    drafter = make_drafter(spec, cfg, weights, backend)
    if drafter.runner.name != "tensorrt":
        raise K2Error(f"the draft runs on {drafter.runner.name}, not on the engines (were they built with it?)")
    limits = Limits.resolve(cfg, backend.limits)
    executor = StageExecutor(backend, cfg)
    scheduler = Scheduler(executor, cfg, limits, speculation=spec, drafter=drafter)
    (fast,), _ = Generator(backend, cfg, limits, executor, scheduler).generate([PROMPT], DRAFT_TOKENS)
    if fast.token_ids != plain.token_ids:
        raise K2Error(f"with the draft {fast.token_ids}, without {plain.token_ids}")
    drafts = scheduler.spec_counters.num_drafts
    if not drafts:
        raise K2Error("the draft proposed nothing")
    return f"{DRAFT_TOKENS} tokens equal without it, {drafts} verify steps"


def _draft_tokens(state: dict) -> str:
    from k2trt.config import K2Config
    from k2trt.runtime.backends.tensorrt import TrtBackend
    from k2trt.tiny.synthetic import RandomWeights

    work = state["work"]
    weights = RandomWeights(K2Config.preset("tiny"), seed=0)
    return draft_tokens_agree(TrtBackend(work / "engines", weights, export_dir=work / "onnx"), weights,
                              state["draft"])


def steps() -> list[Step]:
    from k2trt.graphs.fp8 import PER_TOKEN_GROUP
    from k2trt.runtime.tensorrt.plugin_cases import node_cases

    out = [Step("TensorRT and CUDA", _environment), Step("plugin registration", _registration, ("TensorRT and CUDA",))]
    for case in node_cases("bfloat16", PER_TOKEN_GROUP):
        out.append(Step(f"one-node engine {case.label}", _one_node_step(case), ("plugin registration",)))
    out.append(Step("K2-size expert weights", _large_inputs, ("plugin registration",)))
    out.append(Step("tiny model block engines", _block_engines, ("plugin registration",)))
    out.append(Step("8 tokens vs ONNX Runtime", _tokens, ("tiny model block engines",)))
    out.append(Step("EAGLE-3 draft on its engines", _draft_tokens, ("tiny model block engines",)))
    return out


def run(args) -> int:
    missing = missing_dependencies()
    if missing:
        raise MissingDependency("; ".join(missing))
    print("k2trt doctor: the TensorRT path on this machine", flush=True)
    with tempfile.TemporaryDirectory(prefix="k2trt-doctor-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        state = {"plugins": args.plugins, "work": work}
        failed = run_steps(steps(), state, lambda line: print(line, flush=True))
    if failed:
        print(f"k2trt doctor: {failed} step(s) failed", flush=True)
        return 1
    print("k2trt doctor: all steps passed", flush=True)
    return 0
