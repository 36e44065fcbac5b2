"""The cases `pipemem validate cuda` measures: small HF Llama / Mistral / Mixtral models built
from configs (no weights), under each precision, attention kernel, recompute policy, AdamW
implementation and pipeline schedule worth checking on a real GPU.

Each case says everything both sides need: how to build and run it (hf_config, precision,
recompute...) and how to ask pipemem for the same run (`hf_config_dict`, `to_plan`). Sizes
are chosen so that a case runs in seconds on one GPU (hidden 1024-4096, 2-8 layers).
No torch import here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from ..errors import UserError
from ..plan import ParallelPlan

ARCHS = ("llama", "mistral", "mixtral")
PRECISIONS = ("bf16_autocast", "bf16", "fp32")  # autocast over fp32 weights, pure bf16, fp32
ATTENTIONS = ("sdpa", "eager")  # sdpa takes the flash kernel on CUDA for bf16
RECOMPUTES = ("none", "full", "selective")  # selective = core attention (Megatron's meaning)
OPTIMIZERS = ("adamw_foreach", "adamw_fused")
SCHEDULES = ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")
CONFIG_SETS = ("small", "full")

# Schedules whose stages sit on the ranks in a V (rank r holds stages r and 2p-1-r).
V_SCHEDULES = frozenset({"ZBVZeroBubble", "DualPipeV", "VHalf", "VMin"})


@dataclass(frozen=True)
class Case:
    arch: str = "llama"
    hidden: int = 1024
    layers: int = 4
    heads: int = 16
    kv_heads: int = 4
    intermediate: int = 2816
    vocab: int = 32000
    experts: int = 0  # Mixtral: local experts; 0 = dense MLP
    top_k: int = 2
    seq_len: int = 2048
    micro_batch: int = 1
    microbatches: int = 2
    precision: str = "bf16"
    attn: str = "sdpa"
    recompute: str = "none"
    optimizer: str = "adamw_foreach"
    pp: int = 1
    vpp: int = 1
    schedule: str | None = None  # None when pp == 1: the microbatches run one after the other

    def __post_init__(self) -> None:
        for value, allowed, what in (
            (self.arch, ARCHS, "arch"),
            (self.precision, PRECISIONS, "precision"),
            (self.attn, ATTENTIONS, "attn"),
            (self.recompute, RECOMPUTES, "recompute"),
            (self.optimizer, OPTIMIZERS, "optimizer"),
        ):
            if value not in allowed:
                raise UserError(f"case {what} {value!r}: use one of {', '.join(allowed)}")
        if self.arch == "mixtral" and self.experts < 2:
            raise UserError("a mixtral case needs experts >= 2")
        if self.pp > 1 and self.schedule is None:
            raise UserError("a pipeline case (pp > 1) needs a schedule name")
        if self.layers < self.num_stages:
            raise UserError(f"case with {self.layers} layers cannot fill {self.num_stages} pipeline stages")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise UserError("case heads must divide hidden and kv_heads must divide heads")

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def name(self) -> str:
        parts = [f"{self.arch}-h{self.hidden}-L{self.layers}"]
        if self.experts:
            parts.append(f"e{self.experts}k{self.top_k}")
        parts += [
            f"s{self.seq_len}b{self.micro_batch}m{self.microbatches}",
            self.precision,
            self.attn,
            f"rc-{self.recompute}",
            self.optimizer.replace("adamw_", "adamw-"),
        ]
        if self.pp > 1:
            parts.append(f"pp{self.pp}" + (f"v{self.vpp}" if self.vpp > 1 else "") + f"-{self.schedule}")
        return "/".join(parts)

    @property
    def placement(self) -> str:
        return "v" if self.schedule in V_SCHEDULES else "loop"

    def layer_layout(self) -> list[int]:
        """Decoder layers per stage, in stage order: an even split, the first stages taking
        one more when the layers do not divide."""
        q, r = divmod(self.layers, self.num_stages)
        return [q + (1 if s < r else 0) for s in range(self.num_stages)]

    def stage_layers(self, stage: int) -> range:
        layout = self.layer_layout()
        start = sum(layout[:stage])
        return range(start, start + layout[stage])

    def to_dict(self) -> dict:
        return dict(asdict(self), name=self.name)


def hf_config_dict(case: Case) -> dict:
    """The HF config.json of the case's model (what `pipemem estimate --model FILE` reads)."""
    d = {
        "model_type": case.arch,
        "architectures": [
            {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM"}[
                case.arch
            ]
        ],
        "hidden_size": case.hidden,
        "num_hidden_layers": case.layers,
        "num_attention_heads": case.heads,
        "num_key_value_heads": case.kv_heads,
        "head_dim": case.hidden // case.heads,
        "intermediate_size": case.intermediate,
        "vocab_size": case.vocab,
        "max_position_embeddings": max(4096, case.seq_len),
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "attention_dropout": 0.0,
        "attn_implementation": case.attn,
    }
    if case.arch == "mistral":
        d["sliding_window"] = 4096
    if case.arch == "mixtral":
        d.update(
            num_local_experts=case.experts,
            num_experts_per_tok=case.top_k,
            sliding_window=None,
            output_router_logits=False,
        )
    return d


