"""Paddle program capture: op-role split, shapes, dtypes, aliases, no_need_buffer.

Paddle runs in a subprocess per test module (one snippet for all checks), so this process
never imports paddle next to torch. Needs paddlepaddle (CI installs it).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from pipemem.paddle.split import role_type

SNIPPET = textwrap.dedent("""
    import json, os, warnings
    warnings.filterwarnings("ignore")
    import paddle
    paddle.enable_static()
    from pipemem.errors import UserError
    from pipemem.paddle.capture import resolve_shapes, to_ir
    from pipemem.paddle.split import split_program, op_role
    from pipemem.liveness import analyze_sequence

    out = {}
    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        x = paddle.static.data("x", [-1, -1, 16], "float32")
        h = paddle.nn.Linear(16, 32)(x)
        h = paddle.nn.functional.dropout(h, 0.5)
        m = paddle.cast(h > 0, "float32")          # a bool var, then back to float
        hb = paddle.cast(h, "bfloat16")            # a bf16 var (captured, never run here)
        loss = paddle.mean(h * m) + paddle.mean(paddle.cast(hb, "float32"))
        paddle.optimizer.Adam(0.1).minimize(loss)
    ops = main.global_block().ops
    out["roles"] = [(op.type, op_role(op)) for op in ops]

    try:
        resolve_shapes(main, batch=3)               # the sequence dim stays unbound
        out["unbound"] = None
    except UserError as e:
        out["unbound"] = str(e)
    try:
        to_ir(split_program(main))                  # capture without binding at all
        out["unresolved"] = None
    except UserError as e:
        out["unresolved"] = str(e)

    try:
        resolve_shapes(main, feed_shapes={"x": [3, 5, 17]})   # Linear(16, 32) cannot take 17
        out["bad_shape"] = None
    except UserError as e:
        out["bad_shape"] = str(e)

    res = resolve_shapes(main, batch=3, seq=5)
    subs = split_program(res)
    out["sub_ops"] = {t: [op.type for op in p.global_block().ops] for t, p in subs.items()}
    progs = to_ir(subs)
    tensors = {}
    for p in progs:
        for n, t in p.tensors.items():
            tensors[n] = dict(shape=list(t.shape), dtype=t.dtype, kind=t.kind.value,
                              storage=t.storage, persistent=t.persistent, nbytes=t.nbytes)
    out["tensors"] = tensors
    out["ops"] = {p.type: [dict(type=o.type, inputs=list(o.inputs), outputs=list(o.outputs),
                                no_need_buffer=list(o.no_need_buffer)) for o in p.ops] for p in progs}
    out["types"] = [p.type for p in progs]
    out["forward_retained"] = sorted(analyze_sequence(progs)[0].retained)

    from pipemem.paddle.split import split_backward_bw
    zb = split_backward_bw(subs)
    out["zb_ops"] = {t: [(op.type, {s: op.output(s) for s in op.output_names if op.output(s)})
                         for op in p.global_block().ops] for t, p in zb.items()}

    sp_main, sp_startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(sp_main, sp_startup), paddle.utils.unique_name.guard():
        ids = paddle.static.data("ids", [4, 3], "int64")
        emb = paddle.nn.Embedding(10, 8, sparse=True)(ids)
        paddle.optimizer.SGD(0.1).minimize(paddle.mean(emb))
    try:
        to_ir(split_program(sp_main))
        out["sparse"] = None
    except UserError as e:
        out["sparse"] = str(e)

    from pipemem.validation.paddle_runs.compare import estimate
    from pipemem.validation.paddle_runs.models import mlp
    est = estimate(mlp().main, batch=32)
    out["mlp_estimate"] = {t: [r.net_bytes, r.peak_bytes] for t, r in est.items()}

    # Op by op: a marker before every op of a real MLP step vs pipemem's op timeline.
    from pipemem.validation.paddle_runs.measure import measure_step
    case = mlp()
    subs_mlp = split_program(resolve_shapes(case.main, batch=32))
    ir = to_ir(subs_mlp)
    walk = dict(zip([p.type for p in ir], analyze_sequence(ir)))
    per_op = []
    for m in measure_step(case.startup, subs_mlp, case.feeds, per_op=True):
        if "/" not in m.type:
            continue
        t, rest = m.type.split("/")
        i = int(rest.split(":")[0])
        r = walk[t]
        before = int(r.after[i - 1]) if i else 0
        per_op.append([m.type, m.net_bytes, m.peak_bytes, int(r.after[i]) - before, int(r.during[i]) - before])
    out["mlp_per_op"] = per_op

    # The seed-compatible API on the captured programs, called the way Paddle's pass calls
    # Paddle's estimator, against the per-sub-program measurement.
    from pipemem.pipeline_estimator import PipelineMemoryEstimator
    seed_api = PipelineMemoryEstimator()
    seed_api.set_program_skip_gc_vars({p.type: p for p in ir}, [p.type for p in ir])
    measured = {m.type: [m.net_bytes, m.peak_bytes] for m in measure_step(case.startup, subs_mlp, case.feeds)}
    out["mlp_seed_api"] = {p.type: [list(seed_api.estimate_memory(p, p.type)), measured[p.type]] for p in ir}
    print(json.dumps(out))
