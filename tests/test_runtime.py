"""The runtime on the embedded tiny checkpoint: ONNX Runtime generation equals the torch reference, the
sampling and stop rules, and the clear errors of the CLI."""

import io
import json

import pytest
import torch

from k2trt.checkpoint import Checkpoint
from k2trt.cli import main
from k2trt.graphs.reference import ReferenceModel, greedy_generate
from k2trt.runtime.backends.contract import BackendLimits, BackendWrapper
from k2trt.runtime.entrypoints.printers import StreamPrinter
from k2trt.runtime.generation.generator import Generator
from k2trt.runtime.generation.limits import Limits
from k2trt.runtime.backends.ort import OrtBackend
from k2trt.runtime.generation.sampling import Sampler, SamplingParams
from k2trt.runtime.text.text_stream import StopRules
from k2trt.runtime.text.tokenizer import KimiTokenizer
from k2trt.errors import K2Error


@pytest.fixture(scope="module")
def setup(tiny_ckpt, tiny_export):
    ckpt = Checkpoint.open(tiny_ckpt)
    tok = KimiTokenizer.from_dir(tiny_ckpt)
    ref = ReferenceModel(ckpt)
    gen = Generator(OrtBackend(tiny_export, ckpt), ckpt.config)
    return ckpt, tok, ref, gen


PROMPTS = ["The quick brown fox jumps over", "Hello", "Zwölf Boxkämpfer jagen Viktor quer über den großen Sylter Deich."]


def test_greedy_batch1_matches_reference_for_32_tokens(setup):
    ckpt, tok, ref, gen = setup
    ids = tok.encode(PROMPTS[0])
    expect, first = greedy_generate(ref, ids, 32)
    (res,), _ = gen.generate([ids], 32)
    assert res.token_ids == expect
    assert len(set(expect)) > 4  # the tiny model does not just repeat one token


def test_greedy_ragged_batch_matches_reference(setup):
    ckpt, tok, ref, gen = setup
    prompts = [tok.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == 3
    results, _ = gen.generate(prompts, 32)
    for p, r in zip(prompts, results):
        assert r.token_ids == greedy_generate(ref, p, 32)[0]


def test_first_step_logits_within_tolerance(setup):
    ckpt, tok, ref, gen = setup
    ids = tok.encode(PROMPTS[2])
    _, first = greedy_generate(ref, ids, 1)
    seen = {}

    class Spy(BackendWrapper):
        def head(self, h):
            seen.setdefault("logits", self.inner.head(h))
            return seen["logits"]

    Generator(Spy(gen.backend), ckpt.config).generate([ids], 1)
    got = seen["logits"][0, -1]
    assert (got - first).abs().max() <= 1e-4 * first.abs().max()


def test_stop_token_and_stop_string(setup):
    ckpt, tok, ref, gen = setup
    ids = tok.encode(PROMPTS[0])
    free = greedy_generate(ref, ids, 8)[0]
    (res,), _ = gen.generate([ids], 8, stops=StopRules(ids=frozenset({free[3]})))
    assert res.token_ids == free[:4] and res.finish_reason == "stop_token"
    # a stop string that first appears in the text of the second token ends the sequence there, cut before it
    first, second = tok.decode(free[:1]), tok.decode(free[:2])
    stop = second[len(first):][:2]
    assert stop.strip() and stop not in first
    (res,), _ = gen.generate([ids], 8, stops=StopRules.of(tok, [stop]))
    assert res.token_ids == free[:2] and res.finish_reason == "stop_string"
    assert res.text == second[:second.index(stop)]


def test_one_text_path_decodes_each_token_once(setup, monkeypatch):
    """The stop check, the streamed text and the final text come from one TextStream per sequence, which decodes
    each kept token once; the text streamed is the final text."""
    _, tok, _, gen = setup
    decoded = []
    real = tok.id_to_bytes
    monkeypatch.setattr(tok, "id_to_bytes", lambda i: (decoded.append(i), real(i))[1])
    streamed: dict[int, str] = {}
    prompts = [tok.encode(p) for p in PROMPTS]
    results, _ = gen.generate(prompts, 12, stops=StopRules.of(tok, ["no such text"]),
                              on_text=lambda seq, text: streamed.update({seq: streamed.get(seq, "") + text}))
    shown = [t for r in results for t in r.token_ids if t not in tok.stop_ids]
    assert sorted(decoded) == sorted(shown)
    assert [streamed.get(i, "") for i in range(len(prompts))] == [r.text for r in results]
    assert [r.text for r in results] == [tok.decode([t for t in r.token_ids if t not in tok.stop_ids])
                                         for r in results]


def test_stream_printer_cuts_stop_string_before_printing(setup):
    _, tok, _, _ = setup
    out = io.StringIO()
    printer, stream = StreamPrinter(out), StopRules.of(tok, ["STOP"]).stream()
    for t in tok.encode("hello worSTOPld, more"):
        printer(0, stream.feed(t))
        assert "S" not in out.getvalue()  # never a part of the stop string
    printer(0, stream.finish())
    printer.finish()
    assert out.getvalue() == "hello wor\n" and stream.stopped and stream.text == "hello wor"


def test_sampling_is_seeded_and_degenerates_to_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    a = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=5))(logits)
    b = Sampler(SamplingParams(temperature=0.8, top_p=0.9, seed=5))(logits)
    assert torch.equal(a, b)
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, top_k=1, seed=1))(logits), logits.argmax(-1))
    assert torch.equal(Sampler(SamplingParams(temperature=1.0, top_p=1e-6, seed=1))(logits), logits.argmax(-1))


