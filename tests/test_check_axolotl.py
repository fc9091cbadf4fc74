"""Axolotl configs: the plugin's model of Axolotl main@067b021c (its defaults, rewrites and validators; Axolotl
itself needs Python >= 3.12 and cannot be imported here). Each test names the Axolotl behaviour it pins down; the
source lines are cited in `trl_gc_plugin/configcheck/launchers/axolotl.py`."""

from __future__ import annotations

import json

import pytest

from trl_gc_plugin.configcheck.check import Launch, check_files

pytestmark = pytest.mark.line_independent

BASE = "base_model: NousResearch/Llama-3.2-1B\nmicro_batch_size: 1\n"


def check(tmp_path, text, name="cfg.yml", **launch):
    path = tmp_path / name
    path.write_text(BASE + text)
    (report,) = check_files([str(path)], Launch(parser="model", **launch))
    return report


def errors(report):
    return {d.rule_id for d in report.decisions if d.action == "error"}


def rules(report):
    return {d.rule_id for d in report.decisions}


# --- normalize_config: use_reentrant True when nothing else sets it ------------------------------------------------


def test_sft_with_checkpointing_and_nothing_else_gets_reentrant_from_axolotl(tmp_path):
    report = check(tmp_path, "adapter: lora\ngradient_checkpointing: true\n")
    assert (report.facts.use_reentrant, report.facts.use_reentrant_source) == (True, "unknown")
    assert report.sources["use_reentrant"].origin == "launcher rewrite" and "normalize_config" in report.sources["use_reentrant"].detail
    assert "axolotl:sft-defaults-reentrant" in rules(report)
    (engine,) = [d for d in report.decisions if d.rule_id == "non-reentrant-default"]
    assert (engine.action, engine.source) == ("warn", "launcher (axolotl)")  # kept, with the reason


@pytest.mark.parametrize(
    ("text", "value", "detail"),
    [
        ("unfrozen_parameters: ['^lm_head.weight$']\n", False, "builder passes {use_reentrant: false}"),
        ("unfrozen_parameters: []\n", False, "builder passes"),  # `is None` in normalize_config: [] stops it too
        ("rl: dpo\nadapter: lora\n", False, "builder passes"),
        ("gradient_checkpointing_kwargs: {}\n", None, "has no use_reentrant"),
        ("gradient_checkpointing_kwargs: {use_reentrant: false}\n", False, "key 'gradient_checkpointing_kwargs.use_reentrant'"),
    ],
)
def test_what_stops_axolotls_reentrant_default(tmp_path, text, value, detail):
    report = check(tmp_path, "gradient_checkpointing: true\n" + text)
    assert report.facts.use_reentrant is value
    assert detail in report.sources["use_reentrant"].detail or (value is None and report.facts.kwargs_given)
    assert "axolotl:sft-defaults-reentrant" not in rules(report)


def test_checkpointing_is_off_by_default(tmp_path):
    report = check(tmp_path, "adapter: lora\n")
    assert report.facts.gc_enabled is False and report.status == "ok"


# --- DDP: the SFT builder passes ddp_find_unused_parameters=False, the RL builder nothing ---------------------------


def test_sft_lora_with_axolotls_reentrant_under_ddp_is_fine(tmp_path):
    report = check(tmp_path, "adapter: lora\ngradient_checkpointing: true\n", nproc=8)
    assert report.status == "ok"
    assert report.facts.ddp_find_unused_parameters is False and report.sources["ddp_find_unused_parameters"].origin == "launcher rewrite"


def test_sft_lora_reentrant_with_find_unused_true_in_the_file_is_refused(tmp_path):
    report = check(tmp_path, "adapter: lora\ngradient_checkpointing: true\nddp_find_unused_parameters: true\n", nproc=8)
    assert errors(report) == {"ddp-reentrant-find-unused"}
    assert report.change == "set gradient_checkpointing_kwargs: {use_reentrant: false}"


