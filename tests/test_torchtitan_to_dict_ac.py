"""torchtitan 0.3's Trainer.Config.to_dict() writes [activation_checkpoint] without a `mode`:
the policy is read from which fields the table has (pipemem.configs.torchtitan._ac_mode)."""

import pytest

from pipemem.configs.torchtitan import read as read_torchtitan
from pipemem.errors import UserError

BASE = """
[model_spec]
name = "llama3"
flavor = "debugmodel"
[training]
local_batch_size = 2
seq_len = 256
[parallelism]
data_parallel_shard_degree = 2
"""
AC_BASE = '[activation_checkpoint]\npreserve_rng_state = true\ndeterminism_check = "default"\ndebug = false\n'


@pytest.mark.parametrize(
    "table,recompute",
    [
        (AC_BASE, "full"),  # FullAC.Config
        (
            AC_BASE + 'force_recompute_mm_shapes_by_fqns = ["moe.router.gate"]\n',
            "selective",
        ),  # SelectiveAC.Config
        ('[activation_checkpoint]\nmode = "none"\n', "none"),
    ],
)
def test_policy_from_the_tables_fields(tmp_path, table, recompute):
    f = tmp_path / "t.toml"
    f.write_text(BASE + table)
    tc = read_torchtitan(str(f))
    assert tc.plan["recompute"] == recompute and not tc.warnings, (tc.plan, tc.warnings)


def test_memory_budget_table_is_refused(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(BASE + AC_BASE + "memory_budget = 0.5\n[compile]\nenable = true\n")
    with pytest.raises(UserError, match="memory_budget"):
        read_torchtitan(str(f))


def test_missing_table_assumes_selective_and_says_so(tmp_path):
    f = tmp_path / "t.toml"
    f.write_text(BASE)
    tc = read_torchtitan(str(f))
    assert tc.plan["recompute"] == "selective" and any("SelectiveAC assumed" in w for w in tc.warnings)
