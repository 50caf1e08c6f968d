"""Faults of `--pipeline N`, each ended within a bounded time with one line naming the right rank: a rank killed
on an idle server, a killed launcher (no rank may outlive it), ^C (one line, not one per rank), a fault every rank
finds (always the same rank named), and the rule that picks the cause among the ranks' records.

Every wait is a poll with a deadline on a state (a port answering, a process gone), never a fixed sleep; the
deadlines are hang guards far above the work."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from k2trt.runtime.distributed.launch import first_cause
from k2trt.tools.bench_serve import free_port

K2TRT = [sys.executable, "-m", "k2trt.cli"]
HANG_S = 120  # far above any of this work on a slow machine


def record(at: float, message: str, lost: bool = False) -> str:
    return json.dumps({"at": at, "message": message, "lost": lost})


def test_the_cause_is_a_reason_then_a_silent_death_then_a_lost_contact():
    lost = {0: record(2.0, "lost contact with the pipeline (connection closed)", lost=True)}
    # rank 1 died without a word (SIGKILL): rank 0 only lost contact with it
    assert first_cause(lost, [(1, -9), (0, 2)]) == "rank 1 was killed by signal 9"
    # a rank's own reason beats everything, even one written after another rank's lost contact
    assert first_cause({**lost, 2: record(3.0, "bad shard")}, [(0, 2), (2, 2)]) == "rank 2: bad shard"
    # the same fault found by several ranks names the lowest of them, whoever wrote first
    same = {r: record(at, "shard missing") for r, at in ((2, 1.0), (0, 1.2), (1, 1.1))}
    assert first_cause(same, [(2, 2), (1, 2), (0, 2)]) == "rank 0: shard missing"
    # different faults: the earliest
    assert first_cause({1: record(1.0, "a"), 0: record(2.0, "b")}, [(1, 2), (0, 2)]) == "rank 1: a"
    # only lost contacts: the first of them
    assert first_cause(lost, [(0, 2)]) == "rank 0: lost contact with the pipeline (connection closed)"
    assert first_cause({}, [(1, 3)]) == "rank 1 exited with status 3"


def ranks_of(launcher: int) -> dict[int, int]:
    """rank -> pid of the launcher's children (their RANK in /proc/<pid>/environ)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher:
            rank = [e for e in env if e.startswith(b"RANK=")]
            if rank:
                found[int(rank[0][5:])] = int(pid)
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_until(what: str, test, timeout_s: float = HANG_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = test()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


class PipelineServer:
    """`k2trt serve --pipeline 2` in a session of its own (so a test can send ^C to the whole group, as a terminal
    does), its output in files under tmp_path, up when /health answers."""

    def __init__(self, tmp_path: Path, ckpt, onnx):
        self.port = free_port()
        self.out, self.err = open(tmp_path / "out.log", "w+"), open(tmp_path / "err.log", "w+")
        self.proc = subprocess.Popen(
            K2TRT + ["serve", "--model", str(ckpt), "--onnx", str(onnx), "--pipeline", "2", "--port", str(self.port),
                     "--log-level", "warning", "--dist-timeout", "30"],
            stdout=self.out, stderr=self.err, start_new_session=True)
        wait_until("the server to answer /health", self._healthy)
        self.ranks = ranks_of(self.proc.pid)
        assert sorted(self.ranks) == [0, 1], self.ranks

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.stderr()
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def stderr(self) -> str:
        self.err.flush()
        self.err.seek(0)
        return self.err.read()

    def wait(self) -> int:
        return self.proc.wait(timeout=HANG_S)

    def close(self) -> None:
        """Nothing left behind, whatever the test did."""
        for pid in [self.proc.pid, *self.ranks.values()]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=HANG_S)
        self.out.close()
        self.err.close()


@pytest.fixture
def pipeline_server(tmp_path, tiny_ckpt, tiny_export):
    s = PipelineServer(tmp_path, tiny_ckpt, tiny_export)
    yield s
    s.close()


@pytest.mark.slow
def test_a_rank_killed_on_an_idle_server_is_the_one_named(pipeline_server):
    os.kill(pipeline_server.ranks[1], signal.SIGKILL)
    assert pipeline_server.wait() == 2
    lines = pipeline_server.stderr().strip().splitlines()
    assert lines == ["k2trt serve: error: rank 1 was killed by signal 9"], lines
    assert not alive(pipeline_server.ranks[0])


@pytest.mark.slow
def test_a_rank_killed_mid_stream_ends_the_stream_with_an_error_and_done(pipeline_server):
    """The client is told in the stream (an error event, then [DONE]), the log has no traceback, and the one line
    names the rank that died."""
    s = pipeline_server
    body = {"model": "x", "prompt": "Hi", "max_tokens": 100000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HANG_S) as client:
        model = client.get(f"http://127.0.0.1:{s.port}/v1/models").json()["data"][0]["id"]
        with client.stream("POST", f"http://127.0.0.1:{s.port}/v1/completions", json={**body, "model": model}) as r:
            assert r.status_code == 200
            events = []
            for line in r.iter_lines():
                if not line:
                    continue
                events.append(line)
                if len(events) == 2:  # decoding: the stream has started
                    os.kill(s.ranks[1], signal.SIGKILL)
    assert events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "server_error", error
    assert s.wait() == 2
    lines = s.stderr().strip().splitlines()
    assert lines == ["k2trt serve: error: rank 1 was killed by signal 9"], lines


@pytest.mark.slow
def test_a_killed_launcher_leaves_no_rank_behind(pipeline_server):
    os.kill(pipeline_server.proc.pid, signal.SIGKILL)
    pipeline_server.wait()
    wait_until("every rank to end", lambda: not any(alive(p) for p in pipeline_server.ranks.values()))
    lines = pipeline_server.stderr().strip().splitlines()
    assert lines == ["k2trt: the pipeline's launcher is gone; ending every rank"], lines


@pytest.mark.slow
def test_interrupt_under_a_pipeline_is_one_line(pipeline_server):
    os.killpg(pipeline_server.proc.pid, signal.SIGINT)  # ^C: the terminal signals every process of the group
    assert pipeline_server.wait() == 130
    wait_until("every rank to end", lambda: not any(alive(p) for p in pipeline_server.ranks.values()))
    lines = pipeline_server.stderr().strip().splitlines()
    assert lines == ["k2trt serve: interrupted"], lines


@pytest.mark.slow
def test_a_fault_every_rank_finds_names_the_same_rank(tiny_ckpt, tiny_export, tmp_path):
    """A missing shard: every rank opens the index and finds it gone; rank 0 is named, run after run."""
    from fixtures import clone

    index = json.loads((Path(tiny_ckpt) / "model.safetensors.index.json").read_text())["weight_map"]
    gone = sorted(set(index.values()))[2]
    bad = clone(Path(tiny_ckpt), tmp_path / "ckpt")
    (bad / gone).unlink()
    for _ in range(2):
        r = subprocess.run(K2TRT + ["generate", "--model", str(bad), "--onnx", str(tiny_export), "--prompt", "Hi",
                                    "--pipeline", "3"], capture_output=True, text=True, timeout=HANG_S)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-3000:]
        assert lines[0].startswith("k2trt generate: error: rank 0: ") and gone in lines[0], lines
    shutil.rmtree(bad)
