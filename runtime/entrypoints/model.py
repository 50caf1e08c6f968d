"""A model loaded for a command: from command-line choices to a ready checkpoint, tokenizer and backend
(`load_model` -> LoadedModel), the one place that checks that they belong together, and the scheduler or static
batch the command runs on it. The backend itself comes from the factory (runtime/backends/factory.py); under a
pipeline (`--pipeline N` or torchrun) each rank binds only its stage, and every rank but 0 follows rank 0's
steps."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from k2trt.args import FreeShare, at_least, int_in, int_list, memory_size, positive_number
from k2trt.errors import K2Error
from k2trt.hub import model_dir
from k2trt.runtime.backends.contract import Backend
from k2trt.runtime.backends.factory import BackendChoice, add_backend_arguments, choice_from_args, open_backend


MAX_LOCAL_RANKS = 1024  # --pipeline starts this many processes on one machine, one per device

def speculative_config(text: str):
    """An argparse type: --speculative-config's JSON, checked (runtime/generation/speculation.py)."""
    from k2trt.runtime.generation.speculation import SpeculativeConfig

    try:
        return SpeculativeConfig.parse(text)
    except K2Error as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--speculative-config: ")) from None


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=model_dir, required=True,
                   help="checkpoint directory (weights, config, tokenizer), or owner/name[@revision] from the Hugging Face cache")
    add_backend_arguments(p)
    p.add_argument("--max-context", type=at_least(1), default=None,
                   help="refuse prompts + new tokens longer than this (default: the model's maximum)")
    p.add_argument("--cache-memory", type=memory_size, default=None, metavar="SIZE",
                   help="latent-cache memory per device, of the layers it holds: bytes (e.g. 8GiB) or a share "
                        "of the device's free memory once the model has loaded (e.g. 90%%); its pages are shared "
                        "by the sequences as they grow (default: every slot can reach --max-context; on a GPU at "
                        "most 90%% of the free memory)")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM takes it: {"method": "ngram", "num_speculative_tokens": 3, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} (prompt lookup: drafts copied from the '
                        "prompt and output; the tokens are those decoding without it gives)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="compute every prompt in full (default: reuse the cached pages of a prompt's prefix "
                        "another request computed)")


def add_pipeline_arguments(p: argparse.ArgumentParser, micro_batch_list: bool = False) -> None:
    """For the commands that run as pipeline stages (generate, serve, bench); chat is one process. bench takes a
    list of micro-batch counts (each measured in the same run)."""
    g = p.add_argument_group("pipeline parallelism")
    g.add_argument("--pipeline", type=int_in(1, MAX_LOCAL_RANKS), default=None, metavar="N",
                   help="run as N pipeline stages on this machine, one process each (across nodes: torchrun)")
    g.add_argument("--stages", default=None, metavar="COUNTS",
                   help="blocks per stage, e.g. 2,2 (default: split by bytes, see `k2trt plan`)")
    g.add_argument("--expert-parallel", type=int_in(1, MAX_LOCAL_RANKS), default=None, metavar="E",
                   help="E expert-parallel ranks per stage: each holds 1/E of every MoE block's routed experts and "
                        "runs its own requests' attention (needs `k2trt export --expert-parallel E`); with "
                        "--pipeline P, P x E processes")
    g.add_argument("--micro-batches", type=int_list(1) if micro_batch_list else at_least(1),
                   default=[1] if micro_batch_list else 1, metavar="M" + (",..." if micro_batch_list else ""),
                   help="requests dealt to M micro-batches, up to one per stage in flight, so the stages work at "
                        "once (default 1)" + ("; several counts are measured one after another" if micro_batch_list
                                              else ""))
    g.add_argument("--dist-timeout", type=positive_number, default=None, metavar="SECONDS",
                   help="how long a step may wait for another rank before giving up (default 120)")


@dataclass
class LoadedModel:
    backend: Backend
    tokenizer: object
    checkpoint: object
    session: object = None  # a pipeline rank's RankSession, or None in a single process
    micro_batches: int = 1  # lanes of requests in flight through the pipeline (rank 0)
    cache_budgets: list | None = None  # rank 0 of a pipeline: every rank's runtime/cache/sizing.CacheBudget

    @property
    def config(self):
        return self.checkpoint.config

    @property
    def executor(self):
        """What the scheduler runs steps on: rank 0's pipeline executor, or None (a local StageExecutor)."""
        return self.session.leader if self.session is not None else None

    def limits(self, max_context: int | None = None, max_batch: int | None = None,
               cache_memory: int | FreeShare | None = None):
        """The scheduler's limits: the model's, the user's and the backend's, resolved once. E expert-parallel
        ranks hold E times the sequences one backend takes (each its own), in E partitions of the pool.
        cache_memory: bytes of latent cache per device (of the layers it holds), a share of the device's free
        memory, or None for the default pool. Under a pipeline each rank measured its own (`cache_budgets`, from
        the same --cache-memory) and the pool is what every rank can hold."""
        from k2trt.runtime.cache.sizing import CacheBudget, pool_pages
        from k2trt.runtime.generation.limits import Limits

        backend = self.backend.limits
        columns = self.session.layout.expert_parallel if self.session is not None else 1
        if backend.max_batch and columns > 1:
            backend = replace(backend, max_batch=backend.max_batch * columns)
        unsized = Limits.resolve(self.config, backend, max_context=max_context, max_batch=max_batch,
                                 cache_parts=columns)
        budgets = self.cache_budgets
        if budgets is None:
            layers = len(self.session.stage.layers) if self.session is not None else self.config.num_hidden_layers
            budgets = [CacheBudget.measure(cache_memory, self.backend.device, layers)]
        pages = pool_pages(budgets, self.config, self.backend.act_dtype, unsized.part_batch, unsized.cache_pages)
        return replace(unsized, cache_pages=pages) if pages else unsized

    def scheduler(self, limits, prefix_cache: bool = True, speculation=None):
        """A scheduler over this model: its steps run here (one process) or down rank 0's pipeline — with several
        micro-batches in flight, M schedulers behind one (runtime/distributed/micro_batches.py)."""
        from k2trt.runtime.generation.executor import StageExecutor
        from k2trt.runtime.generation.scheduler import Scheduler

        from k2trt.runtime.generation.eagle import make_drafter

        drafter = make_drafter(speculation, self.config, self.backend.weights, self.backend)
        if self.micro_batches > 1 and self.executor is not None:
            from k2trt.runtime.distributed.micro_batches import MicroBatchScheduler

            return MicroBatchScheduler(self.executor, self.config, limits, self.micro_batches, prefix_cache,
                                       speculation, drafter)

        return Scheduler(self.executor or StageExecutor(self.backend, self.config), self.config, limits, prefix_cache,
                         speculation, drafter)

    @property
    def follower(self) -> bool:
        return self.session is not None and self.session.leader is None

    def close(self) -> list | None:
        """End the pipeline (rank 0): every rank leaves its loop; -> each rank's timings."""
        if self.session is None or self.session.leader is None:
            return None
        stats = self.session.shutdown()
        self.session.world.close()
        return stats


def open_model(model_dir: Path, validate: bool = True):
    """The checkpoint (every tensor checked against the config, from the headers) and its tokenizer, checked
    against each other: a damaged checkpoint is refused before any weight is bound. A pipeline rank passes
    validate=False and checks only its own stage's tensors (runtime/distributed/session.py)."""
    from k2trt.checkpoint import Checkpoint
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    ckpt = Checkpoint.open(model_dir)
    if validate:
        ckpt.validate()
    tok = KimiTokenizer.from_dir(model_dir)
    if tok.vocab_size != ckpt.config.vocab_size:
        raise K2Error(f"{model_dir}: tokenizer has {tok.vocab_size} ids but config.json says vocab_size "
                      f"{ckpt.config.vocab_size}")
    return ckpt, tok


def progress_line(prefix: str, doing: str = "binding weights", stream=None):
    """A progress callback show(done, total, what) that rewrites one line on a terminal (and says nothing
    elsewhere): Backend.prepare's, and the long-prefill line of generate."""
    stream = stream or sys.stderr
    if not stream.isatty():
        return None

    def show(done: int, total: int, what: str) -> None:
        stream.write(f"\r{prefix}: {doing} {done:,}/{total:,} ({what})\033[K" + ("\n" if done == total else ""))
        stream.flush()

    return show


def load_model(args, choice: BackendChoice | None = None, command: str = "generate",
               micro_batches: int | None = None) -> LoadedModel:
    """micro_batches: the lanes rank 0's scheduler deals requests to (default --micro-batches)."""
    from k2trt.runtime.distributed.world import DEFAULT_TIMEOUT_S, launched

    micro_batches = micro_batches or getattr(args, "micro_batches", 1)
    choice = choice or choice_from_args(args)
    ckpt, tok = open_model(args.model, validate=not launched())
    if launched():
        from k2trt.runtime.distributed.placement import parse_counts
        from k2trt.runtime.distributed.session import load_rank

        counts = parse_counts(args.stages) if getattr(args, "stages", None) else None
        backend, session = load_rank(ckpt, choice, counts, getattr(args, "dist_timeout", None) or DEFAULT_TIMEOUT_S,
                                     getattr(args, "expert_parallel", None) or 1)
        from k2trt.runtime.cache.sizing import CacheBudget

        # each rank's device and layers, measured now its weights are bound: rank 0 sizes the pool from all of them
        mine = CacheBudget.measure(getattr(args, "cache_memory", None), backend.device, len(session.stage.layers),
                                   session.world.rank)
        return LoadedModel(backend, tok, ckpt, session, micro_batches, session.cache_budgets(mine))
    if micro_batches > 1:
        raise K2Error("--micro-batches keeps several steps in flight through pipeline stages: give --pipeline too")
    backend = open_backend(choice, ckpt)
    backend.prepare(progress=progress_line(f"k2trt {command}"))
    return LoadedModel(backend, tok, ckpt)


def launch_if_asked(args) -> int | None:
    """`--pipeline N` in the user's own process: start the N ranks and return their exit status; None when this
    process is itself the work (no --pipeline, or already a rank)."""
    from k2trt.runtime.distributed.world import launched

    stages, experts = getattr(args, "pipeline", None), getattr(args, "expert_parallel", None)
    if (stages is None and experts is None) or launched():
        return None
    from k2trt.config import K2Config, check_expert_parallel
    from k2trt.runtime.distributed.launch import run_pipeline

    cfg = K2Config.from_json(args.model)
    check_expert_parallel(cfg, experts or 1)  # one line before any rank starts
    from k2trt.runtime.distributed.placement import check_stage_counts, parse_counts

    counts = parse_counts(args.stages) if getattr(args, "stages", None) else None
    check_stage_counts(counts, stages or 1, cfg.num_hidden_layers)

    return run_pipeline(args.argv, (stages or 1) * (experts or 1))


def make_generator(loaded: LoadedModel, args):
    """A static batch through the scheduler (generate; chat, whose every turn resends the conversation: the prefix
    cache gives it the last turn's pages)."""
    from k2trt.runtime.generation.generator import Generator

    limits = loaded.limits(args.max_context, cache_memory=args.cache_memory)
    scheduler = loaded.scheduler(limits, prefix_cache=args.prefix_cache, speculation=args.speculative_config)
    return Generator(loaded.backend, loaded.config, limits, executor=scheduler.executor,
                     scheduler=scheduler)
