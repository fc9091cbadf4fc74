"""TRL CLI configs: the plugin's model of `TrlParser` and TRL's own parser (run for real in a subprocess) read the
same facts; string booleans, `accelerate_config`, `num_processes`, the trainers' own rewrites; the parse never hangs
on a distributed environment and has a time limit."""

from __future__ import annotations

import json
import os
import time

import pytest
from torchrun import free_port

from trl_gc_plugin.configcheck.check import Launch, check_files
from trl_gc_plugin.configcheck.read.accelerate import trl_bundled  # the same rule as the plugin's model of TRL

CONFIGS = {
    "lora.yaml": "model_name_or_path: Qwen/Qwen2-0.5B\ndataset_name: trl-lib/Capybara\nuse_peft: true\n",
    "string_false.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: 'false'\n",
    "string_yes.yaml": "model_name_or_path: m\ndataset_name: d\nuse_peft: 'yes'\nload_in_4bit: 'TRUE'\n",
    "null_gc.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: null\n",
    "zero_gc.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: 0\n",
    "json_kwargs.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing_kwargs: '{\"use_reentrant\": true}'\n",
    "string_reentrant.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing_kwargs: {use_reentrant: 'false', preserve_rng_state: false}\n",
    "ddp.yaml": "model_name_or_path: m\ndataset_name: d\nuse_peft: true\nddp_find_unused_parameters: 'false'\n",
    "fsdp_prefix.yaml": "model_name_or_path: m\ndataset_name: d\nfsdp: full_shard\nfsdp_config: {fsdp_activation_checkpointing: true}\n",
    "ds_inline.yaml": "model_name_or_path: m\ndataset_name: d\nuse_peft: true\ndeepspeed: {zero_optimization: {stage: 3, overlap_comm: true}}\n",
    "fsdp2.yaml": "model_name_or_path: m\ndataset_name: d\nfsdp: full_shard\nfsdp_config: {version: 2}\n",
    "zero3.yaml": "model_name_or_path: m\ndataset_name: d\nuse_peft: true\nload_in_4bit: true\naccelerate_config: zero3\nnum_processes: 4\n",
    "env.yaml": "model_name_or_path: m\ndataset_name: d\nenv: {SOME_FLAG: 1}\nuse_peft: true\n",
}


def write_all(tmp_path, configs):
    paths = []
    for name, text in configs.items():
        path = tmp_path / name
        path.write_text(text)
        paths.append(str(path))
    return paths


def by_name(reports):
    return {os.path.basename(r.path): r for r in reports}


COMPARED = (
    "gc_enabled",
    "use_reentrant",
    "use_reentrant_source",
    "kwargs_given",
    "is_peft",
    "quantization",
    "zero_stage",
    "fsdp",
    "fsdp_activation_checkpointing",
    "ddp_find_unused_parameters",
    "ddp_static_graph",
    "world_size",
    "trainer_kind",
    "fsdp_version",
    "zero_overlap_comm",
)


@pytest.fixture(scope="module")
def both_parsers(tmp_path_factory):
    """Every config of `CONFIGS` read by the model and by TRL's own parser (one subprocess for all), the latter
    with a distributed environment around the check (RANK, WORLD_SIZE, MASTER_ADDR...): without the clean
    environment of the worker, TrainingArguments would wait for the other ranks forever."""
    tmp_path = tmp_path_factory.mktemp("trl")
    paths = write_all(
        tmp_path,
        {
            **CONFIGS,
            "unknown_key.yaml": "model_name_or_path: m\ndataset_name: d\nwarmup_ratioo: 0.1\n",
            "static_graph.yaml": "model_name_or_path: m\ndataset_name: d\nddp_static_graph: true\n",
        },
    )
    model = by_name(check_files(paths, Launch(parser="model")))
    saved = dict(os.environ)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        start = time.perf_counter()
        launcher = by_name(check_files(paths, Launch(parser="launcher", timeout=300)))
        elapsed = time.perf_counter() - start
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return model, launcher, elapsed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_model_reads_what_trls_parser_reads(both_parsers, name):
    from trl_gc_plugin.core.capabilities import installed_versions

    model, launcher, _ = both_parsers
    a, b = model[name], launcher[name]
    if "deepspeed:" in CONFIGS[name] and installed_versions()["deepspeed"] is None:
        # transformers needs DeepSpeed installed to build arguments that name a DeepSpeed config: TRL's parser
        # cannot run on this machine (with --parser auto the model reads the file, and says why)
        assert b.status == "error" and "TRL's own parser could not run here" in b.error and "deepspeed" in b.error
        return
    assert a.status == b.status == "ok", (a.error, b.error)
    trl_version = installed_versions()["trl"]
    assert "the plugin's model of TRL" in a.parser and f"TRL {trl_version}'s own TrlParser" in b.parser
    compared = [k for k in COMPARED if hasattr(a.facts, k)]  # fields of the installed Facts
    assert {k: getattr(a.facts, k) for k in compared} == {k: getattr(b.facts, k) for k in compared}
    assert not [n for n in b.notes if "TRL's own parser" in n]  # no disagreement to report
    assert [d.to_dict() for d in a.decisions] == [d.to_dict() for d in b.decisions]