def test_context_limit_and_bad_requests_fail_before_work(setup):
    ckpt, _, _, gen = setup
    limited = Generator(gen.backend, ckpt.config, Limits.resolve(ckpt.config, gen.backend.limits, max_context=16))
    with pytest.raises(K2Error, match="exceeds the context limit of 16"):
        limited.generate([[1] * 10], 7)
    with pytest.raises(K2Error, match="prompt 1 is empty"):
        gen.generate([[1], []], 4)
    with pytest.raises(K2Error, match="outside the vocabulary"):
        gen.generate([[ckpt.config.vocab_size]], 4)


def test_generate_cli_json(tiny_ckpt, tiny_export, capsys):
    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "Hello there",
               "--max-new-tokens", "5", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert {"prompt_token_ids", "token_ids", "text", "timings"} <= set(out) and len(out["token_ids"]) == 5


def test_generate_cli_streams_and_summarizes(tiny_ckpt, tiny_export, capsys):
    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--chat", "Hi",
               "--max-new-tokens", "4", "--temperature", "0.7", "--seed", "3"])
    cap = capsys.readouterr()
    assert rc == 0 and "prompt tokens" in cap.err and "decode" in cap.err


@pytest.mark.parametrize("extra, message", [
    (["--temperature", "-1"], "argument --temperature: must be a finite number >= 0"),
    (["--top-p", "0"], "argument --top-p: must be in (0, 1]"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: must be >= 1"),
    (["--max-context", "4"], "exceeds the context limit of 4"),
])
def test_generate_cli_bad_arguments(tiny_ckpt, tiny_export, capsys, extra, message):
    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "Hello there"] + extra)
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1


def test_generate_cli_missing_model(tmp_path, capsys):
    rc = main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1


def test_generate_cli_batch_of_prompts(tiny_ckpt, tiny_export, capsys):
    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--prompt", "Hello there",
               "--prompt", "A much longer prompt than the first one", "--chat", "Hi", "--max-new-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [len(r["token_ids"]) for r in out["results"]] == [3, 3, 3]


def test_generate_cli_needs_a_prompt(tiny_ckpt, capsys):
    rc = main(["generate", "--model", str(tiny_ckpt)])
    assert rc == 2 and "give --prompt TEXT or --chat TEXT" in capsys.readouterr().err


def test_seeded_sampling_gives_the_same_tokens_on_ort_and_torch(setup):
    from k2trt.runtime.backends.torch_reference import TorchBackend

    ckpt, tok, _, gen = setup
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1234)
    prompts = [tok.encode(p) for p in PROMPTS]
    ort_res, _ = gen.generate(prompts, 16, params)
    torch_res, _ = Generator(TorchBackend(ckpt), ckpt.config).generate(prompts, 16, params)
    assert [r.token_ids for r in ort_res] == [r.token_ids for r in torch_res]


