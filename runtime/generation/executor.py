"""Running step plans through a backend: the part of the runtime that touches tensors.

A StageExecutor owns a backend, the paged latent cache of its layers and (on the stage with the head) one sampler
per slot. `run(plan)` applies the plan's slot operations, then embeds (first stage), runs its layers over the
cache gathered through the plan's page tables, writing their new entries into their pages in place, and applies
the head and samples (last stage). A single process is one stage with every layer;
a pipeline (runtime/distributed/) is several, with the hidden state passed between them — the same code.

Log-probabilities are an output of the step beside its tokens (`take_logprobs`): of each sampled token, for the
slots whose sampling asks; and of every prompt token, for the slots that ask for prompt log-probabilities — for
those the head runs on every position of the prompt chunk, of that sequence only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from k2trt.config import K2Config
from k2trt.runtime.backends.contract import Backend
from k2trt.runtime.cache.pools import PagedLatentCache
from k2trt.runtime.generation.interfaces import Executor
from k2trt.runtime.generation.sampling import Sampler, logprobs_of, sample_rows
from k2trt.runtime.generation.step import (Admit, RopeTable, StepLogprobs, StepPlan, StepTensors, apply_slot_ops,
                                          step_tensors)


def carried_aux(aux_layers, before: int) -> list[int]:
    """The distinct aux layers below layer `before`, in order: what a stage starting there receives from the
    stages before it (layers are split into stages in order; an aux layer is one whose input is kept)."""
    return sorted({i for i in aux_layers if i < before})


@dataclass
class StageClock:
    backend_s: float = 0.0  # inside the backend's embed/block/head calls


class StageExecutor(Executor):
    samples_here = True  # the stage with the head samples (a pipeline's last stage; every stage of one process)
    verifies_drafts = True
    captures_aux = True  # a pipeline's stages carry theirs down to the last (runtime/distributed/pipeline.py)
    aux_layers: tuple[int, ...] = ()  # set by an EAGLE-3 scheduler (runtime/generation/eagle.py), or by the step

    def __init__(self, backend: Backend, cfg: K2Config, layers: list[int] | None = None,
                 first: bool = True, last: bool = True):
        self.backend, self.cfg = backend, cfg
        self.layers = list(range(cfg.num_hidden_layers) if layers is None else layers)
        self.first, self.last = first, last
        self.cache = PagedLatentCache(self.layers, cfg.latent_dim, backend.act_dtype, backend.device)
        # A GPU stage reserves the whole pool at its first step (plan.pool_pages): grown as pages are named, a pool
        # near its share of free memory would hold its old and new tensors at once. A CPU stage grows as it goes,
        # holding what it uses (the CPU default, every slot at the full context, would be far more).
        self.reserve_whole = torch.device(backend.device).type == "cuda"
        self.samplers: dict[int, Sampler] = {}
        self.parked: dict[int, Sampler] = {}  # preempted sequences' samplers, by key (Park), until resumed
        self.rope = RopeTable(cfg)
        self.clock = StageClock()
        self.logprobs = StepLogprobs({}, {})
        self.aux: torch.Tensor | None = None  # the last stage's: every aux layer, in aux_layers' order
        self.carry: torch.Tensor | None = None  # another stage's: what it passes on (carried_aux)

    # ---- slot bookkeeping ------------------------------------------------------------------------------
    def apply(self, plan: StepPlan) -> None:
        apply_slot_ops(plan.ops, self.samplers, self._new_sampler, self.parked)
        if plan.tables or (self.reserve_whole and plan.pool_pages):
            if self.cache.pages and plan.page_tokens != self.cache.page_tokens:
                raise ValueError(f"a plan of {plan.page_tokens}-position pages for a cache of {self.cache.page_tokens}")
            self.cache.page_tokens = plan.page_tokens
            named = 1 + max((max(t, default=0) for t in plan.tables), default=0)
            if plan.pool_pages and named > plan.pool_pages:
                raise ValueError(f"a plan names page {named - 1} of a pool of {plan.pool_pages} pages")
            self.cache.reserve(max(named, plan.pool_pages) if self.reserve_whole else named,
                               limit=plan.pool_pages or None)

    def _new_sampler(self, op: Admit) -> Sampler | None:
        return Sampler(op.sampling, op.grammar) if self.last else None  # only the stage with the head samples

    # ---- the step, in the three parts a pipeline distributes -----------------------------------------------
    def tensors(self, plan: StepPlan) -> StepTensors:
        return step_tensors(plan, self.rope, self.backend.device, self.backend.act_dtype)

    def embed(self, st: StepTensors) -> torch.Tensor:
        t0 = time.perf_counter()
        h = self.backend.embed(st.input_ids)
        self.clock.backend_s += time.perf_counter() - t0
        return h

    def run_layers(self, plan: StepPlan, st: StepTensors, hidden: torch.Tensor,
                   carried: torch.Tensor | None = None) -> torch.Tensor:
        """This stage's layers over the step. With aux_layers set, the residual stream entering each of them is
        kept: `carried` holds those of the stages before (carried_aux, concatenated), and the stage leaves all of
        them in `aux` if it is the last, else what the next stage is to carry in `carry`."""
        captured = {}
        if carried is not None:
            before = carried_aux(self.aux_layers, self.layers[0])
            captured = dict(zip(before, carried.split(self.cfg.hidden_size, dim=-1)))
        for layer in self.layers:
            if layer in self.aux_layers:  # a copy: a backend may reuse the buffer it returned
                captured[layer] = hidden.clone()
            hidden = self.run_block(layer, plan, st, hidden)
        if self.aux_layers:
            wanted = self.aux_layers if self.last else carried_aux(self.aux_layers, self.layers[-1] + 1)
            missing = [i for i in wanted if i not in captured]
            if missing:
                raise ValueError(f"aux layers {missing} reached the stage of layers {self.layers} uncarried")
            parts = [captured[i] for i in wanted]
            joined = torch.cat(parts, dim=-1) if parts else None
            self.aux, self.carry = (joined, None) if self.last else (None, joined)
        return hidden

    def take_aux(self) -> torch.Tensor | None:
        out, self.aux = self.aux, None
        return out

    def run_block(self, layer: int, plan: StepPlan, st: StepTensors, hidden: torch.Tensor) -> torch.Tensor:
        """One layer over the step's slot range; an expert-parallel stage runs its MoE layers split instead
        (runtime/distributed/expert_parallel.py)."""
        cache, mask = self.layer_cache(layer, st)
        t0 = time.perf_counter()
        hidden, new = self.backend.block(layer, hidden, st.rope_cos, st.rope_sin, mask, cache)
        self.clock.backend_s += time.perf_counter() - t0
        self.cache.write(layer, new, st.cache_rows, st.valid)  # the only write of this step
        return hidden

    def layer_cache(self, layer: int, st: StepTensors):
        """(cache, mask) a block attends with: the pool read where it lies (Backend.reads_pages; no mask), or the
        step's gathered cache and its mask."""
        if self.backend.reads_pages:
            return self.cache.paged(layer, st.page_table, st.ctx_lens, st.n_new), None
        return self.cache.gather(layer, st.gather_rows), st.mask

    def sample(self, plan: StepPlan, st: StepTensors, hidden: torch.Tensor) -> list[int | None]:
        """The head on each sampling sequence's last real position, then each row's own sampler."""
        self.logprobs = StepLogprobs({}, {})
        self._prompt_logprobs(plan, hidden)
        verify = {b for b, n in enumerate(plan.drafts) if n and plan.sample[b]}
        rows = [b for b in range(plan.batch) if plan.sample[b] and b not in verify]
        out: list = [None] * plan.batch
        for b in sorted(verify):
            out[b] = self._verify(plan, b, hidden)
        if not rows:
            return out
        idx = torch.tensor(rows, device=hidden.device)
        last = hidden[idx, st.last[idx]].unsqueeze(1).contiguous()  # [R, 1, d]
        t0 = time.perf_counter()
        logits = self.backend.head(last)[:, -1]
        self.clock.backend_s += time.perf_counter() - t0
        samplers = [self.samplers[plan.first + b] for b in rows]
        for b, s, tok in zip(rows, samplers, sample_rows(samplers, logits)):
            out[b] = tok
            if s.chosen is not None:
                self.logprobs.sampled[b] = s.chosen
        return out

    def _verify(self, plan: StepPlan, b: int, hidden: torch.Tensor) -> tuple[int, ...]:
        """A sequence feeding its last token and k drafts: the head on all 1 + k positions, then its own sampler
        draws position by position (its grammar masking and advancing as it goes) until a draw differs from the
        draft there -> the tokens kept, the differing (or the k+1-th) one last. One draw per token kept, in order:
        the tokens decoding one at a time would have drawn (speculation.py)."""
        tokens, s = plan.tokens[b], self.samplers[plan.first + b]
        t0 = time.perf_counter()
        logits = self.backend.head(hidden[b:b + 1, :len(tokens)].contiguous())[0]
        self.clock.backend_s += time.perf_counter() - t0
        drafts = tokens[len(tokens) - plan.drafts[b]:]
        kept: list[int] = []
        entries = []
        for j in range(len(drafts) + 1):
            (tok,) = sample_rows([s], logits[j:j + 1].clone())  # tokens are [last, *drafts]: row j follows token j
            kept.append(tok)
            if s.chosen is not None:
                entries.append(s.chosen)
            if j == len(drafts) or tok != drafts[j]:
                break
        if entries:
            self.logprobs.verified[b] = entries
        return tuple(kept)

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> None:
        """For each sequence feeding prompt tokens that asks: the head on all its positions of the chunk, and the
        log-probability of each prompt token from the logits before it — the previous chunk's last position for
        the chunk's first token (kept in its sampler), none for the prompt's first."""
        for b, tokens in enumerate(plan.tokens):
            s = self.samplers.get(plan.first + b)
            k = s.params.prompt_logprobs if s is not None else None
            # not asked, or the prompt is done (a preempted sequence feeding its prompt again has them already)
            if k is None or s.prompt_done or (plan.starts[b] > 0 and s.prompt_tail is None):
                continue
            t0 = time.perf_counter()
            logits = self.backend.head(hidden[b:b + 1, :len(tokens)].contiguous())[0].float()
            self.clock.backend_s += time.perf_counter() - t0
            before = [s.prompt_tail] if s.prompt_tail is not None else []
            rows = torch.cat([*before, logits[:len(tokens) - 1]]) if len(before) + len(tokens) > 1 else logits[:0]
            targets = tokens if before else tokens[1:]
            entries = logprobs_of(rows, targets, k) if targets else []
            self.logprobs.prompt[b] = ([] if before else [None]) + entries
            # the chunk's last position: the next chunk's first token, unless this chunk ends the prompt
            s.prompt_tail = None if plan.sample[b] else logits[len(tokens) - 1:]
            s.prompt_done = plan.sample[b]

    def take_logprobs(self) -> StepLogprobs:
        """The last step's log-probabilities (read after `run`)."""
        out, self.logprobs = self.logprobs, StepLogprobs({}, {})
        return out

    def run(self, plan: StepPlan) -> list[int | None]:
        """The whole step in one process: -> the sampled token of each sequence (None where not sampled)."""
        self.apply(plan)
        if not plan.tokens:
            return []
        st = self.tensors(plan)
        hidden = self.run_layers(plan, st, self.embed(st))
        return self.sample(plan, st, hidden)

    def session_seconds(self) -> float | None:
        return self.backend.session_seconds()