def to_plan(case: Case) -> ParallelPlan:
    """The parallel plan pipemem estimates for this case (one GPU per pipeline rank, dp=tp=1).

    bf16_autocast keeps fp32 weights, grads and Adam states and computes in bf16 (torch
    autocast), which is neither Megatron's bf16 (bf16 weights + fp32 master) nor pure bf16;
    it is passed as dtype bf16 with master weights and `extra["autocast"] = True`."""
    dtype = "fp32" if case.precision == "fp32" else "bf16"
    return ParallelPlan(
        seq_len=case.seq_len,
        micro_batch=case.micro_batch,
        microbatches=case.microbatches,
        pp=case.pp,
        vpp=case.vpp,
        pp_layout=tuple(case.layer_layout()),
        dtype=dtype,
        master_weights=case.precision == "bf16_autocast",
        main_grad_dtype={"bf16": "bf16", "fp32": "fp32", "bf16_autocast": "fp32"}[case.precision],
        optimizer="adamw",
        recompute=case.recompute,
        flash_attn=case.attn == "sdpa",
        convention="torchtitan",
        schedule=case.schedule,
        extra={
            "precision": case.precision,
            "autocast": case.precision == "bf16_autocast",
            "adamw_impl": case.optimizer.removeprefix("adamw_"),
            "attn_implementation": case.attn,
        },
    )


# The matrix ---------------------------------------------------------------------------------

_LLAMA_1K = Case()
_MISTRAL_1K = replace(_LLAMA_1K, arch="mistral")
_MIXTRAL_1K = replace(_LLAMA_1K, arch="mixtral", layers=2, experts=4, intermediate=1408)
_LLAMA_2K = replace(_LLAMA_1K, hidden=2048, heads=16, kv_heads=4, intermediate=5632)
_LLAMA_4K = replace(_LLAMA_1K, hidden=4096, heads=32, kv_heads=8, intermediate=11008, layers=8)


def _pipelines(base: Case, pps: tuple[int, ...], precisions: tuple[str, ...]) -> list[Case]:
    out = []
    for pp in pps:
        for schedule in SCHEDULES:
            vpp = 1 if schedule == "1F1B" else 2
            layers = max(base.layers, pp * vpp)
            for precision in precisions:
                out.append(
                    replace(
                        base,
                        pp=pp,
                        vpp=vpp,
                        schedule=schedule,
                        layers=layers,
                        microbatches=2 * pp,
                        precision=precision,
                    )
                )
    return out


def small_cases() -> list[Case]:
    """About a dozen cases, one per feature, a few minutes on one GPU."""
    return [
        _LLAMA_1K,
        replace(_LLAMA_1K, precision="bf16_autocast"),
        replace(_LLAMA_1K, precision="fp32", attn="eager"),
        replace(_LLAMA_1K, optimizer="adamw_fused"),
        replace(_LLAMA_1K, recompute="full"),
        replace(_LLAMA_1K, attn="eager", recompute="selective"),
        _MISTRAL_1K,
        _MIXTRAL_1K,
        *_pipelines(replace(_LLAMA_2K, layers=8), (2,), ("bf16",)),
    ]


def full_cases() -> list[Case]:
    """Every arch x precision x attention x recompute at hidden 2048 (AdamW foreach), both
    AdamW implementations per precision, and every schedule at pp 2 and 4 at hidden 4096."""
    out: list[Case] = []
    for arch in ARCHS:
        base = {
            "llama": _LLAMA_2K,
            "mistral": replace(_LLAMA_2K, arch="mistral"),
            "mixtral": replace(_LLAMA_2K, arch="mixtral", layers=2, experts=4, intermediate=2816),
        }[arch]
        for precision in PRECISIONS:
            for attn in ATTENTIONS:
                for recompute in RECOMPUTES:
                    out.append(replace(base, precision=precision, attn=attn, recompute=recompute))
    for precision in PRECISIONS:
        out.append(replace(_LLAMA_2K, precision=precision, optimizer="adamw_fused"))
    out += _pipelines(_LLAMA_4K, (2, 4), ("bf16", "bf16_autocast"))
    return out


def get_cases(configs: str = "small", only: list[str] | tuple[str, ...] = ()) -> list[Case]:
    """The case set `configs`, narrowed to names containing any of `only` (substrings)."""
    if configs not in CONFIG_SETS:
        raise UserError(f"--configs {configs!r}: use one of {', '.join(CONFIG_SETS)}")
    cases = small_cases() if configs == "small" else full_cases()
    if only:
        cases = [c for c in cases if any(s in c.name for s in only)]
        if not cases:
            raise UserError(
                f"--case {' '.join(only)}: matches no case of --configs {configs}; "
                "see `pipemem validate cuda --list`"
            )
    return cases
