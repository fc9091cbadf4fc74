"""Real FSDP (FSDP1 and FSDP2) through the HF Trainer under `torchrun --nproc_per_node 2` (gloo, CPU), with the
test-only accelerate shim of tests/fsdp_scenarios.py (without it, accelerate wraps the model in DDP on a CPU-only
machine, silently): what the plugin's FSDP rules are about, reproduced without the plugin; what the plugin does
under real FSDP today; and what it should do (xfail)."""

from __future__ import annotations

import json

import pytest
from torchrun import run_scenarios
from trainers import TF5

BOTH_AC = ("ValueError: `fsdp_config['activation_checkpointing']` (FSDP's own activation checkpointing) and the "
           "`activation_checkpointing` training argument can't both be set to True." if TF5 else
           "ValueError: The activation_checkpointing in FSDP config and the gradient_checkpointing in training arg "
           "can't be set to True simultaneously.")
DDP_TWICE = "RuntimeError: Expected to mark a variable ready only once"

# scenario: expected outcome prefix (None: trained). Grammar in tests/fsdp_scenarios.py:
# <fsdp>-<model>-<gc>-<fsdp activation checkpointing>-<use_cache>-<plugin>
UPSTREAM = {
    "ddp-full-off-0-0-none": None,  # FSDP asked for, no shim: DDP, silently
    "v2-full-off-0-0-none": None,
    "v1-full-off-0-0-none": None,
    "v2-full-true-1-0-none": BOTH_AC,
    "v1-full-true-1-0-none": BOTH_AC,
    "ddp-full-true-1-0-none": None,  # the same arguments pass when accelerate fell back to DDP
    "v2-full-off-1-1-none": None if TF5 else "CheckpointError: torch.utils.checkpoint: Recomputed values",
    "v1-full-off-1-1-none": None if TF5 else "CheckpointError: torch.utils.checkpoint: Recomputed values",
    "v2-full-off-1-0-none": None,
    "v2-full-true-0-0-none": None,
    "v2-full-false-0-0-none": None,
    "v1-full-true-0-0-none": None,
    "v1-full-false-0-0-none": None,
    "v2-frozenemb-true-0-0-none": None,  # transformers 4: trains, but no layer parameter changes (below)
    "v1-frozenemb-true-0-0-none": None,
    "v2-lora-true-0-0-none": None if TF5 else "RuntimeError: element 0 of tensors does not require grad",
    "v2-lora-false-0-0-none": None,
    "v2-lorahook-true-0-0-none": None,
    "v1-lorahook-true-0-0-none": None,
    "v2-lora-off-1-0-none": None,
    "ddp-lorahook-true-0-0-none": DDP_TWICE,
    "v2-dropout-off-0-0-none": None,
    "v2-dropout-off-1-0-none": None,
    "v2-dropout-false-0-0-none": None,
    "v1-dropout-off-1-0-none": None,
    "v2-loradrop-off-0-0-none": None,
    "v2-loradrop-off-1-0-none": None,
}
if TF5:  # `TrainingArguments(use_cache=True)`, copied into the model config after on_init_end
    UPSTREAM["v2-full-off-1-2-none"] = "RuntimeError: The size of tensor a (32) must match the size of tensor b (16)"
PLUGIN = {
    "v2-full-off-1-1-strict": None,
    "v1-full-off-1-1-strict": None,
    "v2-full-true-1-0-installed": "GCConfigError",
    "v2-full-true-1-0-installedfix": None,
    "v2-frozenemb-unset-0-0-strict": None,
    "v2-frozenemb-true-0-0-strict": None if TF5 else "GCConfigError",
    "v1-frozenemb-true-0-0-strict": None,
}
if TF5:
    PLUGIN["v2-full-off-1-2-strict"] = None
# a memory plan under FSDP2 (issue 22), against the same run without the plugin (full checkpointing)
PLANS = ["v2-full-false-0-0-budget", "v2-tied-false-0-0-budget", "v2-tied-false-0-0-none", "v1-full-false-0-0-budget",
         "v1g-deep-false-0-0-budget", "v2g-deep-false-0-0-budget", "v2-deep-false-0-0-unshard"]
PLANNED = ["ddp-full-off-1-0-strict", "ddp-lorahook-true-0-0-strict", "v2-dropout-off-1-0-strict"]
SCENARIOS = {**UPSTREAM, **PLUGIN}
FULL = [s for s in SCENARIOS if s.split("-")[1] == "full" and SCENARIOS[s] is None]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    return out, run_scenarios("fsdp_scenarios.py", out, [*SCENARIOS, *PLANNED, *PLANS])


