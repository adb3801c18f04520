"""Graph API: shape inference, symbolic dims, and every error path naming op and tensors."""

import pytest
import torch

import megaegg as me
from megaegg import GraphError, ShapeError

S, P = me.sym("S"), me.sym("pos")


def test_graph_ops_are_the_reference_ops():
    """graph.OPS (what add_node accepts) lists exactly the ops run_reference evaluates, and the leaves."""
    from megaegg.graph import LEAF_OPS, OPS
    from megaegg.reference import _EVAL

    assert OPS == set(_EVAL) | set(LEAF_OPS)


def test_dim_arithmetic_and_eval():
    d = me.ceildiv(S * 4 + 3, 2)
    assert d.eval({"S": 5}) == 12
    assert str(S + 0) == "S" and str(S * 1) == "S" and (S * 0).value == 0
    assert (S + 2) + 3 == S + 5
    assert 3 + S == S + 3
    assert (S // 4).eval({"S": 17}) == 4 and (S % 4).eval({"S": 17}) == 1
    assert me.dmin(S, 7).eval({"S": 9}) == 7 and me.dmax(S, 7).eval({"S": 9}) == 9
    with pytest.raises(KeyError, match="S"):
        d.eval({})
    with pytest.raises(ValueError):
        me.sym("not an identifier")


def test_shape_inference():
    g = me.Graph()
    x = g.input("x", [S, 64], me.bf16)
    w = g.weight("w", [128, 64], me.bf16)
    y = me.linear(x, w)
    assert y.shape == (S, me.Dim("const", (128,))) and y.dtype == me.bf16
    assert (x @ g.weight("b", [64, 32], me.bf16)).shape[-1].value == 32
    assert (y + g.input("bias", [128], me.bf16)).shape == y.shape
    assert me.reshape(y, [-1]).shape[0].eval({"S": 3}) == 384
    assert me.transpose(y, 0, 1).shape == (y.shape[1], y.shape[0])
    assert me.slice(y, 1, 16, 48).shape[1].value == 32
    assert me.concat([y, y], 1).shape[1].value == 256
    assert me.argmax(y).dtype == me.i32 and me.argmax(y).shape == (S,)
    assert me.expand(g.input("one", [1, 128], me.bf16), [S, 128]).shape == (S, y.shape[1])
    assert me.cast(y, me.f32).dtype == me.f32
    emb = me.embedding(g.weight("emb", [1000, 64], me.bf16), g.input("ids", [S], me.i32))
    assert emb.shape == (S, me.Dim("const", (64,)))


def _layer_graph():
    g = me.Graph()
    q = g.input("q", [8, 64], me.bf16)
    kc = g.input("kc", [2, 128, 64], me.bf16)
    return g, q, kc


@pytest.mark.parametrize(
    "build, pattern",
    [
        (lambda g: me.linear(g.input("x", [1, 64], me.f32), g.weight("w", [32, 48], me.f32)), r"linear: in-features differ.*'x'.*'w'"),
        (lambda g: me.matmul(g.input("a", [2, 3], me.f32), g.input("b", [4, 5], me.f32)), r"matmul: inner dims differ.*'a'.*\[2, 3\].*'b'.*\[4, 5\]"),
        (lambda g: me.add(g.input("a", [2, 3], me.f32), g.input("b", [4, 3], me.f32)), r"add: shapes do not broadcast.*'a'.*'b'"),
        (lambda g: me.add(g.input("a", [3], me.f32), g.input("b", [3], me.bf16)), r"add: dtypes differ"),
        (lambda g: me.rms_norm(g.input("x", [2, 8], me.f32), g.weight("g", [4], me.f32)), r"rms_norm: weight 'g'"),
        (lambda g: me.rope(g.input("x", [2, 7], me.f32), P), r"rope: last dim.*even"),
        (lambda g: me.embedding(g.weight("t", [10, 4], me.f32), g.input("i", [3], me.f32)), r"embedding: ids 'i'.*i32"),
        (lambda g: me.reshape(g.input("x", [4, 6], me.f32), [5, 5]), r"reshape: 'x'.*element counts differ"),
        (lambda g: me.permute(g.input("x", [4, 6], me.f32), [0, 0]), r"permute"),
        (lambda g: me.slice(g.input("x", [4, 6], me.f32), 1, 2, 9), r"slice: stop 9 exceeds"),
        (lambda g: me.expand(g.input("x", [2, 6], me.f32), [4, 6]), r"expand: 'x'"),
        (lambda g: me.concat([g.input("a", [2, 3], me.f32), g.input("b", [2, 4], me.f32)], 0), r"concat: 'b'"),
        (lambda g: me.softmax(g.input("x", [2, 3], me.f32), dim=2), r"softmax: dim 2 out of range"),
        (lambda g: me.silu(g.input("x", [2], me.i32)), r"silu: 'x' i32.*float"),
        (lambda g: me.attention(g.input("q", [6, 64], me.f32), g.input("k", [4, 16, 64], me.f32),
                                g.input("v", [4, 16, 64], me.f32), P + 1), r"attention: q heads.*multiple"),
        (lambda g: me.attention(g.input("q", [8, 32], me.f32), g.input("k", [4, 16, 64], me.f32),
                                g.input("v", [4, 16, 64], me.f32), P + 1), r"attention: head dim"),
        (lambda g: me.kv_append(g.input("k", [4, 16, 64], me.f32), g.input("n", [4, 32], me.f32), P), r"kv_append: new entry 'n'"),
        (lambda g: me.kv_append(g.weight("k", [4, 16, 64], me.f32), g.input("n", [4, 64], me.f32), P), r"kv_append: cache 'k'.*graph input"),
        (lambda g: g.weight("w", [S, 4], me.f32), r"weight 'w'.*concrete"),
        # dims the block ops take at compile time: a runtime dim there is refused when the graph is built
        (lambda g: me.linear(g.input("x", [2, S], me.f32), g.input("w", [8, S], me.f32)), r"linear: weight 'w' f32\[8, S\] must have static dims \[N, K\]"),
        (lambda g: me.matmul(g.input("a", [2, 8], me.f32), g.input("b", [8, S], me.f32)), r"matmul: b 'b' .* must have static dims \[K, N\]"),
        (lambda g: me.rms_norm(g.input("x", [2, S], me.f32), g.input("g", [S], me.f32)), r"rms_norm: x 'x' f32\[2, S\] must have static last dim"),
        (lambda g: me.embedding(g.input("t", [9, S], me.f32), g.input("i", [3], me.i32)), r"embedding: table 't' .* static row width"),
        (lambda g: me.kv_append(g.input("k", [2, S, 8], me.f32), g.input("n", [2, 8], me.f32), P), r"kv_append: cache 'k' f32\[2, S, 8\] must have static dims"),
        (lambda g: me.attention(g.input("q", [2, S], me.f32), g.input("k", [2, 9, S], me.f32),
                                g.input("v", [2, 9, S], me.f32), P + 1), r"attention: q 'q' f32\[2, S\] must have static head dim"),
        (lambda g: me.sample(*(g.input(n, s, t) for n, s, t in (("l", [2, S], me.f32), ("t", [2], me.f32), ("k", [2], me.i32),
                                                                 ("p", [2], me.f32), ("s", [2], me.i32), ("c", [2], me.i32)))),
         r"sample: logits 'l' f32\[2, S\] must have static vocab"),
        (lambda g: me.moe_mlp(g.input("x", [2, 16], me.f32), g.input("r", [2, 4], me.f32), *(g.weight(n, s, me.f32) for n, s in (
            ("wg", [4, 8, 16]), ("wu", [4, 8, 16]), ("wd", [4, 16, 8]))), top_k=5, normalize=True), r"moe_mlp: top_k must be an int in \[1, 4\] \(the number of experts\), got 5"),
        (lambda g: me.rope(g.input("x", [2, S, 16], me.f32), g.input("i", [2], me.i32)), r"rope: x 'x' f32\[2, S, 16\] must have static dims between"),
        (lambda g: me.slice(g.input("x", [4, 6], me.f32), 1, S + 4, S), r"slice: bad range S \+ 4:S"),
    ],
)
def test_errors_name_op_and_tensors(build, pattern):
    with pytest.raises(ShapeError, match=pattern):
        build(me.Graph())


def test_graph_errors():
    g = me.Graph()
    g.input("x", [2], me.f32)
    with pytest.raises(GraphError, match="'x'.*already exists"):
        g.input("x", [3], me.f32)
    other = me.Graph().input("y", [2], me.f32)
    with pytest.raises(GraphError, match="another graph"):
        me.add(me.Tensor(g, 0), other)
    with pytest.raises(GraphError, match="rope scaling type 'yarn'"):
        me.rope(g.input("r", [2, 8], me.f32), P, scaling={"rope_type": "yarn", "factor": 2.0})


def test_reference_errors():
    g = me.Graph()
    x = g.input("x", [S, 4], me.f32)
    g.output("y", me.linear(x, g.weight("w", [3, 4], me.f32)))
    w = {"w": torch.randn(3, 4)}
    with pytest.raises(GraphError, match="missing value for runtime dim 'S'"):
        me.run_reference(g, {"x": torch.randn(2, 4)}, w)
    with pytest.raises(GraphError, match="missing input.*x"):
        me.run_reference(g, {}, w, {"S": 2})
    with pytest.raises(GraphError, match="missing weight.*w"):
        me.run_reference(g, {"x": torch.randn(2, 4)}, {}, {"S": 2})
    with pytest.raises(GraphError, match=r"input 'x' has shape \[3, 4\], expected \[2, 4\]"):
        me.run_reference(g, {"x": torch.randn(3, 4)}, w, {"S": 2})
    with pytest.raises(GraphError, match="input 'x' has dtype torch.float16"):
        me.run_reference(g, {"x": torch.randn(2, 4).half()}, w, {"S": 2})
    with pytest.raises(GraphError, match="unknown input"):
        me.run_reference(g, {"x": torch.randn(2, 4), "z": torch.randn(1)}, w, {"S": 2})
    with pytest.raises(GraphError, match="runtime dim 'S' must be a non-negative int, got -1"):
        me.run_reference(g, {"x": torch.randn(2, 4)}, w, {"S": -1})
    with pytest.raises(GraphError, match="runtime dim 'S' must be an int, got float 2.0"):
        me.run_reference(g, {"x": torch.randn(2, 4)}, w, {"S": 2.0})


def test_slice_at_runtime_bounds_has_a_static_width():
    """``x[:, S:S + 16]`` is 16 wide whatever S is: a linear over it takes K = 16."""
    g = me.Graph()
    window = me.slice(g.input("a", [3, 80], me.f32), 1, S, S + 16)
    assert window.shape[1].is_const and window.shape[1].value == 16
    assert me.linear(window, g.weight("w", [4, 16], me.f32)).shape[1].value == 4


def test_reference_embedding_id_outside_the_table():
    """The kernel refuses an id outside [0, V) (MEGA_ERR_INDEX); the oracle must not wrap -1 to the last row."""
    g = me.Graph()
    g.output("y", me.embedding(g.weight("t", [5, 4], me.f32), g.input("i", [2], me.i32)))
    for bad in (-1, 5):
        with pytest.raises(GraphError, match=f"embedding .*: token id {bad} outside the table's 5 rows"):
            me.run_reference(g, {"i": torch.tensor([0, bad], dtype=torch.int32)}, {"t": torch.randn(5, 4)})


def test_kv_append_position_out_of_range():
    g = me.Graph()
    kc = g.input("kc", [2, 4, 8], me.f32)
    g.output("k", me.kv_append(kc, g.input("n", [2, 8], me.f32), P))
    with pytest.raises(GraphError, match="position 4 outside"):
        me.run_reference(g, {"kc": torch.randn(2, 4, 8), "n": torch.randn(2, 8)}, {}, {"pos": 4})


# --- the low-level node API: every bad argument names the node and what is wrong (issue 36) --------
def _one_leaf():
    g = me.Graph()
    g.input("x", [4], me.f32)
    return g


@pytest.mark.parametrize("args, pattern", [
    (dict(op="silu", inputs=[5]), r"add_node %1 \(silu\): input id 5 is a later node \(a forward reference"),
    (dict(op="silu", inputs=[1]), r"add_node %1 \(silu\): input id 1 is the node itself \(a cycle\)"),
    (dict(op="silu", inputs=[-1]), r"add_node %1 \(silu\): input id -1 is negative; nodes so far: %0..%0"),
    (dict(op="add", inputs=[0, 2**40]), r"add_node %1 \(add\): input id 1099511627776 is a later node"),
    (dict(op="silu", inputs=["0"]), r"add_node %1 \(silu\): input '0' is not a node id"),
    (dict(op="silu", inputs=[0.0]), r"add_node %1 \(silu\): input 0\.0 is not a node id"),
    (dict(op="silu", inputs=[True]), r"add_node %1 \(silu\): input True is not a node id"),
    (dict(op="silu", inputs=5), r"add_node %1 \(silu\): inputs must be a sequence of node ids, got 5"),
    (dict(op="silu", inputs=[0], shape=4), r"add_node %1 \(silu\): shape must be a list of ints and dims"),
    (dict(op="silu", inputs=[0], shape=["S"]), r"add_node %1 \(silu\): shape must be a list"),
    (dict(op="silu", inputs=[0], dtype="f64"), r"add_node %1 \(silu\): unknown dtype 'f64'"),
    (dict(op="silu", inputs=[0], dtype=torch.float64), r"add_node %1 \(silu\): unsupported torch dtype torch.float64"),
    (dict(op="silu", inputs=[0], attrs=[("eps", 1)]), r"add_node %1 \(silu\): attrs must be a dict, got list"),
    (dict(op="silu", inputs=[0], name=3), r"add_node %1 \(silu\): name must be a string or None, got 3"),
    (dict(op="erfinv", inputs=[0]), r"add_node %1 \(erfinv\): unknown op 'erfinv'; known ops: .*silu"),
    (dict(op="", inputs=[0]), r"add_node %1: op must be a non-empty string, got ''"),
    (dict(op=None, inputs=[0]), r"add_node %1: op must be a non-empty string, got None"),
    (dict(op="input", inputs=[]), r"add_node %1 \(input\): leaves are declared with graph\.input\(name, \.\.\.\)"),
    (dict(op="silu", inputs=[0], shape=[2**40, 2**40]), r"add_node %1 \(silu\): f32\[1099511627776, 1099511627776\] is "
                                                        r"4835703\.3 EB; a tensor holds at most 2\*\*62 bytes"),
])
def test_add_node_refuses_bad_ids_and_types(args, pattern):
    g = _one_leaf()
    args = {"shape": [4], "dtype": me.f32, **args}
    with pytest.raises(GraphError, match=pattern):
        g.add_node(args.pop("op"), args.pop("inputs"), args.pop("shape"), args.pop("dtype"), **args)
    assert len(g.nodes) == 1  # nothing was added


def test_add_node_of_a_tensor_instead_of_its_id():
    g = _one_leaf()
    x = me.Tensor(g, 0)
    with pytest.raises(GraphError, match=r"add_node %1 \(silu\): inputs are node ids \(tensor\.id\), got the Tensor"):
        g.add_node("silu", [x], [4], me.f32)
    y = g.add_node("silu", [x.id], [4], me.f32)  # the right way still builds
    g.output("y", y)
    got = me.run_reference(g, {"x": torch.arange(4.0)})["y"]
    torch.testing.assert_close(got, torch.nn.functional.silu(torch.arange(4.0)))


def test_a_hand_edited_node_list_is_refused_by_compile():
    """``nodes`` is a plain list: a cycle or a dangling id put there by hand is a GraphError at compile, not a
    KeyError or IndexError from inside the rewrite."""
    from megaegg.graph import Node

    for bad_inputs, pattern in (((2,), r"node %1\(silu\) reads 2, which is not an earlier node"),
                                ((1,), r"node %1\(silu\) reads 1"), ((-3,), r"node %1\(silu\) reads -3")):
        g = _one_leaf()
        g.output("y", me.silu(me.Tensor(g, 0)))
        n = g.nodes[1]
        g.nodes[1] = Node(n.id, n.op, bad_inputs, n.shape, n.dtype, n.attrs, n.name)
        with pytest.raises(GraphError, match=pattern):
            me.compile(g, backend="sim", cache=False)
    g = _one_leaf()
    g.output("y", me.silu(me.Tensor(g, 0)))
    g.outputs["z"] = 7
    with pytest.raises(GraphError, match=r"output 'z' is 7, not a node of the graph"):
        me.compile(g, backend="sim", cache=False)
    g = _one_leaf()
    g.nodes.append(g.nodes[0])  # a node at the wrong index
    with pytest.raises(GraphError, match=r"nodes\[1\] is .* not node %1"):
        me.compile(g, backend="sim", cache=False)


@pytest.mark.parametrize("build, pattern", [
    (lambda g: g.weight("w", [2**40, 2**40], me.f32), r"weight 'w': f32\[1099511627776, 1099511627776\] is 4835703\.3 EB"),
    (lambda g: g.input("x", [S, 2**31, 2**31], me.bf16), r"input 'x': bf16\[S, 2147483648, 2147483648\] is 9\.2 EB"),
    (lambda g: me.expand(g.input("x", [1, 1], me.f32), [2**31, 2**31]), None),  # 18.4 EB: checked
    (lambda g: me.linear(g.input("x", [1, 8], me.f32), g.weight("w", [2**61, 8], me.f32)), r"weight 'w': f32\[2305843009213693952, 8\]"),
])
def test_sizes_beyond_2_62_bytes_are_refused_where_declared(build, pattern):
    with pytest.raises(ShapeError, match=pattern or r"a tensor holds at most 2\*\*62 bytes"):
        build(me.Graph())


def test_output_name_must_be_a_string():
    g = _one_leaf()
    with pytest.raises(GraphError, match=r"output: name must be a non-empty string, got 3"):
        g.output(3, me.Tensor(g, 0))
