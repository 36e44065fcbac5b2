"""Build PaddleNLP's own Llama auto-parallel training programs for one rank, on the CPU.

Runs in a Python that has ``paddlenlp`` (2.8.1) and ``paddlepaddle`` (3.x) installed, in a
process of its own (`pipemem.paddle.paddlenlp_worker`): Paddle's auto-parallel state (the
rank, the mesh, the dist context) is per process. The route is the one PaddleNLP's
`AutoTrainer` takes with ``--enable_auto_parallel 1 --to_static 1``:

1. the rank comes from ``PADDLE_TRAINER_ID`` and friends (set before paddle is imported);
2. ``fleet.auto.create_mesh([("pp", pp), ("dp", dp * sharding), ("mp", mp)])`` as
   `TrainingArguments` does for ``hybrid_parallel_topo_order == "pp_first"``;
3. `LlamaForCausalLM3DAuto` + `LlamaPretrainingCriterion3DAuto` built under
   `paddle.LazyGuard` (no parameter is allocated), ``model.recompute_enable()`` when
   recomputing, ``dist.shard_optimizer(AdamW, ShardingStageN())`` when sharding;
4. ``dist.to_static(model, loader, criterion, optimizer, strategy)`` and the engine's
   ``_prepare_program("train", init_parameters=False)``: Paddle's planner, partitioner,
   reshard, recompute, sharding and pipeline passes (1F1B, FThenB, VPP: the ones 3.3.1 applies to PIR) run as
   in training and leave the rank's job plan (`core.Plan`: job list + one PIR program
   per job type).

Two engine methods are replaced because they need a live cluster: ``Engine._init_comm``
(creates the NCCL communicators) and ``Engine._initialize`` (runs the startup program,
allocating every parameter). Nothing else is faked: the programs are Paddle's own.

Shapes only: a full-size (llama-7b width) rank is built without allocating its weights.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

# Job types in the order a micro-batch meets them (the pipeline passes' "optimizer"; the
# gradient-merge plan without pipeline names it "optimize"); a type missing from a plan is skipped.
JOB_TYPE_ORDER = (
    "recv_forward",
    "forward",
    "send_forward",
    "recv_backward",
    "backward",
    "backward_b",
    "backward_w",
    "send_backward",
    "optimizer",
    "optimize",
)


@dataclass
class BuildSpec:
    """Everything that shapes a rank's programs: the model's shape and PaddleNLP's plan."""

    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    layers: int
    seq: int
    micro_batch: int = 1
    accumulate_steps: int = 1
    pp: int = 1
    mp: int = 1
    dp: int = 1  # data_parallel_degree
    sharding: int = 1  # sharding_parallel_degree
    sharding_stage: int = 0  # 1, 2, 3 (0: no sharding)
    vpp: int = 1
    schedule: str = "1F1B"  # Paddle's pipeline_schedule_mode: 1F1B, FThenB or VPP (PIR)
    recompute: str = "none"  # none, full, full_attn, core_attn
    flash: bool = False
    sp: bool = False  # sequence_parallel
    dtype: str = "fp32"  # fp32, bf16, fp16 (AMP O2)
    rms_eps: float = 1e-6
    max_positions: int = 0  # 0: seq
    fuse_qkv: bool = False
    fuse_ffn: bool = False
    tied: bool = False

    @property
    def world(self) -> int:
        return self.pp * self.mp * self.dp * self.sharding

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)


@dataclass
class RankPlan:
    rank: int
    job_list: list[tuple[str, int]]  # (job type, micro-batch id) in run order
    programs: dict = field(default_factory=dict)  # job type -> PIR program, in JOB_TYPE_ORDER


def set_rank_env(rank: int, world: int) -> None:
    """What `paddle.distributed.launch` sets for a rank (read by `dist.get_rank()`)."""
    os.environ["PADDLE_TRAINER_ID"] = str(rank)
    os.environ["PADDLE_TRAINERS_NUM"] = str(world)
    eps = [f"127.0.0.1:{6170 + i}" for i in range(world)]
    os.environ["PADDLE_TRAINER_ENDPOINTS"] = ",".join(eps)
    os.environ["PADDLE_CURRENT_ENDPOINT"] = eps[rank]
    os.environ.setdefault("FLAGS_enable_pir_api", "1")


