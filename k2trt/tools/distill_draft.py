"""`python -m k2trt.tools.distill_draft --model DIR --draft DIR --out DIR`: a draft that agrees with its target, made
briefly on a CPU — for measuring what an agreeing EAGLE-3 draft does here (acceptance, tokens per verify step)
without a published one for the tiny model.

The target generates greedy continuations of seeded random prompts (or of the texts given with --prompt, encoded as
`generate --prompt` encodes them) through the runtime's own scheduler, with a
recording drafter that proposes nothing: what it records is what a draft is trained on — each committed position's
aux residual state and the token after it. The draft (a Llama-layout checkpoint, `make-tiny --draft llama`) is then
trained teacher-forced, as it runs in `EagleDrafter.advance`: position p reads fc(aux_p) and the embedding of
token p + 1 and predicts token p + 2 (cross-entropy over the draft vocabulary; tokens outside it are skipped). Only
the first draft position is trained (no EAGLE-3 training-time test), so later positions agree less. The result is
written in the draft's own published form, beside its config.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from k2trt.args import at_least
from k2trt.errors import K2Error


class _Recorder:
    """A drafter that proposes nothing and keeps what EagleDrafter.advance would see."""

    suggested_k = None

    def __init__(self, aux_layers):
        self.aux_layers = aux_layers
        self.seen: dict[int, list] = {}

    def advance_many(self, items):
        for key, start, next_tokens, aux in items:
            rows = self.seen.setdefault(key, [])
            del rows[start:]  # as the draft rolls back by length
            rows += [(aux[i].clone(), int(t)) for i, t in enumerate(next_tokens)]

    def propose_many(self, asks):
        return [[] for _ in asks]

    def forget(self, key):
        pass

    def keep_pages(self, key, page_keys, tokens, page_tokens):
        pass  # collect() runs without the prefix cache

    def restore(self, key, page_keys, tokens, page_tokens):
        pass


def collect(model: Path, draft_dir: Path, sequences: int, prompt_len: int, new_tokens: int, seed: int,
            texts: list[str] | None = None):
    """(aux [N, L, 3H], next tokens [N, L]) of greedy continuations on the torch reference: of seeded random
    prompts, or of `texts` encoded by the checkpoint's tokenizer (each position up to the shortest's length)."""
    import random

    from k2trt.checkpoint import Checkpoint
    from k2trt.draft import load_draft
    from k2trt.runtime.backends.torch_reference import TorchBackend
    from k2trt.runtime.generation.executor import StageExecutor
    from k2trt.runtime.generation.limits import Limits
    from k2trt.runtime.generation.sampling import SamplingParams
    from k2trt.runtime.generation.scheduler import Request, Scheduler
    from k2trt.runtime.generation.speculation import SpeculativeConfig

    ckpt = Checkpoint.open(model)
    cfg = ckpt.config
    draft = load_draft(draft_dir, cfg)
    if texts:
        from k2trt.runtime.text.tokenizer import KimiTokenizer

        tok = KimiTokenizer.from_dir(model)
        prompts = [tok.encode(text) for text in texts]
        if not all(prompts):
            raise K2Error("--prompt: a prompt encodes to no tokens")
    else:
        rnd = random.Random(seed)
        prompts = [[rnd.randrange(3, cfg.vocab_size) for _ in range(prompt_len)] for _ in range(sequences)]
    longest = max(map(len, prompts))
    backend = TorchBackend(ckpt, "float32", 0)
    recorder = _Recorder(draft.config.aux_layer_ids)
    limits = Limits(max_context=longest + new_tokens + 8, max_batch=16, prefill_chunk=longest)
    sched = Scheduler(StageExecutor(backend, cfg), cfg, limits, prefix_cache=False,
                      speculation=SpeculativeConfig(method="eagle3", model=str(draft_dir)), drafter=recorder)
    reqs = [sched.submit(Request(p, new_tokens, SamplingParams())) for p in prompts]
    sched.run_until_idle()
    length = min(len(recorder.seen[r.id]) for r in reqs)
    aux = torch.stack([torch.stack([a for a, _ in recorder.seen[r.id][:length]]) for r in reqs])
    nxt = torch.tensor([[t for _, t in recorder.seen[r.id][:length]] for r in reqs])
    return draft, ckpt, aux, nxt


def train(draft, target_embedding, aux, nxt, steps: int, lr: float, log) -> dict[str, torch.Tensor]:
    from k2trt.graphs import eagle
    from k2trt.graphs.mask import simple_mask
    from k2trt.graphs.ops import TorchOps

    cfg, ops = draft.config, TorchOps("float32")
    params = {k: v.float().clone().requires_grad_(True) for k, v in draft.tensors.items()
              if v.dtype.is_floating_point}
    embed = params.get("embed_tokens.weight", target_embedding.float())
    to_draft = torch.full((cfg.vocab_size,), -100, dtype=torch.long)  # target id -> draft id; -100: not in it
    to_draft[draft.target_ids] = torch.arange(cfg.draft_vocab_size)
    n, length = nxt.shape
    inputs, labels = nxt[:, :-1], to_draft[nxt[:, 1:]]  # position p reads token p + 1 and predicts token p + 2
    positions = torch.arange(length - 1)[None].expand(n, -1)
    cos, sin = eagle.rope_tables(cfg, positions)
    mask = simple_mask(n, 0, length - 1)
    empty = torch.zeros(n, cfg.num_key_value_heads, 0, cfg.head_dim)
    opt = torch.optim.Adam(list(params.values()), lr=lr)
    for step in range(steps):
        hidden = eagle.draft_fc(ops, cfg, aux[:, :-1], params)
        out, _, _ = eagle.draft_layer(ops, cfg, embed[inputs], hidden, cos, sin, mask, empty, empty, params)
        logits = eagle.draft_head(ops, cfg, out, params)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % max(1, steps // 10) == 0 or step == steps - 1:
            with torch.no_grad():
                ok = labels != -100
                agree = (logits.argmax(-1) == labels)[ok].float().mean().item()
            log(f"distill_draft: step {step + 1}/{steps}: loss {loss.item():.3f}, first-position agreement "
                f"{agree:.1%} on the training positions")
    return {k: v.detach() for k, v in params.items()}


def write(draft, trained: dict[str, torch.Tensor], out: Path) -> None:
    """The trained weights under the draft's own stored names and dtypes, its other files copied."""
    from k2trt.draft import normalized_name
    from k2trt.safetensors_io import SafetensorsFile, save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in draft.root.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    for f in sorted(draft.root.glob("*.safetensors")):
        st = SafetensorsFile(f)
        tensors = {}
        for name in st.names():
            t = st.tensor(name)
            key = normalized_name(name)
            tensors[name] = trained[key].to(t.dtype) if key in trained else t.clone()
        save_file(tensors, out / f.name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m k2trt.tools.distill_draft", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="the target checkpoint (the tiny one)")
    p.add_argument("--draft", type=Path, required=True, help="a Llama-layout draft for it (make-tiny --draft llama)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sequences", type=at_least(1), default=48)
    p.add_argument("--prompt-len", type=at_least(2), default=24)
    p.add_argument("--new-tokens", type=at_least(2), default=64)
    p.add_argument("--steps", type=at_least(1), default=300)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=1, help="of the prompts (spec_bench's are seed 0: keep them apart)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="train on the continuation of this text instead of random prompts (repeat for several)")
    args = p.parse_args(argv)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    draft, ckpt, aux, nxt = collect(args.model, args.draft, args.sequences, args.prompt_len, args.new_tokens,
                                    args.seed, args.prompt)
    log(f"distill_draft: {nxt.numel()} positions of {nxt.shape[0]} greedy continuations "
        f"({time.perf_counter() - t0:.0f} s)")
    name = "model.embed_tokens.weight"
    trained = train(draft, ckpt.globals([name])[name], aux, nxt, args.steps, args.lr, log)
    write(draft, trained, args.out)
    print(json.dumps({"out": str(args.out), "positions": nxt.numel(), "seconds": round(time.perf_counter() - t0)}))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except K2Error as e:
        print(f"distill_draft: error: {e}", file=sys.stderr)
        sys.exit(2)
