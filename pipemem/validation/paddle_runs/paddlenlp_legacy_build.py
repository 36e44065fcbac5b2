"""Build PaddleNLP's legacy-IR auto-parallel Llama job programs of one card (Paddle 2.6).

`python -m pipemem.validation.paddle_runs.paddlenlp_legacy_build SPEC.json CARD OUT_DIR` runs in
an interpreter with paddlepaddle 2.6.x and paddlenlp 2.8.1 (``$PIPEMEM_PADDLE26_PYTHON``):
the pairing the estimator PR's `run_pretrain_auto_static.py` ran, on legacy IR, where Paddle's
`pipeline_scheduler_{FThenB,1F1B}` passes split the card's program into forward / backward /
optimizer jobs (3.x refuses: "Not support for old IR"). It writes, for the card:

* ``<type>.pb``: each job type's ProgramDesc (`desc.serialize_to_string()`), exactly the
  programs the pass hands the executor's plan;
* ``card.json``: the job list (type, micro-batch), each job's ``skip_gc_vars`` as the pass
  set them, the feed and fetch names and the fed shapes (one micro-batch).

The route is the script's: ``fleet.auto.create_mesh([("pp", pp), ("dp", dp), ("mp", mp)])``,
`LlamaForCausalLMAuto` (modeling_auto_static), AdamW with global-norm clipping, the
`fleet.auto.Strategy` PaddleNLP's `TrainingArguments` fills for ``--enable_auto_parallel 1``
(pipeline: accumulate_steps, micro_batch_size, schedule_mode; recompute), then
``auto.Engine(model, loss, optimizer, strategy).prepare([InputSpec input_ids, labels])``:
Paddle's completion, planner, partitioner, reshard and the static passes (recompute,
gradient merge, clipping) write the rank's main program. The executor's preparation of that
program is then done as `paddle.base.executor` does it on the first ``engine.run``: feed and
fetch ops added, the ``buffer_shared_inplace_pass`` applied (a plain Program runs with no
build strategy, so in-place is on), the pipeline scheduler pass applied to a clone.

Faked, because one CPU process has no cluster: the rank comes from ``PADDLE_TRAINER_ID``
and friends; ``Engine._init_comm`` (NCCL communicators) and ``Engine._initialize`` (the
startup run) are replaced by no-ops, and `paddle.device.cuda.get_device_properties` (read
by the engine's default cluster, an input of its cost model only) answers an A100. Nothing
else: the programs are Paddle's own.

scipy is imported before paddle: in this venv importing a C extension after paddle 2.6.2
fails with ``zlib.error: Error -2 while decompressing data`` (paddle's bundled zlib).
"""

from __future__ import annotations

import json
import os
import sys


class _FakeGPU:
    name = "NVIDIA A100-SXM4-80GB"
    total_memory = 80 * 1000**3


def set_rank_env(rank: int, world: int) -> None:
    """What `paddle.distributed.launch` sets for a rank, and legacy IR throughout."""
    from ...paddle.paddlenlp_build import set_rank_env as launcher_env

    launcher_env(rank, world)
    os.environ["FLAGS_enable_pir_api"] = "0"
    os.environ["FLAGS_enable_pir_in_executor"] = "0"


def build_card(spec: dict, rank: int, out_dir: str) -> dict:
    import paddle
    import paddle.distributed as dist
    import scipy  # noqa: F401  (before paddle: module docstring)
    from paddle.distributed import fleet
    from paddle.distributed.auto_parallel.static.engine import Engine

    if dist.get_rank() != rank:
        raise RuntimeError(f"paddle sees rank {dist.get_rank()}, not {rank}")
    Engine._init_comm = lambda self: None
    Engine._initialize = lambda self, mode, init_parameters=True: None
    # The engine's default cluster (a cost-model input) asks for the GPU's properties.
    paddle.device.cuda.get_device_properties = lambda device=None: _FakeGPU()

    from paddlenlp.transformers import LlamaConfig, LlamaForCausalLMAuto

    paddle.set_device("cpu")
    pp, mp, dp = spec["pp"], spec.get("mp", 1), spec.get("dp", 1)
    sharding = spec.get("sharding", 1)
    # TrainingArguments: the mesh's "dp" dimension is the dataset world, dp x sharding
    fleet.auto.create_mesh([("pp", pp), ("dp", dp * sharding), ("mp", mp)])
    cfg = LlamaConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden"],
        intermediate_size=spec["ffn"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"],
        max_position_embeddings=spec["seq"],
        seq_length=spec["seq"],
        rms_norm_eps=1e-6,
    )
    cfg.use_flash_attention = False
    cfg.use_fused_rms_norm = False
    cfg.fuse_attention_qkv = False
    cfg.fuse_attention_ffn = False
    cfg.use_fused_rope = False
    cfg.sequence_parallel = False
    cfg.virtual_pp_degree = 1
    cfg.recompute_granularity = spec.get("recompute_granularity", "full")
    cfg.use_recompute = bool(spec.get("recompute"))
    cfg.tensor_parallel_degree = mp
    cfg.tensor_parallel_rank = 0
    paddle.seed(0)
    model = LlamaForCausalLMAuto._from_config(cfg)
    if spec.get("recompute"):

        def enable(layer):  # run_pretrain_auto_static.py's model.apply(fn)
            if hasattr(layer, "enable_recompute") and not layer.enable_recompute:
                layer.enable_recompute = True

        model.apply(enable)
    decay = [p.name for n, p in model.named_parameters() if not any(nd in n for nd in ("bias", "norm"))]
    opt = paddle.optimizer.AdamW(
        learning_rate=1e-4,
        parameters=model.parameters(),
        weight_decay=0.01,
        apply_decay_param_fun=lambda x: x in decay,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )

    strategy = fleet.auto.Strategy()
    acc = spec["accumulate_steps"]
    if pp > 1 and acc > 1:
        strategy.pipeline.enable = True
        strategy.pipeline.enable_send_recv_overlap = False
        strategy.pipeline.accumulate_steps = acc
        strategy.pipeline.micro_batch_size = spec["micro_batch"]
        strategy.pipeline.schedule_mode = spec["schedule"]
    elif acc > 1:
        strategy.gradient_merge.enable = True
        strategy.gradient_merge.k_steps = acc
        strategy.gradient_merge.avg = True
    if sharding > 1:
        strategy.sharding.enable = True
        strategy.sharding.degree = sharding
        strategy.sharding.stage = spec.get("sharding_stage", 1)
    if spec.get("recompute"):
        strategy.recompute.enable = True
        strategy.recompute.sr = 0
        strategy.recompute.refined_ops_patterns = []

    engine = fleet.auto.Engine(model, lambda loss, outputs: loss, opt, strategy=strategy)
    total = spec["micro_batch"] * dp * sharding * acc
    engine.prepare(
        [
            paddle.static.InputSpec([total, spec["seq"]], "int64", "input_ids"),
            paddle.static.InputSpec([total, spec["seq"]], "int64", "labels"),
        ],
        mode="train",
    )
    main = engine.main_program
    return _executor_plan(engine, main, spec, out_dir)


