"""Hugging Face causal LMs through their own modelling code (issue 41): a prompt step and a decode step
exported with ``torch.export``, their attention routed to custom ops (cache_ops.py) the translator maps
onto the Graph API's KV cache ops, each compiled into a megakernel, and a greedy / sampling loop.

    from transformers import AutoModelForCausalLM
    import megaegg
    lm = megaegg.from_transformers(AutoModelForCausalLM.from_pretrained(path), max_len=512, backend="sim")
    ids = lm.generate([1, 15043, 29892], max_new_tokens=16)

How: the model runs with ``attn_implementation="megaegg"`` (registered here with transformers'
``AttentionInterface``) and no transformers cache, so each attention layer hands this module the
step's q and its rotated k, v; the caches are inputs of the steps, written in place by the kernels
(docs/frontend.md). Everything else (embedding, norms, RoPE, MLP, LM head, whatever the architecture
computes) is the model's own ATen graph.
"""

from __future__ import annotations

import operator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from . import cache_ops, routed_ops  # noqa: F401  (registers torch.ops.megaegg.kv_append / attention / moe_mlp)
from .aten import UnsupportedTorch
from .export import export_program

ATTN_IMPLEMENTATION = "megaegg"
# transformers' sparse MoE blocks whose routing ops.moe_mlp computes (softmax in f32, the top k, silu experts of
# stacked gate_up_proj / down_proj; Qwen2-MoE's shared expert and its sigmoid gate traced as they are), by class:
# the config field that says whether the top-k weights are divided by their sum (None: always)
ROUTED_BLOCKS = {"Qwen3MoeSparseMoeBlock": "norm_topk_prob", "MixtralSparseMoeBlock": None,
                 "OlmoeSparseMoeBlock": "norm_topk_prob", "Qwen2MoeSparseMoeBlock": "norm_topk_prob"}


def _megaegg_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention interface: q [1, heads, n, D], k / v [1, kv_heads, n, D] (rotated) ->
    ([1, n, heads, D], None), through the step's caches (``kwargs["megaegg_caches"]``): one token over
    ``megaegg_positions`` (the decode step), or n rows at their own (slot, position) (``megaegg_rows``)."""
    caches = kwargs.get("megaegg_caches")
    if caches is None:
        raise UnsupportedTorch(f"{type(module).__name__}: the step's caches did not reach the attention (outside a "
                               "megaegg step, or the model's layers do not pass their keyword arguments through to it)")
    if query.shape[0] != 1:
        raise RuntimeError(f"a megaegg step takes one batch row of tokens, got q {tuple(query.shape)}")
    # what the ops do not compute is refused, never ignored (a wrong answer otherwise)
    name = type(module).__name__
    if kwargs.get("softcap") is not None:
        raise UnsupportedTorch(f"{name}: attention logit soft-capping (softcap={kwargs['softcap']}) is not supported")
    window, rows = kwargs.get("sliding_window") or getattr(module, "sliding_window", None), caches[0].shape[-2]
    if window is not None and window < rows:
        raise UnsupportedTorch(f"{name}: a sliding window of {window} rows under max_len {rows} is not supported "
                               f"(give max_len <= {window})")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise UnsupportedTorch(f"{name}: attention sinks are not supported")
    if dropout:
        raise UnsupportedTorch(f"{name}: attention dropout {dropout} (call model.eval())")
    if attention_mask is not None:  # (the registered mask function makes none: the model built its own)
        raise UnsupportedTorch(f"{name}: an attention mask of the model's own is not supported (causal only)")
    layer, heads, kv_heads, n, d = module.layer_idx, query.shape[1], key.shape[1], query.shape[2], query.shape[3]
    kc, vc = caches[2 * layer], caches[2 * layer + 1]
    scale = float(scaling if scaling is not None else d ** -0.5)
    # (reshapes and transposes, not indexing: the translator takes views, not selects)
    if kwargs.get("megaegg_rows") is None:  # the decode step: one token at position len(positions) - 1
        positions = kwargs["megaegg_positions"]
        kc = torch.ops.megaegg.kv_append(kc, key.reshape(kv_heads, d), positions)
        vc = torch.ops.megaegg.kv_append(vc, value.reshape(kv_heads, d), positions)
        out = torch.ops.megaegg.attention(query.reshape(heads, d), kc, vc, positions, scale)
        return out.reshape(1, 1, heads, d), None
    pos, slot, bound = kwargs["megaegg_rows"]
    rows_of = lambda t, h: t.transpose(1, 2).reshape(n, h, d)  # noqa: E731
    kc = torch.ops.megaegg.kv_store(kc, rows_of(key, kv_heads), pos, slot)
    vc = torch.ops.megaegg.kv_store(vc, rows_of(value, kv_heads), pos, slot)
    out = torch.ops.megaegg.ragged_attention(rows_of(query, heads), kc, vc, pos, slot, bound, scale)
    return out.reshape(1, n, heads, d), None


def register() -> None:
    """``attn_implementation="megaegg"`` for transformers (idempotent): the attention above, no mask (the
    step attends every cache row up to its position)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, _megaegg_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, lambda *args, **kwargs: None)