def test_rl_lora_reentrant_under_ddp_is_refused_and_find_unused_in_the_file_does_not_help(tmp_path):
    text = "rl: dpo\nadapter: lora\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\nddp_find_unused_parameters: false\n"
    report = check(tmp_path, text, nproc=8)
    assert report.facts.ddp_find_unused_parameters is None  # the RL builder does not pass it: a PeftModel finds unused
    assert errors(report) == {"ddp-reentrant-find-unused"}
    assert "axolotl:rl-ignores-ddp-find-unused" in rules(report)


def test_ebft_strided_flex_forces_reentrant_and_the_change_is_the_launch(tmp_path):
    report = check(tmp_path, "rl: ebft\nebft: {mode: strided}\nattn_implementation: flex_attention\nadapter: lora\ngradient_checkpointing: true\n", nproc=8)
    assert report.facts.use_reentrant is True and "EBFT strided + flex_attention" in report.sources["use_reentrant"].detail
    assert errors(report) == {"ddp-reentrant-find-unused"}
    assert "launch with DeepSpeed or FSDP instead of plain DDP" in report.change
    # with DeepSpeed there is no DDP: fine
    report = check(tmp_path, "rl: ebft\nebft: {mode: strided}\nattn_implementation: flex_attention\nadapter: lora\ngradient_checkpointing: true\ndeepspeed: deepspeed_configs/zero2.json\n", nproc=8)
    assert report.status == "ok" and report.facts.zero_stage == 2


# --- Axolotl's own refusals -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "rule", "nproc"),
    [
        ("unfrozen_parameters: ['^model.layers.2.*']\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\n", "axolotl:unfrozen-needs-non-reentrant", 1),
        ("rl: kto\nadapter: qlora\nload_in_4bit: true\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\n", "axolotl:distributed-rl-qlora-reentrant", 2),
        ("deepspeed: deepspeed_configs/zero3.json\nfsdp: [full_shard]\n", "axolotl:fsdp-and-deepspeed", 1),
        ("load_in_4bit: true\n", "axolotl:quantized-needs-adapter", 1),
        ("adapter: dora-plus\n", "axolotl:unknown-adapter", 1),
        ("adapter: qlora\n", "axolotl:qlora-needs-4bit", 1),
        ("adapter: qlora\nload_in_4bit: true\nload_in_8bit: true\n", "axolotl:qlora-needs-4bit", 1),
        ("activation_offloading: true\n", "axolotl:offloading-needs-gc", 1),
        ("selective_checkpointing: true\n", "axolotl:selective-needs-gc", 1),
        ("selective_checkpointing: true\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\n", "axolotl:selective-needs-non-reentrant", 1),
        ("selective_checkpointing: true\ngradient_checkpointing: true\nactivation_offloading: legacy\n", "axolotl:selective-with-offloading", 1),
        ("selective_checkpointing: {save: ['aten::mm']}\ngradient_checkpointing: true\nadapter: lora\n", "axolotl:selective-saves-matmul-with-adapter", 1),
        ("activation_offloading: hidden_states\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: true}\nunfrozen_parameters: ['^lm_head']\n", "axolotl:hidden-states-reentrant-unfrozen", 1),
        ("rl: ebft\nebft: {mode: strided}\nattn_implementation: flex_attention\ngradient_checkpointing: true\nactivation_offloading: true\n", "axolotl:ebft-offloading-flex", 1),
        ("gradient_checkpointing: true\n", None, 1),
    ],
)
def test_axolotls_validators(tmp_path, text, rule, nproc):
    report = check(tmp_path, text, nproc=nproc)
    if rule is None:
        assert not any(":" in r for r in errors(report))
    else:
        assert rule in errors(report), report.decisions
        assert report.change  # the one change to make


