"""Capabilities, not version numbers: every rule that used a transformers version gate, for the releases around each
capability (5.15 / 5.16 / 5.17 / 5.22 / 5.23, a newer one), at the engine and through `trl-gc-check
--transformers-version`; and the capabilities detected in the installed environment against the table read from the
released wheels (`trl_gc_plugin/capabilities.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from trl_gc_plugin import Facts, decide
from trl_gc_plugin.core import capabilities
from trl_gc_plugin.core.capabilities import Capabilities, for_versions
from trl_gc_plugin.core.engine import applicable, capabilities_apply, errors
from trl_gc_plugin.core.rules import RULES, get_rule

RELEASES = ("4.53.2", "4.57.6", "5.15.0", "5.16.0", "5.17.0", "5.22.0", "5.23.0", "5.24.0", "5.40.0")

# What each release can do, as read in its wheel (5.40.0: newer than every tested release -> the newest).
EXPECTED = {
    "4.53.2": dict(every_n_layers=False, offload=False, activation_fields=False, none_kwargs_reentrant=True),
    "4.57.6": dict(every_n_layers=False, offload=False, activation_fields=False, none_kwargs_reentrant=True),
    "5.15.0": dict(every_n_layers=False, offload=False, activation_fields=False, none_kwargs_reentrant=False),
    "5.16.0": dict(every_n_layers=True, offload=False, activation_fields=False, none_kwargs_reentrant=False),
    "5.17.0": dict(every_n_layers=True, offload=True, activation_fields=False, none_kwargs_reentrant=False),
    "5.22.0": dict(every_n_layers=True, offload=True, activation_fields=False, none_kwargs_reentrant=False),
    "5.23.0": dict(every_n_layers=True, offload=True, activation_fields=True, none_kwargs_reentrant=False),
    "5.24.0": dict(every_n_layers=True, offload=True, activation_fields=True, none_kwargs_reentrant=False),
    "5.40.0": dict(every_n_layers=True, offload=True, activation_fields=True, none_kwargs_reentrant=False),
}


def facts(tf: str, **kw) -> Facts:
    kw.setdefault("gc_enabled", True)
    return Facts(versions={"transformers": tf, "torch": "2.13.0", **kw.pop("extra", {})}, **kw)


@pytest.mark.parametrize("tf", RELEASES)
def test_the_version_table(tf):
    caps = for_versions({"transformers": tf})
    assert {k: getattr(caps, k) for k in EXPECTED[tf]} == EXPECTED[tf]
    assert caps.empty_kwargs_to_none is EXPECTED[tf]["every_n_layers"]  # both from 5.16
    assert caps.source == ("newest" if tf == "5.40.0" else "table")


@pytest.mark.parametrize("tf", RELEASES)
@pytest.mark.parametrize("keys", [("every_n_layers",), ("offload",), ("every_n_layers", "offload")])
def test_layer_kwargs_are_taken_out_only_where_transformers_cannot_read_them(tf, keys):
    f = facts(tf, kwargs_keys=keys, every_n_layers=2 if "every_n_layers" in keys else None, offload="offload" in keys)
    unread = tuple(k for k in keys if not EXPECTED[tf][k])
    found = [d for d in decide(f) if d.rule_id == "layer-kwargs-unsupported"]
    if unread:
        (d,) = found
        assert d.before == unread and d.action == "repair" and d.applied
    else:
        assert not found  # 5.16-5.22 no longer lose a working every_n_layers (5.17-5.22: a working offload)


@pytest.mark.parametrize("tf", RELEASES)
def test_offload_without_an_accelerator_is_refused_where_transformers_offloads(tf):
    f = facts(tf, kwargs_keys=("offload",), offload=True, accelerator=False)
    refused = [d.rule_id for d in errors(decide(f))]
    # 5.17-5.22 fail on CPU in the first forward as 5.23 does: refused; before 5.17 the plugin takes offload out
    assert refused == (["offload-needs-accelerator"] if EXPECTED[tf]["offload"] else [])


@pytest.mark.parametrize("tf", RELEASES)
def test_field_disagreement_needs_the_activation_fields(tf):
    f = facts(tf, has_activation_fields=True, fields_disagree=True)
    assert ("field-disagreement" in {r.id for r in applicable(f)}) is EXPECTED[tf]["activation_fields"]


@pytest.mark.parametrize("tf", RELEASES)
def test_shared_layer_state_by_the_default_reentrancy(tf):
    ids = {r.id for r in applicable(facts(tf, shared_state_layers=True))}
    five = not EXPECTED[tf]["none_kwargs_reentrant"]
    assert ("shared-layer-state-needs-non-reentrant" in ids) is five
    assert ("shared-layer-state-prefers-non-reentrant" in ids) is not five


@pytest.mark.parametrize("tf", RELEASES)
def test_input_hook_pileup_is_watched_where_enabling_adds_a_hook(tf):
    assert capabilities_apply(get_rule("input-hook-pileup"), for_versions({"transformers": tf})) is tf.startswith("5")


@pytest.mark.parametrize(("ds", "applies"), [("0.19.2", True), ("0.19.3", False), ("0.19.8", False), (None, False)])
def test_old_deepspeed_by_its_recompute_fix(ds, applies):
    extra = {"deepspeed": ds} if ds else {}
    f = facts("5.23.0", extra=extra, zero_stage=3, frozen_params=True)
    assert ("zero3-frozen-needs-reentrant" in {r.id for r in applicable(f)}) is applies


def test_detected_capabilities_win_over_the_version():
    """A patched or back-ported transformers: the rules follow what it can do, not its number."""
    caps = for_versions({"transformers": "5.23.0"}).replace(every_n_layers=False, source="installed")
    f = facts("5.23.0", kwargs_keys=("every_n_layers",), every_n_layers=2, capabilities=caps)
    assert [d.before for d in decide(f) if d.rule_id == "layer-kwargs-unsupported"] == [("every_n_layers",)]


def test_unknown_capabilities_gate_nothing():
    f = Facts(gc_enabled=True, kwargs_keys=("every_n_layers", "offload"), offload=True, accelerator=False,
              has_activation_fields=True, fields_disagree=True, capabilities=Capabilities())
    assert not {"layer-kwargs-unsupported", "offload-needs-accelerator", "field-disagreement"} & {
        r.id for r in applicable(f)}


def test_no_rule_gates_on_a_version_any_more():
    for rule in RULES:
        assert set(rule.needs) <= set(capabilities.CAPABILITY_NAMES), rule.id


# --- the installed environment ------------------------------------------------------------------------------------

INSTALLED_TF = metadata.version("transformers")


def test_installed_capabilities_match_the_released_sources():
    """What is detected here (text search, no import) equals the table read from the wheel of this release."""
    detected, table = capabilities.installed(), for_versions({"transformers": INSTALLED_TF})
    assert detected.source == "installed" and detected.transformers == INSTALLED_TF
    for name in capabilities.TRANSFORMERS_FIRST:
        assert getattr(detected, name) is getattr(table, name), name
    assert detected.none_kwargs_reentrant is table.none_kwargs_reentrant


def test_signature_and_source_text_agree():
    """Detection by signature (transformers and torch imported) and by source text (not imported) give the same answer:
    the transformers capabilities and the keywords torch's `checkpoint` reads."""
    code = (
        "import json, sys; from trl_gc_plugin.core import capabilities as c; a = c.installed();"
        "k = sorted(c.torch_checkpoint_keywords());"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules;"
        "import transformers.modeling_utils, transformers.training_args; c.installed.cache_clear();"
        "c.torch_checkpoint_keywords.cache_clear();"
        "print(json.dumps([[a.to_dict(), k], [c.installed().to_dict(), sorted(c.torch_checkpoint_keywords())]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    by_text, by_signature = json.loads(out.strip().splitlines()[-1])
    assert by_text == by_signature
    assert {"use_reentrant", "context_fn", "preserve_rng_state"} <= set(by_text[1])  # torch's keywords, read unimported


def test_deepspeed_detection_matches_its_version():
    try:
        ds = metadata.version("deepspeed")
    except metadata.PackageNotFoundError:
        assert capabilities.detect_deepspeed() is None
        return
    assert capabilities.detect_deepspeed() is for_versions({"deepspeed": ds}).deepspeed_recompute_fix


def test_detection_reads_a_package_directory(tmp_path):
    """A transformers with every_n_layers in the model but not in the Trainer cannot honour it: not detected."""
    tf = tmp_path / "transformers"
    tf.mkdir()
    (tf / "modeling_utils.py").write_text(
        'class PreTrainedModel:\n    def gradient_checkpointing_enable(\n        self, gradient_checkpointing_kwargs=None,'
        ' every_n_layers: int = 1, offload: bool = False\n    ):\n        kw = {"use_reentrant": False}\n'
        '        gradient_checkpointing_kwargs = {"use_reentrant": False}\n'
    )
    (tf / "trainer.py").write_text('gc_kwargs.pop("offload", False)\n')
    caps = capabilities.detect_transformers(Path(tf))
    assert (caps.every_n_layers, caps.offload, caps.none_kwargs_reentrant) == (False, True, False)


# --- trl-gc-check --transformers-version ---------------------------------------------------------------------------


def _check(tmp_path, capsys, tf: str, kwargs: str) -> tuple[int, str]:
    from trl_gc_plugin.__main__ import check_main

    path = tmp_path / "sft.yaml"
    path.write_text(
        "model_name_or_path: Qwen/Qwen2-0.5B\ndataset_name: trl-lib/Capybara\noutput_dir: out\n"
        f"gradient_checkpointing: true\ngradient_checkpointing_kwargs: {kwargs}\n"
    )
    capsys.readouterr()
    code = check_main([str(path), "--parser", "model", "--transformers-version", tf])
    return code, capsys.readouterr().out


@pytest.mark.parametrize("tf", ["4.57.6", "5.15.0", "5.16.0", "5.17.0", "5.22.0", "5.23.0", "5.40.0"])
def test_check_cli_layer_kwargs(tmp_path, capsys, tf):
    code, out = _check(tmp_path, capsys, tf, "{use_reentrant: false, every_n_layers: 2, offload: true}")
    assert code == 0, out
    unread = [k for k in ("every_n_layers", "offload") if not EXPECTED[tf][k]]
    if unread:
        assert "[layer-kwargs-unsupported]" in out and repr(tuple(unread)) in out
    else:
        assert "layer-kwargs-unsupported" not in out


@pytest.mark.parametrize("tf", ["5.15.0", "5.16.0", "5.23.0", "5.40.0"])
def test_check_cli_never_refuses_a_plain_config(tmp_path, capsys, tf):
    code, out = _check(tmp_path, capsys, tf, "{use_reentrant: false}")
    assert code == 0 and "verdict: fine" in out, out