def _routed_forward(block, normalize: bool, hidden_states):
    """A sparse MoE block's forward as ``megaegg::moe_mlp`` (its experts' loop over data-dependent rows does not
    export): the router's logits, then every row's top-k experts."""
    x = hidden_states  # (its shape as it is: a reshape between the norm, the experts and the residual add would
    # keep the rewrite from fusing them, rules.py)
    gate_up, f = block.experts.gate_up_proj, block.experts.down_proj.shape[-1]
    out = torch.ops.megaegg.moe_mlp(x, F.linear(x, block.gate.weight), gate_up[:, :f], gate_up[:, f:],
                                    block.experts.down_proj, block.gate.top_k, normalize)
    if hasattr(block, "shared_expert"):  # (Qwen2-MoE)
        out = out + torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return out


@contextmanager
def _routed_experts(model):
    """While exporting: ``model``'s sparse MoE blocks run as ``megaegg::moe_mlp`` (ROUTED_BLOCKS); any other
    block with experts is refused by name."""
    text = model.config.get_text_config()
    patched = []
    try:
        for m in model.modules():
            if not hasattr(m, "experts"):
                continue
            name = type(m).__name__
            silu = getattr(text, "hidden_act", None) == "silu"
            if name not in ROUTED_BLOCKS or not hasattr(m.experts, "gate_up_proj") or not silu:
                raise UnsupportedTorch(f"{type(model).__name__}: its routed experts ({name}) are not supported: "
                                       f"from_transformers takes {', '.join(ROUTED_BLOCKS)} (silu experts stacked in "
                                       "gate_up_proj / down_proj, transformers 5)")
            field = ROUTED_BLOCKS[name]
            normalize = True if field is None else bool(getattr(text, field))
            m.forward = lambda h, m=m, normalize=normalize: _routed_forward(m, normalize, h)
            patched.append(m)
        yield
    finally:
        for m in patched:
            del m.forward


@contextmanager
def _static_rope(model, max_len: int):
    """While exporting: rotary embeddings whose frequencies transformers recomputes from the sequence length
    (``dynamic_rope_update``: ``dynamic`` NTK scaling, ``longrope``; a data-dependent branch and an in-place
    buffer update that torch.export cannot take) run with the frequencies they have at every position below
    ``max_len``: the original ones, where max_len stays within the length past which they change; a longer
    max_len is refused, naming the rope type and that length."""
    patched = []
    try:
        for m in model.modules():
            kinds = getattr(m, "rope_type", None)
            if not hasattr(m, "original_max_seq_len") or kinds is None:
                continue
            layered = isinstance(kinds, dict)  # (Gemma 3: a rope type a layer type)
            changed = {}
            for layer_type, kind in (kinds.items() if layered else [(None, kinds)]):
                if "dynamic" not in kind and kind != "longrope":
                    continue
                if kind == "longrope":  # (long factors past it, short ones below)
                    params = m.config.rope_parameters if layer_type is None else m.config.rope_parameters[layer_type]
                    limit = params.get("original_max_position_embeddings", m.original_max_seq_len)
                else:  # (the frequencies grow past it)
                    limit = m.original_max_seq_len
                if max_len > limit:
                    raise UnsupportedTorch(f"{type(model).__name__}: rope_type {kind!r} changes its frequencies past "
                                           f"{limit} positions (transformers' dynamic_rope_update), which a compiled step "
                                           f"does not follow: give max_len <= {limit}")
                prefix = "" if layer_type is None else f"{layer_type}_"
                changed[f"{prefix}inv_freq"] = getattr(m, f"{prefix}original_inv_freq")
            if not changed:
                continue
            # (new tensors, not copy_: the exported program keeps the ones it read, the model gets its own back)
            saved = {name: getattr(m, name) for name in changed}
            patched.append((m, kinds, saved))
            for name, freq in changed.items():
                m.register_buffer(name, freq.clone(), persistent=False)
            m.rope_type = {k: "default" for k in kinds} if layered else "default"  # (no update in the forward)
        yield
    finally:
        for m, kinds, saved in patched:
            m.rope_type = kinds
            for name, t in saved.items():
                m.register_buffer(name, t, persistent=False)