def test_model_name_validators(tmp_path):
    path = tmp_path / "mpt.yml"
    path.write_text("base_model: mosaicml/mpt-7b\ngradient_checkpointing: true\nsequence_len: 2048\n")
    (report,) = check_files([str(path)], Launch(parser="model"))
    assert "axolotl:mpt-checkpointing" in errors(report) and report.change == "gradient_checkpointing: false"
    path.write_text("base_model: nvidia/Nemotron-H-8B\ngradient_checkpointing: true\nsequence_len: 2048\n")
    (report,) = check_files([str(path)], Launch(parser="model"))
    assert "axolotl:nemotron-h-needs-packing" in errors(report)


def test_a_plugin_may_register_an_adapter(tmp_path):
    assert "axolotl:unknown-adapter" not in errors(check(tmp_path, "adapter: dora-plus\nplugins: [my.plugin.Adapter]\n"))


# --- spellings of checkpointing -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "on"),
    [("true", True), ("'false'", False), ("'no'", False), ("'off'", False), ("0", False), ("'Y'", True), ("null", False)],
)
def test_gradient_checkpointing_booleans_are_read_as_pydantic_reads_them(tmp_path, value, on):
    assert check(tmp_path, f"gradient_checkpointing: {value}\n").facts.gc_enabled is on


@pytest.mark.parametrize("value", ["unsloth", "Offload", "''", "2", "[true]", "' true'"])
def test_gradient_checkpointing_values_axolotl_refuses_exit_2(tmp_path, value):
    report = check(tmp_path, f"gradient_checkpointing: {value}\n")
    assert report.status == "error" and "key 'gradient_checkpointing' (line 3)" in report.error
    assert "Axolotl's schema takes true, false, offload or offload_disk" in report.error