""")  # noqa: E501 (a script run under Paddle's Python)


@pytest.fixture(scope="module")
def captured():
    env = dict(os.environ, FLAGS_enable_pir_api="0", GLOG_minloglevel="2")
    proc = subprocess.run(
        [sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_role_type_follows_paddle_op_role_bits():
    assert role_type(0) == "forward"
    assert role_type(256) == "forward"  # Loss | Forward: the loss op
    assert role_type(1) == "backward"
    assert role_type(257) == "backward"  # Loss | Backward: the loss-gradient seed
    assert role_type(2) == "optimizer"
    assert role_type(16) == "optimizer"  # LRSched
    assert role_type(2 | 16) == "optimizer"


def test_split_keeps_each_role_in_order(captured):
    expect = {"forward": [], "backward": [], "optimizer": []}
    for op_type, role in captured["roles"]:
        expect[role_type(role)].append(op_type)
    assert captured["sub_ops"] == expect
    assert captured["types"] == ["forward", "backward", "optimizer"]
    assert all(t == "adam" for t in expect["optimizer"]) and len(expect["optimizer"]) == 2


def test_dynamic_dims_resolved_from_batch_and_seq(captured):
    t = captured["tensors"]
    assert t["x"]["shape"] == [3, 5, 16]
    assert t["linear_0.tmp_1"]["shape"] == [3, 5, 32]
    assert t["linear_0.w_0"]["shape"] == [16, 32]


def test_unresolved_dims_are_user_errors_naming_the_var(captured):
    assert "'x'" in captured["unbound"]
    assert "linear_0.tmp_0" in captured["unresolved"] or "'x'" in captured["unresolved"]
    assert "unresolved" in captured["unresolved"] or "dynamic" in captured["unresolved"]


def test_shapes_that_do_not_fit_the_program_are_user_errors(captured):
    msg = captured["bad_shape"]
    assert msg.startswith("shape inference failed at op #0 (matmul_v2)") and "[3, 5, 17]" in msg


def test_dtypes_have_their_real_sizes(captured):
    t = captured["tensors"]
    bool_vars = [v for v in t.values() if v["dtype"] == "bool"]
    assert bool_vars and all(v["nbytes"] == 3 * 5 * 32 for v in bool_vars)  # 1 byte, not 4
    bf16 = [v for v in t.values() if v["dtype"] == "bfloat16"]
    assert bf16 and all(v["nbytes"] == 3 * 5 * 32 * 2 for v in bf16)
    mask = t["dropout_0.tmp_1"]
    assert mask["dtype"] == "uint8" and mask["nbytes"] == 3 * 5 * 32
    assert t["linear_0.tmp_1"]["nbytes"] == 3 * 5 * 32 * 4


def test_persistables_are_static_and_fed_inputs_are_held(captured):
    t = captured["tensors"]
    assert t["linear_0.w_0"]["kind"] == "param" and t["linear_0.w_0"]["persistent"]
    assert t["linear_0.w_0_moment1_0"]["kind"] == "optimizer_state"
    assert t["x"]["persistent"] and t["x"]["kind"] == "activation"
    assert t["linear_0.w_0@GRAD"]["kind"] == "grad" and not t["linear_0.w_0@GRAD"]["persistent"]


def test_in_place_outputs_share_the_input_storage(captured):
    adam = captured["ops"]["optimizer"][0]
    shared = set(adam["inputs"]) & set(adam["outputs"])
    assert any(n.endswith("moment1_0") for n in shared) and any("beta1_pow" in n for n in shared)


def test_no_need_buffer_inputs_come_from_paddle(captured):
    # reduce_mean_grad reads only X's shape; elementwise_add_grad neither X's nor Y's data.
    bwd = captured["ops"]["backward"]
    mean_grad = next(o for o in bwd if o["type"] == "reduce_mean_grad")
    assert mean_grad["no_need_buffer"] == [n for n in mean_grad["inputs"] if not n.endswith("@GRAD")]
    add_grad = next(
        o for o in bwd if o["type"] == "elementwise_add_grad" and "linear_0.b_0@GRAD" in o["outputs"]
    )
    assert set(add_grad["no_need_buffer"]) == {"linear_0.tmp_0", "linear_0.b_0"}
    # So the forward does not keep the matmul output for backward; it keeps the mask.
    assert "linear_0.tmp_0" not in captured["forward_retained"]
    assert "dropout_0.tmp_1" in captured["forward_retained"]


def test_estimate_api_binds_batch_and_matches_hand_derivation(captured):
    # models.mlp: 64 -> 256 (ReLU) -> 10; forward keeps the ReLU output and the softmax.
    b, d, h, c = 32, 64, 256, 10
    est = captured["mlp_estimate"]
    assert est["forward"][0] == (b * h + b * c) * 4
    assert est["optimizer"] == [-(d * h + h + h * c + c) * 4, 0]


def test_zero_bubble_split_puts_weight_gradients_in_backward_w(captured):
    zb = captured["zb_ops"]
    assert list(zb) == ["forward", "backward_b", "backward_w", "optimizer"]
    b_types = [t for t, _ in zb["backward_b"]]
    w = zb["backward_w"]
    # x is a fed input (no gradient), so the matmul's only output is the weight gradient.
    assert [t for t, _ in w] == ["matmul_v2_grad"] and w[0][1] == {"Y@GRAD": ["linear_0.w_0@GRAD"]}
    # Mixed outputs (activation and bias gradients) stay in backward_b, as Paddle's split does.
    assert "elementwise_add_grad" in b_types and "matmul_v2_grad" not in b_types
    assert sorted(b_types + ["matmul_v2_grad"]) == sorted(captured["sub_ops"]["backward"])


def test_sparse_gradients_are_refused_by_name(captured):
    assert "embedding_0.w_0@GRAD" in captured["sparse"] and "SELECTED_ROWS" in captured["sparse"]


def test_mlp_step_matches_op_by_op(captured):
    rows = captured["mlp_per_op"]
    assert len(rows) > 20
    assert [r[0].split(":")[1] for r in rows if r[0].startswith("optimizer/")] == ["adam"] * 4
    mismatches = [r for r in rows if r[1:3] != r[3:5]]
    assert not mismatches


def test_seed_compatible_estimator_on_captured_programs_matches_measurement(captured):
    for t, (estimated, measured) in captured["mlp_seed_api"].items():
        assert estimated == measured, t