def _check(ranks: dict, expected: str | None) -> None:
    assert set(ranks) == {0, 1}
    for rank in ranks.values():
        if expected is None:
            assert rank["outcome"] == "trained", rank
            assert rank["checksums"][0] == rank["checksums"][1], "parameters out of sync across ranks"
        else:
            assert rank["outcome"].startswith(expected), rank


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_outcome(results, scenario):
    _check(results[1][scenario], SCENARIOS[scenario])


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if SCENARIOS[s] is None])
def test_what_wraps_the_model(results, scenario):
    """The detection a callback can do: accelerate's state on `args.distributed_state` already says FSDP at
    on_init_end (set in Trainer.__init__); at on_train_begin the model itself shows FSDP2 (FSDPModule, every
    parameter a DTensor) or FSDP1 (the callbacks get the FullyShardedDataParallel root). The DDP fallback shows
    MULTI_CPU with FSDP requested."""
    for rank in results[1][scenario].values():
        kind = scenario.split("-")[0]
        init, begin = rank["seen"]["init_end"], rank["seen"]["train_begin"]
        assert init["structure"] is None and init["fsdp_requested"]
        if kind == "ddp":
            assert init["verdict"] == begin["verdict"] == "not-fsdp" and begin["state"] == "MULTI_CPU", rank
            assert rank["wrapper"] == "DistributedDataParallel"
            continue
        assert init["verdict"] == "fsdp" and init["state"] == "FSDP", rank
        if kind == "v2":
            assert begin["verdict"] == "fsdp2" and begin["fsdp2_modules"] >= 3, rank  # root + 2 decoder layers
            assert begin["dtensor_params"] > 0 and begin["fsdp1_modules"] == 0
        else:
            assert begin["verdict"] == "fsdp1" and begin["model_class"] == "FullyShardedDataParallel", rank
            assert begin["fsdp1_modules"] >= 3 and begin["dtensor_params"] == 0
        assert begin["checkpoint_wrappers"] == (2 if scenario.split("-")[3] == "1" else 0)


def test_fsdp_trains_what_ddp_trains(results):
    """Real sharding changes nothing in the result: FSDP1/FSDP2, with the Trainer's checkpointing (reentrant or not)
    or FSDP's own, end with the parameters of the DDP run."""
    by = results[1]
    reference = by["ddp-full-off-0-0-none"][0]["checksums"][0]
    for scenario in FULL:
        rank = by[scenario][0]
        assert rank["layer_params_changed"] == rank["layer_params"] == 18, scenario
        assert abs(rank["checksums"][0] - reference) < 1e-6 * abs(reference), scenario


def test_fsdp_activation_checkpointing_with_use_cache(results):
    """transformers 4.57: FSDP's checkpoint_wrapper + use_cache=True fails in the backward (the recompute grows the
    cache); transformers 5 copies `args.use_cache` (False by default) into the model config at the end of
    Trainer.__init__, so only an explicit `use_cache=True` there fails (another error, same cause)."""
    by = results[1]
    if TF5:
        rank = by["v2-full-off-1-2-none"][0]
        assert rank["in_backward"] and rank["seen"]["train_begin"]["checkpoint_wrappers"] == 2, rank
        assert by["v2-full-off-1-1-none"][0]["use_cache"] is False  # the Trainer overwrote the model config
    else:
        for scenario in ("v2-full-off-1-1-none", "v1-full-off-1-1-none"):
            assert by[scenario][0]["in_backward"], by[scenario][0]
    # the plugin's use-cache-off rule covers FSDP's own checkpointing, under real FSDP
    for scenario in ["v2-full-off-1-1-strict", "v1-full-off-1-1-strict"] + (["v2-full-off-1-2-strict"] if TF5 else []):
        rank = by[scenario][0]
        if not TF5 or scenario.endswith("-2-strict"):
            assert ["use-cache-off", "default"] in rank["decisions"], rank
        assert rank["seen"]["train_begin"]["checkpoint_wrappers"] == 2


def test_both_checkpointings_refused_by_transformers_and_explained_by_the_plugin(results):
    by = results[1]
    assert by["v2-full-true-1-0-none"][0]["where"] == "Trainer"  # Trainer.__init__, before any callback
    refused = by["v2-full-true-1-0-installed"][0]
    assert refused["where"] == "TrainingArguments" and "[fsdp-activation-checkpointing]" in refused["outcome"]
    fixed = by["v2-full-true-1-0-installedfix"][0]
    assert fixed["seen"]["train_begin"]["checkpoint_wrappers"] == 2  # FSDP's own kept
    assert fixed["running"] is None  # the Trainer's switched off
    # after the DDP fallback nothing refuses the pair; FSDP's checkpointing is silently not applied
    ddp = by["ddp-full-true-1-0-none"][0]
    assert ddp["seen"]["train_begin"]["checkpoint_wrappers"] == 0 and ddp["running"] is True