class DecodeStep(torch.nn.Module):
    """One token of one sequence through ``model``: ``forward(input_ids [1, 1], positions [ctx], *caches)``
    -> logits [1, vocab] of the token at position ``ctx - 1`` (``positions[-1]``). ``caches``: per layer
    its K then its V cache, [kv_heads, max_len, head_dim] in the model's dtype."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, positions, *caches):
        last = positions[positions.shape[0] - 1:][None]  # [1, 1]: the token's position
        out = self.model(input_ids=input_ids, position_ids=last, use_cache=False, megaegg_caches=caches,
                         megaegg_positions=positions)
        return out.logits.reshape(1, -1)


class PromptStep(torch.nn.Module):
    """n tokens in one launch: ``forward(input_ids [1, n], pos [n], slot [n], bound [ctx], *caches)`` writes
    each token's K / V at (``slot[i]``, ``pos[i]``) of caches [slots, kv_heads, max_len, head_dim], attends
    causally (every ``pos[i] + 1 <= ctx``) and returns the last token's logits [1, vocab]."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, pos, slot, bound, *caches):
        out = self.model(input_ids=input_ids, position_ids=pos[None], use_cache=False, logits_to_keep=1,
                         megaegg_caches=caches, megaegg_rows=(pos, slot, bound))
        return out.logits.reshape(1, -1)


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype

    @property
    def bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.max_len * self.head_dim * self.dtype.itemsize

    def new(self, device=None) -> list[torch.Tensor]:
        """Zeroed caches in the step's argument order (K, V per layer)."""
        shape = (self.kv_heads, self.max_len, self.head_dim)
        return [torch.zeros(shape, dtype=self.dtype, device=device) for _ in range(2 * self.layers)]


def cache_shape(model, max_len: int) -> CacheShape:
    cfg = model.config
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return CacheShape(text.num_hidden_layers, kv_heads, head_dim, max_len, next(model.parameters()).dtype)


