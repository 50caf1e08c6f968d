"""`k2trt plan` for layouts: pipeline stages × expert-parallel ranks, what one rank holds, and the roofline of a
decode step — checked against the weight table's own arithmetic and the notes' figures for K2 on H200s."""

from __future__ import annotations

import json
import math

import pytest

from k2trt.cli import main
from k2trt.config import K2Config
from k2trt.errors import K2Error
from k2trt.graphs.weights import expert_specs, layer_specs
from k2trt.runtime.distributed import layout as L
from k2trt.runtime.distributed import placement, roofline

K2 = K2Config.preset("kimi-k2")
H200 = placement.parse_size("141GB")


def k2_items(max_context=4096, max_batch=1):
    return placement.items_from_config(K2, placement.cache_bytes_per_layer(K2, max_context, max_batch))


def nbytes(specs) -> int:
    from k2trt.dtypes import torch_dtype

    return sum(s.numel * torch_dtype(s.dtype).itemsize for s in specs)


def test_a_rank_holds_the_rest_whole_and_its_share_of_the_experts():
    items = k2_items()
    per_expert = nbytes(expert_specs(K2, 0))
    assert items[1].expert_bytes == K2.n_routed_experts * per_expert and items[0].expert_bytes == 0
    for e in (1, 2, 8, 16):
        plan = L.plan_layout(K2, items, L.Layout(1, e), H200, placement.DEFAULT_RESERVE, 4096, 1)
        (stage,) = plan.placement.stages
        rest = sum(i.weight_bytes - i.expert_bytes + i.extra_bytes for i in items)
        assert stage.weight_bytes == rest + sum(i.expert_bytes for i in items) // e
        assert sum(i.expert_bytes for i in stage.items) == 60 * K2.n_routed_experts // e * per_expert
    moe = nbytes(layer_specs(K2, 1))
    assert items[1].weight_bytes == moe


def test_the_cache_is_divided_among_the_ranks_of_a_group():
    items = k2_items(8192, 10)
    plan = L.plan_layout(K2, items, L.Layout(2, 4), H200, placement.DEFAULT_RESERVE, 8192, 10)
    per_layer = 8192 * math.ceil(10 / 4) * K2.latent_dim * 2
    assert all(i.cache_bytes == per_layer for s in plan.placement.stages for i in s.items)


def test_k2_fp8_on_8_h200_pipeline_only_is_the_notes_bandwidth_floor():
    plan = L.plan_layout(K2, k2_items(), L.Layout(8, 1), H200, placement.DEFAULT_RESERVE, 4096, 1)
    est = roofline.decode_step(K2, plan, 1)
    # anchors: batch-1 decode reads ~33 GB of weights per token, 6.9 ms at an H200's 4.8 TB/s
    assert plan.fits and 6.5e-3 < est.step_s < 7.3e-3 and est.all_to_all_share == 0
    assert sum(s.read_bytes for s in est.stages) == pytest.approx(33e9, rel=0.03)


def test_experts_hit_by_a_batch():
    assert roofline.experts_hit(K2, 1) == pytest.approx(8 / 384)
    assert roofline.experts_hit(K2, 10_000) == pytest.approx(1.0)


def test_an_all_to_all_across_nodes_runs_at_the_network_bandwidth():
    items = k2_items(4096, 64)
    links = roofline.Links(all_to_all_latency=0.0, hop_latency=0.0)  # bandwidth alone
    inside = roofline.decode_step(K2, L.plan_layout(K2, items, L.Layout(2, 8), 10 * H200, 0, 4096, 64), 64, links)
    across = roofline.decode_step(K2, L.plan_layout(K2, items, L.Layout(1, 16), 10 * H200, 0, 4096, 64), 64, links)
    a2a = lambda est: sum(s.all_to_all_s for s in est.stages)  # noqa: E731
    sent = lambda est: sum(s.all_to_all_bytes for s in est.stages)  # noqa: E731
    assert a2a(inside) == pytest.approx(sent(inside) / links.nvlink)
    assert a2a(across) == pytest.approx(sent(across) / links.network)
    # the pipeline hop of PP 2 x EP 8 crosses from node 0 to node 1
    assert inside.stages[0].hop_s == pytest.approx(inside.stages[0].hop_bytes / links.network)