def test_reentrant_with_frozen_inputs_under_fsdp(results):
    """FSDP2 keeps the reentrant silent failure of transformers 4 (frozen input embeddings: no layer parameter
    changes); FSDP1 (use_orig_params, the embeddings in the root's flat parameter, which requires grad) makes the
    embedding output require grad and trains every layer, without changing the frozen embeddings."""
    by = results[1]
    fsdp2, fsdp1 = by["v2-frozenemb-true-0-0-none"][0], by["v1-frozenemb-true-0-0-none"][0]
    assert fsdp2["layer_params_changed"] == (18 if TF5 else 0), fsdp2
    assert fsdp2["layer0_input_requires_grad"] is TF5
    assert fsdp1["layer_params_changed"] == 18 and fsdp1["layer0_input_requires_grad"] is True, fsdp1
    assert fsdp1["frozen_changed"] == fsdp2["frozen_changed"] == []
    fixed = by["v2-frozenemb-unset-0-0-strict"][0]
    assert fixed["layer_params_changed"] == 18 and fixed["running"] is False
    if not TF5:
        assert "[frozen-inputs-observed]" in by["v2-frozenemb-true-0-0-strict"][0]["outcome"]
    # the first-forward observation sees FSDP1's inputs require grad: nothing refused, and it trains
    assert by["v1-frozenemb-true-0-0-strict"][0]["layer_params_changed"] == 18


def test_lora_under_fsdp(results):
    """LoRA trains the same under FSDP1/FSDP2 with reentrant (input hook) and non-reentrant checkpointing and with
    FSDP's own checkpointing."""
    by = results[1]
    trained = [s for s in SCENARIOS if s.split("-")[1] in ("lora", "lorahook") and SCENARIOS[s] is None]
    checksums = {by[s][0]["checksums"][0] for s in trained}
    assert max(checksums) - min(checksums) < 1e-6, {s: by[s][0]["checksums"][0] for s in trained}
    assert all(by[s][0]["layer_params_changed"] == by[s][0]["layer_params"] == 8 for s in trained)


def test_fsdp2_activation_checkpointing_replays_dropout_differently(results):
    """accelerate's FSDP2 activation checkpointing wraps each layer in `checkpoint_wrapper(layer,
    preserve_rng_state=False)`: with dropout, the recompute draws other masks than the forward and the gradients
    are not those of the forward. The Trainer's checkpointing and FSDP1's own keep the RNG state: equal."""
    import torch

    out = results[0]

    def load(scenario):
        return torch.load(out / f"{scenario}.pt")

    def max_diff(a, b):
        return max((a[n] - b[n]).abs().max().item() for n in a)

    reference = load("v2-dropout-off-0-0-none")
    assert max_diff(load("v2-dropout-false-0-0-none"), reference) <= 1e-6
    assert max_diff(load("v1-dropout-off-1-0-none"), reference) <= 1e-6
    assert max_diff(load("v2-dropout-off-1-0-none"), reference) > 1e-3
    assert max_diff(load("v2-loradrop-off-1-0-none"), load("v2-loradrop-off-0-0-none")) > 1e-3


def test_fsdp_requested_but_ddp_used(results):
    """Expected: FSDP asked for (`fsdp`, ACCELERATE_USE_FSDP) but accelerate's state is not FSDP (here MULTI_CPU:
    the model is wrapped in DDP) is told to the user, at on_init_end, as a WARNING decision; FSDP's activation
    checkpointing, asked for, is not applied at all."""
    for rank in results[1]["ddp-full-off-1-0-strict"].values():
        rules = {rule: action for rule, action in rank["decisions"]}
        assert any("fsdp" in rule and rule != "fsdp-activation-checkpointing" and action == "warn"
                   for rule, action in rules.items()), rank


def test_ddp_rules_apply_after_the_fallback(results):
    """Expected: when FSDP was asked for but DDP wraps the model, the DDP rules apply: LoRA + reentrant + the
    Trainer's find_unused_parameters=True for a PeftModel is refused before step 1 (today the plugin believes FSDP,
    and DDP crashes in the first backward)."""
    for rank in results[1]["ddp-lorahook-true-0-0-strict"].values():
        assert rank["outcome"].startswith("GCConfigError") and "ddp-reentrant-find-unused" in rank["outcome"], rank