def test_offload_is_activation_offloading_and_a_full_fine_tune_runs_non_reentrant(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: offload\n")
    facts = report.facts
    assert (facts.gc_enabled, report.sources["activation_offloading"].value, facts.use_reentrant) == (True, True, False)
    assert facts.offload is False  # Axolotl's offloading, not transformers' `offload` kwarg
    assert "offload -> true + activation_offloading: true" in report.sources["gc_enabled"].detail
    assert "checkpoint_wrapper" in report.sources["use_reentrant"].detail


def test_offload_disk_with_an_adapter_keeps_the_load_time_kwargs(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: offload_disk\nadapter: lora\n")
    assert (report.sources["activation_offloading"].value, report.facts.use_reentrant) == ("disk", True)  # normalize_config's True


def test_legacy_offloading_with_an_adapter_is_reentrant_style(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\nactivation_offloading: legacy\nadapter: lora\ngradient_checkpointing_kwargs: {use_reentrant: false}\n")
    assert report.facts.use_reentrant is True and "reentrant-style" in report.sources["use_reentrant"].detail


def test_hidden_states_offloading_defaults_to_non_reentrant(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\nactivation_offloading: hidden_states\n")
    assert (report.facts.use_reentrant, report.sources["activation_offloading"].value) == (False, "hidden_states")
    assert "hidden_states defaults use_reentrant to false" in report.sources["use_reentrant"].detail


def test_selective_checkpointing_runs_non_reentrant(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\nselective_checkpointing: true\n")
    assert (report.facts.use_reentrant, report.facts.selective) == (False, True)
    assert report.status == "ok"


def test_deprecated_fsdp_prefix_is_understood(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\nfsdp_config:\n  fsdp_version: 2\n  fsdp_activation_checkpointing: true\n", nproc=2)
    assert (report.facts.fsdp, report.facts.fsdp_activation_checkpointing) == (True, True)
    assert errors(report) == {"fsdp-activation-checkpointing"}
    assert "axolotl:fsdp-checkpointing-and-gc" in rules(report)  # Axolotl has no validator for the pair: said
    assert report.change == "set gradient_checkpointing: false"


def test_a_string_use_reentrant_is_repaired_and_axolotls_blind_spot_said(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: 'false'}\nunfrozen_parameters: ['^lm_head']\n")
    assert report.facts.use_reentrant == "false"
    assert {"invalid-use-reentrant", "axolotl:string-use-reentrant"} <= rules(report)
    assert report.status == "ok"


# --- DeepSpeed --------------------------------------------------------------------------------------------------


def test_bundled_deepspeed_names_are_known_and_the_qlora_zero3_warning_follows_the_path(tmp_path):
    text = "adapter: qlora\nload_in_4bit: true\ngradient_checkpointing: true\ngradient_checkpointing_kwargs: {use_reentrant: false}\n"
    report = check(tmp_path, text + "deepspeed: deepspeed_configs/zero3_bf16.json\n", nproc=2)
    assert report.facts.zero_stage == 3 and report.sources["zero_stage"].origin == "launcher default"
    assert "axolotl:qlora-zero3-warning" in rules(report)
    # a stage-3 file whose name lacks "zero3": Axolotl does not warn, the plugin still reads stage 3
    ds = tmp_path / "ds_stage3.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "activation_checkpointing": {"partition_activations": True}}))
    report = check(tmp_path, text + f"deepspeed: {ds}\n", nproc=2, versions=(("deepspeed", "0.19.2"),))
    assert "axolotl:qlora-zero3-warning" not in rules(report)
    assert report.facts.zero_stage == 3 and report.facts.deepspeed_activation_checkpointing is True
    assert errors(report) == {"zero3-frozen-needs-reentrant"}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x00\x01", "not a UTF-8 text file"),
        (b"[1, 2]", "must be a JSON object, not a list"),
        (b'{"zero_optimization": "auto"}', "key 'zero_optimization': expected a mapping"),
        (b'{"zero_optimization": {"stage": 5}}', "must be 0, 1, 2 or 3, got 5"),
        (b'{"activation_checkpointing": true}', "key 'activation_checkpointing': expected a mapping"),
        (b"{not json", "line 1, column 2"),
    ],
)
def test_a_broken_deepspeed_file_exits_2(tmp_path, content, message):
    ds = tmp_path / "ds.json"
    ds.write_bytes(content)
    report = check(tmp_path, f"deepspeed: {ds}\n")
    assert report.status == "error" and message in report.error and str(ds) in report.error


def test_a_missing_deepspeed_file_that_axolotl_does_not_ship_exits_2(tmp_path):
    report = check(tmp_path, "deepspeed: configs/my_zero3.json\n")
    assert report.status == "error" and "DeepSpeed config 'configs/my_zero3.json' not found" in report.error


# --- Gemma 4, types -----------------------------------------------------------------------------------------------


def test_gemma4_from_a_local_model_config(tmp_path):
    model = tmp_path / "gemma"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "gemma4", "text_config": {"model_type": "gemma4_text", "num_kv_shared_layers": 18, "attention_dropout": 0.0}}))
    path = tmp_path / "g.yml"
    path.write_text(f"base_model: {model}\nadapter: lora\ngradient_checkpointing: true\nsequence_len: 1024\n")
    (report,) = check_files([str(path)], Launch(parser="model", nproc=2))
    assert report.facts.use_reentrant is False and "Gemma 4" in report.sources["use_reentrant"].detail
    assert report.facts.ddp_find_unused_parameters is True
    assert (report.facts.shared_state_layers, report.facts.dropout) == (True, False)  # read from the model's config
    assert report.sources["shared_state_layers"].origin == "model config"
    # a Hub id: assumed from the name, and said
    path.write_text("base_model: google/gemma-4-26B-A4B\nadapter: lora\ngradient_checkpointing: true\nddp_find_unused_parameters: true\nsequence_len: 1024\n")
    (report,) = check_files([str(path)], Launch(parser="model", nproc=8))
    assert report.facts.use_reentrant is False and report.status == "ok"  # non-reentrant: find_unused is harmless
    assert any("assumed to be Gemma 4 from its name" in note for note in report.notes)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rl: 5\n", "key 'rl' (line 3): not one of Axolotl's RL types"),
        ("rl: DPO\n", "not one of Axolotl's RL types"),
        ("unfrozen_parameters: lm_head\n", "key 'unfrozen_parameters' (line 3)"),
        ("gradient_checkpointing_kwargs: [1]\n", "key 'gradient_checkpointing_kwargs' (line 3): expected a mapping"),
        ("activation_offloading: sometimes\n", "key 'activation_offloading'"),
        ("selective_checkpointing: {save: attention}\n", "selective_checkpointing.save"),
        ("load_in_4bit: maybe\n", "key 'load_in_4bit' (line 3): Axolotl's schema takes true or false"),
        ("fsdp: full_shard\n", "key 'fsdp' (line 3)"),
        ("fsdp_config: {activation_checkpointing: sometimes}\n", "fsdp_config.activation_checkpointing"),
        ("deepspeed: true\n", "key 'deepspeed' (line 3): Axolotl's schema takes a path or a mapping"),
        ("ebft: strided\n", "key 'ebft' (line 3): expected a mapping"),
        ("fsdp_version: two\n", "key 'fsdp_version'"),
    ],
)
def test_wrong_types_exit_2_with_the_key(tmp_path, text, message):
    report = check(tmp_path, text)
    assert report.status == "error" and message in report.error, report.error