def build_rank(spec: BuildSpec, rank: int) -> RankPlan:
    """Paddle's job plan of `rank` for `spec` (call `set_rank_env` before importing paddle)."""
    import numpy as np
    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet
    from paddle.distributed.auto_parallel.static.engine import Engine

    if dist.get_rank() != rank:
        raise RuntimeError(
            f"paddle sees rank {dist.get_rank()}, not {rank}: set_rank_env before importing paddle"
        )
    _numpy2_mesh_fix()
    Engine._init_comm = lambda self: None  # no NCCL communicators on a CPU
    Engine._initialize = lambda self, mode, init_parameters=True: None  # no startup run: shapes only

    from paddlenlp.transformers import LlamaConfig
    from paddlenlp.transformers.llama.modeling_auto import (
        LlamaForCausalLM3DAuto,
        LlamaPretrainingCriterion3DAuto,
    )

    paddle.set_device("cpu")
    fleet.auto.create_mesh([("pp", spec.pp), ("dp", spec.dp * spec.sharding), ("mp", spec.mp)])
    cfg = LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions or spec.seq,
        seq_length=spec.seq,
        rms_norm_eps=spec.rms_eps,
        tensor_parallel_degree=spec.mp,
        tie_word_embeddings=spec.tied,
    )
    cfg.use_flash_attention = spec.flash
    cfg.sequence_parallel = spec.sp
    cfg.fuse_attention_qkv = spec.fuse_qkv
    cfg.fuse_attention_ffn = spec.fuse_ffn
    cfg.use_fused_rms_norm = False
    cfg.use_fused_rope = False
    cfg.virtual_pp_degree = spec.vpp
    if spec.recompute != "none":
        cfg.recompute = True
        cfg.recompute_granularity = spec.recompute
    with paddle.LazyGuard():
        model = LlamaForCausalLM3DAuto(cfg)
    if spec.recompute != "none":
        model.recompute_enable()
    criterion = LlamaPretrainingCriterion3DAuto(cfg)
    opt = paddle.optimizer.AdamW(
        learning_rate=1e-4,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )
    if spec.sharding > 1 and spec.sharding_stage:
        stage = {1: dist.ShardingStage1, 2: dist.ShardingStage2, 3: dist.ShardingStage3}[spec.sharding_stage]
        # PaddleNLP 2.8.1 calls ShardingStageN() with no argument; Paddle 3.3.1 requires the
        # mesh dimension to shard over: "dp", the dimension PaddleNLP's mesh gives data parallelism.
        opt = dist.shard_optimizer(opt, stage("dp"))
    else:
        opt = dist.shard_optimizer(opt)

    seq, vocab = spec.seq, spec.vocab

    class Tokens(paddle.io.Dataset):
        def __getitem__(self, i):
            x = np.random.randint(0, vocab, size=[seq]).astype("int64")
            return x, x

        def __len__(self):
            return 1 << 20

    global_batch = spec.micro_batch * spec.accumulate_steps * spec.dp * spec.sharding
    loader = paddle.io.DataLoader(Tokens(), batch_size=global_batch)
    # PaddleNLP's AutoTrainer._wrap_for_dist_loader: the batch is split over "dp", read on
    # the first and last stages.
    meshes = [fleet.auto.get_mesh().get_mesh_with_dim("pp", 0)]
    if spec.pp > 1:
        meshes.append(fleet.auto.get_mesh().get_mesh_with_dim("pp", spec.pp - 1))
    loader = dist.shard_dataloader(loader, meshes=meshes, shard_dims="dp")

    strategy = dist.Strategy()
    if spec.pp > 1:
        strategy.pipeline.enable = True
        strategy.pipeline.pp_degree = spec.pp
        strategy.pipeline.accumulate_steps = spec.accumulate_steps
        strategy.pipeline.micro_batch_size = spec.micro_batch
        strategy.pipeline.schedule_mode = spec.schedule
        if spec.vpp > 1:
            strategy.pipeline.vpp_degree = spec.vpp
            strategy.pipeline.vpp_seg_method = "LlamaDecoderLayerAuto"
    elif spec.accumulate_steps > 1:
        strategy.gradient_merge.enable = True
        strategy.gradient_merge.k_steps = spec.accumulate_steps
        strategy.gradient_merge.avg = True
    if spec.recompute != "none":
        strategy._recompute.enable = True
    if spec.dtype in ("bf16", "fp16"):
        strategy.amp.enable = True
        strategy.amp.dtype = "bfloat16" if spec.dtype == "bf16" else "float16"
        strategy.amp.level = "o2"
    dm = dist.to_static(model, loader, criterion, opt, strategy=strategy)
    engine = dm._engine
    engine._prepare_program(mode="train", init_parameters=False)
    plan = engine._job_plan
    if plan is None:
        main = engine._pir_dist_main_progs["train"]
        return RankPlan(rank=rank, job_list=[("step", 0)], programs={"step": main})
    types = set(plan.job_types())
    unknown = types - set(JOB_TYPE_ORDER)
    order = [t for t in JOB_TYPE_ORDER if t in types] + sorted(unknown, key=_chunked_type_key)
    return RankPlan(
        rank=rank,
        job_list=[(j.type(), int(j.micro_batch_id())) for j in plan.job_list()],
        programs={t: plan.ir_program(t) for t in order},
    )


def _numpy2_mesh_fix() -> None:
    """Paddle 3.3.1's `ProcessMesh.get_rank_by_dim_and_process_id` converts a one-element
    array with int(), which numpy >= 2.4 refuses (TypeError); the same lookup, numpy-2 safe."""
    import numpy as np
    from paddle.distributed.auto_parallel.process_mesh import ProcessMesh

    def get_rank_by_dim_and_process_id(self, dim, process_id):
        if dim is None:
            return 0
        index = self._dim_names.index(dim) if isinstance(dim, str) else int(dim)
        return int(np.where(self._mesh == process_id)[index].item())

    ProcessMesh.get_rank_by_dim_and_process_id = get_rank_by_dim_and_process_id


def _chunked_type_key(t: str):
    """VPP job types carry their chunk: forward0, forward1, backward1, backward0, ...; order
    them as a micro-batch meets them: forwards by chunk, then backwards by reverse chunk."""
    import re

    m = re.fullmatch(r"([a-z_]+?)(\d+)", t)
    if not m:
        return (9, 0, t)
    base, chunk = m.group(1), int(m.group(2))
    rank = {n: i for i, n in enumerate(JOB_TYPE_ORDER)}.get(base, 8)
    backward = base.startswith(("backward", "send_backward", "recv_backward"))
    return (1 if backward else 0, -chunk if backward else chunk, rank)