def test_chat_keeps_history_and_resets(tiny_ckpt, tiny_export, capsys, monkeypatch):
    from k2trt.runtime.entrypoints import chat

    seen = []
    real = chat.make_generator

    def spy(loaded, args, **kw):
        gen = real(loaded, args, **kw)
        inner = gen.generate

        def generate(prompts, *a, **k):
            seen.append(loaded.tokenizer.decode(prompts[0]))
            return inner(prompts, *a, **k)

        gen.generate = generate
        return gen

    monkeypatch.setattr(chat, "make_generator", spy)
    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nHow are you?\n/reset\nAgain\n/exit\n"))
    rc = main(["chat", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--max-new-tokens", "3"])
    assert rc == 0 and len(seen) == 3
    assert "Hello" in seen[1] and "How are you?" in seen[1]  # the second turn carries the first
    assert "Hello" not in seen[2] and "Again" in seen[2]  # /reset cleared it
    assert seen[0].startswith("<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>")


@pytest.mark.slow
def test_chat_stop_ends_the_reply_and_the_history_keeps_it_cut(tiny_ckpt, tiny_export, capsys, monkeypatch):
    """`chat --stop STR`: generation ends at the stop string (not at --max-new-tokens), the display is cut before it,
    and the next turn's prompt carries the reply as shown, not the text past the stop."""
    from k2trt.runtime.entrypoints import chat

    def talk(*extra: str) -> tuple[list[str], list[str], str]:
        prompts = []
        real = chat.make_generator

        def spy(loaded, args, **kw):
            gen = real(loaded, args, **kw)
            inner = gen.generate
            gen.generate = lambda ps, *a, **k: (prompts.append(loaded.tokenizer.decode(ps[0])), inner(ps, *a, **k))[1]
            return gen

        monkeypatch.setattr(chat, "make_generator", spy)
        monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAgain\n/exit\n"))
        rc = main(["chat", "--model", str(tiny_ckpt), "--onnx", str(tiny_export), "--max-new-tokens", "24", *extra])
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        replies = [r.removesuffix("\n") for r in cap.out.split("k2> ")[1:]]
        return replies, prompts, cap.err

    free, _, _ = talk()
    at = next(i for i in range(len(free[0]) // 3, len(free[0]) - 1) if free[0][i:i + 2].strip()
              and free[0].index(free[0][i:i + 2]) == i)
    stop = free[0][at:at + 2]
    cut, prompts, err = talk("--stop", stop)
    assert cut[0] == free[0][:at]
    assert "24 new" not in err.splitlines()[0]  # the first reply ended at the stop string
    assert free[0][:at] + "<|im_end|>" in prompts[1] and free[0] not in prompts[1]


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "ort" / "head.onnx").write_bytes(b"not a graph"), "changed since export"),
    (lambda d: (d / "ort" / "head.onnx").unlink(), "missing (re-export)"),
    (lambda d: (d / "manifest.json").write_text('{"format": "k2trt-export/2"}'), "missing config_fingerprint"),
    (lambda d: (d / "manifest.json").write_text("[1, 2]"), "expected a JSON object"),
])
def test_damaged_export_gives_one_clear_line(tiny_ckpt, tiny_export, tmp_path, capsys, damage, message):
    import shutil

    broken = tmp_path / "onnx"
    shutil.copytree(tiny_export, broken)
    damage(broken)
    rc = main(["generate", "--model", str(tiny_ckpt), "--onnx", str(broken), "--prompt", "Hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and message in err and len(err.splitlines()) == 1


def test_unwritable_output_path_gives_one_line(capsys):
    rc = main(["make-tiny", "/proc/k2trt-cannot-write-here"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("k2trt make-tiny: error:") and len(err.splitlines()) == 1


def test_chunked_prefill_gives_the_same_tokens(setup):
    ckpt, tok, ref, gen = setup
    prompts = [tok.encode(p) for p in PROMPTS]
    def chunked_by(chunk: int) -> Generator:
        return Generator(gen.backend, ckpt.config, Limits.resolve(ckpt.config, gen.backend.limits,
                                                                  prefill_chunk=chunk))

    whole, _ = chunked_by(10_000).generate(prompts, 8)
    chunked, _ = chunked_by(3).generate(prompts, 8)
    assert [r.token_ids for r in whole] == [r.token_ids for r in chunked]


def test_backend_limits_bound_the_request(setup):
    ckpt, _, _, gen = setup

    class Limited(BackendWrapper):
        def __init__(self, inner):
            super().__init__(inner)
            self.limits = BackendLimits(max_context=20, max_tokens_per_step=4)

    g = Generator(Limited(gen.backend), ckpt.config)
    assert (g.limits.max_context, g.limits.prefill_chunk) == (20, 4)
    with pytest.raises(K2Error, match="context limit of 20"):
        g.generate([[5] * 15], 6)


def test_ort_outputs_are_fresh_tensors_each_call(setup):
    """ONNX Runtime writes each output into a new torch tensor: a later call never overwrites an earlier result."""
    ckpt, _, ref, gen = setup
    a = gen.backend.embed(torch.tensor([[1, 2, 3]]))
    keep = a.clone()
    b = gen.backend.embed(torch.tensor([[4, 5, 6]]))
    assert torch.equal(a, keep) and a.data_ptr() != b.data_ptr()
    assert torch.equal(b, ref.embed(torch.tensor([[4, 5, 6]])))


def test_ort_block_skips_a_past_no_query_sees(setup):
    """Fresh prompts see none of the cache slots: the ORT backend drops them, and the block's result is the
    reference's on the full masked cache."""
    from k2trt.graphs.mask import simple_mask
    from k2trt.graphs.rope import rope_tables

    ckpt, _, ref, gen = setup
    cfg = ckpt.config
    h = torch.randn(2, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    cos, sin = rope_tables(cfg, torch.arange(5).expand(2, 5))
    cache = torch.randn(2, 16, cfg.latent_dim)  # written slots no query may see
    mask = torch.cat([torch.full((2, 5, 16), -1e9), simple_mask(2, 0, 5)], dim=-1)
    for layer in range(cfg.num_hidden_layers):
        got, new = gen.backend.block(layer, h, cos, sin, mask, cache)
        want, want_new = ref.block(layer, h, cos, sin, mask, cache)
        assert (got - want).abs().max() <= 1e-4 * want.abs().max()
        assert (new - want_new).abs().max() <= 1e-4 * want_new.abs().max()
