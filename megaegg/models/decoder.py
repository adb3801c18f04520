"""A Llama / Qwen3 / Qwen3-MoE forward step as a megaegg Graph, in two forms.

:func:`build_decode_graph`: batch 1, one token at runtime position ``pos``: the token's K and V
are appended to the per-layer caches in place and attention reads the first ``pos + 1`` rows.

:func:`build_step_graph`: ``n`` tokens (a runtime dim), each of its own sequence slot and
position: a batch of sequences decoding, prompts prefilling, or both, in one launch. Token ``i``
writes its K and V at ``pos[i]`` of slot ``slot[i]`` and attends that slot's rows ``[0, pos[i]]``
(a prompt's tokens see themselves and the tokens before them). Only the rows listed in ``out``
(``r`` of them, a runtime dim: each sequence's last token) go through the LM head.

Weights carry Hugging Face's state-dict names, so a checkpoint binds by name, and both forms
share them.

>>> from megaegg.models import ModelConfig, build_decode_graph, build_step_graph
>>> g, spec = build_decode_graph(ModelConfig.preset("tiny"), max_len=128)
>>> sorted(g.outputs), spec.caches["k_cache.0"], g.symbols()
(['logits', 'next_token'], (2, 128, 64), {'pos'})
>>> g, spec = build_step_graph(ModelConfig.preset("tiny"), max_len=128, slots=4)
>>> sorted(g.outputs), spec.caches["k_cache.0"], sorted(g.symbols())
(['logits', 'next_token'], (4, 2, 128, 64), ['ctx', 'n', 'r'])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from ..blockops.moe import ROW_BYTES, expert_rows_fit
from ..dims import sym
from ..dtypes import DType, as_dtype, f32, i32
from ..graph import Graph, GraphError, Tensor
from ..ops import (
    MAX_RANKS, all_gather, all_reduce, argmax, attention, embedding, kv_append, kv_store, linear, moe_mlp, ragged_attention, rms_norm, rope, rope_inv_freq,
    sample, silu,
)
from .config import ModelConfig, UnsupportedConfig


@dataclass(frozen=True)
class ModelSpec:
    """What a decode graph needs bound: weight and cache names with shapes, and its dtype."""

    config: ModelConfig
    max_len: int
    weights: dict[str, tuple[int, ...]]  # Hugging Face state-dict name (or a stack of them, below) -> shape
    # "k_cache.{l}" / "v_cache.{l}" -> [kv_heads, max_len, head_dim]; a step graph's: [slots, kv_heads, max_len, head_dim]
    caches: dict[str, tuple[int, ...]]
    slots: int = 0  # sequence slots of a step graph's caches (0: a decode graph's, one sequence)
    tp: int = 1  # tensor-parallel ranks: ``weights`` and ``caches`` are then one rank's shards (shard_weights)

    @property
    def dtype(self) -> DType:
        return self.config.dtype

    @property
    def weight_bytes(self) -> int:
        """Bytes of all the weights (what binding them costs)."""
        return sum(_numel(s) for s in self.weights.values()) * self.dtype.itemsize

    @property
    def step_bytes(self) -> int:
        """Bytes of weights one decode step reads (the memory floor's numerator, without KV): of
        each stack of routed experts, only the ``top_k`` chosen ones."""
        stacks, total = self.stacks, 0
        for name, shape in self.weights.items():
            n = _numel(shape)
            total += n // shape[0] * self.config.moe.top_k if name in stacks else n
        return total * self.dtype.itemsize

    @functools.cached_property  # (a 30B MoE stacks 18432 checkpoint tensors: built once)
    def stacks(self) -> dict[str, tuple[str, ...]]:
        """Graph weights that stack per-expert checkpoint tensors on a leading axis: name -> the
        tensors' names, in expert order (``load_checkpoint`` stacks them)."""
        moe = self.config.moe
        if moe is None:
            return {}
        return {expert_stack(layer, proj): tuple(checkpoint_expert(self.config.arch, layer, e, proj)
                                                  for e in range(moe.experts))
                for layer in moe.sparse_layers if layer < self.config.layers for proj in EXPERT_PROJS}

    @functools.cached_property
    def renamed(self) -> dict[str, str]:
        """Graph weights stored under another name in a checkpoint (Mixtral's routers): name -> the tensor's."""
        moe, arch = self.config.moe, self.config.arch
        if moe is None or arch not in MOE_CHECKPOINT_NAMES:
            return {}
        return {f"model.layers.{layer}.mlp.gate.weight": f"model.layers.{layer}.{MOE_CHECKPOINT_NAMES[arch][0]}.weight"
                for layer in moe.sparse_layers if layer < self.config.layers}

    def new_caches(self, device="cpu", dtype=None) -> dict:
        """Fresh KV caches by input name (zeros: rows at or past ``pos`` are never read)."""
        import torch

        dtype = check_dtype(self, dtype)
        return {name: torch.zeros(shape, dtype=dtype, device=device) for name, shape in self.caches.items()}


def build_decode_graph(cfg: ModelConfig, *, max_len: int, logits: bool = True, tp: int = 1,
                       sampling: bool = False) -> tuple[Graph, ModelSpec]:
    """The graph of one decode step: ``token`` i32[1] at ``pos`` -> ``logits`` [1, vocab], ``next_token`` i32[1].

    ``logits=False`` outputs only ``next_token``: the compiler may then fuse the LM head
    with the argmax partials and never store the logits. ``sampling``: ``next_token`` is drawn on the
    device (:func:`megaegg.ops.sample`) with the inputs ``temperature``, ``top_k``, ``top_p``, ``seed``
    and ``counter`` of one row each (temperature 0: the argmax), as :func:`build_step_graph`'s are.

    ``tp > 1``: one rank's graph of a tensor-parallel group of ``tp`` GPUs (every rank runs the same
    graph on its own shards, :func:`shard_weights`; run it with ``megaegg.parallel.ParallelKernel``):
    each rank holds ``heads / tp`` attention heads (and KV heads, and their cache) and
    ``intermediate / tp`` MLP columns; the O and down projections are row-parallel, their partial
    sums all-reduced. An untied LM head whose vocabulary ``tp`` divides is vocabulary-parallel (each
    rank ``vocab / tp`` rows, the logits all-gathered); embeddings, norms and a tied LM head are replicated.
    """
    _check_max_len(cfg, max_len)
    check_tp(cfg, tp)
    g = Graph(f"{cfg.arch}_decode" + (f"_tp{tp}" if tp > 1 else ""))
    pos = sym("pos")
    inv_freq = g.constant("rope_inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    embed = g.weight("model.embed_tokens.weight", [cfg.vocab, cfg.hidden], cfg.dtype)
    x = embedding(embed, g.input("token", [1], i32))  # [1, hidden]
    H, Hkv, D = cfg.heads // tp, cfg.kv_heads // tp, cfg.head_dim

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = (rope(t, pos, inv_freq=inv_freq) for t in head_norms(cfg, layer, q.reshape(H, D), k.reshape(Hkv, D)))
        k_cache = kv_append(g.input(f"k_cache.{layer}", [Hkv, max_len, D], cfg.dtype), k, pos)
        v_cache = kv_append(g.input(f"v_cache.{layer}", [Hkv, max_len, D], cfg.dtype), v.reshape(Hkv, D), pos)
        return attention(q, k_cache, v_cache, pos + 1).reshape(1, H * D)

    for layer in range(cfg.layers):
        x = decoder_layer(cfg, x, layer, attend, tp=tp)
    scores = lm_head(cfg, x, embed, tp=tp)  # [1, vocab]
    if logits:
        g.output("logits", scores)
    if sampling:
        g.output("next_token", sample(scores, *(g.input(name, [1], dt) for name, dt in SAMPLING_INPUTS)))
    else:
        g.output("next_token", argmax(scores))  # i32[1]
    return g, _spec(g, cfg, max_len, slots=0, tp=tp)


def check_tp(cfg: ModelConfig, tp: int) -> None:
    """``tp`` ranks must split the heads, the KV heads and the MLP evenly (an UnsupportedConfig names which not)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or not 1 <= tp <= MAX_RANKS:
        raise GraphError(f"tp must be an int in [1, {MAX_RANKS}] (GPUs of one host), got {tp!r}")
    if tp == 1:
        return
    if cfg.moe is not None:
        raise UnsupportedConfig(f"tensor parallelism (tp={tp}) of the routed experts of a {cfg.arch} model is not supported")
    for what, n in (("attention heads", cfg.heads), ("KV heads", cfg.kv_heads), ("MLP intermediate size", cfg.intermediate)):
        if n % tp:
            raise UnsupportedConfig(f"tp={tp} does not divide the {n} {what} of this model")


def shard_weights(spec: ModelSpec, weights, rank: int) -> dict:
    """Rank ``rank``'s shards of a full (one-GPU) weight dict for ``spec``, a tensor-parallel decode
    graph's spec: each weight whose shard shape differs from the full one is cut along the dim that
    differs (the heads' and MLP's rows, the O and down projections' columns); the rest is shared."""
    return _shard(spec, spec.weights, weights, rank, "weight")


def shard_caches(spec: ModelSpec, caches, rank: int) -> dict:
    """Rank ``rank``'s share of full (one-GPU) KV caches: its KV heads, copied (the kernel writes them)."""
    return {n: t.clone() for n, t in _shard(spec, spec.caches, caches, rank, "cache").items()}


def _shard(spec: ModelSpec, shapes: dict, full: dict, rank: int, what: str) -> dict:
    if not 0 <= rank < spec.tp:
        raise GraphError(f"rank {rank} outside [0, {spec.tp})")
    out = {}
    for name, shape in shapes.items():
        if name not in full:
            raise GraphError(f"shard_{what}s: missing {what} {name!r}")
        t = full[name]
        cut = [d for d, (a, b) in enumerate(zip(t.shape, shape)) if a != b]
        if len(cut) > 1 or t.ndim != len(shape) or (cut and t.shape[cut[0]] != shape[cut[0]] * spec.tp):
            raise GraphError(f"shard_{what}s: {what} {name!r} {list(t.shape)} is not a full {what} of shard {list(shape)}")
        out[name] = t.narrow(cut[0], rank * shape[cut[0]], shape[cut[0]]).contiguous() if cut else t
    return out


def build_step_graph(cfg: ModelConfig, *, max_len: int, slots: int, sampling: bool = False, page_len: int | None = None,
                     pages: int | None = None) -> tuple[Graph, ModelSpec]:
    """The graph of one step over ``n`` tokens of up to ``slots`` sequences (see the module docstring).

    Inputs: ``token``, ``pos``, ``slot`` i32[n]; ``out`` i32[r], the rows whose logits are wanted;
    the caches ``k_cache.{l}`` / ``v_cache.{l}`` [slots, kv_heads, max_len, head_dim]; the runtime dim
    ``ctx`` bounds every ``pos + 1`` (attention splits that many cache rows: pass ``max(pos) + 1``). Outputs:
    ``logits`` [r, vocab] and ``next_token`` i32[r]: their argmax, or with ``sampling`` a token
    drawn on the device (:func:`megaegg.ops.sample`) with the per-row inputs ``temperature``,
    ``top_p`` (f32[r]), ``top_k``, ``seed`` and ``counter`` (i32[r]).

    Paged (``page_len`` and ``pages``): the caches are pools of ``pages`` pages of ``page_len`` rows
    ``[pages, kv_heads, page_len, head_dim]``, and the input ``pages`` i32[slots, ceil(max_len / page_len)]
    lists the pages of each sequence's rows in order (:func:`megaegg.ops.kv_store`): memory follows the
    rows in use, and sequences may share a prefix's pages.
    """
    _check_max_len(cfg, max_len)
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
        raise GraphError(f"slots must be an int >= 1, got {slots!r}")
    if (page_len is None) != (pages is None):
        raise GraphError("build_step_graph: page_len and pages go together (a paged cache), got "
                         f"page_len={page_len!r}, pages={pages!r}")
    for what, v in (("page_len", page_len), ("pages", pages)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise GraphError(f"build_step_graph: {what} must be an int >= 1, got {v!r}")
    g = Graph(f"{cfg.arch}_step")
    n, r, ctx = sym("n"), sym("r"), sym("ctx")
    inv_freq = g.constant("rope_inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    embed = g.weight("model.embed_tokens.weight", [cfg.vocab, cfg.hidden], cfg.dtype)
    pos, slot = g.input("pos", [n], i32), g.input("slot", [n], i32)
    x = embedding(embed, g.input("token", [n], i32))  # [n, hidden]
    Hkv, D = cfg.kv_heads, cfg.head_dim
    table = g.input("pages", [slots, -(-max_len // page_len)], i32) if page_len else None
    shape = [pages, Hkv, page_len, D] if page_len else [slots, Hkv, max_len, D]

    def attend(layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k = head_norms(cfg, layer, q.reshape(n, cfg.heads, D), k.reshape(n, Hkv, D))
        # K and V into the caches before q's RoPE: the queue follows the graph's order, and the K rows'
        # store (rotated as it stores them) is the attention's slowest input, so its instances go first
        k_cache = kv_store(g.input(f"k_cache.{layer}", shape, cfg.dtype), rope(k, pos, inv_freq=inv_freq), pos, slot,
                           pages=table)
        v_cache = kv_store(g.input(f"v_cache.{layer}", shape, cfg.dtype), v.reshape(n, Hkv, D), pos, slot, pages=table)
        q = rope(q, pos, inv_freq=inv_freq)
        # (r, the rows whose tokens the step returns: about one a sequence; a mixed step's decode rows then
        # spread over the prompt's attention instances)
        return ragged_attention(q, k_cache, v_cache, pos, slot, length=ctx, sequences=r,
                                pages=table).reshape(n, cfg.heads * D)

    for layer in range(cfg.layers):
        x = decoder_layer(cfg, x, layer, attend)
    scores = lm_head(cfg, embedding(x, g.input("out", [r], i32)), embed)  # [r, vocab]: the rows asked for
    g.output("logits", scores)
    if sampling:
        knobs = [g.input(name, [r], dt) for name, dt in SAMPLING_INPUTS]
        g.output("next_token", sample(scores, *knobs))  # i32[r]
    else:
        g.output("next_token", argmax(scores))  # i32[r]
    return g, _spec(g, cfg, max_len, slots=slots)


# the per-row sampling inputs of a step graph, in megaegg.ops.sample's order
SAMPLING_INPUTS = (("temperature", f32), ("top_k", i32), ("top_p", f32), ("seed", i32), ("counter", i32))


def _check_max_len(cfg: ModelConfig, max_len: int) -> None:
    if not 0 < max_len <= cfg.max_positions:
        raise GraphError(f"max_len {max_len} must be in [1, {cfg.max_positions}] (max_position_embeddings, or a "
                         "shorter sliding_window)")


def _spec(g: Graph, cfg: ModelConfig, max_len: int, *, slots: int, tp: int = 1) -> ModelSpec:
    weights = {n.name: tuple(d.value for d in n.shape) for n in g.weights.values()}
    caches = {n.name: tuple(int(d) for d in n.shape) for n in g.inputs.values() if n.name.endswith(tuple(
        f"_cache.{layer}" for layer in range(cfg.layers)))}
    return ModelSpec(config=cfg, max_len=max_len, weights=weights, caches=caches, slots=slots, tp=tp)


def lm_head(cfg: ModelConfig, x: Tensor, embed: Tensor, *, tp: int = 1) -> Tensor:
    """The final norm and the LM head (tied to the embeddings or not): ``x`` [rows, hidden] -> [rows, vocab].
    With :func:`vocab_parallel`, one rank's ``vocab / tp`` rows, the logits all-gathered."""
    g = x.graph
    x = rms_norm(x, g.weight("model.norm.weight", [cfg.hidden], cfg.dtype), cfg.rms_eps)
    if cfg.tie_embeddings:
        return linear(x, embed)
    split = tp if vocab_parallel(cfg, tp) else 1
    scores = linear(x, g.weight("lm_head.weight", [cfg.vocab // split, cfg.hidden], cfg.dtype))
    return all_gather(scores, ranks=split) if split > 1 else scores


def vocab_parallel(cfg: ModelConfig, tp: int) -> bool:
    """Whether a ``tp``-rank decode graph splits the LM head by vocabulary rows: an untied head whose
    vocabulary ``tp`` divides (a tied one is the embedding table, which every rank needs whole)."""
    return tp > 1 and not cfg.tie_embeddings and cfg.vocab % tp == 0


def head_norms(cfg: ModelConfig, layer: int, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """qwen3's per-head RMSNorm of q and k (before RoPE); the identity for other models."""
    if not cfg.qk_norm:
        return q, k
    g, D = q.graph, cfg.head_dim
    norm = [g.weight(f"model.layers.{layer}.self_attn.{p}_norm.weight", [D], cfg.dtype) for p in "qk"]
    return rms_norm(q, norm[0], cfg.rms_eps), rms_norm(k, norm[1], cfg.rms_eps)


EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


# Where a checkpoint other than Qwen3-MoE's keeps a sparse layer's router and its experts' projections (the graph
# names them as Qwen3-MoE does): the router, an expert, and each projection's tensor
MOE_CHECKPOINT_NAMES = {"mixtral": ("block_sparse_moe.gate", "block_sparse_moe.experts",
                                    {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"})}


def checkpoint_expert(arch: str, layer: int, e: int, proj: str) -> str:
    """The checkpoint tensor of expert ``e``'s ``proj`` in ``layer`` (Hugging Face's ``mlp.experts.{e}.gate_proj.weight``)."""
    if arch in MOE_CHECKPOINT_NAMES:
        _, experts, projs = MOE_CHECKPOINT_NAMES[arch]
        return f"model.layers.{layer}.{experts}.{e}.{projs[proj]}.weight"
    return f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"


def expert_stack(layer: int, proj: str) -> str:
    """The graph weight stacking layer ``layer``'s experts' ``proj`` weights ``[E, ...]``."""
    return f"model.layers.{layer}.mlp.experts.{proj}.stacked"


Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def decoder_layer(cfg: ModelConfig, x: Tensor, layer: int, attend: Attend, *, tp: int = 1) -> Tensor:
    """One pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; ``x`` is [rows, hidden].
    ``attend(layer, q, k, v)`` takes the projections ([rows, heads * head_dim]) through the head
    norms, RoPE, the cache write and attention, to [rows, heads * head_dim]. ``tp > 1``: one rank's
    share of the heads and MLP columns, the O and down projections' partial sums all-reduced."""
    g, dt, eps = x.graph, cfg.dtype, cfg.rms_eps
    H, Hkv, D, E, F = cfg.heads // tp, cfg.kv_heads // tp, cfg.head_dim, cfg.hidden, cfg.intermediate // tp

    def reduced(t: Tensor) -> Tensor:
        return all_reduce(t, ranks=tp) if tp > 1 else t

    def w(name: str, *shape: int) -> Tensor:
        return g.weight(f"model.layers.{layer}.{name}.weight", shape, dt)

    h = rms_norm(x, w("input_layernorm", E), eps)
    q = linear(h, w("self_attn.q_proj", H * D, E))
    k = linear(h, w("self_attn.k_proj", Hkv * D, E))
    v = linear(h, w("self_attn.v_proj", Hkv * D, E))
    x = x + reduced(linear(attend(layer, q, k, v), w("self_attn.o_proj", E, H * D)))

    # MLP: down(silu(gate(h)) * up(h)); or the routed experts' (Qwen3-MoE's sparse layers)
    h = rms_norm(x, w("post_attention_layernorm", E), eps)
    if cfg.is_sparse(layer):
        check_experts(cfg)
        moe = cfg.moe
        n, f = moe.experts, moe.intermediate
        stacks = [g.weight(expert_stack(layer, p), s, dt) for p, s in zip(EXPERT_PROJS, ((n, f, E), (n, f, E), (n, E, f)))]
        logits = linear(h, w("mlp.gate", n, E))
        return x + moe_mlp(h, logits, *stacks, top_k=moe.top_k, normalize=moe.normalize)
    gate = silu(linear(h, w("mlp.gate_proj", F, E)))
    up = linear(h, w("mlp.up_proj", F, E))
    return x + reduced(linear(gate * up, w("mlp.down_proj", E, F)))


def check_experts(cfg: ModelConfig) -> None:
    """The megakernel's routed experts (``blockops/moe.py``) read the expert weights' rows, ``hidden_size``
    elements, ROW_BYTES at a time: an UnsupportedConfig naming the field (not a compile error on the op)."""
    if not expert_rows_fit(cfg.hidden, cfg.dtype):
        raise UnsupportedConfig(f"config field 'hidden_size' = {cfg.hidden} is not supported for the routed experts of "
                                f"a {cfg.arch} model in {cfg.dtype} (supported: a multiple of "
                                f"{ROW_BYTES // cfg.dtype.itemsize}, {ROW_BYTES} bytes)")


def check_dtype(spec: ModelSpec, dtype=None):
    """The torch dtype of ``spec``'s tensors; asking for another one is an error, not a silent cast."""
    if dtype is not None and as_dtype(dtype) != spec.dtype:
        raise GraphError(
            f"the graph was built for {spec.dtype}, not {as_dtype(dtype)}; "
            "rebuild it with dataclasses.replace(config, dtype=...)"
        )
    return spec.dtype.torch


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