def _executor_plan(engine, main, spec, out_dir) -> dict:
    """What the executor does with `main` on its first run, up to the job plan (module
    docstring); writes the job programs and their job list."""
    import paddle
    from paddle.base.executor import _add_feed_fetch_ops, _apply_inplace_addto_pass
    from paddle.distributed.passes import pipeline_pass_base
    from paddle.distributed.passes.pipeline_scheduler_pass import apply_pass

    block = main.global_block()
    feed_names = [n for n in ("input_ids", "labels") if block.has_var(n)]
    fetch_names, _ = engine._prepare_fetch(None, mode="train")
    fetch_names = [n for n in fetch_names if block.has_var(n)]
    program = _add_feed_fetch_ops(
        program=main,
        feed={n: None for n in feed_names},
        fetch_list=fetch_names,
        feed_var_name="feed",
        fetch_var_name="fetch",
        use_fetch_v2=True,
    )
    _apply_inplace_addto_pass(program, True, False, feed_names + fetch_names)
    new_program = program.clone()

    captured = {}
    original = pipeline_pass_base.set_skip_gc_vars

    def recording(num_micro_batches, job_types, sub_programs, jobs):
        type_to_program = original(num_micro_batches, job_types, sub_programs, jobs)
        captured["programs"] = dict(type_to_program)
        captured["skip"] = _skip_gc_sets(num_micro_batches, type_to_program, jobs)
        return type_to_program

    pipeline_pass_base.set_skip_gc_vars = recording
    try:
        if new_program._pipeline_opt and "standalone_opt" in new_program._pipeline_opt:
            opt = new_program._pipeline_opt["standalone_opt"]
            plan = apply_pass(new_program, new_program, opt["schedule_mode"], opt)
            jobs = [(j.type(), int(j.micro_batch_id())) for j in plan.job_list()]
        else:  # no pipeline: the executor's one default job
            captured["programs"] = {"default": new_program}
            captured["skip"] = [[]]
            jobs = [("default", 0)]
    finally:
        pipeline_pass_base.set_skip_gc_vars = original

    os.makedirs(out_dir, exist_ok=True)
    for t, p in captured["programs"].items():
        with open(os.path.join(out_dir, f"{t}.pb"), "wb") as f:
            f.write(p.desc.serialize_to_string())
    mb = spec["micro_batch"]
    doc = {
        "rank": int(os.environ["PADDLE_TRAINER_ID"]),
        "paddle": paddle.__version__,
        "job_list": jobs,
        "skip_gc_vars": captured["skip"],
        "types": list(captured["programs"]),
        "feed": feed_names,
        "fetch": fetch_names,
        "feed_shapes": {n: [mb, spec["seq"]] for n in feed_names},
        "spec": spec,
    }
    with open(os.path.join(out_dir, "card.json"), "w") as f:
        json.dump(doc, f, indent=1)
    return doc


def _skip_gc_sets(num_micro_batches, type_to_program, jobs) -> list[list[str]]:
    """Each job's skip_gc_vars, as `pass_utils.set_skip_gc_vars` computes them (its Job
    binding has a setter and no getter in 2.6): required vars of the job that a later job
    of the same micro-batch requires."""
    from paddle.distributed.passes.pass_utils import OpInOutInfo, var_can_be_deleted

    required = {}
    for t, program in type_to_program.items():
        req = set()
        for block in program.blocks:
            for op in block.ops:
                if op.type in ("c_sync_comm_stream", "conditional_block", "nop", "while"):
                    continue
                info = OpInOutInfo()
                info.build_info(op)
                for n in op.input_arg_names + op.output_arg_names:
                    if var_can_be_deleted(n, block) and info.is_needed(n):
                        req.add(n)
        required[t] = req
    later = [set() for _ in range(num_micro_batches)]
    out = []
    for job in reversed(jobs):
        t, mb = job.type(), job.micro_batch_id()
        out.append(sorted(required[t] & later[mb]))
        later[mb] |= required[t]
    return out[::-1]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(open(argv[0]).read())
    rank = int(argv[1])
    world = spec["pp"] * spec.get("mp", 1) * spec.get("dp", 1) * spec.get("sharding", 1)
    set_rank_env(rank, world)
    doc = build_card(spec, rank, argv[2])
    print(json.dumps({"rank": rank, "jobs": len(doc["job_list"]), "types": doc["types"]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
