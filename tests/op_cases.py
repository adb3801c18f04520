"""Small single-op graphs shared by the simulator and GPU tests: name -> dtype -> (build, inputs, weights)."""

import megaegg as me

P = me.sym("pos")


def _gated_mlp(g, dt, f=200):
    """x + down(silu(gate(norm(x))) * up(norm(x))): the glu_down + acc_residual fusion; f = 203 leaves
    a ragged last tile (its weight slots past the tile re-read the last row, matvec.cuh: load_step)."""
    x = g.input("x", [1, 128], dt)
    h = me.rms_norm(x, g.weight("g", [128], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [f, 128], dt))) * me.linear(h, g.weight("wu", [f, 128], dt))
    g.output("y", x + me.linear(a, g.weight("wd", [128, f], dt)))


def mlp_sum_readers(g, dt, sum_output=False):
    """The MLP's sum read by matvecs only, as x (norm prologue) and as a residual: no
    acc_residual op, the readers add the f32 sum themselves."""
    x = g.input("x", [1, 128], dt)
    h = me.rms_norm(x, g.weight("g", [128], dt), 1e-5)
    a = me.silu(me.linear(h, g.weight("wg", [200, 128], dt))) * me.linear(h, g.weight("wu", [200, 128], dt))
    s = x + me.linear(a, g.weight("wd", [128, 200], dt))
    q = me.linear(me.rms_norm(s, g.weight("g2", [128], dt), 1e-5), g.weight("wq", [72, 128], dt))
    g.output("y", me.linear(q, g.weight("wo", [128, 72], dt)) + s)
    if sum_output:
        g.output("s", s)

def qk_norm_rope_append(g, dt):
    """qwen3's attention inputs: per-head RMSNorm, RoPE, k appended to its cache (one rope op
    each for q and k, the k op writing the cache row)."""
    q = me.rope(me.rms_norm(g.input("q", [4, 64], dt), g.weight("gq", [64], dt), 1e-6), P, theta=10000.0)
    k = me.rope(me.rms_norm(g.input("k", [2, 64], dt), g.weight("gk", [64], dt), 1e-6), P, theta=10000.0)
    kc = me.kv_append(g.input("kc", [2, 16, 64], dt), k, P)
    vc = me.kv_append(g.input("vc", [2, 16, 64], dt), g.input("v", [2, 64], dt), P)
    g.output("y", me.attention(q, kc, vc, P + 1))


def _reshape_of_transpose(g, dt):
    flat = me.reshape(me.transpose(g.input("x", [6, 4], dt), 0, 1), [24])
    g.output("y", me.silu(flat))
    g.output("flat", flat)


def moe(g, dt, *, residual=True, normalize=True, top_k=2, rows=1):
    """A mixture of 5 experts (72 rows each: ragged tiles): the router's linear on the normed x,
    then the experts, routed inside the kernel; with the residual add, the experts' sum is
    rounded by it. ``rows`` > 1: the experts grouped over the rows (moe_route, moe_experts)."""
    x = g.input("x", [rows, 128], dt)
    h = me.rms_norm(x, g.weight("g", [128], dt), 1e-5)
    logits = me.linear(h, g.weight("wr", [5, 128], dt))
    y = me.moe_mlp(h, logits, g.weight("we_g", [5, 72, 128], dt), g.weight("we_u", [5, 72, 128], dt),
                   g.weight("we_d", [5, 128, 72], dt), top_k=top_k, normalize=normalize)
    g.output("y", x + y if residual else y)


MOE_WEIGHTS = {"g": [128], "wr": [5, 128], "we_g": [5, 72, 128], "we_u": [5, 72, 128], "we_d": [5, 128, 72]}