class TransformersLM:
    """A Hugging Face causal LM's steps as megakernels (``megaegg.from_transformers``):
    ``generate(prompt_ids, max_new_tokens)`` runs the prompt in one launch, then a step a token (greedy by
    default, or as a :class:`megaegg.models.batch.Sampling` says); ``prompt(ids, start)`` -> the last token's
    logits, in one launch; ``step(token, pos)`` -> logits."""

    def __init__(self, kernel, prompt_kernel, shape: CacheShape, vocab: int):
        self.kernel, self.prompt_kernel, self.shape, self.vocab = kernel, prompt_kernel, shape, vocab
        self.device = kernel.kernel.device  # (the kernel's: the caches are its in-place inputs)
        self.caches = shape.new(self.device)
        self.prompt_caches = [c[None] for c in self.caches]  # (the same memory, as one sequence slot)
        self.rows = torch.arange(shape.max_len, dtype=torch.int64, device=self.device)

    def _tokens(self, ids, what: str) -> list[int]:
        """``ids`` (ints, or a tensor of one row) checked against the vocabulary."""
        if isinstance(ids, torch.Tensor):
            if ids.dim() == 2 and ids.shape[0] == 1:
                ids = ids[0]
            if ids.dim() != 1 or ids.dtype.is_floating_point:
                raise ValueError(f"{what}: expected token ids (a list of ints or a [n] / [1, n] integer tensor), "
                                 f"got a tensor of shape {tuple(ids.shape)} and dtype {ids.dtype}")
            ids = ids.tolist()
        out = []
        for v in ids:
            t = _index(v)  # (a numpy integer, a 0-d integer tensor: what tokenizers and argmax return)
            if t is None:
                raise ValueError(f"{what}: token ids must be ints, got {v!r}")
            if not 0 <= t < self.vocab:
                raise ValueError(f"{what}: token {t} is outside the vocabulary [0, {self.vocab})")
            out.append(t)
        return out

    def reset(self) -> None:
        for c in self.caches:
            c.zero_()

    def prompt(self, ids: Sequence[int], start: int = 0) -> torch.Tensor:
        """Logits [vocab] (f32) of the last of ``ids``, all written to the caches at positions ``start``,
        ``start + 1``, ... in one launch (rows before ``start`` already in the caches)."""
        ids = self._tokens(ids, "prompt")
        n = len(ids)
        at = _index(start)
        if at is None:
            raise ValueError(f"start must be an int, got {start!r}")
        start = at
        if n == 0 or not 0 <= start or start + n > self.shape.max_len:
            raise ValueError(f"{n} tokens at position {start}: outside the caches' max_len {self.shape.max_len}")
        tokens = torch.tensor([ids], dtype=torch.int64, device=self.device)
        pos, bound = self.rows[start:start + n], self.rows[:start + n]
        slot = torch.zeros(n, dtype=torch.int64, device=self.device)
        return self.prompt_kernel(tokens, pos, slot, bound, *self.prompt_caches)[0].float()

    def step(self, token: int, pos: int) -> torch.Tensor:
        """Logits [vocab] (f32) of ``token`` at position ``pos`` (rows before it already in the caches)."""
        (token,) = self._tokens([token], "step")
        at = _index(pos)
        if at is None or not 0 <= at < self.shape.max_len:  # (1.5 too: no int position)
            raise ValueError(f"position {pos!r} is outside the caches' max_len {self.shape.max_len}")
        pos = at
        ids = torch.tensor([[token]], dtype=torch.int64, device=self.device)
        return self.kernel(ids, self.rows[:pos + 1], *self.caches)[0].float()

    def generate(self, prompt_ids, max_new_tokens: int, *, sampling=None, eos_token_id=None) -> list[int]:
        """The new tokens after ``prompt_ids`` (ints, or a [n] / [1, n] tensor), at most ``max_new_tokens``;
        the last one is an ``eos_token_id`` (an int or several) if one came. Greedy, or drawn as ``sampling``
        (a :class:`megaegg.models.batch.Sampling`) says, by megaegg.sampling's rule on the host."""
        from ..models.batch import Sampling
        from ..sampling import sample_row

        sampling = sampling or Sampling()
        if not isinstance(sampling, Sampling):
            raise ValueError(f"sampling must be a megaegg.models.batch.Sampling, got {type(sampling).__name__}")
        ids = self._tokens(prompt_ids, "prompt_ids")
        if not ids:
            raise ValueError("prompt_ids is empty: give at least one token")
        count = _index(max_new_tokens)
        if count is None or count < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        max_new_tokens = count
        if len(ids) + max_new_tokens > self.shape.max_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds max_len "
                             f"{self.shape.max_len}")
        eos = set() if eos_token_id is None else {int(eos_token_id)} if isinstance(eos_token_id, int) else \
            {int(t) for t in eos_token_id}
        out: list[int] = []
        if max_new_tokens == 0:
            return out
        self.reset()
        logits = self.prompt(ids)
        s = sampling
        while True:
            tok = sample_row(logits, s.temperature, s.top_k, s.top_p, s.seed, len(out), where="generate")
            out.append(tok)
            if tok in eos or len(out) == max_new_tokens:
                return out
            logits = self.step(tok, len(ids) + len(out) - 1)