def test_trls_parser_finds_keys_accelerate_launch_does_not_know(both_parsers):
    model, launcher, elapsed = both_parsers
    assert elapsed < 300
    report = launcher["unknown_key.yaml"]
    assert report.status == "refused"
    (decision,) = [d for d in report.decisions if d.rule_id == "trl:unknown-key"]
    assert decision.before == ["warmup_ratioo"] and "unrecognized arguments" in decision.reason
    assert model["unknown_key.yaml"].status == "ok"  # the model does not know every field: it cannot tell


def test_ddp_static_graph_is_a_field_only_from_transformers_5(both_parsers):
    from trl_gc_plugin.core.capabilities import installed_versions

    _, launcher, _ = both_parsers
    report = launcher["static_graph.yaml"]
    if int(installed_versions()["transformers"].split(".")[0]) >= 5:
        assert report.status == "ok" and report.facts.ddp_static_graph is True
    else:  # TRL hands the key to accelerate launch, which refuses it
        assert report.status == "refused"
        assert [d.before for d in report.decisions if d.rule_id == "trl:unknown-key"] == [["ddp_static_graph"]]


def test_string_booleans_are_read_as_trl_reads_them(tmp_path):
    reports = by_name(check_files(write_all(tmp_path, CONFIGS), Launch(parser="model")))
    assert reports["string_false.yaml"].facts.gc_enabled is False
    facts = reports["string_yes.yaml"].facts
    assert (facts.is_peft, facts.quantization) == (True, "bitsandbytes_4bit")
    assert reports["null_gc.yaml"].facts.gc_enabled is False and reports["zero_gc.yaml"].facts.gc_enabled is False
    assert reports["ddp.yaml"].facts.ddp_find_unused_parameters is False


@pytest.mark.parametrize("parser", ["model", "auto"])
def test_a_word_trl_does_not_read_as_a_boolean_exits_2(tmp_path, parser):
    (path,) = write_all(tmp_path, {"off.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: 'off'\n"})
    (report,) = check_files([path], Launch(parser=parser))
    assert report.status == "error" and "'off'" in report.error and "Truthy value expected" in report.error


def test_a_long_word_is_quoted_cut_as_every_other_message_quotes_it(tmp_path):
    word = "enabled-" * 40
    (path,) = write_all(tmp_path, {"long.yaml": f"model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: {word}\n"})
    (report,) = check_files([path], Launch(parser="model"))
    assert report.status == "error" and "Truthy value expected" in report.error
    assert word not in report.error and repr(word)[:57] + "..." in report.error


def test_accelerate_config_zero3_and_num_processes(tmp_path):
    (report,) = check_files(write_all(tmp_path, {"z.yaml": CONFIGS["zero3.yaml"]}), Launch(parser="model"))
    facts, sources = report.facts, report.sources
    assert (facts.zero_stage, facts.world_size) == (3, 4)
    assert sources["zero_stage"].origin == "accelerate config" and trl_bundled("zero3") in sources["zero_stage"].detail
    assert sources["world_size"].origin == "file"
    # TRL's trainers force reentrant for PEFT under ZeRO-3: the plugin sees the trainer's value
    assert (facts.use_reentrant, facts.use_reentrant_source) == (True, "trainer")
    assert "trl:peft-zero3-reentrant" in {d.rule_id for d in report.decisions}


