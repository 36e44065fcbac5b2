"""torch.compile of each decoder layer in traced mode: AOTAutograd's own partitioner decides.

`compile_layers(model)` replaces each decoder layer's forward with an `aot_function` of it
(parameters as graph inputs) that uses inductor's decompositions, its partitioner
`min_cut_rematerialization_partition` and no-op graph compilers. The recorded step then runs the
partitioned forward and backward graphs op by op, and autograd holds exactly the tensors the
compiled forward returns for the backward: the liveness engine sees what a compiled layer saves.
Inductor's fusion of pointwise chains (fewer transient buffers inside a graph) is not modelled;
the saved set is the partitioner's.

The graphs are traced once per layer on its first call, with the recorder's dispatch modes
off (tracing is not part of the step); that warm-up forward is discarded and the call is
repeated under the recorder.
"""

from __future__ import annotations

import torch

MODE = "aot_autograd + inductor decompositions, min_cut_rematerialization_partition (no inductor fusion)"


def _inductor_decompositions():
    """Inductor's decomposition table: the partitioner sees the ops inductor compiles (e.g.
    log-softmax as max / sub / exp / sum / log, each recomputable), not the eager kernels."""
    from torch._inductor.decomposition import select_decomp_table

    return select_decomp_table()


def _tracing_modes(args):
    """Every dispatch mode off (the recorder must not see tracing), then the inputs' fake mode
    back on (constants the decompositions create must be fake too)."""
    import contextlib

    from torch._guards import detect_fake_mode
    from torch.utils._python_dispatch import _disable_current_modes

    fake = detect_fake_mode(args)
    stack = contextlib.ExitStack()
    stack.enter_context(_disable_current_modes())
    if fake is not None:
        stack.enter_context(fake)
    return stack


def compile_layers(model: torch.nn.Module, prefix: str | None = None) -> int:
    """Compile every layer of the model's decoder layer list; returns how many."""
    from .capture import find_layer_prefix

    prefix = prefix if prefix is not None else find_layer_prefix(model)
    if not prefix:
        return 0
    layers = model.get_submodule(prefix)
    for layer in layers:
        _compile_module(layer)
    return len(layers)


def _compile_module(mod: torch.nn.Module) -> None:
    original = mod.forward

    class _Eager(torch.nn.Module):
        """The layer's original forward, as a module whose parameters are graph inputs."""

        def __init__(self):
            super().__init__()
            self.inner = mod

        def forward(self, *args, **kwargs):
            return original(*args, **kwargs)

    wrapper = _Eager()

    def functional(params, buffers, args, kwargs):
        return torch.func.functional_call(wrapper, (params, buffers), args, kwargs)

    # parameters are inputs of the traced graphs (aot_module refuses fake parameters)
    compiled = compile_function(functional)

    def forward(*args, **kwargs):
        return compiled(dict(wrapper.named_parameters()), dict(wrapper.named_buffers()), args, kwargs)

    mod.forward = forward


def compile_function(fn):
    """`fn` as its AOTAutograd-partitioned graphs (e.g. torchtune's compiled
    `compute_cross_entropy`), traced on its first call with the recorder's modes off; that
    warm-up call is discarded and the call repeated under the recorder."""
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def nop(gm, _example_inputs):
        return make_boxed_func(gm.forward)

    holder: dict = {}

    def compiled(*args, **kwargs):
        if "fn" not in holder:
            holder["fn"] = aot_function(
                fn,
                fw_compiler=nop,
                bw_compiler=nop,
                partition_fn=min_cut_rematerialization_partition,
                decompositions=_inductor_decompositions(),
            )
            with _tracing_modes(args):
                holder["fn"](*args, **kwargs)
        return holder["fn"](*args, **kwargs)

    return compiled
