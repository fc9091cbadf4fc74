"""torch DDP under `torchrun --nproc_per_node 2` (gloo, CPU): the crashes reproduced without the plugin, refused
before step 1 in strict mode, trained in fix mode with parameters in sync across ranks."""

from __future__ import annotations

import pytest
from torchrun import run_scenarios
from trainers import TF5

SCENARIOS = {
    # scenario: expected outcome prefix (None: trained)
    "full-true-true-none": "RuntimeError: Expected to mark a variable ready only once",
    "full-true-true-strict": "GCConfigError",
    "full-true-true-fix": None,
    "full-true-false-strict": None,  # find_unused off: reentrant is fine, nothing refused
    "lorahook-true-unset-none": "RuntimeError: Expected to mark a variable ready only once",
    "lorahook-true-unset-strict": "GCConfigError",
    "lorahook-true-unset-fix": None,
    # unset means reentrant on transformers 4, non-reentrant on 5
    "lorahook-unset-unset-none": None if TF5 else "RuntimeError: Expected to mark a variable ready only once",
    "lorahook-unset-unset-strict": None,
    # install(): refused while the arguments are built, before Trainer.__init__ fixes the DDP kwargs (>= 5.12)
    "full-true-true-installed": "GCConfigError",
    # a trainable module the loss never reaches, find_unused off (the Trainer's default with checkpointing on): DDP
    # stops the second step; the plugin refuses at the first optimizer step, before the update (fix mode too: DDP's
    # arguments are fixed by then); find_unused on with non-reentrant trains
    "unused-false-unset-none": "RuntimeError: Expected to have finished reduction",
    "unused-false-unset-strict": "GCConfigError",
    "unused-false-unset-fix": "GCConfigError",
    "unused-false-true-strict": None,
    # checkpointing off: the Trainer turns find_unused_parameters on, DDP copes, nothing is said
    "unusedoff-unset-unset-strict": None,
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_scenarios("ddp_scenarios.py", tmp_path_factory.mktemp("ddp"), list(SCENARIOS))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_scenario(results, scenario):
    ranks = results[scenario]
    assert set(ranks) == {0, 1}
    expected = SCENARIOS[scenario]
    for rank in ranks.values():
        if expected is None:
            assert rank["outcome"] == "trained", rank
            assert rank["checksums"][0] == rank["checksums"][1], "parameters out of sync across ranks"
        else:
            assert rank["outcome"].startswith(expected), rank
    plugin = scenario.rsplit("-", 1)[1]
    if plugin == "none":
        return
    if plugin == "installed":
        assert all("ddp-reentrant-find-unused" in rank["outcome"] and rank["where"] == "TrainingArguments"
                   for rank in ranks.values())
        return
    rules = {rule: action for rank in ranks.values() for rule, action in rank["decisions"]}
    if scenario.startswith("unused-false-unset"):
        assert rules["ddp-unused-parameters"] == "error"
        assert all(rank["unchanged"] for rank in ranks.values()), "refused after an update"
    if scenario.startswith(("full-true-true", "lorahook-true")):
        assert rules["ddp-reentrant-find-unused"] == {"strict": "error", "fix": "override"}[plugin]
    if scenario.startswith("unusedoff"):
        assert "ddp-unused-parameters" not in rules
        return
    if expected is None:
        assert all(rank["running"] is (scenario.split("-")[1] == "true" and "false-strict" in scenario)
                   for rank in ranks.values())
        assert ranks[0]["decisions"] == ranks[1]["decisions"], "ranks decided differently"


def _fsdp_args(tmp_path):
    from trainers import common_args
    from transformers import TrainingArguments

    return TrainingArguments(**common_args(str(tmp_path), gradient_checkpointing=True, fsdp="full_shard",
                                           fsdp_config={"activation_checkpointing": True}))


def test_fsdp_with_both_checkpointings_is_explained_at_construction(tmp_path):
    """transformers only refuses this inside Trainer.__init__ (which needs a distributed FSDP launch to get there);
    the plugin explains it when the arguments are built, and in fix mode keeps FSDP's own checkpointing."""
    import trl_gc_plugin
    from trl_gc_plugin import GCConfigError

    bare = _fsdp_args(tmp_path)
    assert bare.gradient_checkpointing is True  # upstream accepts the arguments as they are
    with trl_gc_plugin.installed(callback=False), pytest.raises(GCConfigError) as err:
        _fsdp_args(tmp_path)
    assert "fsdp-activation-checkpointing" in str(err.value) and "gradient_checkpointing=False" in str(err.value)
    with trl_gc_plugin.installed(mode="fix", callback=False):
        fixed = _fsdp_args(tmp_path)
    assert fixed.gradient_checkpointing is False
    if hasattr(fixed, "activation_checkpointing"):
        assert fixed.activation_checkpointing is False
