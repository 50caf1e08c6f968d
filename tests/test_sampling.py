"""Sampling values checked once (runtime/generation/sampling.py), in the words of their fields, for the CLI and the
API alike; degenerate values sample as their limit, never as float32's NaN; the defaults in one place."""

from __future__ import annotations

import json

import pytest
import torch

from k2trt.args import MAX_SEED
from k2trt.cli import main
from k2trt.runtime.generation.sampling import (API_DEFAULTS, DEFAULTS, FLOAT32_ZERO, Sampler, SamplingError,
                                              SamplingParams, sample_rows)

V = 50
LOGITS = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 10  # |logit| up to ~30


@pytest.mark.parametrize("field, value, says", [
    ("temperature", -1.0, "temperature must be a finite number >= 0, got -1.0"),
    ("temperature", float("nan"), "temperature must be a finite number >= 0, got nan"),
    ("temperature", float("inf"), "temperature must be a finite number >= 0, got inf"),
    ("top_k", -1, "top_k must be an integer >= 0, got -1"),
    ("top_k", True, "top_k must be an integer >= 0, got True"),
    ("top_k", 2.5, "top_k must be an integer >= 0, got 2.5"),
    ("top_p", 0.0, "top_p must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p must be in (0, 1], got 1.5"),
    ("top_p", float("nan"), "top_p must be in (0, 1], got nan"),
    ("seed", -1, f"seed must be an integer in 0..{MAX_SEED}, got -1"),
    ("seed", MAX_SEED + 1, f"seed must be an integer in 0..{MAX_SEED}, got {MAX_SEED + 1}"),
    ("seed", None, f"seed must be an integer in 0..{MAX_SEED}, got None"),
])
def test_sampling_params_check_themselves_naming_the_field(field, value, says):
    with pytest.raises(SamplingError) as e:
        SamplingParams(**{field: value})
    assert str(e.value) == says and e.value.field == field


@pytest.mark.parametrize("flag, value, says", [
    ("--temperature", "-1", "argument --temperature: must be a finite number >= 0, got -1.0"),
    ("--top-k", "-3", "argument --top-k: must be an integer >= 0, got -3"),
    ("--top-p", "2", "argument --top-p: must be in (0, 1], got 2.0"),
    ("--seed", "-1", f"argument --seed: must be an integer in 0..{MAX_SEED}, got -1"),
    ("--top-k", "many", "argument --top-k: expected an integer, got 'many'"),
])
def test_the_cli_refuses_with_the_fields_own_rule(tiny_ckpt, capsys, flag, value, says):
    rc = main(["generate", "--model", str(tiny_ckpt), "--prompt", "Hi", flag, value])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and says in err, err


def test_defaults_live_in_sampling(tiny_ckpt):
    import argparse

    from k2trt.runtime.entrypoints.sampling_args import add_sampling_arguments, to_sampling_params
    from k2trt.runtime.serve.protocol import CompletionRequest

    p = argparse.ArgumentParser()
    add_sampling_arguments(p)
    assert to_sampling_params(p.parse_args([])) == DEFAULTS and DEFAULTS.greedy
    body = CompletionRequest(model="m", prompt="x", seed=MAX_SEED - 1)
    assert body.to_sampling_params(0) == SamplingParams(temperature=API_DEFAULTS.temperature, seed=MAX_SEED - 1)
    assert body.to_sampling_params(2).seed == 0  # choice i draws with seed + i, wrapped into the seed range
    named = CompletionRequest(model="m", prompt="x", temperature=0.5, top_k=3, top_p=0.9, seed=1)
    assert named.to_sampling_params(1) == SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=2)
    unseeded = CompletionRequest(model="m", prompt="x")
    assert 0 <= unseeded.to_sampling_params(0).seed <= MAX_SEED


def _draw(params: SamplingParams, logits=LOGITS) -> list[int]:
    return Sampler(params)(logits).tolist()


def test_a_temperature_float32_cannot_divide_by_samples_greedy():
    """logits / t overflows float32 (about 3.4e38) once t < max|logit| / 3.4e38 — about 1e-37 here — and t below
    about 1.4e-45 is 0 in float32: both are the limit t -> 0, greedy. Just above the overflow the draw itself is
    one-hot on the argmax. Nothing ever picks the last id (where a NaN CDF lands)."""
    greedy = LOGITS.argmax(-1).tolist()
    peak = LOGITS.abs().max().item()
    overflow = peak / torch.finfo(torch.float32).max
    for t in (1e-300, 2 ** -150, 1e-45, overflow / 10, overflow / 1.01, overflow * 1.01, overflow * 10, 1e-30, 1e-9):
        assert _draw(SamplingParams(temperature=t, seed=3)) == greedy, t
        assert _draw(SamplingParams(temperature=t, top_k=5, top_p=0.5, seed=3)) == greedy, t


def test_a_top_p_that_is_zero_in_float32_samples_greedy():
    greedy = LOGITS.argmax(-1).tolist()
    assert SamplingParams(temperature=1.0, top_p=FLOAT32_ZERO).greedy  # rounds to 0 in float32
    assert not SamplingParams(temperature=1.0, top_p=2 ** -149).greedy  # float32's smallest subnormal
    for top_p in (1e-300, FLOAT32_ZERO, 2 ** -149, 1e-30, 1e-6):
        assert _draw(SamplingParams(temperature=1.0, top_p=top_p, seed=4)) == greedy, top_p


def test_a_huge_temperature_samples_its_limit_uniform():
    """t -> infinity is the uniform distribution: every id can come, and all are in the vocabulary."""
    seen = {tok for seed in range(400) for tok in _draw(SamplingParams(temperature=1e38, seed=seed))}
    assert len(seen) > V * 0.9 and max(seen) < V


def test_sample_rows_picks_what_each_sampler_would():
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=3), SamplingParams(top_p=FLOAT32_ZERO / 2),
              SamplingParams(temperature=1.0, top_k=5, seed=4), SamplingParams(temperature=1e-300, seed=5),
              SamplingParams(temperature=1.0, top_p=1e-300, seed=6)]
    got = sample_rows([Sampler(p) for p in params], logits)
    assert got == [int(Sampler(p)(logits[i:i + 1])[0]) for i, p in enumerate(params)]


@pytest.mark.parametrize("degenerate", [["--temperature", "1e-300"], ["--temperature", "1", "--top-p", "1e-300"],
                                        ["--temperature", "1e-40", "--top-k", "3"]])
@pytest.mark.slow
def test_degenerate_values_on_the_command_line_generate_the_greedy_tokens(tiny_ckpt, tiny_export, capsys, degenerate):
    def ids(*extra: str) -> list[int]:
        rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "Hello there",
                   "--max-new-tokens", "8", "--json", *extra])
        assert rc == 0
        return json.loads(capsys.readouterr().out)["token_ids"]

    assert ids(*degenerate) == ids()
