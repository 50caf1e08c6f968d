"""Hostile inputs: every damaged file and bad value gets one clear line (`k2trt X: error: ...`, exit 2, no
traceback); nothing hangs; nothing runs on values the model cannot compute with. One test per class of input,
several cases each (the header fuzzer is tests/test_safetensors_fuzz.py)."""

from __future__ import annotations

import pytest
import torch

from fixtures import clone, one_error_line, rewrite_tensors, shard_of
from k2trt.checkpoint import Checkpoint, CheckpointError
from k2trt.cli import main

EMBED, NORM, HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
INDEX = "model.safetensors.index.json"


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- 2. every tensor a command uses is checked against the weight table ---------------------------------

GLOBAL_DAMAGE = {
    "lm_head missing": (HEAD, lambda t: t.pop(HEAD), "missing tensor 'lm_head.weight'"),
    "embedding of the wrong shape": (EMBED, lambda t: t.update({EMBED: t[EMBED][:, :64].clone()}),
                                     "has shape [2048, 64], expected [2048, 128]"),
    "final norm stored as FP8": (NORM, lambda t: t.update({NORM: t[NORM].to(torch.float8_e4m3fn)}),
                                 "has dtype float8_e4m3fn, expected bfloat16"),
    "lm_head in float32": (HEAD, lambda t: t.update({HEAD: t[HEAD].float()}), "has dtype float32, expected bfloat16"),
}


@pytest.mark.parametrize("case", list(GLOBAL_DAMAGE))
def test_generate_refuses_the_globals_inspect_refuses(tiny_ckpt, tiny_export, tmp_path, capsys, case):
    name, edit, message = GLOBAL_DAMAGE[case]
    shard = shard_of(tiny_ckpt, name)
    broken = clone(tiny_ckpt, tmp_path / "ckpt", copy=(shard, INDEX))
    rewrite_tensors(broken, shard, edit)
    for argv in (["generate", "--model", str(broken), "--onnx", str(tiny_export), "--prompt", "Hi"],
                 ["generate", "--model", str(broken), "--backend", "torch", "--prompt", "Hi"],
                 ["inspect", str(broken)]):
        rc, out, err = cli(capsys, *argv)
        if argv[0] == "inspect":  # inspect prints its table and the differences, and exits 1
            assert rc == 1 and message in out
        else:
            assert message in one_error_line(rc, err, "generate")
    # Not only at load: a weight source never hands out a tensor the table refuses.
    with pytest.raises(CheckpointError, match="lm_head|model.norm|embed_tokens"):
        Checkpoint.open(broken).globals()