def _index(v) -> int | None:
    """``v`` as an int where it is one (an int, a numpy integer, a 0-d integer tensor), else None (a bool, a
    float, a float or bool tensor, a list)."""
    if isinstance(v, (bool, float)) or (isinstance(v, torch.Tensor) and v.dtype == torch.bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _compile_step(model, step, example, specs, caches: int, **compile_args):
    """``step`` exported at ``example`` (``specs``: one dynamic-shape spec a non-cache input; the ``caches``
    inputs after them, static) and compiled (``compile_exported``)."""
    from . import compile_exported
    from .export import dim_names

    ep = _export(model, step, example, (*specs, (None,) * caches))  # (forward's *caches: one tuple)
    return compile_exported(ep, dim_names(ep, (*specs, *((None,) * caches))), name=type(model).__name__,
                            **compile_args)


def _export(model, step, example, dynamic_shapes):
    """``torch.export`` of a step; its failure (a construct torch.export cannot trace) as one error naming the
    model, not torch's traceback (an UnsupportedTorch raised while tracing stays as it is)."""
    try:
        with _routed_experts(model):
            return export_program(step, example, dynamic_shapes)
    except UnsupportedTorch:
        raise
    except Exception as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UnsupportedTorch(f"{type(model).__name__}: torch.export could not trace its {type(step).__name__}: "
                               f"{first}") from e


def from_transformers(model, *, max_len: int = 512, backend: str | None = None, device=None) -> TransformersLM:
    """A transformers causal LM (``AutoModelForCausalLM``) as a megakernel decode step over KV caches of
    ``max_len`` rows: exported through its own forward with ``attn_implementation="megaegg"``, translated
    (megaegg.from_torch's translator) and compiled for ``backend``, twice: a prompt step (n tokens in one
    launch: tensor-core tiles and flash attention for long prompts on a GPU) and a decode step."""
    from ..compiler import resolve_backend

    if not (isinstance(model, torch.nn.Module) and hasattr(model, "config") and hasattr(model, "set_attn_implementation")):
        raise ValueError(f"from_transformers takes a transformers causal LM (AutoModelForCausalLM), got "
                         f"{type(model).__name__}")
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
        raise ValueError(f"max_len must be an int >= 2, got {max_len!r}")
    backend = resolve_backend(backend)
    if getattr(model.config.get_text_config(), "attention_chunk_size", None):
        raise UnsupportedTorch(f"{type(model).__name__}: attention_chunk_size (chunked attention) is not supported")
    register()
    model = model.eval()
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    try:
        return _from_transformers(model, max_len, backend, device)
    finally:
        model.set_attn_implementation(previous)


def _from_transformers(model, max_len: int, backend: str, device) -> TransformersLM:
    from ..compiler import check_fits

    with _static_rope(model, max_len):
        shape = cache_shape(model, max_len)
        dev = next(model.parameters()).device
        # (before allocating them: a max_len beyond the memory is one error naming it, not the allocator's)
        check_fits([("cache", f"KV caches of max_len {max_len} ({2 * shape.layers} x [{shape.kv_heads}, {max_len}, "
                              f"{shape.head_dim}] {shape.dtype})", shape.bytes)], dev, hint=": give a smaller max_len")
        common = dict(backend=backend, device=device)
        ctx = torch.export.Dim("ctx", min=1, max=max_len)
        caches = shape.new(dev)
        example = (torch.zeros(1, 1, dtype=torch.int64, device=dev), torch.arange(2, device=dev), *caches)
        run = _compile_step(model, DecodeStep(model), example, (None, {0: ctx}), len(caches),
                            max_dims={"ctx": max_len}, dims_hint={"ctx": min(max_len, 512)}, **common)
        n = torch.export.Dim("n", min=1, max=max_len)
        i64 = dict(dtype=torch.int64, device=dev)
        tokens, rows = min(3, max_len), min(5, max_len)  # (example sizes: >= 2, within the dims' ranges)
        example = (torch.zeros(1, tokens, **i64), torch.arange(tokens, **i64), torch.zeros(tokens, **i64),
                   torch.arange(rows, **i64), *(c[None] for c in caches))
        prompt = _compile_step(model, PromptStep(model), example, ({1: n}, {0: n}, {0: n}, {0: ctx}), len(caches),
                               max_dims={"n": max_len, "ctx": max_len}, dims_hint={"n": 16, "ctx": min(max_len, 512)},
                               **common)
    return TransformersLM(run, prompt, shape, model.get_input_embeddings().weight.shape[0])
