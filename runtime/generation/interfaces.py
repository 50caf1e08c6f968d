"""The step loop's two seams, declared: what a scheduler runs its steps on (`Executor`), and what the batch
generator, the server's scheduler thread and the serving object ask of a scheduler (`BatchScheduler`). Each
implementation names its protocol as a base class, and tests/test_interfaces.py checks that it defines every
member itself, so nothing at the seam is probed with hasattr.

Executors: StageExecutor (one process: every layer, samples), PipelineExecutor (rank 0 of a pipeline: sends the
plan down the stages, the last ones sample), a micro-batch lane's (its plans go to the pipeline's driver).
Schedulers: Scheduler, and MicroBatchScheduler (M lanes behind one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from k2trt.runtime.generation.executor import StageClock
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.scheduler import CacheCounters, Request
    from k2trt.runtime.generation.speculation import SpecCounters
    from k2trt.runtime.generation.step import StepLogprobs, StepPlan
    from k2trt.runtime.generation.timings import Timings


class Executor(Protocol):
    samples_here: bool  # whether this process samples: grammars and log-probabilities apply only where it does
    clock: "StageClock"  # time inside the backend's calls (a pipeline's: rank 0's)
    verifies_drafts: bool  # whether a step may carry drafts to verify and give back each verify row's kept tokens
    aux_layers: tuple[int, ...]  # target layers whose incoming residual stream take_aux gives (an EAGLE-3 draft's)
    captures_aux: bool  # whether take_aux can give them (a micro-batch lane's cannot)

    def run(self, plan: "StepPlan") -> list[int | None]:
        """Apply the plan's slot operations and run its step: -> the sampled id of each sequence (None where it
        samples nothing)."""
        ...

    def take_logprobs(self) -> "StepLogprobs":
        """The log-probabilities of the last step (empty where this process does not sample)."""
        ...

    def take_aux(self) -> "torch.Tensor | None":
        """The last step's residual stream entering each of aux_layers, concatenated [B, T, len · hidden] in the
        activations' dtype (None: no aux_layers)."""
        ...

    def session_seconds(self) -> float | None:
        """Time inside the backend's inference sessions, or None where that cannot be told apart."""
        ...


class BatchScheduler(Protocol):
    executor: Executor  # what its steps run on (the one whose clock times them)
    limits: "Limits"
    spec_counters: "SpecCounters"  # what speculative decoding proposed and kept (empty without it)
    drafter: object  # the EAGLE-3 draft following its sequences (runtime/generation/eagle.py), or None
    samples_here: bool
    timings: "Timings"

    def check(self, req: "Request", name: str = "the prompt") -> None:
        """Every error the request can have (a RequestError), raised before any work."""
        ...

    def submit(self, req: "Request") -> "Request":
        ...

    def has_work(self) -> bool:
        ...

    def iteration(self) -> None:
        """Admit what can be admitted, then one prefill step and one decode step."""
        ...

    def keepalive(self) -> None:
        """An empty step: every rank hears from rank 0, pending slot operations are applied."""
        ...

    def run_until_idle(self) -> None:
        ...

    def running(self) -> int:
        """Requests holding a slot."""
        ...

    def cache_counters(self) -> "CacheCounters":
        ...
