"""The processes of a pipeline: who this rank is, how they meet, and how one rank's failure reaches the others.

A rank learns its place from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), or from our own launcher (runtime/distributed/launch.py), which also hosts the key-value store
(K2TRT_STORE=host:port) and so outlives the ranks. Through the store every rank reports its loading progress and,
if it fails, one line saying why; the step traffic goes over process groups: gloo for the plans and the sampled
ids (CPU tensors), and NCCL for the hidden states when the ranks run on GPUs (gloo on a CPU). Every collective
has a timeout, so a rank that dies or hangs cannot keep the others waiting for ever.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from k2trt.errors import K2Error
from k2trt.runtime.distributed.launcher_link import (STORE_ENV, LostContact, launched,  # noqa: F401 (re-exported)
                                                   under_launcher)

DEFAULT_TIMEOUT_S = 120.0  # any one collective or transfer of a step
LOAD_TIMEOUT_S = 24 * 3600.0  # loading a stage of the real model takes many minutes: waited on with progress


def failure_key(rank: int) -> str:
    return f"k2trt/failed/{rank}"


def failure_record(message: str, lost: bool = False) -> str:
    return json.dumps({"at": time.time(), "message": message, "lost": lost})


def causes(records: dict[int, str]) -> tuple[dict[int, dict], dict[int, dict]]:
    """The records split into (causes, ranks that only lost contact with another)."""
    parsed = {r: json.loads(v) for r, v in records.items()}
    return ({r: p for r, p in parsed.items() if not p.get("lost")},
            {r: p for r, p in parsed.items() if p.get("lost")})


def earliest(parsed: dict[int, dict]) -> tuple[int, str] | None:
    """(rank, message) of the earliest record. Several ranks that found the same fault (a missing shard every rank
    opens) write the same message: the lowest of them is named, so the same fault always names the same rank."""
    if not parsed:
        return None
    r = min(parsed, key=lambda k: parsed[k]["at"])
    message = parsed[r]["message"]
    return min(k for k, p in parsed.items() if p["message"] == message), message


def first_failure(records: dict[int, str]) -> tuple[int, str] | None:
    """(rank, message) of the failure to report: the earliest cause, else the earliest lost contact."""
    found, lost = causes(records)
    return earliest(found) or earliest(lost)


def read_key(store: dist.Store, key: str) -> bytes | None:
    """The key's value, or None when it is not set or the store's host has gone with the pipeline."""
    try:
        return store.get(key) if store.check([key]) else None
    except Exception:
        return None


def failures(store: dist.Store, size: int) -> dict[int, str]:
    """rank -> failure record, of every rank that has written one."""
    return {r: raw.decode() for r in range(size) if (raw := read_key(store, failure_key(r))) is not None}


def failed_error(first: tuple[int, str]) -> K2Error:
    return K2Error(f"rank {first[0]} failed: {first[1]}")


def cpu_threads(ranks_here: int) -> int:
    """Threads per rank when several ranks share this machine's cores."""
    return max(1, (os.cpu_count() or 1) // max(1, ranks_here))


def _launcher_store(hosted: str, size: int, timeout: timedelta) -> dist.Store:
    """A client of the store our launcher hosts at host:port."""
    host, port = hosted.rsplit(":", 1)
    return dist.TCPStore(host, int(port), size, is_master=False, timeout=timeout)


def report_to_launcher(message: str, lost: bool = False) -> bool:
    """Write this rank's failure where our launcher reads it (before or after joining); `lost`: it only lost
    contact with another rank. False if not launched by it (torchrun): the rank then prints its own line."""
    if not under_launcher():
        return False
    try:
        hosted, rank = os.environ[STORE_ENV], int(os.environ["RANK"])
        store = _launcher_store(hosted, int(os.environ.get("WORLD_SIZE", "1")), timedelta(seconds=5))
        store.set(failure_key(rank), failure_record(message, lost))
    except Exception:  # the launcher is gone: nobody is left to tell
        pass
    return True


@dataclass
class World:
    rank: int
    size: int
    local_rank: int
    store: dist.Store
    cpu_group: object  # gloo: plans, sampled ids
    device_group: object  # hidden states: NCCL between GPUs, gloo on CPUs
    timeout_s: float

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    # ---- failures: one line per failing rank, in the store -------------------------------------------
    def raise_if_failed(self) -> None:
        first = first_failure(failures(self.store, self.size))
        if first:
            raise failed_error(first)

    def lost_contact(self, error: Exception) -> K2Error:
        """The one line for a step that failed because another rank went away: its reason if it wrote one."""
        time.sleep(0.5)  # a failing rank writes its reason before its sockets close
        found, _ = causes(failures(self.store, self.size))
        first = earliest(found)
        if first:
            return LostContact(failed_error(first))
        return LostContact(f"lost contact with the pipeline ({str(error).splitlines()[0][:200]})")

    def wait_for(self, keys: list[str], timeout_s: float) -> None:
        """Wait until every key is set, watching for failures."""
        end = time.monotonic() + timeout_s
        while True:
            self.raise_if_failed()
            if self.store.check(keys):
                return
            if time.monotonic() > end:
                missing = [k for k in keys if not self.store.check([k])]
                raise K2Error(f"timed out after {timeout_s:.0f} s waiting for {', '.join(missing)}")
            time.sleep(0.2)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _store(rank: int, size: int, timeout: timedelta) -> dist.Store:
    hosted = os.environ.get(STORE_ENV)
    if hosted:  # our launcher hosts the store: every rank is a client
        return _launcher_store(hosted, size, timeout)
    from torch.distributed import rendezvous  # torchrun: rank 0 or the elastic agent hosts it

    store, _, _ = next(rendezvous("env://", rank=rank, world_size=size, timeout=timeout))
    return store


def join(timeout_s: float = DEFAULT_TIMEOUT_S, use_cuda: bool = False) -> World:
    """Join the pipeline this process was launched into."""
    try:
        rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
    except (KeyError, ValueError):
        raise K2Error("RANK and WORLD_SIZE must be set for a pipeline rank (use --pipeline N or torchrun)") from None
    timeout = timedelta(seconds=timeout_s)
    store = _store(rank, size, timeout)
    if use_cuda:
        torch.cuda.set_device(local_rank)  # before any engine is deserialized: it belongs to the current device
    backend = "nccl" if use_cuda else "gloo"
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank, world_size=size,
                            timeout=timeout)
    cpu_group = dist.new_group(backend="gloo", timeout=timeout) if use_cuda else dist.group.WORLD
    return World(rank, size, local_rank, store, cpu_group, dist.group.WORLD, timeout_s)


def new_groups(world: World, rank_lists: list[list[int]]) -> list:
    """A process group per list of ranks (every rank creates every group, in the same order, as
    torch.distributed requires), on the world's device backend: NCCL between GPUs, gloo on CPUs."""
    timeout = timedelta(seconds=world.timeout_s)
    return [dist.new_group(ranks, timeout=timeout) for ranks in rank_lists]