def test_fsdp2_activation_checkpointing_with_dropout(results):
    """Expected: FSDP2's own activation checkpointing (accelerate: preserve_rng_state=False) on a model with
    dropout > 0 is reported (the `preserve-rng-state-with-dropout` rule extended to it): at least a warning naming
    the dropout and the way out (the Trainer's checkpointing, or dropout 0)."""
    for rank in results[1]["v2-dropout-off-1-0-strict"].values():
        assert any(rule == "fsdp2-checkpointing-with-dropout" and action in ("warn", "error", "override")
                   for rule, action in rank["decisions"]), rank


def test_what_a_gradient_audit_can_read(results):
    """Before the first optimizer step, per rank: under FSDP2 every layer parameter that received a gradient has a
    (DTensor) .grad, and none has one when reentrant checkpointing lost them (transformers 4, frozen embeddings), so
    the audit's "no .grad" test works there as it is; under FSDP1 (use_orig_params) a parameter whose flat-parameter
    shard lies on the other rank has no .grad on this one even when it trains, so a per-rank audit would blame
    healthy blocks (it needs an OR across ranks)."""
    by = results[1]
    for rank in by["v2-full-true-0-0-none"].values():
        assert rank["seen"]["grads"]["grad_none"] == 0, rank["seen"]["grads"]
    assert any(rank["seen"]["grads"]["grad_none"] > 0 for rank in by["v1-full-true-0-0-none"].values())
    for rank in by["v2-frozenemb-true-0-0-none"].values():
        grads = rank["seen"]["grads"]
        assert grads["grad_none"] == (0 if TF5 else grads["layer_params"]), grads


@pytest.mark.parametrize("fsdp", ["v2", "v1"])
def test_a_memory_plan_under_fsdp(results, fsdp):
    """FSDP2 shards the parameters (DTensors) and their gradients, FSDP1 its flat parameters and theirs: the plan is
    made with half the gradients on each of the 2 ranks and the parameters gathered while a block or the head computes
    (the estimate falls back to the config: FSDP refuses a deep copy), the same on both ranks, with no warning from the
    first step's check, and the update is that of the same run without the plugin (full checkpointing)."""
    ranks, full = results[1][f"{fsdp}-full-false-0-0-budget"], results[1][f"{fsdp}-full-false-0-0-none"]
    _check(ranks, None)
    plans = [rank["plans"] for rank in ranks.values()]
    assert plans[0] == plans[1] and len(plans[0]) == 1, plans
    ((name, share),) = plans[0]
    assert share == 0.5 and name not in ("none", "full"), plans
    assert all(not rank["warnings"] for rank in ranks.values()), [rank["warnings"] for rank in ranks.values()]
    for rank, other in zip(ranks.values(), full.values(), strict=True):
        assert rank["checksums"][0] == rank["checksums"][1] == other["checksums"][0], (rank["checksums"], other)


@pytest.mark.parametrize("scenario", ["v2-full", "v2-tied", "v1-full", "v2g-deep", "v1g-deep"])
def test_the_plans_gathered_parameters_cover_what_fsdp_holds_whole(results, scenario):
    """What FSDP really holds whole at the start of every module's forward (recomputed ones too), read on each rank
    (`held.watch`: FSDP2's whole parameters are plain tensors, sharded ones DTensors; FSDP1's gathered units have the
    storage of their padded whole flat parameter), against the plan's gathered-parameter term. With tied embeddings,
    accelerate's FSDP2 group of the embeddings, the final norm and the head does not reshard after forward, so it is
    whole through the blocks; FSDP1 never frees its root unit (everything outside the blocks here) after forward; the
    plan counts both (`sharding.fsdp2_layout`, `sharding.fsdp1_layout`). The plan also allows the next block, which FSDP
    prefetches on a GPU; on CPU nothing is prefetched, so the term is what was measured plus one block. With
    `shard_grad_op` (no reshard after forward; 4 layers, so that it differs from two blocks) every unit stays whole
    until its backward: the whole model, measured and planned."""
    ranks = results[1][f"{scenario}-false-0-0-budget"]
    _check(ranks, None)
    for rank in ranks.values():
        held, (predicted,) = rank["seen"]["held"], rank["gathered_predicted"]
        assert not rank["warnings"], rank["warnings"]
        if scenario.endswith("g-deep"):
            assert held["max"] == predicted and len(held["whole"]) >= 4, (held, predicted)
            continue
        assert held["max"] <= predicted == held["max"] + rank["block_bytes"], (held, predicted)
        before_blocks = "root" if scenario == "v1-full" else "model.embed_tokens.weight"
        assert (before_blocks in held["whole"]) == (scenario != "v2-full"), held
    if scenario == "v2-tied":
        for rank, other in zip(ranks.values(), results[1]["v2-tied-false-0-0-none"].values(), strict=True):
            assert rank["checksums"][0] == other["checksums"][0], (rank["checksums"], other["checksums"])


