"""PaddleNLP's legacy-IR pipeline job programs (the seed's era): capture rules and the cases.

The capture rules these programs need (the executor's share_buffer aliases, gradient merge's
conditional optimizer block) are checked on a legacy program built here with paddlepaddle
3.3.1 (CI). The cases themselves need paddlepaddle 2.6 with paddlenlp 2.8.1 in an
interpreter of their own ($PIPEMEM_PADDLE26_PYTHON) and skip without it.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SNIPPET = textwrap.dedent("""
    import json, warnings
    warnings.filterwarnings("ignore")
    import numpy as np
    import paddle
    paddle.enable_static()
    from pipemem.paddle.capture import resolve_job_shapes, to_ir
    from pipemem.validation.paddle_runs.compare import pipemem_estimates
    from pipemem.validation.paddle_runs.measure import measure_step

    main, startup = paddle.static.Program(), paddle.static.Program()
    with paddle.static.program_guard(main, startup), paddle.utils.unique_name.guard():
        x = paddle.static.data("x", [4, 16], "float32")
        h = paddle.nn.functional.relu(paddle.nn.Linear(16, 32)(x))
        block = main.global_block()
        # what paddle 2.6's buffer_shared_inplace_pass writes before an in-place op
        t = block.create_var(name="h_inplace", shape=h.shape, dtype="float32")
        block.append_op(type="share_buffer", inputs={"X": [h]}, outputs={"Out": [t], "XOut": [h]},
                        attrs={"share_dims_and_dtype": [False]})
        block.append_op(type="scale", inputs={"X": [h]}, outputs={"Out": [t]}, attrs={"scale": 2.0})
        loss = paddle.mean(t)
        paddle.incubate.optimizer.GradientMergeOptimizer(paddle.optimizer.SGD(0.1), k_steps=2).minimize(loss)
    subs = {"step": main}
    ir = to_ir(resolve_job_shapes(subs))[0]
    ours = pipemem_estimates(resolve_job_shapes(subs))["step"]
    m = measure_step(startup, subs, {"x": np.ones((4, 16), "float32")})[0]
    print(json.dumps({"storages": [ir.tensors["h_inplace"].storage, ir.tensors[h.name].storage],
                      "ops": [o.type for o in ir.ops], "estimated": [ours.net_bytes, ours.peak_bytes],
                      "measured": [m.net_bytes, m.peak_bytes]}))
