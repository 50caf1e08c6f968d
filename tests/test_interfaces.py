"""The step loop's seams (runtime/generation/interfaces.py): every executor and every scheduler names its protocol
and defines each of its members itself — a method left to the Protocol's `...` body would answer None — and the
code at the seam never probes its other side with hasattr or getattr."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest

from k2trt.runtime.distributed.expert_parallel import ExpertParallelStage
from k2trt.runtime.distributed.micro_batches import MicroBatchScheduler, _LaneExecutor
from k2trt.runtime.distributed.pipeline import PipelineExecutor
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.interfaces import BatchScheduler, Executor
from k2trt.runtime.generation.scheduler import Scheduler

ROOT = Path(__file__).resolve().parent.parent


def members(protocol) -> tuple[set[str], set[str]]:
    """(methods, data members) the protocol declares."""
    own = protocol.__dict__
    methods = {n for n, v in own.items() if inspect.isfunction(v) and not n.startswith("_")}
    return methods, set(own.get("__annotations__", {}))


def defined_by(cls, name: str):
    """The class of cls's MRO whose own namespace holds `name`, or None."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def assigned_in_init(cls, name: str) -> bool:
    """Whether some __init__ of cls's MRO below the protocol sets self.<name>."""
    for c in cls.__mro__:
        init = c.__dict__.get("__init__")
        if init is not None and inspect.isfunction(init):
            for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
                if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store):
                    return True
    return False


@pytest.mark.parametrize("protocol, implementations", [
    (Executor, [StageExecutor, ExpertParallelStage, PipelineExecutor, _LaneExecutor]),
    (BatchScheduler, [Scheduler, MicroBatchScheduler]),
])
def test_every_implementation_states_its_protocol_and_defines_each_member(protocol, implementations):
    methods, data = members(protocol)
    assert methods and data
    for cls in implementations:
        assert protocol in cls.__mro__, f"{cls.__name__} does not name {protocol.__name__}"
        for name in methods:
            owner = defined_by(cls, name)
            assert owner is not None and owner is not protocol, f"{cls.__name__}.{name} is the protocol's stub"
        for name in data:
            owner = defined_by(cls, name)
            assert (owner is not None and owner is not protocol) or assigned_in_init(cls, name), \
                f"{cls.__name__} never sets {name}"


def test_a_missing_member_is_caught():
    """The check itself: an executor that forgets take_logprobs is reported."""
    class Forgetful(Executor):
        samples_here = False
        verifies_drafts = captures_aux = False
        aux_layers = ()

        def __init__(self):
            self.clock = None

        def run(self, plan):
            return []

        def session_seconds(self):
            return None

        def take_aux(self):
            return None

    with pytest.raises(AssertionError, match="take_logprobs is the protocol's stub"):
        test_every_implementation_states_its_protocol_and_defines_each_member(Executor, [Forgetful])


SEAM = ["runtime/generation/scheduler.py", "runtime/generation/generator.py", "runtime/serve/scheduler_thread.py",
        "runtime/serve/serving.py", "runtime/entrypoints/model.py", "runtime/distributed/micro_batches.py"]


def test_the_seam_probes_nothing():
    probes = []
    for rel in SEAM:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr":
                probes.append(f"{rel}:{node.lineno} hasattr")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" \
                    and node.args and ast.unparse(node.args[0]) != "args":  # command-line namespaces may lack a flag
                probes.append(f"{rel}:{node.lineno} {ast.unparse(node)}")
    assert not probes, probes
