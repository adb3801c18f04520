"""ragged_flash: ragged attention over a prompt on tensor cores (``interpreter/cuda/flash.cuh``), the
prompt-side alternative to ``ragged_partial_merge`` (``ragged_attention.py``).

Instance ``(i, h)``: the ``BT = 128 // G`` rows ``[i*BT, i*BT + BT)`` of ``q [N, Hq, D]`` and the ``G``
query heads of KV head ``h``, 128 (row, head) pairs sharing K/V. Row ``r`` attends cache rows ``[0,
pos[r]]`` of slot ``slot[r]``: the instance runs one flash-attention pass (64 cache rows a block, online
softmax, QK^T and PV on ``mma.sync`` m16n8k16) per distinct slot of its rows, so the rows of one
prompt (one slot, consecutive positions) share every K/V block read. A tile of rows of different
sequences (decode rows) runs one pass per sequence: correct, but no faster than the split-KV path,
which the cost model picks for batches of such rows (``decode_like``).
"""

from __future__ import annotations

import torch

from ..dims import ceildiv
from ..dtypes import bf16
from .base import BlockKind, Partition, Term, c_call, f32, fields, register, term
from ..ir.footprint import Full, Tile
from .ragged_attention import row_length

ROWS = 128  # (row, head) pairs an instance: 8 warps x 16
BLOCK = 64  # cache rows a K/V block
HEAD_DIMS = (64, 128)


def tokens_per_tile(group: int) -> int:
    return ROWS // group


@register
class RaggedFlash(BlockKind):
    name = "ragged_flash"
    cuda_file = "flash.cuh"

    def build(self, inputs, output, params) -> Partition:
        q, kc, _, _, _ = inputs
        g = params["group"]
        bt = tokens_per_tile(g)
        kv = (Full(), Tile(1, 1), Full(), Full())
        rows = (Tile(0, bt),)
        return Partition(grid=(ceildiv(q.shape[0], bt), kc.shape[1]),
                         reads=((Tile(0, bt), Tile(1, g), Full()), kv, kv, rows, rows),
                         writes=(Tile(0, bt), Tile(1, g), Full()))

    def cpu(self, op, env, ins, out):
        q, kc, vc, pos, slot = ins
        g = op.params["group"]
        bt = tokens_per_tile(g)
        i, h = env["_i0"], env["_i1"]
        heads = slice(h * g, (h + 1) * g)
        for r in range(i * bt, min(i * bt + bt, q.shape[0])):
            length, s = row_length(op, pos, slot, r, kc.shape)
            k, v = f32(kc[s, h, :length]), f32(vc[s, h, :length])  # [L, D]
            scores = f32(q[r, heads]) @ k.T * op.params["scale"]  # [G, L]
            out[r, heads] = (torch.softmax(scores, -1) @ v).to(out.dtype)

    def bytes_moved(self, op, env):
        q, kc = op.inputs[0], op.inputs[1]
        n, length = q.shape[0].eval(env), min(kc.shape[2].value, op.params["length"].eval(env))
        hkv, d = kc.shape[1].value, kc.shape[3].value
        tiles = -(-n // tokens_per_tile(op.params["group"]))
        passes = tiles * (tokens_per_tile(op.params["group"]) if decode_like(op, env) else 1)
        return passes * hkv * 2 * length * d * kc.dtype.itemsize + 2 * n * q.shape[1].value * d * q.dtype.itemsize

    def flops(self, op, env) -> float:
        q, kc = op.inputs[0], op.inputs[1]
        n, length = q.shape[0].eval(env), min(kc.shape[2].value, op.params["length"].eval(env))
        tiles = -(-n // tokens_per_tile(op.params["group"])) * kc.shape[1].value
        passes = tokens_per_tile(op.params["group"]) if decode_like(op, env) else 1
        return 4.0 * tiles * passes * ROWS * length * kc.shape[3].value  # (causal rows skip blocks past them)

    def cuda_call(self, op, ins, out):
        q, kc, vc, pos, slot = ins
        p = op.params
        d = op.inputs[0].shape[2].value
        slots, _, max_len, _ = (x.value for x in op.inputs[1].shape)
        args = [("smem", "smem"), ("q", q.view()), ("kc", kc.view()), ("vc", vc.view()), ("pos", pos.view(0)),
                ("slot", slot.view(0)), ("N", q.shape[0]), ("slots", f"{slots}LL"), ("max_len", f"{max_len}LL"),
                ("scale", f"{float(p['scale'])!r}f"), ("out", out.view(const=False)), ("c0", "c0"), ("c1", "c1")]
        return c_call("ragged_flash", [d, p["group"]], args)


def decode_like(op, env) -> bool:
    """Whether the rows may each be another sequence's (no more rows than cache slots): then a tile
    runs a pass per row, and the cost model prices it so."""
    return op.inputs[0].shape[0].eval(env) <= op.inputs[1].shape[0].value


@term
class RaggedFlashTerm(Term):
    """Ragged attention as one flash-attention pass per tile of rows and KV head (``ragged_flash``)."""

    name = "ragged_flash"
    fields = fields("node:node chunk:int")
    tile = "chunk"
    min_rows = 64  # tokens: a decode batch keeps the split-KV path
    needs = "bf16, head dim 64 or 128, query heads a multiple of the KV heads"

    def fits(self, graph, args) -> bool:
        n = graph.nodes[args["node"]]
        q, kc = (graph.nodes[i] for i in n.inputs[:2])
        d = q.shape[-1]
        if args["chunk"] != BLOCK or q.dtype != bf16 or kc.dtype != bf16 or not d.is_const or d.value not in HEAD_DIMS:
            return False
        hq, hkv = q.shape[1], kc.shape[1]
        return hq.is_const and hkv.is_const and hq.value % hkv.value == 0 and hq.value // hkv.value <= ROWS

    def lower(self, b, value, args):
        n = b.graph.nodes[value]
        q, kc, vc, pos, slot = (b.operand(i) for i in n.inputs)
        group = q.shape[1].value // kc.shape[1].value
        params = {"group": group, "scale": n.attrs["scale"], "length": n.attrs["length"]}
        b.emit("ragged_flash", [value], [q, kc, vc, b.flat(pos), b.flat(slot)], b.output(value), params)
