"""Capabilities, not version numbers: every rule that used a transformers version gate, for the releases around each
capability (5.15 / 5.16 / 5.17 / 5.22 / 5.23, a newer one), at the engine and through `trl-gc-check
--transformers-version`; and the capabilities detected in the installed environment against the table read from the
released wheels (`trl_gc_plugin/capabilities.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import fields, replace
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
    f = facts(tf, kwargs_keys=("offload",), offload=True, accelerator_built=False)
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
    caps = replace(for_versions({"transformers": "5.23.0"}), every_n_layers=False, source="installed")
    f = facts("5.23.0", kwargs_keys=("every_n_layers",), every_n_layers=2, capabilities=caps)
    assert [d.before for d in decide(f) if d.rule_id == "layer-kwargs-unsupported"] == [("every_n_layers",)]


def test_unknown_capabilities_gate_nothing():
    f = Facts(gc_enabled=True, kwargs_keys=("every_n_layers", "offload"), offload=True, accelerator=False,
              has_activation_fields=True, fields_disagree=True, capabilities=Capabilities())
    assert not {"layer-kwargs-unsupported", "offload-needs-accelerator", "field-disagreement"} & {
        r.id for r in applicable(f)}


def test_no_rule_gates_on_a_version_any_more():
    for rule in RULES:
        assert set(rule.needs) <= {f.name for f in fields(Capabilities)} - {"transformers", "source"}, rule.id


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
        "import dataclasses, json, sys; from trl_gc_plugin.core import capabilities as c; a = c.installed();"
        "k = sorted(c.torch_checkpoint_keywords());"
        "assert 'transformers' not in sys.modules and 'torch' not in sys.modules;"
        "import transformers.modeling_utils, transformers.training_args; c.installed.cache_clear();"
        "c.torch_checkpoint_keywords.cache_clear();"
        "b = dataclasses.asdict(c.installed());"
        "print(json.dumps([[dataclasses.asdict(a), k], [b, sorted(c.torch_checkpoint_keywords())]]))"
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
    from trl_gc_plugin.cli.check import check_main

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


# --- TRL's activation offloading: its stream fixes read in its source ---------------------------------------------


def _trl_offloading_source() -> str | None:
    trl_dir = capabilities._package_dir("trl")
    source = trl_dir / "models" / "activation_offloading.py" if trl_dir else None
    return source.read_text() if source is not None and source.is_file() else None


def test_trl_offload_detection_matches_its_release():
    """Read in the installed TRL's source, the fixes are where the wheels have them (1.14+; this matrix runs TRL
    0.20.0 and 0.26.2 without them, 1.16.0 with them)."""
    try:
        trl = metadata.version("trl")
    except metadata.PackageNotFoundError:
        assert capabilities.detect_trl_offload() is None
        return
    expected = for_versions({"trl": trl}).trl_offload_stream_fixes
    assert capabilities.detect_trl_offload() is (expected if _trl_offloading_source() is not None else None)


def test_trl_offload_detection_sees_each_fix_undone(tmp_path):
    """The installed source with one fix undone at a time (as the released source before it): not detected."""
    text = _trl_offloading_source()
    if text is None or not capabilities.detect_trl_offload():
        pytest.skip("this TRL's offloading lacks the fixes (the release test covers it)")
    undone = {
        "compute stream cached": text.replace("@property\n    def s0(", "def s0("),
        "clone after the wait": text.replace("activation.clone(memory_format", "activation.contiguous(memory_format")
        + "\n# activation.clone(memory_format=...) on the transfer stream\n",
        "no sync at exit": text.replace(".synchronize()", ".query()"),
        # trl PR 6241: a released tensor's storage key stays, a new tensor at the reused address is not offloaded
        "dedupe entry kept": text.replace("del self.storage_to_tensor_id[storage_key]", "pass"),
    }
    for name, source in undone.items():
        models = tmp_path / name / "models"
        models.mkdir(parents=True)
        (models / "activation_offloading.py").write_text(source)
        assert capabilities.detect_trl_offload(models.parent) is False, name


@pytest.mark.parametrize(("trl", "fires"), [("0.26.2", True), ("1.13.0", True), ("1.14.0", False), ("1.16.0", False)])
def test_trl_offloading_without_the_stream_fixes_is_said(trl, fires):
    for tf, alternative in (("5.23.0", "gradient_checkpointing_kwargs={'offload': True}"), ("4.57.6", "Upgrade TRL")):
        f = facts(tf, extra={"trl": trl}, trl_activation_offloading=True, accelerator=True)
        found = [d for d in decide(f) if d.rule_id == "trl-activation-offloading-stream-races"]
        assert bool(found) is fires
        if fires:
            assert found[0].action == "warn" and alternative in found[0].reason
    # Without offloading, or on a machine without an accelerator (another rule refuses there), nothing is said.
    for f in (facts("5.23.0", extra={"trl": trl}, accelerator=True),
              facts("5.23.0", extra={"trl": trl}, trl_activation_offloading=True, accelerator=False)):
        assert "trl-activation-offloading-stream-races" not in {d.rule_id for d in decide(f)}


def test_check_cli_reads_trls_activation_offloading(tmp_path, capsys):
    from trl_gc_plugin.cli.check import check_main

    path = tmp_path / "sft.yaml"
    path.write_text("model_name_or_path: Qwen/Qwen2-0.5B\ndataset_name: trl-lib/Capybara\noutput_dir: out\nactivation_offloading: true\n")
    for trl, said in (("1.13.0", True), ("1.16.0", False)):
        capsys.readouterr()
        code = check_main([str(path), "--parser", "model", "--trl-version", trl])
        out = capsys.readouterr().out
        assert code == 0 and "activation offloading (TRL)" in out
        assert ("[trl-activation-offloading-stream-races]" in out) is said, out


# --- FSDP2 mixed precision and the recompute's casts (torch's source) -------------------------------------------


def test_fsdp2_recompute_casts_read_in_torchs_source(tmp_path):
    """The installed torch (2.13+ in every environment here) casts the recompute; its source with the PRE_BACKWARD
    branch as torch before 2.13 wrote it (`return args, kwargs`) does not."""
    torch_dir = capabilities._package_dir("torch")
    source = torch_dir / "distributed" / "fsdp" / "_fully_shard" / "_fsdp_state.py"
    text = source.read_text()
    assert capabilities.detect_fsdp2_recompute_casts() is True
    assert capabilities.detect_fsdp2_recompute_casts() is for_versions({"torch": metadata.version("torch")}).fsdp2_recompute_casts
    old = tmp_path / "torch" / "distributed" / "fsdp" / "_fully_shard"
    old.mkdir(parents=True)
    before = text.replace("return self._cast_forward_inputs(args, kwargs)\n", "return args, kwargs\n", 1)
    assert before != text
    (old / "_fsdp_state.py").write_text(before)
    assert capabilities.detect_fsdp2_recompute_casts(tmp_path / "torch") is False


@pytest.mark.parametrize(("torch_version", "fires"), [("2.12.1", True), ("2.13.0", False), ("2.15.0", False)])
def test_fsdp2_mixed_precision_on_a_torch_that_recomputes_in_another_dtype(torch_version, fires):
    base = dict(fsdp=True, fsdp_version=2, world_size=2, mixed_precision=True)
    cases = {
        "trainer's checkpointing": (dict(base), fires),
        "FSDP's own with dropout (fix switches)": (dict(base, gc_enabled=False, fsdp_activation_checkpointing=True, dropout=True), fires),
        "FSDP's own without dropout": (dict(base, gc_enabled=False, fsdp_activation_checkpointing=True, dropout=False), False),
        "no mixed precision": (dict(base, mixed_precision=False), False),
        "FSDP1": (dict(base, fsdp_version=1), False),
    }
    for name, (kw, expected) in cases.items():
        gc = kw.pop("gc_enabled", True)
        f = facts("5.23.0", extra={"torch": torch_version}, gc_enabled=gc, **kw)
        found = [d for d in decide(f) if d.rule_id == "fsdp2-mixed-precision-recompute"]
        assert bool(found) is expected, name
        assert all(d.action == "warn" for d in found)