""")


@pytest.fixture(scope="module")
def captured():
    env = dict(os.environ, FLAGS_enable_pir_api="0", FLAGS_eager_delete_tensor_gb="0", GLOG_minloglevel="2")
    proc = subprocess.run(
        [sys.executable, "-c", SNIPPET], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_share_buffer_puts_the_output_on_its_input_storage(captured):
    inplace, base = captured["storages"]
    assert inplace == base


def test_conditional_block_runs_its_sub_block_then_closes(captured):
    ops = captured["ops"]
    assert "conditional_block" in ops and ops[-1] == "conditional_block"
    # the optimizer's sub-block (two sgd updates) is walked in place of the op, before it
    assert ops.count("sgd") == 2 and ops.index("sgd") < ops.index("conditional_block")


def test_step_with_share_buffer_and_conditional_block_matches_the_executor(captured):
    assert captured["estimated"] == captured["measured"]


PADDLE26 = os.environ.get("PIPEMEM_PADDLE26_PYTHON")


@pytest.mark.skipif(
    not PADDLE26 or not os.path.exists(PADDLE26),
    reason="needs paddlepaddle 2.6 + paddlenlp 2.8.1 ($PIPEMEM_PADDLE26_PYTHON)",
)
def test_pp4_first_and_last_stage_within_1pct_and_better_than_paddles_estimator(tmp_path):
    from pipemem.validation.paddle_runs.paddlenlp_legacy import build_case, compare_built

    cards = build_case("paddlenlp-legacy-pp4", tmp_path, cards=(0, 3))
    rows = compare_built("paddlenlp-legacy-pp4", cards)
    assert {r["name"].split("/")[1] for r in rows} == {"card0", "card3"}
    assert len(rows) == 10
    for r in rows:
        assert r["rel_error"] is not None and abs(r["rel_error"]) <= 0.01, r
    ours = max(abs(r["rel_error"]) for r in rows)
    theirs = max(abs(r["paddle_rel_error"]) for r in rows if r["paddle_rel_error"] is not None)
    assert ours < theirs


@pytest.mark.skipif(
    not PADDLE26 or not os.path.exists(PADDLE26),
    reason="needs paddlepaddle 2.6 + paddlenlp 2.8.1 ($PIPEMEM_PADDLE26_PYTHON)",
)
def test_seed_pp4_backward_peak_at_full_size_is_the_seeds_gpu_measurement(tmp_path):
    """The seed's public row: pp 4 (no recompute) backward peak measured 322 MB (2^20 B) on
    GPUs, Paddle's estimator 290. Built at the seed's full size, estimated only."""
    from pipemem.validation.paddle_runs.paddlenlp_legacy import SEED_RUNS, build_case, compare_built

    cards = build_case("seed-pp4", tmp_path, cards=(0,), spec=SEED_RUNS["seed-pp4"])
    rows = {r["name"]: r for r in compare_built("seed-pp4", cards, measure=False)}
    peak = rows["seed-pp4/card0/backward/peak"]
    assert peak["measured_bytes"] is None
    assert abs(peak["estimated_bytes"] / 2**20 - 322) / 322 <= 0.01
    assert abs(peak["paddle_estimated_bytes"] / 2**20 - 322) / 322 > 0.05  # the seed's 290


_MOMENT_BYTES = """
import sys, numpy as np, paddle
paddle.enable_static()
from pipemem.validation.paddle_runs.paddlenlp_legacy import load_card
progs, _ = load_card(sys.argv[1])
vs = [v for v in progs["default"].global_block().vars.values() if v.persistable]
size = lambda v: int(np.prod([max(int(d), 1) for d in v.shape])) * 4
print(sum(size(v) for v in vs if "moment" in v.name), sum(size(v) for v in vs if v.name.endswith((".w_0", ".b_0"))
      or "weight" in v.name))
"""  # noqa: E501 (a script run under Paddle's Python)


@pytest.mark.skipif(
    not PADDLE26 or not os.path.exists(PADDLE26),
    reason="needs paddlepaddle 2.6 + paddlenlp 2.8.1 ($PIPEMEM_PADDLE26_PYTHON)",
)
def test_dp2_sharding2_cards_within_1pct_and_states_sharded_over_the_sharding_group(tmp_path):
    """No pipeline: the executor's one job, split by op role. The static auto-parallel script
    shards the Adam moments over sharding_parallel_degree (2), not dp x sharding (4): what
    `--from-paddlenlp` reads for run_pretrain_auto_static.py (tests/test_configs_readers.py)."""
    import subprocess
    import sys

    from pipemem.validation.paddle_runs.paddlenlp_legacy import build_case, compare_built

    cards = build_case("paddlenlp-legacy-dp2-sharding2", tmp_path, cards=(0, 1))
    rows = compare_built("paddlenlp-legacy-dp2-sharding2", cards)
    assert len(rows) == 10
    for r in rows:
        assert r["rel_error"] is not None and abs(r["rel_error"]) <= 0.01, r
    env = {**os.environ, "FLAGS_enable_pir_api": "0"}
    moments, params = zip(
        *(
            map(
                int,
                subprocess.run(
                    [sys.executable, "-c", _MOMENT_BYTES, str(folder)],
                    env=env,
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout.split(),
            )
            for folder in cards.values()
        )
    )
    assert params[0] == params[1] > 0
    # two moments per parameter, the pair of cards holding each parameter's once between them
    assert sum(moments) == 2 * params[0]
    assert abs(moments[0] - params[0]) < 0.1 * params[0]
