"""What a torch.compile'd layer saves for backward: AOTAutograd's min-cut, on a template tape.

Inductor compiles the joint forward+backward graph of each compiled module and lets
`torch._functorch.partitioners.min_cut_rematerialization_partition` choose what the forward
saves: the smallest set of tensors (by bytes) from which the backward can recompute everything
it reads, where only cheap ops may be recomputed. We run the same construction over the
nodes of one template region (pipemem.templates.tape), with the partitioner's default rules:

* not recomputable ("banned", so saved when the backward needs them): outputs of
  compute-intensive ops (matmuls, attention, grouped GEMMs), collectives, random ops
  (dropout), reductions whose output is over 4x smaller than their input (norm statistics),
  and any tensor the backward reads with a compute-intensive op ("materialized in backward":
  a matmul's input for its weight grad, attention's q/k/v/out);
* recomputable: pointwise ops, casts, views, rope, norms' elementwise parts;
* region inputs (the layer input) are available for free on the forward side; parameters
  cost nothing to save.

Each tensor v becomes an edge v_in -> v_out of capacity = its bytes; a node's inputs feed its
outputs with infinite capacity; banned tensors hang from the source, tensors the backward
reads go to the sink. The minimum cut is the saved set; nodes with an output on the sink side
are recomputed in backward (the tape's region replay). `tests/test_features_vs_libraries.py`
holds this against the real partitioner run on Hugging Face layers on fake tensors.
"""

from __future__ import annotations

from .tape import PARAM, Tape

# Template node types that are compute-intensive or otherwise never recomputed.
COMPUTE = frozenset(
    {
        "linear",
        "linear_sp",
        "matmul",
        "grouped_mm",
        "flash_attn",
        "bmm_qk",
        "bmm_pv",
        "embedding",
        "fp8_linear",
        "te_linear",
        "fused_linear_ce",
    }
)
COLLECTIVES = frozenset({"all_gather", "reduce_scatter", "all_reduce", "all_to_all"})
RANDOM = frozenset({"dropout"})
# Ops whose backward is itself compute-intensive: the tensors they save are materialized.
MATERIALIZING = COMPUTE
INF = float("inf")


def _nbytes(tape: Tape, name: str) -> int:
    t = tape.tensors[name]
    return 0 if t.kind is PARAM else t.nbytes


def min_cut_region(tape: Tape, region: int) -> dict[str, int]:
    """Mark the nodes of `region` that the compiled forward keeps (pinned) or the compiled
    backward recomputes; return the saved tensors {name: bytes}."""
    try:
        import networkx as nx
    except ImportError:
        from ..errors import UserError

        raise UserError(
            "--compile needs networkx for the compiled layers' min-cut partition: pip install "
            "networkx (or pipemem[modern])"
        ) from None

    nodes = [n for n in tape.nodes if n.region == region]
    produced = {o: n for n in nodes for o in n.outputs}
    bwd_reads: dict[str, bool] = {}  # tensor -> read by a materializing backward op
    for n in nodes:
        reads = list(n.save_i) + list(n.save_w)
        for b in (*n.pre_i, *n.post_i, *n.pre_w):
            reads += [x for x in b.inputs if not x.startswith("d.")]
        for x in reads:
            if x in tape.tensors and tape.tensors[x].kind is not PARAM:
                bwd_reads[x] = bwd_reads.get(x, False) or n.type in MATERIALIZING

    g = nx.DiGraph()

    def vertex(name: str) -> None:
        if g.has_edge(name + "_in", name + "_out"):
            return
        g.add_edge(name + "_in", name + "_out", capacity=_nbytes(tape, name))

    for n in nodes:
        for x in n.inputs:
            vertex(x)
            if x not in produced:  # region input: available in the forward
                g.add_edge("source", x + "_in", capacity=INF)
        banned_type = n.type in COMPUTE or n.type in COLLECTIVES or n.type in RANDOM
        in_bytes = sum(_nbytes(tape, x) for x in n.inputs)
        for o in n.outputs:
            vertex(o)
            for x in n.inputs:
                g.add_edge(x + "_out", o + "_in", capacity=INF)
            reduction = 4 * tape.tensors[o].nbytes < in_bytes
            if banned_type or reduction or bwd_reads.get(o, False):
                g.add_edge("source", o + "_in", capacity=INF)
    for x in bwd_reads:
        vertex(x)
        if x not in produced:
            g.add_edge("source", x + "_in", capacity=INF)
        g.add_edge(x + "_out", "sink", capacity=INF)
    if "sink" not in g:
        for n in nodes:
            n.pinned = True
        return {}
    _, (reach, _) = nx.minimum_cut(g, "source", "sink")
    saved = {}
    for name in {e[0][:-3] for e in g.edges if e[0].endswith("_in") and e[1] == e[0][:-3] + "_out"}:
        if name + "_in" in reach and name + "_out" not in reach:
            saved[name] = _nbytes(tape, name)
    for n in nodes:
        n.pinned = all(o + "_in" in reach for o in n.outputs)
    return saved
