"""The K2 family's INT4 checkpoints (K2-Thinking, K2.5): the format of every tensor decided from quantization_config,
the K2.5 layout, the INT4 math against the library and against transformers + compressed-tensors, what inspect and
plan say about K2-Thinking's published sizes, bad input refused in one line, and models named owner/name."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from fixtures import clone, header_only_checkpoint, one_error_line, rewrite_tensors, shard_of
from k2trt.checkpoint import Checkpoint
from k2trt.cli import main
from k2trt.config import KIMI_K2_THINKING_QUANTIZATION, ConfigError, K2Config
from k2trt.graphs import int4
from k2trt.graphs import weights as W
from k2trt.quantization import BF16, FP8_BLOCK, INT4_GROUP

INDEX = "model.safetensors.index.json"
EXPERT = "model.layers.1.mlp.experts.5.up_proj"
PROMPT = [678, 520, 711, 1537, 1263, 1572]


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


# ---- formats decided from the checkpoint ----------------------------------------------------------------

@pytest.mark.slow
def test_every_tensor_has_the_format_its_config_gives():
    fp8, thinking = W.weight_formats(K2Config.preset("kimi-k2")), W.weight_formats(K2Config.preset("kimi-k2-thinking"))
    assert {f.kind for f in fp8.values()} == {FP8_BLOCK, BF16}  # lm_head stays bf16 in K2's FP8 checkpoint
    assert thinking[("moe_block", "mlp.experts.down_proj")].kind == INT4_GROUP
    assert thinking[("moe_block", "mlp.experts.down_proj")].group_size == 32
    others = {k: f.kind for k, f in thinking.items() if not k[1].startswith("mlp.experts.")}
    assert set(others.values()) == {BF16} and ("dense_block", "mlp.gate_proj") in others
    specs = W.checkpoint_specs(K2Config.preset("kimi-k2-thinking"))
    packed = specs["model.layers.1.mlp.experts.0.gate_proj.weight_packed"]
    assert (packed.dtype, packed.shape, packed.params) == ("int32", (2048, 896), 2048 * 7168)
    assert specs["model.layers.1.mlp.experts.0.gate_proj.weight_scale"].shape == (2048, 224)
    assert specs["model.layers.1.self_attn.q_a_proj.weight"].dtype == "bfloat16"
    # packing changes storage, not the model: the same 61-block figure as K2 FP8, about 594 GB stored
    blocks = [s for n, s in specs.items() if n.startswith("model.layers.")]
    assert W.parameter_count(blocks) == 1_024_059_415_040
    assert 590e9 < W.stored_bytes(specs.values()) < 600e9


def test_the_packing_is_the_librarys():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (3, 5, 64), generator=g, dtype=torch.int8)
    packed = int4.pack(q)
    assert torch.equal(packed[1], pack_to_int32(q[1], 4))
    assert torch.equal(int4.unpack(packed), q)
    # value i at bits 4i..4i+3 of its word, offset by +8
    word = int(packed[0, 0, 0]) & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [int(v) + 8 for v in q[0, 0, :8]]
    scale = torch.rand(3, 5, 2, generator=g).to(torch.bfloat16)
    w = int4.dequant_weight(packed, scale)
    assert torch.equal(w, (q.float().view(3, 5, 2, 32) * scale.float().unsqueeze(-1)).view(3, 5, 64)
                       .to(torch.bfloat16).float())


def test_the_k25_layout_reads_through_text_config(tiny_k25_ckpt, tiny_int4_ckpt):
    raw = json.loads((tiny_k25_ckpt / "config.json").read_text())
    assert raw["architectures"] == ["KimiK25ForConditionalGeneration"] and "text_config" in raw
    cfg = K2Config.from_json(tiny_k25_ckpt)
    assert cfg.layout == "k2.5" and cfg.weight_prefix == "language_model."
    ckpt = Checkpoint.open(tiny_k25_ckpt)
    assert ckpt.validate() is None
    assert set(ckpt.other_tensors()) and all(n.startswith(("vision_tower.", "mm_projector."))
                                             for n in ckpt.other_tensors())
    assert "language_model.model.layers.1.mlp.experts.0.gate_proj.weight_packed" in ckpt.weight_map
    # the same weights as the K2-Thinking layout, read by the text model's names
    assert torch.equal(ckpt.read(f"{EXPERT}.weight_packed"), Checkpoint.open(tiny_int4_ckpt).read(f"{EXPERT}.weight_packed"))


def test_inspect_shows_stored_bytes_and_the_vision_tower(tiny_k25_ckpt, capsys):
    rc, out, _ = cli(capsys, "inspect", str(tiny_k25_ckpt))
    assert rc == 0 and "every count matches" in out
    assert "routed experts int4 (group 32)" in out and "attention bf16" in out
    assert "vision_tower.*" in out and "never loaded" in out
    rc, out, _ = cli(capsys, "inspect", str(tiny_k25_ckpt), "--json")
    data = json.loads(out)
    assert data["layout"] == "k2.5" and set(data["outside_text_model"]) == {"vision_tower", "mm_projector"}
    assert all(r["headers_bytes"] == r["bytes"] for r in data["rows"])


# ---- the same greedy ids everywhere, and as transformers + compressed-tensors computes them --------------

def _ids(capsys, *argv) -> list[int]:
    rc, out, err = cli(capsys, "generate", *argv, "--prompt", "The quick brown fox", "--max-new-tokens", "12",
                       "--json")
    assert rc == 0, err
    return json.loads(out)["token_ids"]


@pytest.mark.slow
def test_int4_and_k25_give_the_same_ids_on_every_backend(tiny_int4_ckpt, tiny_k25_ckpt, tiny_int4_export,
                                                          capsys):
    torch_ids = _ids(capsys, "--model", str(tiny_int4_ckpt), "--backend", "torch")
    assert _ids(capsys, "--model", str(tiny_int4_ckpt), "--onnx", str(tiny_int4_export)) == torch_ids
    assert _ids(capsys, "--model", str(tiny_k25_ckpt), "--backend", "torch") == torch_ids


@pytest.mark.slow
def test_transformers_with_compressed_tensors_picks_the_same_ids(tiny_int4_ckpt, tiny_int4_export):
    """The outside oracle: transformers' DeepseekV3ForCausalLM reads the INT4 directory itself, compressed-tensors
    decompressing the experts; its greedy ids equal the reference's and ONNX Runtime's."""
    tf = pytest.importorskip("transformers", reason="the bench extra (pip install 'k2trt[bench]') is not installed")
    from k2trt.graphs.reference import ReferenceModel, greedy_generate
    from k2trt.runtime.backends.ort import OrtBackend
    from k2trt.runtime.generation.generator import Generator

    d = K2Config.from_json(tiny_int4_ckpt).to_hf_dict()
    hf_cfg = tf.DeepseekV3Config(**{k: v for k, v in d.items() if k not in ("auto_map", "architectures", "model_type")})
    model = tf.DeepseekV3ForCausalLM.from_pretrained(str(tiny_int4_ckpt), config=hf_cfg, dtype=torch.float32)
    for p in model.parameters():  # the dequantized experts come back in the scales' dtype, bf16(q·s): exact in fp32
        p.data = p.data.float()
    ids = torch.tensor([PROMPT])
    out = model.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, pad_token_id=0)
    theirs = out[0, len(PROMPT):].tolist()
    ckpt = Checkpoint.open(tiny_int4_ckpt)
    assert greedy_generate(ReferenceModel(ckpt), PROMPT, 12)[0] == theirs
    [ours], _ = Generator(OrtBackend(tiny_int4_export, ckpt), ckpt.config).generate([PROMPT], 12)
    assert ours.token_ids == theirs


def test_chat_templates_think_as_the_releases_do(tiny_int4_ckpt, tiny_k25_ckpt):
    from k2trt.runtime.text.tokenizer import KimiTokenizer

    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning_content": "r1"},
            {"role": "user", "content": "c"}]
    thinking = KimiTokenizer.from_dir(tiny_int4_ckpt).apply_chat_template(msgs)
    assert "<|im_assistant|>assistant<|im_middle|><think></think>b<|im_end|>" in thinking  # an earlier round
    assert thinking.endswith("<|im_assistant|>assistant<|im_middle|>")
    k25 = KimiTokenizer.from_dir(tiny_k25_ckpt)
    assert k25.apply_chat_template(msgs).endswith("<|im_middle|><think>")
    assert k25.apply_chat_template(msgs, thinking=False).endswith("<|im_middle|><think></think>")
    assert k25.token_to_id("<think>") == k25.num_base_tokens + 22  # a special token, as in the release


# ---- K2-Thinking at its published sizes: inspect and plan from the headers --------------------------------

@pytest.mark.slow
def test_k2_thinking_inspect_and_plan_on_its_published_sizes(tmp_path, capsys):
    ckpt = header_only_checkpoint(K2Config.preset("kimi-k2-thinking"), tmp_path / "K2-Thinking")
    rc, out, _ = cli(capsys, "inspect", str(ckpt), "--json")
    data = json.loads(out)
    assert rc == 0 and data["cross_check"]["ok"], data["cross_check"]["differences"][:3]
    rows = {r["component"]: r for r in data["rows"]}
    assert rows["all 61 blocks"]["total"] == 1_024_059_415_040
    assert 590e9 < rows["model total"]["headers_bytes"] < 600e9
    assert rows["384 routed experts"]["headers_bytes"] > 0.9 * rows["model total"]["headers_bytes"]
    load = ["--devices", "8", "--device-memory", "141GB", "--max-context", "131072", "--max-batch", "8"]
    rc, out, _ = cli(capsys, "plan", "--model", str(ckpt), *load, "--json")
    assert rc == 0 and json.loads(out)["fits"]
    # K2 FP8 at the same load does not fit one 8 x H200 node (Moonshot's guide: 16 GPUs)
    rc, _, err = cli(capsys, "plan", "--preset", "kimi-k2", *load)
    assert rc == 2 and "smallest device count that fits is" in err


# ---- bad input: one line naming the field or the tensor, before any work ----------------------------------

def _quant(edit):
    q = json.loads(json.dumps(KIMI_K2_THINKING_QUANTIZATION))
    edit(q)
    return q


def _weights(edit):
    return lambda q: edit(q["config_groups"]["group_0"]["weights"])


BAD_CONFIGS = {
    "8-bit weights": (_weights(lambda w: w.update(num_bits=8)), "num_bits 8"),
    "asymmetric": (_weights(lambda w: w.update(symmetric=False)), "asymmetric zero points"),
    "a group size the kernels do not take": (_weights(lambda w: w.update(group_size=12)), "group_size 12"),
    "channel strategy": (_weights(lambda w: w.update(strategy="channel", group_size=None)), "strategy 'channel'"),
    "float weights": (_weights(lambda w: w.update(type="float")), "type 'float'"),
    "activation quantization": (lambda q: q["config_groups"]["group_0"].update(
        input_activations={"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
        "input_activations: activation quantization is not supported"),
    "another format": (lambda q: q.update(format="int-quantized"), "format 'int-quantized'"),
    "an unknown method": (lambda q: q.update(quant_method="awq"), "quant_method 'awq'"),
    "an ignore regex that cannot compile": (lambda q: q["ignore"].append("re:(unclosed"), "ignore[4]"),
    "attention quantized": (lambda q: q["ignore"].remove("re:.*self_attn.*"), "INT4 only in the routed experts"),
    "lm_head quantized": (lambda q: q["ignore"].remove("lm_head"), "lm_head"),
    "experts of one layer in bf16": (lambda q: q["ignore"].append("re:model\\.layers\\.2\\.mlp\\.experts\\..*"),
                                     "in one format"),
    "a schema error": (_weights(lambda w: w.update(num_bits="four")), "num_bits"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_a_quantization_config_k2trt_cannot_compute_is_one_line(tiny_int4_ckpt, tmp_path, capsys, case):
    edit, message = BAD_CONFIGS[case]
    broken = clone(tiny_int4_ckpt, tmp_path / "ckpt", copy=("config.json",))
    raw = json.loads((broken / "config.json").read_text())
    raw["quantization_config"] = _quant(edit)
    (broken / "config.json").write_text(json.dumps(raw))
    for argv in (["inspect", str(broken)], ["export", "--model", str(broken), "--out", str(tmp_path / "onnx")]):
        rc, _, err = cli(capsys, *argv)
        line = one_error_line(rc, err, argv[0])
        assert message in line and "quantization_config" in line, line
    assert not (tmp_path / "onnx").exists()


def test_an_ignore_entry_for_a_module_k2trt_does_not_load_is_fine():
    q = _quant(lambda q: q["ignore"].append("re:.*vision_tower.*"))
    cfg = K2Config.from_hf_dict({**K2Config.preset("tiny").to_hf_dict(), "quantization_config": q})
    assert W.experts_format(cfg).kind == INT4_GROUP


def _replace(name, make):
    return lambda t: t.update({name: make(t[name])})


BAD_TENSORS = {
    "packed weight of the wrong shape": (f"{EXPERT}.weight_packed", _replace(f"{EXPERT}.weight_packed",
                                         lambda t: t[:, :8].clone()), "has shape [128, 8], expected [128, 16]"),
    "scale of the wrong shape": (f"{EXPERT}.weight_scale", _replace(f"{EXPERT}.weight_scale",
                                 lambda t: t[:, :2].clone()), "has shape [128, 2], expected [128, 4]"),
    "scale of the wrong dtype": (f"{EXPERT}.weight_scale", _replace(f"{EXPERT}.weight_scale", lambda t: t.float()),
                                 "has dtype float32, expected bfloat16"),
    "missing scale": (f"{EXPERT}.weight_scale", lambda t: t.pop(f"{EXPERT}.weight_scale"),
                      f"missing tensor '{EXPERT}.weight_scale'"),
    "weight_shape that disagrees": (f"{EXPERT}.weight_shape", _replace(f"{EXPERT}.weight_shape",
                                    lambda t: torch.tensor([128, 64], dtype=torch.int32)), "hold [128, 128]"),
    "weight_shape not two positive ints": (f"{EXPERT}.weight_shape", _replace(f"{EXPERT}.weight_shape",
                                           lambda t: torch.tensor([-1, 128], dtype=torch.int32)),
                                           "not two positive ints"),
    "weight_shape of three ints": (f"{EXPERT}.weight_shape", _replace(f"{EXPERT}.weight_shape",
                                   lambda t: torch.tensor([1, 128, 128], dtype=torch.int32)),
                                   "has shape [3], expected [2]"),
    "weight_shape as floats": (f"{EXPERT}.weight_shape", _replace(f"{EXPERT}.weight_shape", lambda t: t.float()),
                               "has dtype float32, expected int32"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(BAD_TENSORS))
def test_damaged_int4_tensors_are_refused_before_any_work(tiny_int4_ckpt, tiny_int4_export, tmp_path, capsys,
                                                          case):
    name, edit, message = BAD_TENSORS[case]
    shard = shard_of(tiny_int4_ckpt, name)
    broken = clone(tiny_int4_ckpt, tmp_path / "ckpt", copy=(shard, INDEX))
    rewrite_tensors(broken, shard, edit)
    for argv in (["generate", "--model", str(broken), "--onnx", str(tiny_int4_export), "--prompt", "Hi"],
                 ["export", "--model", str(broken), "--out", str(tmp_path / "onnx")]):
        rc, _, err = cli(capsys, *argv)
        assert message in one_error_line(rc, err, argv[0])
    assert not (tmp_path / "onnx").exists()


def test_weight_shape_as_the_library_writes_it_is_accepted(tiny_int4_ckpt, tmp_path):
    """compressed-tensors' own compressor stores weight_shape as int64; Moonshot's files hold int32: both read."""
    name = f"{EXPERT}.weight_shape"
    shard = shard_of(tiny_int4_ckpt, name)
    ckpt = clone(tiny_int4_ckpt, tmp_path / "ckpt", copy=(shard, INDEX))
    rewrite_tensors(ckpt, shard, _replace(name, lambda t: t.long()))
    Checkpoint.open(ckpt).validate()


def test_an_image_in_a_chat_request_is_a_clear_400():
    from pydantic import ValidationError

    from k2trt.runtime.serve.protocol import ChatCompletionRequest

    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(ValidationError, match="image_url parts are not supported: this server runs the text model"):
        ChatCompletionRequest(model="k2", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    ChatCompletionRequest(model="k2", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_a_config_error_names_the_field():
    with pytest.raises(ConfigError, match="quantization_config.config_groups.group_0.weights.num_bits"):
        K2Config.from_hf_dict({**K2Config.preset("tiny").to_hf_dict(),
                               "quantization_config": _quant(_weights(lambda w: w.update(num_bits=3)))})


# ---- a model named as users name it: the Hugging Face cache ------------------------------------------------

def _cache(root, repo: str, source, commit: str = "0123456789abcdef0123456789abcdef01234567", ref: str = "main"):
    """A cache laid out as huggingface_hub lays it out: blobs by hash, snapshots/<commit>/ of symlinks to them,
    refs/<branch> holding the commit."""
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo_dir / "snapshots" / commit
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(p for p in source.iterdir() if p.is_file())):
        blob = repo_dir / "blobs" / f"{i:040x}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (repo_dir / "refs").mkdir(exist_ok=True)
    (repo_dir / "refs" / ref).write_text(commit)
    return snap


def test_owner_name_resolves_through_the_hf_cache(tiny_int4_ckpt, tmp_path):
    from k2trt.hub import ModelNotCached, resolve_model

    snap = _cache(tmp_path / "hub", "moonshotai/Kimi-K2-Thinking", tiny_int4_ckpt)
    assert resolve_model("moonshotai/Kimi-K2-Thinking", cache_dir=tmp_path / "hub") == snap
    assert resolve_model(f"moonshotai/Kimi-K2-Thinking@{snap.name}", cache_dir=tmp_path / "hub") == snap
    assert Checkpoint.open(snap).config == K2Config.from_json(tiny_int4_ckpt)
    with pytest.raises(ModelNotCached, match=r"download it with `hf download moonshotai/Kimi-K2\.5`"):
        resolve_model("moonshotai/Kimi-K2.5", cache_dir=tmp_path / "hub")
    with pytest.raises(ModelNotCached, match="--revision v2"):
        resolve_model("moonshotai/Kimi-K2-Thinking@v2", cache_dir=tmp_path / "hub")
    assert resolve_model(str(tiny_int4_ckpt)) == tiny_int4_ckpt  # a directory is itself


@pytest.mark.slow
def test_the_cli_takes_owner_name_from_hf_hub_cache(tiny_int4_ckpt, tmp_path):
    """As a user runs it: HF_HUB_CACHE picks the cache, offline; an uncached model is one line, exit 2."""
    _cache(tmp_path / "hub", "moonshotai/Kimi-K2-Thinking", tiny_int4_ckpt)
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    run = lambda *a: subprocess.run([sys.executable, "-m", "k2trt.cli", *a], env=env, capture_output=True,  # noqa: E731
                                    text=True, timeout=300)
    done = run("inspect", "moonshotai/Kimi-K2-Thinking")
    assert done.returncode == 0 and "every count matches" in done.stdout, done.stderr
    done = run("plan", "--model", "moonshotai/Kimi-K2.6", "--devices", "1", "--device-memory", "1GB")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and "hf download moonshotai/Kimi-K2.6" in lines[0], done.stderr


@pytest.mark.slow
def test_compare_covers_int4_blocks(tiny_int4_ckpt, tiny_int4_export, capsys):
    rc, out, err = cli(capsys, "compare", "--model", str(tiny_int4_ckpt), "--onnx", str(tiny_int4_export),
                       "--tokens", "4")
    assert rc == 0, out + err
    assert "moe_block_1" in out and "all" in out and "checks passed" in out


def test_tensorrt_form_of_an_int4_block_binds_packed_weights(tmp_path):
    """The bf16 TensorRT-bound graphs of the INT4 model: profiles only for the activations (weights are static),
    the packed experts uploaded as int32 words beside their scales in the activation dtype, bf16 linears as bf16."""
    from k2trt import export_manifest
    from k2trt.export.exporter import export
    from k2trt.runtime.backends.tensorrt import upload_weights
    from k2trt.runtime.tensorrt.profiles import ProfileSpec, graph_profiles
    from k2trt.tiny.synthetic import RandomWeights

    cfg = K2Config.preset("tiny-int4")
    export(cfg, tmp_path, "bfloat16", 1, log=lambda *a: None)
    entry = export_manifest.read_manifest(tmp_path)["graphs"]["trt/moe_block"]
    prefill, _ = graph_profiles(ProfileSpec(), entry)
    assert set(prefill.shapes) == {"hidden_states", "rope_cos", "rope_sin", "kv_pool", "page_table", "ctx_lens",
                                   "n_new"}  # the pool read in place
    up = upload_weights(entry, RandomWeights(cfg).block_weights(1), torch.bfloat16, "cpu")
    assert up["mlp.experts.gate_proj.weight_packed"].dtype == torch.int32
    assert up["mlp.experts.gate_proj.weight_packed"].shape == (cfg.n_routed_experts, 128, 16)
    assert up["mlp.experts.down_proj.weight_scale"].dtype == torch.bfloat16
    assert up["self_attn.q_a_proj.weight"].dtype == torch.bfloat16 and "mlp.experts.gate_proj.weight_shape" not in up
