"""The reference executor: runs a Graph with plain torch ops. The oracle for every test.

Float ops compute in float32 and round the result to the node's dtype, the same
contract the block ops follow (fp32 accumulation, storage in the tensor's dtype).
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from .dims import evaluate_shape, fmt_shape
from .graph import COLLECTIVES, Graph, GraphError, Node


def bind_dims(graph: Graph, dims: Mapping[str, int]) -> dict[str, int]:
    """Check that every runtime dim of the graph has a non-negative int value."""
    env: dict[str, int] = {}
    for name in sorted(graph.symbols()):
        if name not in dims:
            raise GraphError(f"missing value for runtime dim {name!r} (graph uses: {', '.join(sorted(graph.symbols()))})")
        v = dims[name]
        if isinstance(v, bool) or not isinstance(v, int):  # the same words as Kernel's check
            raise GraphError(f"runtime dim {name!r} must be an int, got {type(v).__name__} {v!r}")
        if v < 0:
            raise GraphError(f"runtime dim {name!r} must be a non-negative int, got {v!r}")
        env[name] = v
    extra = set(dims) - graph.symbols()
    if extra:
        raise GraphError(f"unknown runtime dim(s) {sorted(extra)}; graph uses: {sorted(graph.symbols())}")
    return env


def check_leaf(node: Node, value, env: Mapping[str, int], kind: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise GraphError(f"{kind} {node.name!r} must be a torch.Tensor, got {type(value).__name__}")
    want = evaluate_shape(node.shape, env)
    if tuple(value.shape) != want:
        raise GraphError(f"{kind} {node.name!r} has shape {list(value.shape)}, expected {list(want)} ({fmt_shape(node.shape)})")
    if value.dtype != node.dtype.torch:
        raise GraphError(f"{kind} {node.name!r} has dtype {value.dtype}, expected {node.dtype.torch}")


def collect_leaves(graph: Graph, inputs: Mapping, weights: Mapping, env: Mapping[str, int]) -> dict[int, torch.Tensor]:
    """Leaf values by node id, after checking names, shapes and dtypes."""
    for kind, given, want in (("input", inputs, graph.inputs), ("weight", weights, graph.weights)):
        missing = sorted(set(want) - set(given))
        if missing:
            raise GraphError(f"missing {kind}(s): {', '.join(missing)}")
        unknown = sorted(set(given) - set(want))
        if unknown:
            raise GraphError(f"unknown {kind}(s): {', '.join(unknown)}; graph has: {', '.join(sorted(want))}")
    values: dict[int, torch.Tensor] = {}
    for node in graph.nodes:
        if node.op == "input":
            check_leaf(node, inputs[node.name], env, "input")
            values[node.id] = inputs[node.name]
        elif node.op == "weight":
            check_leaf(node, weights[node.name], env, "weight")
            values[node.id] = weights[node.name]
    return values


def run_reference(
    graph: Graph,
    inputs: Mapping[str, torch.Tensor] | None = None,
    weights: Mapping[str, torch.Tensor] | None = None,
    dims: Mapping[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Run ``graph`` with torch on the device its inputs live on; returns outputs by name.

    ``kv_append`` writes into the cache tensor passed as input, as the megakernel does.

    >>> import torch, megaegg as me
    >>> g = me.Graph(); x = g.input("x", [2, 3], me.f32)
    >>> _ = g.output("y", me.silu(x))
    >>> run_reference(g, {"x": torch.zeros(2, 3)})["y"].shape
    torch.Size([2, 3])
    """
    if any(n.op in COLLECTIVES and n.attrs["ranks"] > 1 for n in graph.nodes):
        raise GraphError("the graph has collectives over several ranks: run it with run_reference_ranks")
    return run_reference_ranks(graph, [inputs or {}], [weights or {}], dims)[0]


