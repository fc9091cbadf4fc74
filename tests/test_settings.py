"""One settings layer: every input of the plugin parsed and validated the same way on every route (the callback's
arguments, `install()`, the `TRL_GC_PLUGIN_*` variables, the Trainer's checkpointing kwargs). A bad value is one line
naming the setting and what is accepted: refused in strict mode, warned and defaulted otherwise; nothing the user
wrote is replaced silently."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from trainers import block_params, make_trainer, unchanged_block_params

import trl_gc_plugin
from trl_gc_plugin import GCConfigError, SafeGCCallback
from trl_gc_plugin.core.kwargs import unknown_checkpoint_keys
from trl_gc_plugin.core.settings import SETTINGS, GCSettings, markdown_table
from trl_gc_plugin.model import ckpt, probe
from trl_gc_plugin.testing import make_model

ROOT = Path(__file__).resolve().parents[1]

# The documented forms, written out here (not imported), so a change to the parser that the docs do not say fails.
TRUE = {"yes", "true", "t", "y", "1", "on"}
FALSE = {"no", "false", "f", "n", "0", "off"}


def documented_bool(value):
    """What the docs say a boolean setting accepts: (accepted, value)."""
    if isinstance(value, bool):
        return True, value
    if isinstance(value, int) and value in (0, 1):
        return True, bool(value)
    if isinstance(value, str) and value.strip().lower() in TRUE | FALSE:
        return True, value.strip().lower() in TRUE
    return False, None


anything = st.one_of(
    st.booleans(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.sampled_from([*sorted(TRUE | FALSE), "Yes", " TRUE ", "perhaps", "2", "", "none", "40GiB", "auto", "0.5KiB"]),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)

BOOLEAN_SETTINGS = [s.name for s in SETTINGS if s.parse.__name__ == "parse_bool"]


@pytest.mark.parametrize("name", BOOLEAN_SETTINGS)
@hsettings(max_examples=150, deadline=None)
@given(value=anything)
def test_a_boolean_setting_is_accepted_as_documented_or_named_in_one_line(name, value):
    accepted, expected = documented_bool(value)
    for mode in ("strict", "fix", "warn"):
        if accepted:
            assert getattr(GCSettings.resolve({name: value, "mode": mode}, environ={}), name) is expected
        elif mode == "strict":
            with pytest.raises(GCConfigError) as info:
                GCSettings.resolve({name: value, "mode": mode}, environ={})
            message = str(info.value)
            assert "\n" not in message and f"({name}=...)" in message and f"{name} accepts" in message
        else:
            resolved = GCSettings.resolve({name: value, "mode": mode}, environ={})
            default = next(s.default for s in SETTINGS if s.name == name)
            assert getattr(resolved, name) is default  # the documented default, and said:
            (line,) = resolved.problems
            assert f"({name}=...)" in line and "\n" not in line


@hsettings(max_examples=200, deadline=None)
@given(value=anything)
def test_a_memory_budget_is_a_positive_size_or_auto_or_named_in_one_line(value):
    try:
        resolved = GCSettings.resolve({"memory_budget": value, "mode": "warn"}, environ={})
    except GCConfigError:  # pragma: no cover - warn mode never refuses
        pytest.fail("warn mode refused a budget")
    budget = resolved.memory_budget
    if resolved.problems:
        assert budget is None and "memory_budget accepts" in resolved.problems[0]
        with pytest.raises(GCConfigError, match="memory_budget accepts"):
            GCSettings.resolve({"memory_budget": value}, environ={})
        assert not (isinstance(value, int) and not isinstance(value, bool) and value > 0)
    else:
        assert budget == "auto" or (isinstance(budget, int) and budget >= 1)
        assert not isinstance(value, bool | list | dict)
        if isinstance(value, float):
            assert math.isfinite(value) and value > 0


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.env], ids=lambda s: s.env)
@hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=st.text(max_size=10))
def test_an_environment_variable_is_accepted_or_named(setting, value):
    assume(value.strip())
    env = {setting.env: value}
    try:
        parsed = setting.parse(value)
    except ValueError:
        parsed = ValueError
    if parsed is ValueError:
        if setting.name == "mode":  # no mode to judge it by: said, and strict is used
            resolved = GCSettings.resolve({}, environ=env)
            assert resolved.mode == "strict" and resolved.problems[0].startswith(f"{setting.env}: got")
            return
        with pytest.raises(GCConfigError, match=f"{setting.env}: got"):
            GCSettings.resolve({}, environ=env)
        resolved = GCSettings.resolve({"mode": "warn"}, environ=env)
        assert getattr(resolved, setting.name) == setting.default
        assert resolved.problems[0].startswith(f"{setting.env}: got")
    else:
        assert getattr(GCSettings.resolve({"mode": "warn"} if setting.name != "mode" else {}, environ=env),
                       setting.name) == parsed


def test_precedence_argument_then_install_then_environment_then_default():
    env = {"TRL_GC_PLUGIN_AUDIT": "0", "TRL_GC_PLUGIN_BUDGET": "1GiB", "TRL_GC_PLUGIN_MODE": "warn"}
    assert GCSettings.resolve({}, environ={}) == GCSettings()
    from_env = GCSettings.resolve({}, environ=env)
    assert (from_env.audit, from_env.memory_budget, from_env.mode) == (False, 1 << 30, "warn")
    installed = GCSettings.resolve({}, {"mode": "fix", "memory_budget": 2 << 30}, environ=env)
    assert (installed.mode, installed.memory_budget, installed.audit) == ("fix", 2 << 30, False)
    argument = GCSettings.resolve({"mode": "strict", "memory_budget": "3GiB", "audit": "yes"},
                                  {"mode": "fix", "memory_budget": 2 << 30}, environ=env)
    assert (argument.mode, argument.memory_budget, argument.audit) == ("strict", 3 << 30, True)


def test_a_bad_mode_argument_is_refused_whatever_else():
    with pytest.raises(GCConfigError, match=r"SafeGCCallback\(mode=...\): got 'wran'; mode accepts strict, fix or warn"):
        SafeGCCallback(mode="wran")


# --- the callback's and install()'s arguments, as a user writes them ---------------------------------------------


def test_callback_booleans_mean_what_they_say():
    callback = SafeGCCallback(audit="no", parity_check="false", write_json="0")
    assert (callback.audit, callback.parity_check, callback.write_json) == (False, False, False)
    callback = SafeGCCallback(audit="YES", parity_check=1, write_json="on")
    assert (callback.audit, callback.parity_check, callback.write_json) == (True, True, True)


def test_callback_refuses_or_warns_on_a_value_that_spells_no_boolean(plugin_log):
    with pytest.raises(GCConfigError, match=r"SafeGCCallback\(audit=...\): got 'perhaps'; audit accepts True/False"):
        SafeGCCallback(audit="perhaps")
    callback = SafeGCCallback(mode="warn", audit="perhaps")
    assert callback.audit is True
    said = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert any("audit=...): got 'perhaps'" in m and "using the default" in m for m in said)


def test_an_environment_value_is_named(monkeypatch, plugin_log):
    monkeypatch.setenv("TRL_GC_PLUGIN_AUDIT", "perhaps")
    with pytest.raises(GCConfigError, match="TRL_GC_PLUGIN_AUDIT: got 'perhaps'"):
        SafeGCCallback()
    assert SafeGCCallback(mode="fix").audit is True
    assert any("TRL_GC_PLUGIN_AUDIT: got 'perhaps'" in r.getMessage() for r in plugin_log.records)
    monkeypatch.setenv("TRL_GC_PLUGIN_AUDIT", "off")
    assert SafeGCCallback().audit is False


def test_install_validates_with_the_same_layer():
    import transformers.trainer as trainer_module

    with pytest.raises(GCConfigError, match=r"install\(memory_budget=...\): got 'lots'; memory_budget accepts"):
        trl_gc_plugin.install(memory_budget="lots")
    with pytest.raises(GCConfigError, match=r"install\(mode=...\): got 'loud'"):
        trl_gc_plugin.install(mode="loud")
    with pytest.raises(GCConfigError, match=r"install\(callback=...\): got 'maybe'"):
        trl_gc_plugin.install(callback="maybe")
    assert not trl_gc_plugin.is_installed()
    with trl_gc_plugin.installed(callback="no"):  # "no" means no, not a truthy string
        assert not any(getattr(c, "__name__", "") == "AutoSafeGCCallback" for c in trainer_module.DEFAULT_CALLBACKS)


def test_settings_table_in_the_docs_is_the_code():
    assert markdown_table() in (ROOT / "docs" / "settings.md").read_text()


# --- the Trainer's checkpointing kwargs --------------------------------------------------------------------------

NOT_A_DICT = ["use_reentrant=True", ["use_reentrant"]]
PLAIN_ERROR = "must be a mapping|dictionary update sequence"  # transformers 4.x: functools.partial; 5.x: dict()


@pytest.mark.parametrize("kwargs", NOT_A_DICT, ids=["string", "list"])
def test_kwargs_that_are_not_a_dict_crash_the_plain_trainer(kwargs, tmp_path):
    """The failure the rule guards: without the plugin the Trainer stops when it enables checkpointing."""
    with pytest.raises((TypeError, ValueError), match=PLAIN_ERROR):
        make_trainer("trainer", make_model(), str(tmp_path), gc_kwargs=kwargs, max_steps=1).train()


@pytest.mark.parametrize("route", ["callback", "install"])
@pytest.mark.parametrize("kwargs", NOT_A_DICT, ids=["string", "list"])
def test_kwargs_that_are_not_a_dict_are_refused_never_replaced_silently(kwargs, route, tmp_path):
    model = make_model()
    before = block_params(model)
    with pytest.raises(GCConfigError, match=r"checkpointing-kwargs-not-a-dict.*not a dict"):
        if route == "install":
            with trl_gc_plugin.installed():
                make_trainer("trainer", model, str(tmp_path), gc_kwargs=kwargs, max_steps=1).train()
        else:
            make_trainer("trainer", model, str(tmp_path), gc_kwargs=kwargs, callbacks=[SafeGCCallback()],
                         max_steps=1).train()
    assert unchanged_block_params(model, before) == list(before)  # refused before any update


def test_fix_mode_replaces_a_non_dict_loudly_and_warn_mode_leaves_it(tmp_path, plugin_log):
    trainer = make_trainer("trainer", make_model(), str(tmp_path / "fix"), gc_kwargs="use_reentrant=True",
                           callbacks=[SafeGCCallback(mode="fix")], max_steps=1)
    trainer.train()
    assert probe.read_kwargs(trainer.args) == {"use_reentrant": False}
    said = [r.getMessage() for r in plugin_log.records if r.levelno >= logging.WARNING]
    assert any("[checkpointing-kwargs-not-a-dict] override" in m and "not a dict" in m for m in said)
    with pytest.raises((TypeError, ValueError), match=PLAIN_ERROR):  # warn mode changes nothing: the Trainer's own error
        make_trainer("trainer", make_model(), str(tmp_path / "warn"), gc_kwargs="use_reentrant=True",
                     callbacks=[SafeGCCallback(mode="warn")], max_steps=1).train()


def test_an_unknown_key_is_silently_ignored_without_the_plugin_and_named_with_it(tmp_path, plugin_log):
    kwargs = {"use_reentrant": False, "preserve_rng_stat": False}  # a typo of preserve_rng_state
    trainer = make_trainer("trainer", make_model(), str(tmp_path / "plain"), gc_kwargs=kwargs, max_steps=1)
    trainer.train()  # trains; nothing says the setting did nothing
    funcs = [f for _, f in ckpt.functions(trainer.model)]
    assert funcs and all("preserve_rng_state" not in getattr(f, "keywords", {}) for f in funcs)

    callback = SafeGCCallback()
    make_trainer("trainer", make_model(), str(tmp_path / "plugin"), gc_kwargs=kwargs, callbacks=[callback],
                 max_steps=1).train()
    (decision,) = {d.rule_id: d for d in callback.decisions if d.rule_id == "checkpointing-kwargs-unknown"}.values()
    assert decision.level == "warning" and "preserve_rng_stat (did you mean preserve_rng_state?)" in decision.reason


def test_an_unknown_key_with_reentrant_crashes_the_first_forward_refused_or_removed_with_the_plugin(tmp_path):
    """Rule `checkpointing-kwargs-unknown-reentrant`: without the plugin torch's reentrant checkpoint raises at the
    first forward; strict refuses when the Trainer is built (nothing trained), naming the key; fix removes it,
    loudly, and the run trains reentrant as set; warn leaves the crash."""
    kwargs = {"use_reentrant": True, "preserve_rng": False}  # a typo of preserve_rng_state
    with pytest.raises(ValueError, match="Unexpected keyword arguments"):
        make_trainer("trainer", make_model(), str(tmp_path / "plain"), gc_kwargs=kwargs, max_steps=1).train()
    with pytest.raises(GCConfigError, match=r"checkpointing-kwargs-unknown-reentrant.*preserve_rng \(did you mean"):
        make_trainer("trainer", make_model(), str(tmp_path / "strict"), gc_kwargs=kwargs,
                     callbacks=[SafeGCCallback()], max_steps=1)
    callback = SafeGCCallback(mode="fix")
    trainer = make_trainer("trainer", make_model(), str(tmp_path / "fix"), gc_kwargs=kwargs, callbacks=[callback],
                           max_steps=1)
    trainer.train()
    assert probe.read_kwargs(trainer.args) == {"use_reentrant": True}
    assert all(getattr(f, "keywords", {}).get("use_reentrant") is True and "preserve_rng" not in f.keywords
               for _, f in ckpt.functions(trainer.model))
    assert any(d.rule_id == "checkpointing-kwargs-unknown-reentrant" and d.action == "override"
               for d in callback.decisions)
    with pytest.raises(ValueError, match="Unexpected keyword arguments"):
        make_trainer("trainer", make_model(), str(tmp_path / "warn"), gc_kwargs=kwargs,
                     callbacks=[SafeGCCallback(mode="warn")], max_steps=1).train()


def test_known_keys_are_read_from_the_installed_torch():
    import inspect

    from torch.utils.checkpoint import checkpoint

    named = [p.name for p in inspect.signature(checkpoint).parameters.values() if p.kind is p.KEYWORD_ONLY]
    assert named and unknown_checkpoint_keys(named) == ()
    assert unknown_checkpoint_keys(["every_n_layers", "offload", "preserve_rng_state", "selective"]) == ()
    assert unknown_checkpoint_keys(["use_reentrent", "zzz"]) == ("use_reentrent (did you mean use_reentrant?)", "zzz")


kwargs_values = st.one_of(
    st.none(),
    st.text(max_size=10),
    st.lists(st.text(max_size=4), max_size=2),
    st.integers(),
    st.dictionaries(st.sampled_from(["use_reentrant", "use_reentrent", "debug", "bogus", "preserve_rng_state"]),
                    st.one_of(st.booleans(), st.integers(0, 2), st.text(max_size=5)), max_size=3),
)


@hsettings(max_examples=80, deadline=None)
@given(value=kwargs_values, mode=st.sampled_from(["strict", "fix", "warn"]))
def test_any_kwargs_value_is_refused_replaced_loudly_or_left_never_silently_replaced(value, mode):
    """On real arguments, through the post-init patch: strict refuses a non-dict in one clear message, fix replaces
    it (with an OVERRIDDEN decision), warn leaves what the user wrote; never another exception."""
    from transformers import TrainingArguments

    def build():
        return TrainingArguments(output_dir="unused", gradient_checkpointing=True,
                                 gradient_checkpointing_kwargs=value, report_to=[])

    try:
        plain = getattr(build(), probe.OLD_KWARGS)
    except Exception:
        assume(False)  # transformers itself refuses it: nothing for the plugin to say
    not_a_dict = plain is not None and not isinstance(plain, dict)
    with trl_gc_plugin.installed(mode=mode, callback=False):
        try:
            args = build()
        except GCConfigError as exc:
            assert mode == "strict"
            lines = str(exc).splitlines()
            assert lines[0].startswith("trl_gc_plugin refused") and all(
                line.startswith(("- [", "  Change:", "  Evidence:", "To let")) for line in lines[1:])
            return
    assert not (not_a_dict and mode == "strict"), "a non-dict was not refused in strict mode"
    now = getattr(args, probe.kwargs_field(args))
    if not_a_dict and mode == "fix":
        assert isinstance(now, dict)
        assert any(d.rule_id == "checkpointing-kwargs-not-a-dict" and d.action == "override"
                   for d in probe.get_record(args).decisions)
    if not_a_dict and mode == "warn":
        assert now == plain


def test_the_check_reports_an_unknown_key_with_the_same_rule_and_message(tmp_path):
    """trl-gc-check reads the kwargs of a TRL config through the same layer: the same decision as the run."""
    from trl_gc_plugin.configcheck.check import Launch, check_files

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: true\n"
                    "gradient_checkpointing_kwargs:\n  use_reentrant: false\n  use_reentrent: true\n")
    (report,) = check_files([str(path)], Launch(parser="model"))
    (decision,) = [d for d in report.decisions if d.rule_id == "checkpointing-kwargs-unknown"]
    assert "use_reentrent (did you mean use_reentrant?)" in decision.reason
    assert report.facts.kwargs_unknown == ("use_reentrent (did you mean use_reentrant?)",)


def test_the_check_takes_its_mode_as_the_run_does(tmp_path, monkeypatch, capsys):
    """`trl-gc-check` without --mode decides for the mode the run will have ($TRL_GC_PLUGIN_MODE), read by the same
    layer: a setup strict refuses passes the check under TRL_GC_PLUGIN_MODE=warn, as the run would."""
    from trl_gc_plugin.cli.check import check_main as main

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: m\ndataset_name: d\ngradient_checkpointing: true\n"
                    "gradient_checkpointing_kwargs:\n  use_reentrant: maybe\n")
    assert main([str(path)]) == 1  # strict: a use_reentrant that spells no boolean is refused
    monkeypatch.setenv("TRL_GC_PLUGIN_MODE", "warn")
    assert main([str(path)]) == 0
    monkeypatch.setenv("TRL_GC_PLUGIN_MODE", "wran")
    assert main([str(path)]) == 1 and "TRL_GC_PLUGIN_MODE: got 'wran'; mode accepts" in capsys.readouterr().err
    assert main([str(path), "--mode", "loud"]) == 2


@pytest.mark.parametrize("value", ["yes", 1, "False"])
def test_a_non_bool_use_reentrant_gets_one_behaviour_on_every_route(value, tmp_path):
    """The callback and install() used to differ (one warned, one trained silently): the same decision on both."""
    seen = {}
    for route in ("callback", "install"):
        callback = SafeGCCallback()
        if route == "install":
            with trl_gc_plugin.installed():
                trainer = make_trainer("trainer", make_model(), str(tmp_path / route), gc_kwargs={"use_reentrant": value},
                                       callbacks=[callback], max_steps=1)
                trainer.train()
        else:
            trainer = make_trainer("trainer", make_model(), str(tmp_path / route), gc_kwargs={"use_reentrant": value},
                                   callbacks=[callback], max_steps=1)
            trainer.train()
        (decision,) = {d.rule_id: d for d in callback.decisions if d.rule_id == "invalid-use-reentrant"}.values()
        seen[route] = (decision.action, decision.level, decision.after, probe.read_kwargs(trainer.args))
    assert seen["callback"] == seen["install"]
    assert seen["callback"][:2] == ("repair", "warning")


def test_the_callback_named_as_an_axolotl_plugin_says_which_line_to_write():
    """Axolotl's PluginManager calls `register(cfg)` on what `plugins:` names; without it the user got a bare
    AttributeError."""
    with pytest.raises(GCConfigError, match=r"plugins: \[trl_gc_plugin.integrations.axolotl.SafeGCPlugin\]"):
        SafeGCCallback().register({})


def test_the_startup_route_reads_its_mode_through_the_settings_layer(monkeypatch, plugin_log):
    """`TRL_GC_PLUGIN=1` patches the arguments class before any argument exists (no mode given): the mode is
    `$TRL_GC_PLUGIN_MODE` read by the settings layer, as every other route reads it; a bad value is said in its words
    and `strict` used; by the main process only (a rank other than 0 says nothing)."""
    from trl_gc_plugin.routes import post_init as patching

    class Args:
        def __post_init__(self) -> None:
            pass

    original = Args.__dict__["__post_init__"]
    for value, mode in (("WARN", "warn"), ("bogus-at-startup", "strict"), ("", "strict")):
        monkeypatch.setenv("TRL_GC_PLUGIN_MODE", value)
        try:
            patching.patch_training_args(Args)
            assert GCSettings.resolve({}, say=False).mode == mode, value  # what a run of this route uses
        finally:
            patching.uninstall()
        assert Args.__dict__["__post_init__"] is original
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TRL_GC_PLUGIN_MODE", "bogus-on-rank-1")
    try:
        patching.patch_training_args(Args)
        assert GCSettings.resolve({}, say=False).mode == "strict"
    finally:
        patching.uninstall()
    said = [r.getMessage() for r in plugin_log.records if r.levelno == logging.WARNING]
    assert said == ["TRL_GC_PLUGIN_MODE: got 'bogus-at-startup'; mode accepts strict, fix or warn (any case); using the "
                    "default."], said