def test_base_model_is_required(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("adapter: lora\nsequence_len: 1024\n")
    (report,) = check_files([str(path)], Launch(parser="model"))
    assert report.status == "error" and "Axolotl requires base_model" in report.error


def test_trainer_option_is_ignored_and_said(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\n", trainer="grpo")
    assert report.facts.trainer_kind == "sft" and any("--trainer grpo is ignored" in n for n in report.notes)


# --- the plugins: line ------------------------------------------------------------------------------------------


def test_the_callback_on_the_plugins_line_is_refused_with_the_line_to_write(tmp_path):
    report = check(tmp_path, "gradient_checkpointing: true\nplugins:\n  - trl_gc_plugin.SafeGCCallback\n")
    assert "axolotl:plugin-is-a-callback" in errors(report)
    assert report.change == "plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]"


@pytest.mark.parametrize("entry", ["trl_gc_plugin.integration.axolotl.SafeGCPlugin", "trl_gc_plugin.SafeGCPlugin"])
def test_a_misspelled_plugin_line_is_a_warning(tmp_path, entry):
    report = check(tmp_path, f"gradient_checkpointing: true\nplugins:\n  - {entry}\n")
    (found,) = [d for d in report.decisions if d.rule_id == "axolotl:plugin-not-found"]
    assert found.action == "warn" and not errors(report)


def test_the_plugin_line_itself_is_fine(tmp_path):
    from trl_gc_plugin.configcheck.launchers.axolotl import PLUGIN

    report = check(tmp_path, f"gradient_checkpointing: true\nplugins:\n  - {PLUGIN}\n  - axolotl.integrations.liger.LigerPlugin\n")
    assert not {r for r in rules(report) if "plugin" in r}
    assert PLUGIN == "trl_gc_plugin.integrations.axolotl.SafeGCPlugin"  # the module's PLUGIN_LINE (its own test)


def test_parser_launcher_says_truthfully_why_axolotls_own_validation_is_not_run(tmp_path):
    """Before, it said Axolotl "is not importable here" in environments where it is: the reason is the config's own
    code (plugins, dataset modules) that Axolotl's validation imports."""
    from trl_gc_plugin.configcheck.check import Launch, check_files

    path = tmp_path / "cfg.yml"
    path.write_text("base_model: m\nplugins:\n  - my_company.plugin.Thing\ngradient_checkpointing: true\n")
    (report,) = check_files([str(path)], Launch(parser="launcher"))
    assert report.status == "error"
    assert "imports what the config names" in report.error and "not importable" not in report.error