def test_zero3_accelerate_config_without_num_processes_takes_its_8_processes(tmp_path):
    (path,) = write_all(tmp_path, {"z.yaml": "model_name_or_path: m\ndataset_name: d\naccelerate_config: zero3\n"})
    (report,) = check_files([path], Launch(parser="model"))
    assert (report.facts.world_size, report.sources["world_size"].origin) == (8, "accelerate config")
    (report,) = check_files([path], Launch(parser="model", nproc=2))
    assert (report.facts.world_size, report.sources["world_size"].origin) == (2, "option")


def test_rl_qlora_zero3_on_old_deepspeed_is_a_conflict_with_the_way_out(tmp_path):
    (path,) = write_all(tmp_path, {"z.yaml": CONFIGS["zero3.yaml"]})
    (report,) = check_files([path], Launch(parser="model", trainer="dpo", versions=(("deepspeed", "0.19.2"),)))
    assert report.status == "refused"
    assert [d.rule_id for d in report.decisions if d.action == "error"] == ["conflict"]
    assert report.change.startswith("upgrade DeepSpeed to >= 0.19.3")


def test_an_accelerate_config_with_fsdp_checkpointing_and_trls_default(tmp_path):
    accelerate = tmp_path / "fsdp_ac.yaml"
    accelerate.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n  fsdp_activation_checkpointing: true\n")
    (path,) = write_all(tmp_path, {"c.yaml": f"model_name_or_path: m\ndataset_name: d\naccelerate_config: {accelerate}\n"})
    (report,) = check_files([path], Launch(parser="model"))
    # TRL's own default turns the Trainer's checkpointing on; transformers refuses it beside FSDP's: the plugin
    # switches the trainer's default off (it would refuse a value set in the file)
    assert report.status == "ok" and report.sources["fsdp_activation_checkpointing"].origin == "accelerate config"
    (decision,) = [d for d in report.decisions if d.rule_id == "fsdp-activation-checkpointing"]
    assert (decision.action, decision.before, decision.after, decision.source) == ("override", True, False, "trainer")
    # set in the file: refused, with the change to make
    (explicit,) = write_all(tmp_path, {"e.yaml": f"model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: true\naccelerate_config: {accelerate}\n"})
    (report,) = check_files([explicit], Launch(parser="model"))
    assert report.status == "refused" and report.change == "set gradient_checkpointing: false"
    # the same accelerate config given as an option, for a file without accelerate_config
    (plain,) = write_all(tmp_path, {"p.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: yes\n"})
    (report,) = check_files([plain], Launch(parser="model", accelerate_config=str(accelerate)))
    assert report.status == "refused" and report.facts.world_size == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("accelerate_config: zero9\n", "'zero9' is neither a file (from the current directory) nor a config TRL ships (fsdp1, fsdp2, multi_gpu"),
        ("env: [1]\n", "key 'env' (line 3): TRL requires a mapping of environment variables"),
        ("deepspeed: 3\n", "key 'deepspeed' (line 3): expected a path to a DeepSpeed JSON file or a mapping"),
        ("deepspeed: {zero_optimization: auto}\n", "key 'zero_optimization': expected a mapping"),
        ("deepspeed: {zero_optimization: {stage: full}}\n", "must be 0, 1, 2 or 3, got 'full'"),  # 'auto' reads as 2
        ("deepspeed: nothere.json\n", "DeepSpeed config 'nothere.json' not found"),
        ("fsdp_config: [1]\n", "key 'fsdp_config' (line 3): expected a mapping"),
        ("gradient_checkpointing_kwargs: '{broken'\n", "not a JSON object"),
        ("num_processes: many\n", "key 'num_processes': expected a whole number"),
    ],
)
def test_wrong_values_exit_2_with_the_key(tmp_path, text, message):
    (path,) = write_all(tmp_path, {"c.yaml": "model_name_or_path: m\ndataset_name: d\n" + text})
    (report,) = check_files([path], Launch(parser="model"))
    assert report.status == "error" and message in report.error, report.error