def test_compare_prints_every_layout_and_the_best_that_fits(capsys):
    rc = main(["plan", "--preset", "kimi-k2", "--devices", "8", "--device-memory", "141GB", "--layout", "compare",
               "--json"])
    out = json.loads(capsys.readouterr().out)
    names = [x["layout"] for x in out["layouts"]]
    assert rc == 0 and names == ["PP 8", "PP 4 × EP 2", "PP 2 × EP 4", "EP 8"]
    fits = {x["layout"]: x["fits"] for x in out["layouts"]}
    assert fits["PP 8"] and not fits["EP 8"]  # FP8 K2 is 1.03 TB: EP 8 replicates 14 GB on every rank
    fitting = [x for x in out["layouts"] if x["fits"]]
    assert out["best"] == min(fitting, key=lambda x: x["decode_step"]["seconds"])["layout"]
    main(["plan", "--preset", "kimi-k2", "--devices", "8", "--device-memory", "141GB", "--layout", "compare"])
    text = capsys.readouterr().out
    assert "PP 2 × EP 4" in text and "shortest decode step that fits" in text


def test_auto_takes_the_shortest_step_that_fits(capsys):
    rc = main(["plan", "--preset", "kimi-k2", "--devices", "16", "--device-memory", "141GB", "--layout", "auto",
               "--max-batch", "64", "--json"])
    chosen = json.loads(capsys.readouterr().out)
    main(["plan", "--preset", "kimi-k2", "--devices", "16", "--device-memory", "141GB", "--layout", "compare",
          "--max-batch", "64", "--json"])
    every = json.loads(capsys.readouterr().out)
    assert rc == 0 and chosen["layout"] == every["best"]


def test_an_expert_count_that_does_not_divide_is_refused_naming_those_that_do(capsys):
    rc = main(["plan", "--preset", "kimi-k2", "--expert-parallel", "5", "--device-memory", "141GB"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == [err]
    assert "--expert-parallel 5 does not divide the 384 routed experts (nearest that do: 4 or 6)" in err


def test_a_layout_that_does_not_fit_names_the_smallest_that_does(capsys):
    rc = main(["plan", "--preset", "kimi-k2", "--expert-parallel", "8", "--device-memory", "141GB"])
    cap = capsys.readouterr()
    assert rc == 2 and "EP 8 on 8 devices" in cap.out
    assert "the smallest that fits with --expert-parallel 8 is --pipeline 2 (16 devices)" in cap.err
    assert L.plan_layout(K2, k2_items(), L.Layout(2, 8), H200, placement.DEFAULT_RESERVE, 4096, 1).fits
    rc = main(["plan", "--preset", "kimi-k2", "--devices", "4", "--device-memory", "141GB", "--layout", "auto"])
    err = capsys.readouterr().err
    assert rc == 2 and "no layout of 4 devices fits; the smallest device count with a layout that fits is 8" in err


@pytest.mark.parametrize("argv, says", [
    (["--devices", "8", "--pipeline", "2", "--expert-parallel", "2"], "--devices 8 is not --pipeline 2 x"),
    (["--layout", "auto", "--pipeline", "2"], "not both"),
    ([], "give --devices N, or --pipeline P"),
    (["--devices", "8", "--layout", "compare", "--stages", "4,4"], "--stages splits one layout's stages"),
    (["--devices", "8", "--hbm-bandwidth", "0"], "--hbm-bandwidth must be more than 0"),
])
def test_bad_layout_arguments_are_one_line(capsys, argv, says):
    rc = main(["plan", "--preset", "kimi-k2", "--device-memory", "141GB", *argv])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.splitlines() == [err] and says in err


def test_headers_and_the_weight_table_agree_on_expert_bytes(tiny_ckpt):
    from k2trt.checkpoint import Checkpoint

    cfg = K2Config.from_json(tiny_ckpt)
    table = placement.items_from_config(cfg, 0)
    headers = placement.items_from_headers(cfg, Checkpoint.open(tiny_ckpt).header_specs(), 0)
    assert [i.expert_bytes for i in headers] == [i.expert_bytes for i in table]
    assert [i.weight_bytes for i in headers] == [i.weight_bytes for i in table]
    with pytest.raises(K2Error, match="every stage needs at least one block"):
        L.check_layout(cfg, L.Layout(cfg.num_hidden_layers + 1, 1))


def test_every_moe_block_of_an_ep_step_pays_at_least_deepeps_dispatch_and_combine():
    items = k2_items()
    for e, floor in ((2, 191e-6), (8, 191e-6), (16, 313e-6)):
        plan = L.plan_layout(K2, items, L.Layout(1, e), 10 * H200, 0, 4096, 1)
        est = roofline.decode_step(K2, plan, 1)
        assert sum(s.all_to_all_s for s in est.stages) == pytest.approx(K2.num_moe_layers * floor)
    plan = L.plan_layout(K2, items, L.Layout(1, 8), 10 * H200, 0, 4096, 1)
    est = roofline.decode_step(K2, plan, 1, roofline.Links(all_to_all_latency=0.0))
    assert sum(s.all_to_all_s for s in est.stages) == pytest.approx(sum(s.all_to_all_bytes for s in est.stages) / 450e9)