@pytest.mark.parametrize(("scenario", "layout"), [("v1g-deep", "fsdp1-shard-grad-op"), ("v2g-deep", "fsdp2-no-reshard")])
def test_trl_gc_plan_counts_what_shard_grad_op_held(results, tmp_path, capsys, scenario, layout):
    """`trl-gc-plan --sharded-params fsdp1-shard-grad-op / fsdp2-no-reshard`, on the config of the 4-layer model these
    ranks trained, counts as held whole what the run measured on each rank (the whole model), where the fully sharded
    layout counts less."""
    from trl_gc_plugin.cli import plan as plan_cli
    from trl_gc_plugin.testing import make_config

    make_config(num_hidden_layers=4).to_json_file(tmp_path / "config.json")

    def planned(*extra: str) -> int:
        argv = [str(tmp_path), "--batch-size", "2", "--seq-len", "16", "--budget", "1GiB", "--dtype", "fp32", "--json"]
        assert plan_cli.main([*argv, *extra]) == 0
        return json.loads(capsys.readouterr().out)["estimate"]["gathered_bytes"]

    held = {rank["seen"]["held"]["max"] for rank in results[1][f"{scenario}-false-0-0-budget"].values()}
    assert held == {planned("--sharded-params", layout)}, held
    assert planned("--sharded-params", layout.split("-")[0]) < min(held)
    # the accelerate config that launches the same sharding (accelerate 1.15: FSDP1's fsdp_sharding_strategy,
    # FSDP2's fsdp_reshard_after_forward) plans the same
    fsdp_config = (
        "  fsdp_version: 1\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
        if layout.startswith("fsdp1")
        else "  fsdp_version: 2\n  fsdp_reshard_after_forward: false\n"
    )
    (tmp_path / "accelerate.yaml").write_text(f"distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n{fsdp_config}")
    assert held == {planned("--accelerate-config", str(tmp_path / "accelerate.yaml"))}, held


def test_the_first_step_says_when_more_parameters_are_held_whole_than_planned(results):
    """The first training forward also reads what the sharding holds whole (`sharding.watch_held`, one flag per
    parameter at each module with parameters of its own) and says so when it is more than the plan counted: here a
    user's callback unshards every FSDP2 group at train begin, so the first forward starts with the whole model
    gathered (4 layers), where the plan counted two blocks. A warning with both figures on each rank, the plan stands,
    training goes on; the other planned runs above (ZeRO-3, FSDP1, FSDP2 tied, kept and untied) get no warning."""
    for rank in results[1]["v2-deep-false-0-0-unshard"].values():
        assert rank["outcome"] == "trained", rank
        (warning,) = rank["warnings"]
        (predicted,) = rank["gathered_predicted"]
        assert "sharded parameters held whole" in warning, warning
        assert f"({predicted} bytes)" in warning and f"({rank['model_bytes']} bytes) at once" in warning, warning
        assert predicted < rank["model_bytes"], (predicted, rank["model_bytes"])


def test_selective_around_an_fsdp2_unit_inside_the_block(tmp_path):
    """Upstream, selective checkpointing around an FSDP2 unit inside the checkpointed block failed at the first
    backward (torchtitan #3427, with expert parallelism). Here, each decoder layer's MLP a unit of its own: the
    plugin reads the inner units, and selective and lean train with the gradients of full checkpointing, so the
    planner keeps offering them (the memory plan says so, once per run)."""
    scenarios = ["full-flat", "full-inner", "selective-inner", "lean-inner"]
    results = run_scenarios("fsdp2_inner_unit.py", tmp_path, scenarios)
    for scenario in scenarios:
        for rank in (0, 1):
            got = results[scenario][rank]
            assert got["outcome"] == "ok", (scenario, got)
            assert bool(got["inside"]) is scenario.endswith("inner")
    assert results["full-inner"][0]["inside"] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    for scenario, notes in (("full-inner", 1), ("full-flat", 0)):
        got = results[scenario][0]
        assert got["selective_offered"] == [True, True]
        assert len(got["notes"]) == notes and all("model.layers.0.mlp" in n for n in got["notes"])
    sums = {results[s][r]["grad_sum"] for s in scenarios for r in (0, 1)}
    assert len(sums) == 1, sums
