"""Paddle's `PipelineMemoryEstimator` API (as proposed in Paddle's pipeline-memory-estimator pull
request) over pipemem IR programs.

Same calls, without that first version's defects:
* storages carried in from *any* earlier program are alive on entry (Paddle's version only looks at
  the adjacent previous program);
* estimating does not mutate stored state, so the same call gives the same answer twice;
* unknown dimensions are an error (Paddle's version counts -1 as 1), bool is 1 byte (it: 4);
* views and in-place results share their base's storage; op workspaces count.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from .errors import UserError
from .ir import Program
from .liveness import analyze_program, compile_program, retention_sets


class PipelineMemoryEstimator:
    def __init__(self, granularity: int = 1):
        self.granularity = granularity
        self.program_types: list[str] = []
        self.type_to_program: dict[str, Program] = {}
        # type -> {storage name: bytes} kept alive past that program because a later one needs it
        self.type_to_skip_gc_vars: dict[str, dict[str, int]] = {}

    def set_program_skip_gc_vars(
        self, type_to_program: Mapping[str, Program], program_types: Sequence[str]
    ) -> None:
        """For each program type, what it must keep because *any* later type uses it.
        `program_types` is the order the types run in for one microbatch."""
        missing = [t for t in program_types if t not in type_to_program]
        if missing:
            raise UserError(f"program_types names {missing} but type_to_program has no such program")
        self.program_types = list(program_types)
        self.type_to_program = dict(type_to_program)
        programs = [type_to_program[t] for t in program_types]
        for t, prog, keep in zip(program_types, programs, retention_sets(programs)):
            c = compile_program(prog)
            self.type_to_skip_gc_vars[t] = {s: int(c.sizes[c.storage_id(s)]) for s in sorted(keep)}

    def estimate_memory(self, program: Program, program_type: str, dist_context=None) -> tuple[int, int]:
        """(net change, peak above the start) of `program` run as `program_type`.
        `dist_context` is accepted for signature compatibility with Paddle's version; shapes in the
        IR are already the local (per-rank) ones."""
        if program_type not in self.type_to_skip_gc_vars:
            raise UserError(f"call set_program_skip_gc_vars before estimating a {program_type!r} program")
        k = self.program_types.index(program_type)
        carried: set[str] = set()
        for earlier in self.program_types[:k]:
            carried |= self.type_to_skip_gc_vars[earlier].keys()
        r = analyze_program(
            program,
            live_on_entry=carried,
            keep=self.type_to_skip_gc_vars[program_type],
            granularity=self.granularity,
        )
        return r.net_bytes, r.peak_bytes

    def get_program_param_size(self, program_type: str) -> int:
        """Bytes of the parameters the program of this type references."""
        if program_type not in self.type_to_program:
            raise UserError(f"no program of type {program_type!r}; call set_program_skip_gc_vars first")
        return self.type_to_program[program_type].param_bytes()

    def get_increase_memory(self, program_type: str) -> int:
        """Bytes this type keeps for later types (Paddle's `_get_increase_memory`)."""
        return sum(self.type_to_skip_gc_vars[program_type].values())
