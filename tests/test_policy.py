"""The mode policy is one table, and the docs' table is that table."""

from __future__ import annotations

import itertools

import pytest

from trl_gc_plugin.core import policy
from trl_gc_plugin.core.policy import POLICY, action_for


def documented():
    """The table of `policy`'s docstring, read back as (kind, explicit, mode) -> action."""
    rows = {}
    for line in policy.__doc__.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] not in ("failure", "repair"):
            continue
        kind, explicit, strict, fix, warn = cells
        for who in ((True, False) if explicit == "-" else (explicit == "yes",)):
            rows[(kind, who, "strict")] = strict
            rows[(kind, who, "fix")] = fix.split(" ")[0]
            rows[(kind, who, "warn")] = warn
    return rows


def test_the_documented_table_is_the_table():
    assert documented() == POLICY


@pytest.mark.parametrize(("kind", "explicit", "mode"), itertools.product(("failure", "repair"), (True, False),
                                                                          ("strict", "fix", "warn")))
def test_standing_back_reports_and_nothing_to_switch_refuses_in_fix(kind, explicit, mode):
    assert action_for(mode, kind, explicit, stands_back=True) == "warn"
    expected = POLICY[(kind, explicit, "strict" if mode == "fix" else mode)]
    assert action_for(mode, kind, explicit, can_fix=False) == expected
