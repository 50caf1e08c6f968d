"""`--pipeline N` on one machine: start N ranks of the same command, watch them, end them together.

This process hosts the store the ranks meet through (so it outlives them and can read why one failed), starts
each rank as `python -m k2trt.cli <the same arguments>` with RANK / WORLD_SIZE / LOCAL_RANK set (rank 0 keeps the
terminal; the others print nothing unless something fails), and waits. The first rank that exits non-zero ends all
the others (SIGTERM, then SIGKILL after a grace period), and this process prints one line: which rank, and the
reason it wrote to the store — or, for a rank that died without one, the signal that killed it, since the others
only lost contact with it. Ranks hold the read end of a pipe only this process writes to: if it dies, even by
SIGKILL, they end too. ^C is reported once, by this process. Across nodes, torchrun starts the same command on
every rank instead (docs/ARCHITECTURE.md), and the ranks meet through its store.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import timedelta

from k2trt.errors import READER_GONE, K2Error
from k2trt.runtime.distributed.launcher_link import LAUNCHER_FD_ENV, STORE_ENV
from k2trt.runtime.distributed.world import causes, cpu_threads, earliest, failures

GRACE_S = 5.0
SETTLE_S = 1.0  # after the first failure: how long the other ranks may take to exit with their own reasons


def strip_pipeline_flag(argv: list[str]) -> list[str]:
    """The command line without --pipeline N (a rank runs its part, it does not launch)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--pipeline":
            skip = True
        elif not a.startswith("--pipeline="):
            out.append(a)
    return out


def _rank_env(rank: int, size: int, store_port: int, watch_fd: int) -> dict:
    env = dict(os.environ)
    env.update(RANK=str(rank), WORLD_SIZE=str(size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(size),
               MASTER_ADDR="127.0.0.1", **{STORE_ENV: f"127.0.0.1:{store_port}", LAUNCHER_FD_ENV: str(watch_fd)})
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: loopback, whatever the hostname resolves to
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads(size)))
    return env


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def exit_reason(code: int) -> str:
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def first_cause(records: dict[int, str], exits: list[tuple[int, int]]) -> str:
    """The one line for a failed pipeline, from the ranks' records and the abnormal exits this launcher saw, in
    the order it saw them: a rank's own reason first; else a rank that died without one (SIGKILL, a crash) — the
    others only lost contact with it; else the first rank that lost contact."""
    found, lost = causes(records)
    first = earliest(found)
    if first:
        return f"rank {first[0]}: {first[1]}"
    silent = [(r, c) for r, c in exits if r not in records]
    if silent:
        r, code = silent[0]
        return f"rank {r} {exit_reason(code)}"
    first = earliest(lost)
    if first:
        return f"rank {first[0]}: {first[1]}"
    r, code = exits[0]
    return f"rank {r} {exit_reason(code)}"


def run_pipeline(argv: list[str], size: int) -> int:
    """Run `k2trt <argv>` as `size` ranks on this machine; returns the exit status (raises K2Error on failure).
    SIGTERM is passed to rank 0, which ends the pipeline in order (a server stops gracefully); the exit status is
    then rank 0's."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    cmd = [sys.executable, "-m", "k2trt.cli", *strip_pipeline_flag(argv)]
    procs: list[subprocess.Popen] = []
    stopping: list[float] = []  # when a stop was asked for
    exits: list[tuple[int, int]] = []  # (rank, status) of each abnormal exit, in the order seen
    # Only this process holds the write end: when it dies, however, every rank reads end-of-file and ends
    # (environment.watch_launcher), so a killed launcher leaves no rank behind.
    watch_r, watch_w = os.pipe()

    def forward(sig, frame):
        stopping.append(time.monotonic())
        if procs and procs[0].poll() is None:
            procs[0].send_signal(sig)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        for r in range(size):
            quiet = {} if r == 0 else {"stdout": subprocess.DEVNULL}
            procs.append(subprocess.Popen(cmd, env=_rank_env(r, size, store.port, watch_r), pass_fds=(watch_r,),
                                          **quiet))
        os.close(watch_r)
        while True:
            codes = [p.poll() for p in procs]
            exits += [(r, c) for r, c in enumerate(codes) if c not in (None, 0) and all(r != x for x, _ in exits)]
            if stopping:
                if all(c is not None for c in codes):
                    return codes[0]
                if time.monotonic() - stopping[0] > 60:  # the stages did not end in order: end them
                    _end(procs)
                    return codes[0] if codes[0] is not None else 1
            elif codes[0] == READER_GONE:  # rank 0's reader left (`... | head`): not a failure, end quietly
                _end(procs)
                return READER_GONE
            else:
                failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
                if failed:
                    # Let the others' reasons land before choosing: ranks that found the same fault (a shard every
                    # rank opens) exit at about the same time, and then the lowest of them is named.
                    settle = time.monotonic() + SETTLE_S
                    while any(p.poll() is None for p in procs) and time.monotonic() < settle:
                        time.sleep(0.05)
                    _end(procs)  # before the watch pipe closes: the ranks are ended, not told the launcher left
                    raise K2Error(first_cause(failures(store, size), exits))
                if all(c == 0 for c in codes):
                    return 0
            time.sleep(0.05)
    except KeyboardInterrupt:  # ^C reached every rank too (one terminal): give them a moment to stop in order
        deadline = time.monotonic() + GRACE_S
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        _end(procs)
        raise  # the ranks stay quiet about it (cli.main): the one line is this process's
    finally:
        signal.signal(signal.SIGTERM, previous)
        os.close(watch_w)
