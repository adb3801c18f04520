"""GPU: a lone sequence's launches through the batch-1 decode graph, run one token ahead (serving's one-client
path, megaegg.models.batch.single_sequence_decode), and a launch's result read without waiting
(Launcher.result): tokens as without running ahead, errors raised by the launch they belong to."""

import dataclasses

import pytest
import torch

import megaegg as me
from megaegg.interpreter import MegakernelError
from megaegg.models import ModelConfig, build_decode_graph, build_step_graph, random_weights
from megaegg.models.batch import Batcher, Request, Sampling, kernel_batch_step, single_sequence_decode

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def kernels():
    cfg = dataclasses.replace(ModelConfig.preset("tiny"), dtype=me.f32)
    graph, spec = build_step_graph(cfg, max_len=64, slots=3, sampling=True)
    w = random_weights(spec, seed=6, device="cuda")
    step = me.compile(graph, w, backend="cuda", max_dims={"n": 64, "r": 3, "ctx": 64})
    decode = me.compile(build_decode_graph(cfg, max_len=64, logits=False, sampling=True)[0], w, backend="cuda",
                        max_dims={"pos": 63})
    return spec, step, decode


def test_a_lone_sequence_run_ahead_gets_the_tokens_it_gets_without(kernels):
    spec, step_kernel, decode = kernels
    requests = lambda: [Request([3, 17, 5, 60], 20), Request([9, 2], 6, sampling=Sampling(temperature=0.9, seed=11)),  # noqa: E731
                        Request([12, 40], 30, sampling=Sampling(temperature=1.1, top_k=40, top_p=0.9, seed=2))]
    outs, launches = {}, {}
    for ahead in (False, True):
        caches = spec.new_caches("cuda")
        before = decode.launches
        step = single_sequence_decode(kernel_batch_step(step_kernel, caches), decode, caches, run_ahead=ahead)
        batch = Batcher(step, slots=3, max_len=64, device="cuda")
        outs[ahead] = [[g.tokens for g in batch.run(requests()[:k])] for k in (1, 3)]
        launches[ahead] = decode.launches - before
    assert outs[True] == outs[False]
    assert launches[False] >= 19 + 10 and launches[True] == launches[False] + 2  # (each run's last one ran ahead)


def test_a_result_read_later_raises_its_own_launchs_error(kernels):
    """A NaN temperature: the launch's result raises MEGA_ERR_NAN_SETTING's error when read, although the next
    launch was queued before it was read; the one after runs as usual."""
    spec, _, decode = kernels
    one = lambda dt, v: torch.tensor([v], dtype=dt, device="cuda")  # noqa: E731
    caches = {n: c[0] for n, c in spec.new_caches("cuda").items()}
    knobs = dict(top_k=one(torch.int32, 0), top_p=one(torch.float32, 1.0), seed=one(torch.int32, 1), counter=one(torch.int32, 0))
    launch = decode.launcher(token=one(torch.int32, 5), pos=0, temperature=one(torch.float32, 0.0), **knobs, **caches)
    launch(temperature=one(torch.float32, float("nan")))
    bad = launch.result("next_token")
    launch(pos=1, token=bad.device, temperature=one(torch.float32, 0.0))  # (queued before the error is read)
    with pytest.raises(MegakernelError, match="NaN temperature in row 0"):
        bad.get()
    torch.cuda.synchronize()
    launch.kernel.check()  # (what the launch queued behind the error recorded: not this test's subject)
    launch(pos=1, token=one(torch.int32, 7))
    assert 0 <= int(launch.result("next_token").get()[0]) < spec.config.vocab


def test_batches_run_ahead_get_the_tokens_of_one_launch_at_a_time(kernels):
    """The server's batcher with run ahead on the GPU: each launch queued before the previous one's tokens are
    read, its decoding rows' tokens copied on the device; five requests (greedy and sampled, a stop token, one
    joining as another ends) through three slots, with the lone path's decode graph: the tokens of stepping
    one launch at a time."""
    spec, step_kernel, decode = kernels
    requests = lambda stop=(): [Request([3, 17, 5, 60], 12), Request([9, 2], 9, sampling=Sampling(temperature=0.9, seed=11)),  # noqa: E731
                                Request([12, 40], 14, stop_tokens=stop), Request([7] * 20, 6),
                                Request([5, 5, 8], 10, sampling=Sampling(temperature=1.1, top_k=40, top_p=0.9, seed=2))]
    caches = spec.new_caches("cuda")
    stop = (Batcher(kernel_batch_step(step_kernel, caches), slots=3, max_len=64, max_tokens=16, device="cuda")
            .run(requests())[2].tokens[5],)
    outs = {}
    for ahead in (False, True):
        caches = spec.new_caches("cuda")
        step = single_sequence_decode(kernel_batch_step(step_kernel, caches), decode, caches)
        batch = Batcher(step, slots=3, max_len=64, max_tokens=16, device="cuda", prefix_cache=True, run_ahead=ahead)
        outs[ahead] = [(g.tokens, g.stop_token) for g in batch.run(requests(stop))]
    assert outs[True] == outs[False] and outs[True][2][1] == stop[0]


def test_a_moe_model_is_batched_and_gets_the_reference_tokens():
    """Qwen3-MoE as the server runs it (megaegg.serve: the step graph, its rows' experts grouped, a lone decoding
    sequence on the batch-1 decode graph, run ahead): three requests through two slots (prompts prefilling
    beside decoding rows; a shared prefix) get the reference executor's greedy tokens; a seeded draw repeats."""
    from megaegg.models.batch import reference_batch_step

    cfg = dataclasses.replace(ModelConfig.preset("qwen3-moe-tiny"), dtype=me.f32)
    graph, spec = build_step_graph(cfg, max_len=48, slots=2, sampling=True)
    w = random_weights(spec, seed=3, device="cuda")
    step = me.compile(graph, w, backend="cuda", max_dims={"n": 16, "r": 2, "ctx": 48})
    decode = me.compile(build_decode_graph(cfg, max_len=48, logits=False, sampling=True)[0], w, backend="cuda",
                        max_dims={"pos": 47})
    caches = spec.new_caches("cuda")
    batch = Batcher(single_sequence_decode(kernel_batch_step(step, caches), decode, caches), slots=2, max_len=48,
                    max_tokens=16, device="cuda")
    prompts = [[3, 17, 5, 60], [9, 2], [3, 17, 5, 60, 8]]
    got = [g.tokens for g in batch.run([Request(p, 8) for p in prompts])]
    ref = Batcher(reference_batch_step(graph, {k: v.cpu() for k, v in w.items()}, spec.new_caches()), slots=2,
                  max_len=48, max_tokens=16)
    assert got == [g.tokens for g in ref.run([Request(p, 8) for p in prompts])]
    drawn = [[g.tokens for g in batch.run([Request([4, 4, 4], 6, sampling=Sampling(temperature=0.9, seed=5))])]
             for _ in range(2)]
    assert drawn[0] == drawn[1]
