"""The decode program's critical-path schedule (rewrite/critical.py) and the tile heights it re-picks."""

import pytest

from megaegg.models import ModelConfig, build_decode_graph, build_step_graph
from megaegg.rewrite import rewrite, schedule
from megaegg.rewrite.critical import COMBINING, InstanceModel, scheduled_seconds

ENV = {"pos": 512}


def decode_program(preset: str, refine: bool, monkeypatch):
    if not refine:
        monkeypatch.setattr(schedule, "refine_tiles", lambda chosen, *a, **k: chosen)
    g, _ = build_decode_graph(ModelConfig.preset(preset), max_len=1024)
    return rewrite(g, dims_hint=ENV, max_dims={"pos": 1023})


def readers_of_combined(program):
    combined = {o.output.buffer for o in program.ops if o.kind in COMBINING}
    return [o for o in program.ops if any(i.buffer in combined for i in o.inputs)]


def test_the_o_projection_takes_the_tiles_that_end_the_schedule_sooner(monkeypatch):
    """llama-3.2-1b: the extraction alone puts the O projection on 128 instances, which do not fit beside the
    attention's 72 (its 8 merging last arrivals hold their SMs); the schedule picks 86 (perf-notes #97: 0.8%
    faster on an H200), in every layer, and prices the refined program below the unrefined one."""
    with monkeypatch.context() as m:
        plain = decode_program("llama-3.2-1b", False, m)
    refined = decode_program("llama-3.2-1b", True, monkeypatch)
    before, after = readers_of_combined(plain), readers_of_combined(refined)
    assert len(before) == len(after) == 16  # one O projection a layer
    assert {int(o.launch_count.eval(ENV)) for o in before} == {128}
    assert {int(o.launch_count.eval(ENV)) for o in after} == {86}
    assert scheduled_seconds(refined, ENV) < scheduled_seconds(plain, ENV)
    # nothing else moved
    rest = lambda p: [(o.kind, o.params.get("rows"), str(o.grid)) for o in p.ops if o not in readers_of_combined(p)]  # noqa: E731
    assert rest(plain) == rest(refined)


def test_a_combining_ops_last_arrivals_hold_their_sms(monkeypatch):
    """The schedule sees the merge: with a longer combine, the program ends later by at least that much
    (the merges are on the critical path), and with more SMs no later."""
    program = decode_program("qwen3-0.6b", True, monkeypatch)
    base = scheduled_seconds(program, ENV)
    slower = scheduled_seconds(program, ENV, InstanceModel(combine=4e-6))
    layers = sum(1 for o in program.ops if o.kind in COMBINING)
    assert slower >= base + layers * 1e-6 * 0.99
    assert scheduled_seconds(program, ENV, InstanceModel(sms=264)) <= base


@pytest.mark.parametrize("preset", ["tiny"])
def test_programs_with_row_regimes_are_not_refined(preset, monkeypatch):
    """A step graph (row bands) keeps the extraction's choices: the schedule models a decode step only."""
    g, _ = build_step_graph(ModelConfig.preset(preset), max_len=64, slots=4)
    kw = dict(dims_hint={"n": 4, "r": 4, "ctx": 33}, max_dims={"n": 64 + 4, "r": 4, "ctx": 64})
    refined = str(rewrite(g, **kw))
    monkeypatch.setattr(schedule, "refine_tiles", lambda chosen, *a, **k: pytest.fail("refined a step graph"))
    assert str(rewrite(g, **kw)) == refined


def test_a_rewrite_with_repeated_layers_refines_as_a_full_one(monkeypatch):
    """The reduced graph's rewrite (a few layers, the middle one copied) must choose what a rewrite of every
    layer does: the schedule prices the whole program either way (a borderline config, found by a review:
    llama-3.2-1b's shape with 16 heads, where the reduced program once weighed the O tile's gain at half)."""
    import dataclasses

    cfg = dataclasses.replace(ModelConfig.preset("llama-3.2-1b"), heads=16, layers=16)
    g, _ = build_decode_graph(cfg, max_len=1024)
    kw = dict(dims_hint=ENV, max_dims={"pos": 1023})
    once = str(rewrite(g, **kw))
    monkeypatch.setattr(schedule, "find_repeats", lambda graph: None)
    assert str(rewrite(g, **kw)) == once


def test_the_schedule_takes_a_merge_on_an_sm_reused_within_its_op():
    """A combining op whose instances share SMs (131 held by a long op before it): its last arrivals are
    the SMs' latest instances, found without error, and the merge is on the critical path."""
    from types import SimpleNamespace as NS

    from megaegg.dims import as_dim

    def op(kind, grid, nbytes, out, ins=()):
        dims = tuple(as_dim(d) for d in grid)
        count = dims[0]
        for d in dims[1:]:
            count = count * d
        return NS(kind=kind, grid=dims, launch_count=count, estimate=NS(bytes=nbytes, hops=0),
                  inputs=[NS(buffer=b) for b in ins], output=NS(buffer=out))

    model = InstanceModel()
    long = op("matvec", [131], 131 * 10_000_000, 1)
    merge = op("attn_partial_merge", [4, 2], 8 * 1000, 2)
    t = scheduled_seconds(NS(ops=[long, merge]), {}, model)
    alone = scheduled_seconds(NS(ops=[merge]), {}, model)
    assert alone >= model.combine and t >= alone


def test_a_program_with_routed_experts_keeps_its_tiles(monkeypatch):
    """qwen3-30b-a3b: the schedule does not model a routed expert instance, and the O projection it picked
    there (86 instances) measured 1.6% slower on an H200 (perf-notes #100): the program is the extraction's."""
    with monkeypatch.context() as m:
        plain = decode_program("qwen3-30b-a3b", False, m)
    assert str(decode_program("qwen3-30b-a3b", True, monkeypatch)) == str(plain)