CASES = {
    "linear": lambda dt: (lambda g: g.output("y", me.linear(g.input("x", [1, 256], dt), g.weight("w", [200, 256], dt))), {"x": [1, 256]}, {"w": [200, 256]}),
    "linear_ragged_tile": lambda dt: (lambda g: g.output("y", me.linear(g.input("x", [1, 256], dt), g.weight("w", [203, 256], dt))), {"x": [1, 256]}, {"w": [203, 256]}),
    "linear_odd_k": lambda dt: (lambda g: g.output("y", me.linear(g.input("x", [1, 100], dt), g.weight("w", [72, 100], dt))), {"x": [1, 100]}, {"w": [72, 100]}),
    "matmul": lambda dt: (lambda g: g.output("y", g.input("a", [3, 64], dt) @ g.weight("b", [64, 40], dt)), {"a": [3, 64]}, {"b": [64, 40]}),
    "rms_norm": lambda dt: (lambda g: g.output("y", me.rms_norm(g.input("x", [5, 128], dt), g.weight("w", [128], dt), 1e-5)), {"x": [5, 128]}, {"w": [128]}),
    "silu_mul_add": lambda dt: (lambda g: g.output("y", me.silu(g.input("a", [1, 3000], dt)) * g.input("b", [1, 3000], dt) + g.input("c", [3000], dt)), {"a": [1, 3000], "b": [1, 3000], "c": [3000]}, {}),
    "rope": lambda dt: (lambda g: g.output("y", me.rope(g.input("x", [4, 64], dt), P, theta=10000.0)), {"x": [4, 64]}, {}),
    "rope_hf": lambda dt: (lambda g: g.output("y", me.rope(g.input("x", [4, 64], dt), P, theta=10000.0, rounding="hf")), {"x": [4, 64]}, {}),
    "softmax": lambda dt: (lambda g: g.output("y", me.softmax(g.input("x", [3, 777], dt))), {"x": [3, 777]}, {}),
    "argmax": lambda dt: (lambda g: g.output("y", me.argmax(g.input("x", [1, 10000], dt))), {"x": [1, 10000]}, {}),
    "gated_mlp_residual": lambda dt: (lambda g: _gated_mlp(g, dt), {"x": [1, 128]}, {"g": [128], "wg": [200, 128], "wu": [200, 128], "wd": [128, 200]}),
    "gated_mlp_ragged_tile": lambda dt: (lambda g: _gated_mlp(g, dt, f=203), {"x": [1, 128]}, {"g": [128], "wg": [203, 128], "wu": [203, 128], "wd": [128, 203]}),
    "mlp_sum_readers": lambda dt: (lambda g: mlp_sum_readers(g, dt), {"x": [1, 128]}, {"g": [128], "wg": [200, 128], "wu": [200, 128], "wd": [128, 200], "g2": [128], "wq": [72, 128], "wo": [128, 72]}),
    "qk_norm_rope_append": lambda dt: (lambda g: qk_norm_rope_append(g, dt), {"q": [4, 64], "k": [2, 64], "v": [2, 64], "kc": [2, 16, 64], "vc": [2, 16, 64]}, {"gq": [64], "gk": [64]}),
    "moe_residual": lambda dt: (lambda g: moe(g, dt), {"x": [1, 128]}, MOE_WEIGHTS),
    "moe_alone_top3": lambda dt: (lambda g: moe(g, dt, residual=False, normalize=False, top_k=3), {"x": [1, 128]}, MOE_WEIGHTS),
    "moe_rows_residual": lambda dt: (lambda g: moe(g, dt, rows=9), {"x": [9, 128]}, MOE_WEIGHTS),
    "moe_rows_alone_top3": lambda dt: (lambda g: moe(g, dt, residual=False, normalize=False, top_k=3, rows=9), {"x": [9, 128]},
                                       MOE_WEIGHTS),
    # a reshape of a transpose has no strides: copied first (read by silu, and as an output)
    "reshape_of_transpose": lambda dt: (lambda g: _reshape_of_transpose(g, dt), {"x": [6, 4]}, {}),
    "elementwise_5d": lambda dt: (lambda g: g.output("y", me.silu(g.input("a", [2, 3, 1, 4, 5], dt)) + g.input("b", [5], dt)), {"a": [2, 3, 1, 4, 5], "b": [5]}, {}),
    "slice_runtime_window": lambda dt: (lambda g: g.output("y", me.linear(me.slice(g.input("a", [3, 80], dt), 1, P, P + 16), g.weight("w", [24, 16], dt))), {"a": [3, 80]}, {"w": [24, 16]}),
    "concat_transpose": lambda dt: (lambda g: g.output("y", me.concat([g.input("a", [4, 8], dt), me.transpose(g.input("b", [6, 4], dt), 0, 1)], 1)), {"a": [4, 8], "b": [6, 4]}, {}),
}


