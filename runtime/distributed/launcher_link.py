"""Who this process is in a pipeline, read from the environment alone (no torch import, so the CLI can ask while a
subcommand's imports are still loading), and the watch every rank our launcher starts keeps on it."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from k2trt.errors import K2Error

STORE_ENV = "K2TRT_STORE"  # host:port of the store our launcher hosts
LAUNCHER_FD_ENV = "K2TRT_LAUNCHER_FD"  # the read end of a pipe whose write end only the launcher holds
LAUNCHER_GONE_GRACE_S = 5.0  # after the launcher dies: how long a rank may take to stop in order before it is ended


class LostContact(K2Error):
    """This rank failed because another one went away: an effect, never the cause a launcher reports first."""


def launched() -> bool:
    """Whether this process is a pipeline rank: started by our launcher (even as the only stage), or one of
    several started by torchrun."""
    return bool(os.environ.get(STORE_ENV)) or int(os.environ.get("WORLD_SIZE", "1")) > 1


def under_launcher() -> bool:
    """Whether our launcher (not torchrun) started this rank: it then speaks for every rank on the terminal."""
    return bool(os.environ.get(STORE_ENV)) and os.environ.get("RANK") is not None


def watch_launcher() -> threading.Thread | None:
    """End this rank when the launcher that started it dies, however it dies (SIGKILL included): the launcher
    holds the only write end of a pipe, so its death is end-of-file here. The rank is asked to stop as SIGTERM
    asks (a server drains), and ended if it has not within LAUNCHER_GONE_GRACE_S. None where no launcher watches."""
    fd = os.environ.get(LAUNCHER_FD_ENV)
    if not fd or not fd.isdigit():
        return None

    def watch(fd: int) -> None:
        try:
            while os.read(fd, 1):
                pass
        except OSError:
            pass
        if os.environ.get("RANK") == "0":  # the rank with the terminal says it once
            print("k2trt: the pipeline's launcher is gone; ending every rank", file=sys.stderr, flush=True)
        # What follows is the ranks losing their store and each other: noise nobody can act on.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stderr.fileno())
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(LAUNCHER_GONE_GRACE_S)
        os._exit(1)

    thread = threading.Thread(target=watch, args=(int(fd),), name="k2trt-launcher-watch", daemon=True)
    thread.start()
    return thread