def run_reference_ranks(
    graph: Graph,
    inputs: list[Mapping[str, torch.Tensor]],
    weights: list[Mapping[str, torch.Tensor]],
    dims: Mapping[str, int] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Run ``graph`` once per tensor-parallel rank, in lockstep: ``inputs[r]`` and ``weights[r]`` are
    rank ``r``'s (its weight shards); an ``all_reduce`` gives every rank the f32 sum of the ranks'
    values, rounded once, an ``all_gather`` their concatenation along the last dim, in rank order.
    Returns each rank's outputs.

    >>> import torch, megaegg as me
    >>> g = me.Graph(); x = g.input("x", [1, 4], me.f32)
    >>> _ = g.output("y", me.all_reduce(x, ranks=2))
    >>> [o["y"].tolist() for o in run_reference_ranks(g, [{"x": torch.ones(1, 4)}, {"x": 2 * torch.ones(1, 4)}], [{}, {}])]
    [[[3.0, 3.0, 3.0, 3.0]], [[3.0, 3.0, 3.0, 3.0]]]
    """
    env = bind_dims(graph, dims or {})
    if len(inputs) != len(weights) or not inputs:
        raise GraphError(f"run_reference_ranks: one inputs and one weights dict per rank (got {len(inputs)} and {len(weights)})")
    for n in graph.nodes:
        if n.op in COLLECTIVES and n.attrs["ranks"] != len(inputs):
            raise GraphError(f"{n.op} {n.label} spans {n.attrs['ranks']} ranks; {len(inputs)} were given")
    values = [collect_leaves(graph, i, w, env) for i, w in zip(inputs, weights)]
    devices = [next((t.device for t in v.values()), torch.device("cpu")) for v in values]
    live = graph.live_nodes()
    for node in graph.nodes:
        if node.id in values[0] or node.id not in live:
            continue
        if node.op == "all_reduce":
            total = sum(_f(v[node.inputs[0]]).to(devices[0]) for v in values)
            for v, device in zip(values, devices):
                v[node.id] = _to(node, total).to(device)
            continue
        if node.op == "all_gather":
            whole = torch.cat([v[node.inputs[0]].to(devices[0]) for v in values], -1)
            for v, device in zip(values, devices):
                v[node.id] = whole.to(device)
            continue
        for v, device in zip(values, devices):
            args = [v[i] for i in node.inputs]
            try:
                v[node.id] = _EVAL[node.op](node, args, env, device)
            except (RuntimeError, IndexError) as e:
                raise GraphError(f"{node.op} {node.label} failed at run time: {e}") from e
    return [{name: v[i] for name, i in graph.outputs.items()} for v in values]


# --- op semantics -------------------------------------------------------------------
def _f(x: torch.Tensor) -> torch.Tensor:
    return x.float() if x.is_floating_point() else x


def _to(node: Node, x: torch.Tensor) -> torch.Tensor:
    return x.to(node.dtype.torch)


def _rope(node: Node, args, env, device):
    x, inv = _f(args[0]), args[1].to(device).float()
    if node.attrs["pos"] is not None:
        pos = torch.full(x.shape[:1] if x.ndim >= 2 else (1,), node.attrs["pos"].eval(env), device=device, dtype=torch.float32)
    else:
        pos = args[2].float()
    angles = pos[:, None] * inv[None, :]  # [T, D/2]
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (inv.shape[0],) if x.ndim >= 2 else (inv.shape[0],)
    cos, sin = angles.cos().reshape(shape), angles.sin().reshape(shape)
    h = x.shape[-1] // 2
    if node.attrs.get("rounding") == "hf":  # as transformers' apply_rotary_pos_emb: in the dtype, op by op
        x, cos, sin = _to(node, x), _to(node, torch.cat([cos, cos], -1)), _to(node, torch.cat([sin, sin], -1))
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin
    x1, x2 = x[..., :h], x[..., h:]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return _to(node, out)


def _rms_norm(node, args, env, device):
    x, w = _f(args[0]), _f(args[1])
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + node.attrs["eps"])
    return _to(node, _to(node, y).float() * w)


def _attention(node, args, env, device):
    q, kc, vc = (_f(a) for a in args)
    length = node.attrs["length"].eval(env)
    if length < 1 or length > kc.shape[1]:
        raise GraphError(f"attention {node.label}: length {length} outside [1, {kc.shape[1]}]")
    group = q.shape[0] // kc.shape[0]
    k = kc[:, :length].repeat_interleave(group, 0)  # [Hq, L, D]
    v = vc[:, :length].repeat_interleave(group, 0)
    scores = torch.einsum("hd,hld->hl", q, k) * node.attrs["scale"]
    return _to(node, torch.einsum("hl,hld->hd", scores.softmax(-1), v))


def _kv_append(node, args, env, device):
    cache, new = args
    pos = node.attrs["pos"].eval(env)
    if not 0 <= pos < cache.shape[1]:
        raise GraphError(f"kv_append {node.label}: position {pos} outside the cache's {cache.shape[1]} rows")
    cache[:, pos, :] = new
    return cache


def _rows_index(node, name: str, t: torch.Tensor, hi: int) -> list[int]:
    vals = t.tolist()
    for i, v in enumerate(vals):
        if not 0 <= v < hi:
            raise GraphError(f"{node.op} {node.label}: {name}[{i}] = {v} outside [0, {hi - 1}]")
    return vals


class _Pages:
    """Where a sequence's cache rows are: ``(slot, position)`` itself, or through a page table (ops.kv_store:
    ``pages``) row ``position % page_len`` of page ``pages[slot, position // page_len]``, checked."""

    def __init__(self, node, cache: torch.Tensor, pages: torch.Tensor | None):
        self.node, self.pages = node, None if pages is None else pages.tolist()
        self.slots = len(self.pages) if self.pages is not None else cache.shape[0]
        self.rows = cache.shape[2] * (len(self.pages[0]) if self.pages is not None else 1)  # a sequence's
        self.page_len, self.count = cache.shape[2], cache.shape[0]

    def at(self, s: int, p: int) -> tuple[int, int]:
        if self.pages is None:
            return s, p
        page = self.pages[s][p // self.page_len]
        if not 0 <= page < self.count:
            raise GraphError(f"{self.node.op} {self.node.label}: pages[{s}, {p // self.page_len}] = {page} outside "
                             f"[0, {self.count - 1}]")
        return page, p % self.page_len

    def sequence(self, cache: torch.Tensor, s: int, length: int) -> torch.Tensor:
        """Rows ``[0, length)`` of sequence ``s``: ``[Hkv, length, D]``."""
        if self.pages is None:
            return cache[s, :, :length]
        for j in range(-(-length // self.page_len)):  # (each page checked)
            self.at(s, j * self.page_len)
        pos = torch.arange(length)
        pages = torch.tensor(self.pages[s], dtype=torch.long)[pos // self.page_len]
        return cache[pages.to(cache.device), :, (pos % self.page_len).to(cache.device)].transpose(0, 1)  # [Hkv, L, D]


def _kv_store(node, args, env, device):
    cache, new, pos, slot = args[:4]
    where = _Pages(node, cache, args[4] if len(args) > 4 else None)
    pos = _rows_index(node, "pos", pos, where.rows)
    slot = _rows_index(node, "slot", slot, where.slots)
    for i, (p, s) in enumerate(zip(pos, slot)):
        page, row = where.at(s, p)
        cache[page, :, row, :] = new[i]
    return cache


def ragged_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One row of :func:`megaegg.ops.ragged_attention` in f32: ``q [Hq, D]`` over its sequence's cache rows
    ``k``, ``v`` ``[Hkv, L, D]`` (positions ``[0, pos]``)."""
    group = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(group, 0)  # [Hq, L, D]
    v = v.float().repeat_interleave(group, 0)
    scores = torch.einsum("hd,hld->hl", q.float(), k) * scale
    return torch.einsum("hl,hld->hd", scores.softmax(-1), v)


def _ragged_attention(node, args, env, device):
    q, kc, vc, pos, slot = args[:5]
    where = _Pages(node, kc, args[5] if len(args) > 5 else None)
    pos = _rows_index(node, "pos", pos, min(where.rows, node.attrs["length"].eval(env)))
    slot = _rows_index(node, "slot", slot, where.slots)
    out = torch.empty(q.shape, dtype=torch.float32, device=device)
    for i, (p, s) in enumerate(zip(pos, slot)):
        out[i] = ragged_rows(q[i], where.sequence(kc, s, p + 1), where.sequence(vc, s, p + 1), node.attrs["scale"])
    return _to(node, out)


def _sample(node, args, env, device):
    from .sampling import sample_row

    logits, temperature, top_k, top_p, seed, counter = (a.cpu() for a in args)
    out = [sample_row(logits[i], float(temperature[i]), int(top_k[i]), float(top_p[i]), int(seed[i]), int(counter[i]),
                      row=i, where=f"sample {node.label}") for i in range(logits.shape[0])]
    return torch.tensor(out, dtype=torch.int32, device=device)


def _argmax(node, args, env, device):
    """torch.argmax (the first index of the max, +inf included), but NaN is an error naming the row
    (rows: the input's elements along every other dim, in order), not an index, as in the kernel."""
    from .sampling import NaNError

    x, d = _f(args[0]), node.attrs["dim"]
    bad = torch.isnan(x).any(d).reshape(-1).nonzero()
    if bad.numel():
        raise NaNError(f"NaN logits in row {int(bad[0])} of argmax {node.label}")
    return x.argmax(d).to(torch.int32)


def _embedding(node, args, env, device):
    table, ids = args
    bad = ids[(ids < 0) | (ids >= table.shape[0])]
    if bad.numel():  # (torch would wrap a negative id around; the kernel refuses it)
        raise GraphError(f"embedding {node.label}: token id {bad[0].item()} outside the table's {table.shape[0]} rows")
    return table[ids.long()]


def _slice(node, args, env, device):
    a = node.attrs
    return args[0].narrow(a["dim"], a["start"].eval(env), (a["stop"] - a["start"]).eval(env))


def moe_routing(logits: torch.Tensor, top_k: int, normalize: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(routing weights rounded to ``dtype``, expert ids) of each row of ``logits [R, E]``: the
    ``top_k`` largest softmax probabilities (f32), largest first, ties to the lower expert (as the CUDA
    routing takes them; ``topk``'s order of ties is unspecified, and bf16 router logits tie at the top-k's
    edge in ~8% of a random 128-expert model's layers), divided by their sum when ``normalize`` (Qwen3-MoE's router)."""
    probs = logits.float().softmax(-1)
    p, ids = (t[..., :top_k] for t in probs.sort(dim=-1, descending=True, stable=True))
    if normalize:
        p = p / p.sum(-1, keepdim=True)
    return p.to(dtype), ids


def expert_mlp(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``silu(x wg^T) * (x wu^T)`` of f32 rows ``x``, rounded to ``dt`` as the unfused ops round; f32."""
    g = (x @ wg.float().T).to(dt).float()
    u = (x @ wu.float().T).to(dt).float()
    return (torch.nn.functional.silu(g).to(dt).float() * u).to(dt).float()


def moe_sum(x: torch.Tensor, logits: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor, top_k: int,
            normalize: bool, dt: torch.dtype) -> torch.Tensor:
    """``ops.moe_mlp`` of ``x [..., K]``, ``logits [..., E]`` before its one rounding: each row's routed experts'
    gated MLPs summed by their weights in f32, ``x``'s shape."""
    rows = x.reshape(-1, x.shape[-1]).float()
    p, ids = moe_routing(logits.reshape(-1, logits.shape[-1]), top_k, normalize, dt)
    out = torch.zeros(rows.shape, dtype=torch.float32, device=x.device)
    for r in range(rows.shape[0]):
        for j, e in enumerate(ids[r].tolist()):
            h = expert_mlp(rows[r : r + 1], wg[e], wu[e], dt)
            out[r] += p[r, j].float() * (h @ wd[e].float().T)[0]
    return out.reshape(x.shape)


def _moe_mlp(node, args, env, device):
    a = node.attrs
    return _to(node, moe_sum(*args, a["top_k"], a["normalize"], node.dtype.torch))


_EVAL: dict[str, Callable] = {
    "constant": lambda n, a, e, d: n.attrs["value"].to(d),
    "matmul": lambda n, a, e, d: _to(n, _f(a[0]) @ _f(a[1])),
    "linear": lambda n, a, e, d: _to(n, _f(a[0]) @ _f(a[1]).T),
    "add": lambda n, a, e, d: _to(n, _f(a[0]) + _f(a[1])),
    "mul": lambda n, a, e, d: _to(n, _f(a[0]) * _f(a[1])),
    "sub": lambda n, a, e, d: _to(n, _f(a[0]) - _f(a[1])),
    "div": lambda n, a, e, d: _to(n, _f(a[0]) / _f(a[1])),
    "neg": lambda n, a, e, d: _to(n, -_f(a[0])),
    "silu": lambda n, a, e, d: _to(n, torch.nn.functional.silu(_f(a[0]))),
    # (in the tensor's own dtype, as torch computes them)
    "pow": lambda n, a, e, d: a[0] ** n.attrs["exponent"],
    "mean": lambda n, a, e, d: a[0].mean(n.attrs["dim"], keepdim=n.attrs["keepdim"]),
    "rsqrt": lambda n, a, e, d: torch.rsqrt(a[0]),
    "add_scalar": lambda n, a, e, d: a[0] + n.attrs["scalar"],
    "sigmoid": lambda n, a, e, d: _to(n, torch.sigmoid(_f(a[0]))),
    "gelu": lambda n, a, e, d: _to(n, torch.nn.functional.gelu(_f(a[0]), approximate=n.attrs["approximate"])),
    "tanh": lambda n, a, e, d: _to(n, torch.tanh(_f(a[0]))),
    "exp": lambda n, a, e, d: _to(n, torch.exp(_f(a[0]))),
    "cos": lambda n, a, e, d: _to(n, torch.cos(_f(a[0]))),
    "sin": lambda n, a, e, d: _to(n, torch.sin(_f(a[0]))),
    "rms_norm": _rms_norm,
    "softmax": lambda n, a, e, d: _to(n, _f(a[0]).softmax(n.attrs["dim"])),
    "rope": _rope,
    "embedding": _embedding,
    "attention": _attention,
    "kv_append": _kv_append,
    "kv_store": _kv_store,
    "ragged_attention": _ragged_attention,
    "sample": _sample,
    "argmax": _argmax,
    "reshape": lambda n, a, e, d: a[0].reshape(tuple(s.eval(e) for s in n.attrs["shape"])),
    "permute": lambda n, a, e, d: a[0].permute(n.attrs["dims"]),
    "slice": _slice,
    "expand": lambda n, a, e, d: a[0].expand(tuple(s.eval(e) for s in n.attrs["shape"])),
    "concat": lambda n, a, e, d: torch.cat(a, n.attrs["dim"]),
    "cast": lambda n, a, e, d: a[0].to(n.dtype.torch),
    "moe_mlp": _moe_mlp,
    "all_reduce": lambda n, a, e, d: _to(n, _f(a[0])),  # (one rank: run_reference_ranks sums several)
    "all_gather": lambda n, a, e, d: a[0],  # (one rank: run_reference_ranks concatenates several)
}