@pytest.mark.parametrize("content", [b"\x00\x01binary", b'[{"zero_optimization": {"stage": 3}}]'])
def test_deepspeed_file_that_is_not_a_json_object(tmp_path, content):
    ds = tmp_path / "ds.json"
    ds.write_bytes(content)
    (path,) = write_all(tmp_path, {"c.yaml": f"model_name_or_path: m\ndataset_name: d\ndeepspeed: {ds}\n"})
    (report,) = check_files([path], Launch(parser="model"))
    assert report.status == "error" and str(ds) in report.error
    assert "not a UTF-8 text file" in report.error or "must be a JSON object, not a list" in report.error


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("load_in_4bit: true\nload_in_8bit: true\n", "trl:4bit-and-8bit"),
        ("use_deepspeed: true\n", "trl:valueless-launch-flag"),
    ],
)
def test_trls_own_refusals(tmp_path, text, rule):
    (path,) = write_all(tmp_path, {"c.yaml": "model_name_or_path: m\ndataset_name: d\n" + text})
    (report,) = check_files([path], Launch(parser="model"))
    assert report.status == "refused" and rule in {d.rule_id for d in report.decisions if d.action == "error"}
    assert report.change


def test_a_parser_that_runs_out_of_time_falls_back_to_the_model_and_says_so(tmp_path):
    (path,) = write_all(tmp_path, {"lora.yaml": CONFIGS["lora.yaml"]})
    start = time.perf_counter()
    (report,) = check_files([path], Launch(parser="auto", timeout=0.2))
    assert time.perf_counter() - start < 30
    assert report.status == "ok"
    assert "the plugin's model of TRL" in report.parser and "did not finish within 0.2 s" in report.parser
    (report,) = check_files([path], Launch(parser="launcher", timeout=0.2))
    assert report.status == "error" and "did not finish within 0.2 s" in report.error


def test_json_lists_the_trl_parser_used(tmp_path, capsys):
    from trl_gc_plugin.cli.check import check_main

    (path,) = write_all(tmp_path, {"lora.yaml": CONFIGS["lora.yaml"]})
    assert check_main([path, "--parser", "model", "--json"]) == 0
    (item,) = json.loads(capsys.readouterr().out)
    assert item["format"] == "trl" and item["parser"].startswith("the plugin's model of TRL 1.16.0")


def test_a_local_model_directory_gives_the_model_facts(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "attention_dropout": 0.1}))
    text = f"model_name_or_path: {model}\ndataset_name: d\ngradient_checkpointing_kwargs: {{use_reentrant: false, preserve_rng_state: false}}\n"
    (path,) = write_all(tmp_path, {"c.yaml": text})
    (report,) = check_files([path], Launch(parser="model"))
    assert (report.facts.dropout, report.facts.shared_state_layers) == (True, False)
    assert report.sources["dropout"].origin == "model config"
    assert report.status == "refused" and report.change == "set gradient_checkpointing_kwargs: {preserve_rng_state: true}"
    # a Hub id: unknown, and the rule that needs it does not apply
    (hub,) = write_all(tmp_path, {"h.yaml": text.replace(str(model), "Qwen/Qwen2-0.5B")})
    (report,) = check_files([hub], Launch(parser="model"))
    assert report.facts.dropout is None and report.status == "ok"


@pytest.mark.parametrize("parser", ["model", "auto"])
def test_an_explicit_false_is_the_users_choice_not_unset(tmp_path, parser):
    """TRL's configs default checkpointing on: `gradient_checkpointing: false` in the file is the user's (the run says
    the same: `_flag_source` reads the config class's default)."""
    (path,) = write_all(tmp_path, {"off.yaml": "model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: false\n"})
    (report,) = check_files([path], Launch(parser=parser))
    (off,) = [d for d in report.decisions if d.rule_id == "checkpointing-off"]
    assert off.source == "user" and "set by user" in off.line()


def test_the_run_says_the_same_of_an_explicit_false(tmp_path):
    from trainers import make_trainer

    from trl_gc_plugin import SafeGCCallback
    from trl_gc_plugin.testing import make_model

    callback = SafeGCCallback()
    make_trainer("sft", make_model(), str(tmp_path), gc=False, callbacks=[callback])
    (off,) = [d for d in callback.decisions if d.rule_id == "checkpointing-off"]
    assert off.source == "user"
