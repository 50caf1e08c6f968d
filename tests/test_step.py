"""The host work of a step (runtime/generation/step.py, executor sampling) against its plain definitions, on ragged plans:
the mask is graphs/mask.attention_mask over each sequence's own positions, the rope tables rope_tables', and
batched greedy picks what each slot's sampler would."""

import random

import torch

from k2trt.config import K2Config
from k2trt.graphs.mask import attention_mask
from k2trt.graphs.rope import rope_tables
from k2trt.runtime.generation.executor import StageExecutor
from k2trt.runtime.generation.sampling import Sampler, SamplingParams
from k2trt.runtime.generation.step import Admit, RopeTable, StepPlan, step_tensors

CFG = K2Config.preset("tiny")


def ragged_plans(n: int):
    rnd = random.Random(0)
    for _ in range(n):
        b, cap, first = rnd.randint(1, 5), rnd.choice([16, 32, 64]), rnd.randint(0, 3)
        lengths = [rnd.randint(1, 9) for _ in range(b)]
        starts = [rnd.randint(0, cap - n) for n in lengths]
        tokens = [[rnd.randint(0, 99) for _ in range(n)] for n in lengths]
        # each sequence's pages: distinct, in any order, at least enough for what it writes (sometimes more)
        pt = rnd.choice([4, 8, 64])
        pages = rnd.sample(range(200), 200)
        tables = [[pages.pop() for _ in range(-(-(s + n) // pt) + rnd.randint(0, 2))] for s, n in zip(starts, lengths)]
        yield StepPlan(first=first, tokens=tokens, starts=starts, sample=[True] * b, rows=first + b, capacity=cap,
                       tables=tables, page_tokens=pt)


def test_step_tensors_follow_their_definitions_on_ragged_plans():
    rope = RopeTable(CFG)
    for plan in ragged_plans(100):
        st = step_tensors(plan, rope, "cpu", torch.float32)
        b, t, cap = plan.batch, plan.width, plan.capacity
        lengths, starts = torch.tensor([len(x) for x in plan.tokens]), torch.tensor(plan.starts)
        valid = torch.arange(t)[None] < lengths[:, None]
        positions = starts[:, None] + torch.arange(t)[None]
        key_pos = torch.cat([torch.arange(cap).expand(b, cap), positions], dim=1)
        key_valid = torch.cat([torch.arange(cap)[None] < starts[:, None], valid], dim=1)
        assert torch.equal(st.mask, attention_mask(positions, key_pos, key_valid))
        assert torch.equal(st.valid, valid) and st.mask.dtype == torch.float32
        cos, sin = rope_tables(CFG, positions)
        assert torch.allclose(st.rope_cos, cos, atol=1e-6) and torch.allclose(st.rope_sin, sin, atol=1e-6)
        assert st.input_ids.tolist() == [x + [0] * (t - len(x)) for x in plan.tokens]
        pt = plan.page_tokens

        def row(table, p):
            return table[p // pt] * pt + p % pt

        assert st.cache_rows.tolist() == [row(table, s + j) for table, s, x in
                                          zip(plan.tables, plan.starts, plan.tokens) for j in range(len(x))]
        assert st.gather_rows.tolist() == [[row(table, p) if p < len(table) * pt else 0 for p in range(cap)]
                                           for table in plan.tables]
        assert st.last.tolist() == [len(x) - 1 for x in plan.tokens]


class _Head:
    """A backend stand-in whose head returns fixed logits."""
    device, act_dtype = torch.device("cpu"), torch.float32

    def __init__(self, logits):
        self.logits = logits

    def head(self, hidden):
        return self.logits[:, None, :]


def test_batched_greedy_picks_what_each_sampler_would():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(),
              SamplingParams(temperature=1.0, top_k=5, seed=4), SamplingParams(), SamplingParams()]
    ex = StageExecutor(_Head(logits), CFG, layers=[])
    plan = StepPlan(first=0, tokens=[[1]] * 6, starts=[0] * 6, sample=[True] * 6, rows=6, capacity=16,
                    ops=[Admit(i, p) for i, p in enumerate(params)], tables=[[i] for i in range(6)])
    ex.apply(plan)
    st = step_tensors(plan, ex.rope, "cpu", torch.float32)
    got = ex.sample(plan, st, torch.zeros(6, 1, CFG.hidden_size))
    expect = [int(Sampler(p)(logits[i:i + 1])[0]) for i, p in enumerate(params)]
    assert got == expect


def test_prefill_masks_stay_in_budget_and_span_only_their_own_sequences():
    """A step's mask is B x T x (P + T), P what the step's own sequences hold and write (each step gathers its own
    sequences' pages): fresh prompts prefilling beside a long conversation are not widened by it, and every
    prefill step stays within the budget."""
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.scheduler import Request, Scheduler

    class Recorder:  # an executor that records the plans and samples token 1 wherever asked
        def __init__(self):
            self.plans = []

        def run(self, plan):
            self.plans.append(plan)
            return [1 if s else None for s in plan.sample]

    budget = 1 << 20
    executor = Recorder()
    sched = Scheduler(executor, CFG, Limits(max_context=8192, max_batch=8, prefill_chunk=512, mask_budget=budget))
    conversation = sched.submit(Request([5] * 4000, max_new_tokens=64))
    while not conversation.token_ids:
        sched.iteration()
    fresh = [sched.submit(Request([7] * 512, max_new_tokens=4)) for _ in range(4)]
    sched.run_until_idle()
    assert all(r.finish_reason == "length" for r in [conversation, *fresh])
    prefills = [p for p in executor.plans if p.width > 1]
    beside = [p for p in prefills if p.batch == 4]  # the fresh prompts, while the conversation decodes
    assert beside and all(p.capacity <= 512 for p in beside)
    assert any(p.capacity >= 4000 for p in executor.plans)  # the conversation's own steps
    for p in prefills:
        assert p.batch * p.width * (p.capacity + p.width) <= budget, (p.batch, p.width, p.capacity)
