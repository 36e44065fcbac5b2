"""Run one pipeline rank's real action order on one device, without the other ranks.

`pipemem validate cuda` measures a pipeline's per-rank memory on a single GPU: each rank is
run on its own (one process per rank), walking its schedule's actions on the stage modules
it owns. What the other ranks would send is replaced by a fresh tensor of the true shape
and dtype, allocated when the action that consumes it starts (Megatron receives on the fly);
what this rank sends is dropped. Everything else is the real computation, so the memory the
device reports is what that rank holds at each moment of the schedule.

What is kept between actions follows the `torch.distributed.pipelining` runtime:

* F keeps (output, input) of its (stage, microbatch) until that microbatch's backward;
* B (full backward) runs autograd from the output with the received output gradient (or from
  the loss on the last stage) and sends the input gradient;
* I (input gradient, zero-bubble split) computes the input gradient only and keeps, until W,
  what the runtime keeps: the input, the (detached) output, the received output gradient and
  the intermediates needed for the weight gradients. On the first stage I does nothing and W
  runs the whole backward (the input is token ids, there is no input gradient to send);
* a stage whose neighbour lives on the same rank (ZB-V's turn-around) hands its output over
  as a detached view and takes the neighbour's input gradient directly: no new allocation.

This module is device-agnostic (tests run it on CPU with tiny modules); torch is imported
only when an emulator is built.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from ..errors import UserError

# Action kinds as spelled by pipemem.schedules, torch.distributed.pipelining and Paddle.
_KIND_ALIASES = {
    "F": "F",
    "FORWARD": "F",
    "B": "B",
    "FULL_BACKWARD": "B",
    "BACKWARD": "B",
    "I": "I",
    "BACKWARD_INPUT": "I",
    "BACKWARD_B": "I",
    "W": "W",
    "BACKWARD_WEIGHT": "W",
    "BACKWARD_W": "W",
}
# Communication and bookkeeping actions: the emulator receives when it computes and drops sends.
_SKIPPED_KINDS = {"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"}
_OVERLAP_KINDS = {"OVERLAP_F_B"}


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of a rank: kind in F, B, I, W; global stage index; microbatch."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:  # pipemem.schedules' text form: F3@s1
        return f"{self.kind}{self.microbatch}@s{self.stage}"


def _kind_name(kind: Any) -> str:
    name = getattr(kind, "name", None) or getattr(kind, "value", None) or kind
    return str(name).upper()


def normalize_actions(actions: Iterable[Any]) -> list[Action]:
    """Compute actions of one rank, in order, from any of the spellings in use.

    Accepts pipemem `Action(kind, stage, microbatch)`, torch `_Action(stage_index,
    computation_type, microbatch_index, sub_actions)`, (kind, stage, microbatch) tuples and
    `None` (an idle slot). Overlapped actions (DualPipeV's OVERLAP_F_B) are expanded into
    their sub-actions; communication actions are skipped (receives happen at compute time).
    """
    out: list[Action] = []
    for a in actions:
        if a is None:
            continue
        if isinstance(a, Action):
            out.append(a)
            continue
        if isinstance(a, tuple) and len(a) == 3 and not hasattr(a, "computation_type"):
            kind, stage, mb = a
        else:
            kind = getattr(a, "kind", None) or getattr(a, "computation_type", None)
            stage = getattr(a, "stage", getattr(a, "stage_index", None))
            mb = getattr(a, "microbatch", getattr(a, "microbatch_index", None))
        name = _kind_name(kind)
        if name in _OVERLAP_KINDS:
            out.extend(normalize_actions(getattr(a, "sub_actions", None) or ()))
            continue
        if name in _SKIPPED_KINDS:
            continue
        if name not in _KIND_ALIASES or stage is None or mb is None:
            raise UserError(
                f"schedule action {a!r}: cannot read it as a compute action "
                "(kind F/B/I/W with a stage and a microbatch)"
            )
        out.append(Action(_KIND_ALIASES[name], int(stage), int(mb)))
    return out


@dataclass
class ActionRecord:
    """What the probe read after one action, and what the emulator holds then."""

    action: Action
    bytes_after: int | None
    held_forwards: int  # (stage, microbatch) forwards kept for a backward not yet run
    held_weight_grads: int  # I done, W pending


@dataclass
class RankRun:
    """The result of walking one rank's actions once."""

    records: list[ActionRecord] = field(default_factory=list)
    max_held_forwards: int = 0
    received_activations: list[tuple[int, int, tuple, str]] = field(
        default_factory=list
    )  # stage, mb, shape, dtype
    received_grads: list[tuple[int, int, tuple, str]] = field(default_factory=list)
    sent_activations: int = 0
    sent_grads: int = 0


class RankEmulator:
    """Walks one rank's actions on the stage modules it owns.

    stages: global stage index -> module. A module takes one tensor (token ids on stage 0,
        hidden states elsewhere) and returns a tensor (hidden states, or the scalar loss on the
        last stage, which must include the loss computation).
    num_stages: stages in the whole pipeline (pp * vpp).
    make_input(microbatch): stage 0's input (token ids), on the device.
    recv_spec(stage): (shape, torch dtype) of the activation stage receives from stage - 1.
    device: where received tensors are allocated.
    forward_context: context manager factory entered around every forward (e.g. autocast).
    probe: called after every action; its int is recorded (torch.cuda.memory_allocated).
    """

    def __init__(
        self,
        stages: Mapping[int, Any],
        num_stages: int,
        make_input: Callable[[int], Any],
        recv_spec: Callable[[int], tuple[tuple, Any]],
        device: Any = "cpu",
        forward_context: Callable[[], Any] = nullcontext,
        probe: Callable[[], int] | None = None,
    ):
        if not stages:
            raise UserError("a pipeline rank needs at least one stage module")
        bad = [s for s in stages if not 0 <= s < num_stages]
        if bad:
            raise UserError(f"stage indices {bad} are outside 0..{num_stages - 1}")
        self.stages = dict(stages)
        self.num_stages = num_stages
        self.make_input = make_input
        self.recv_spec = recv_spec
        self.device = device
        self.forward_context = forward_context
        self.probe = probe
        self._reset_state()

    def _reset_state(self) -> None:
        self._fwd: dict[tuple[int, int], tuple[Any, Any]] = {}  # (stage, mb) -> (output, input)
        self._pending_w: dict[tuple[int, int], tuple] = {}  # (stage, mb) -> state kept until W
        self._local_grads: dict[tuple[int, int], Any] = {}  # grad of (stage, mb)'s output
        self._done_f: set[tuple[int, int]] = set()

    # The walk ---------------------------------------------------------------------------
    def run(self, actions: Iterable[Any]) -> RankRun:
        """Walk the actions once (one training step without the optimizer)."""
        self._reset_state()
        run = RankRun()
        for action in normalize_actions(actions):
            if action.stage not in self.stages:
                raise UserError(
                    f"schedule action {action}: stage {action.stage} is not on this rank "
                    f"(it holds stages {sorted(self.stages)})"
                )
            {"F": self._forward, "B": self._backward, "I": self._backward_input, "W": self._backward_weight}[
                action.kind
            ](action, run)
            run.max_held_forwards = max(run.max_held_forwards, len(self._fwd))
            run.records.append(
                ActionRecord(
                    action, self.probe() if self.probe else None, len(self._fwd), len(self._pending_w)
                )
            )
        left = sorted(self._fwd) + sorted(self._pending_w)
        if left:
            raise UserError(f"schedule leaves (stage, microbatch) {left} without a finished backward")
        self._reset_state()
        return run

    def _forward(self, a: Action, run: RankRun) -> None:
        import torch

        key = (a.stage, a.microbatch)
        if key in self._done_f:
            raise UserError(
                f"schedule action {a}: forward of stage {a.stage} microbatch {a.microbatch} runs twice"
            )
        if a.stage == 0:
            inp = self.make_input(a.microbatch)
        elif (a.stage - 1) in self.stages:
            prev = self._fwd.get((a.stage - 1, a.microbatch))
            if prev is None:
                raise UserError(
                    f"schedule action {a}: runs before the forward of stage {a.stage - 1} on the same rank"
                )
            # A local hand-over is a detached view: same storage, a new leaf for this stage's graph.
            inp = prev[0].detach().requires_grad_(True)
        else:
            shape, dtype = self.recv_spec(a.stage)
            inp = torch.randn(tuple(shape), dtype=dtype, device=self.device).requires_grad_(True)
            run.received_activations.append((a.stage, a.microbatch, tuple(shape), str(dtype)))
        with self.forward_context():
            out = self.stages[a.stage](inp)
        if a.stage == self.num_stages - 1 and out.dim() != 0:
            raise UserError(
                f"the last stage's module must return the scalar loss, got shape {tuple(out.shape)}"
            )
        if a.stage < self.num_stages - 1 and (a.stage + 1) not in self.stages:
            run.sent_activations += 1
        self._fwd[key] = (out, inp)
        self._done_f.add(key)

    def _output_grad(self, a: Action, out: Any, run: RankRun) -> Any:
        """The gradient of (stage, mb)'s output: None on the last stage (the output is the
        loss), the next stage's input gradient when it is local, else a received tensor."""
        import torch

        if a.stage == self.num_stages - 1:
            return None
        if (a.stage + 1) in self.stages:
            grad = self._local_grads.pop((a.stage, a.microbatch), None)
            if grad is None:
                raise UserError(
                    f"schedule action {a}: runs before the input-gradient pass of stage "
                    f"{a.stage + 1} on the same rank"
                )
            return grad
        grad = torch.randn(out.shape, dtype=out.dtype, device=out.device)
        run.received_grads.append((a.stage, a.microbatch, tuple(out.shape), str(out.dtype)))
        return grad

    def _pop_forward(self, a: Action) -> tuple[Any, Any]:
        try:
            return self._fwd.pop((a.stage, a.microbatch))
        except KeyError:
            raise UserError(
                f"schedule action {a}: backward without a pending forward of stage "
                f"{a.stage} microbatch {a.microbatch}"
            ) from None

    def _send_input_grad(self, a: Action, grad: Any, run: RankRun) -> None:
        if a.stage == 0 or grad is None:
            return
        if (a.stage - 1) in self.stages:
            self._local_grads[(a.stage - 1, a.microbatch)] = grad
        else:
            run.sent_grads += 1  # dropped: the previous rank is not emulated here

    def _backward(self, a: Action, run: RankRun) -> None:
        import torch

        out, inp = self._pop_forward(a)
        grad = self._output_grad(a, out, run)
        torch.autograd.backward(out, grad_tensors=grad)
        dinp = inp.grad if a.stage > 0 else None
        del out, inp, grad
        self._send_input_grad(a, dinp, run)

    def _backward_input(self, a: Action, run: RankRun) -> None:
        out, inp = self._pop_forward(a)
        grad = self._output_grad(a, out, run)
        if a.stage == 0:
            # Nothing to send from the first stage: W runs the whole backward.
            self._pending_w[(a.stage, a.microbatch)] = ("full", out, grad, inp)
            return
        from torch.distributed.pipelining._backward import stage_backward_input

        dinputs, groups = stage_backward_input(
            [out], None if grad is None else [grad], [inp], self.stages[a.stage].parameters()
        )
        self._pending_w[(a.stage, a.microbatch)] = ("split", out, grad, inp, groups)
        self._send_input_grad(a, dinputs[0], run)

    def _backward_weight(self, a: Action, run: RankRun) -> None:
        import torch

        state = self._pending_w.pop((a.stage, a.microbatch), None)
        if state is None:
            raise UserError(f"schedule action {a}: weight-gradient pass without its input-gradient pass")
        if state[0] == "full":
            _, out, grad, _inp = state
            torch.autograd.backward(out, grad_tensors=grad)
            return
        from torch.distributed.pipelining._backward import stage_backward_weight

        stage_backward_weight(self.stages[a.stage].parameters(), state[4])


def stages_of_rank(rank: int, pp: int, vpp: int, style: str = "loop") -> list[int]:
    """Global stage indices held by `rank`: "loop" (interleaved: rank, rank + pp, ...) or
    "v" (ZB-V / DualPipeV: rank and 2 * pp - 1 - rank)."""
    from ..schedules.actions import loop_stage_map, v_stage_map

    if not 0 <= rank < pp:
        raise UserError(f"rank {rank} is outside 0..{pp - 1}")
    if style == "v" and vpp != 2:
        raise UserError(f"V-shaped schedules place 2 stages per rank; got --vpp {vpp}")
    placement = v_stage_map(pp, vpp) if style == "v" else loop_stage_map(pp, vpp)
    return [s for s, r in enumerate(placement) if r == rank]


# Stage modules of an HF causal LM ------------------------------------------------------------


def hf_stage_modules(
    config: Any, stage_layers: Mapping[int, range], num_stages: int, labels: Any, device: Any, dtype: Any
) -> dict[int, Any]:
    """Build only the given stages of an HF causal LM (`config`: a transformers config) on
    `device`, weights drawn at random (no checkpoint). Each stage runs what the HF model's
    forward runs for its layers: embedding on stage 0; position ids, the causal mask and
    rotary embeddings on every stage (as every pipeline stage recomputes them); norm, LM head
    and HF's own loss function on the last stage, which returns the loss."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    stages = {}
    for s, layers in stage_layers.items():
        stage = _HFStage(model, layers, first=s == 0, last=s == num_stages - 1, labels=labels)
        _materialize(stage, device, dtype, config)
        stages[s] = stage.train()
    return stages


def _materialize(module: Any, device: Any, dtype: Any, config: Any) -> None:
    """Allocate a meta-built stage on `device` and draw its weights (norms at 1, others
    N(0, 0.02)); rebuild the rotary embedding, whose buffers are computed at construction."""
    import torch

    module.to_empty(device=device)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02)
    module.to(dtype)
    with torch.device(device):
        module.rotary = type(module.rotary)(config=config)


@functools.lru_cache(maxsize=None)
def _stage_class():
    """The stage module class (defined on first use, so importing this module needs no torch)."""
    import torch

    class HFStage(torch.nn.Module):
        def __init__(self, model, layers: range, first: bool, last: bool, labels):
            super().__init__()
            inner = model.model
            self.config = model.config
            self.embed = inner.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(inner.layers[i] for i in layers)
            self.rotary = inner.rotary_emb
            self.norm = inner.norm if last else None
            self.lm_head = model.lm_head if last else None
            self.loss_function = model.loss_function if last else None
            self.labels = labels

        def forward(self, x):
            from transformers import masking_utils

            h = self.embed(x) if self.embed is not None else x
            pos = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
            make_mask = (
                masking_utils.create_causal_mask
                if getattr(self.config, "sliding_window", None) is None
                else masking_utils.create_sliding_window_causal_mask
            )
            mask = make_mask(
                config=self.config, inputs_embeds=h, attention_mask=None, cache=None, position_ids=pos
            )
            pe = self.rotary(h, position_ids=pos)
            for layer in self.layers:
                h = layer(h, attention_mask=mask, position_embeddings=pe, position_ids=pos, use_cache=False)
            if self.norm is None:
                return h
            logits = self.lm_head(self.norm(h))
            return self.loss_function(
                logits=logits, labels=self.labels.to(logits.device), vocab_size=self.config.vocab_size
            )

    return HFStage


def _HFStage(*args, **kwargs):
    return _stage_class()(*args, **kwargs)


# Recompute ----------------------------------------------------------------------------------


def core_attention_recompute_impl(base: str) -> str:
    """Register (once) an HF attention implementation that runs `base` ("sdpa" or "eager")
    under non-reentrant checkpointing, so only the core attention (scores, softmax, the
    weighted sum) is recomputed in backward: Megatron's selective recompute. Returns the name
    to set as `config._attn_implementation`."""
    import sys

    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    name = f"pipemem_core_recompute_{base}"
    if name in ALL_ATTENTION_FUNCTIONS:
        return name

    def attention(module, query, key, value, attention_mask, **kwargs):
        if base == "eager":
            fn = sys.modules[type(module).__module__].eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]

        def core(q, k, v, mask):
            return fn(module, q, k, v, mask, **kwargs)[0]

        if not torch.is_grad_enabled():
            return core(query, key, value, attention_mask), None
        return checkpoint(core, query, key, value, attention_mask, use_reentrant=False), None

    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    return name


def checkpoint_layers(stage: Any) -> None:
    """Full recompute: every decoder layer of the stage keeps only its input for backward."""
    import torch
    from torch.utils.checkpoint import checkpoint

    class Checkpointed(torch.nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, *args, **kwargs):
            return checkpoint(self.layer, *args, use_reentrant=False, **kwargs)

    stage.layers = torch.nn.ModuleList(Checkpointed(layer) for layer in stage.layers)
