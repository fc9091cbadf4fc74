"""TRL_GC_PLUGIN=1: real interpreters with the built wheel installed, real launchers (TRL CLI, torchrun)."""

from __future__ import annotations

import json
import subprocess
import textwrap
from pathlib import Path

import pytest
from startup_env import build_wheel, clean_env, make_venv


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    base = tmp_path_factory.mktemp("startup")
    return make_venv(base / "venv", build_wheel(base / "dist"))


def py(python, code, cwd, **env):
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(**env), timeout=300)


PROBE = """
    import sys
    heavy = sorted(m for m in ("torch", "transformers", "trl_gc_plugin.patching") if m in sys.modules)
    finders = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"]
    from transformers import TrainingArguments
    import transformers.trainer as t
    patched = getattr(TrainingArguments.__post_init__, "__trl_gc_plugin_wrapper__", False)
    registered = [c.__name__ for c in t.DEFAULT_CALLBACKS if "SafeGC" in c.__name__]
    left = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"]
    print(heavy, finders, patched, registered, left)
"""


def test_wheel_ships_the_start_up_files(venv_python):
    import zipfile

    (wheel,) = list(venv_python.parents[2].glob("dist/*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "trl_gc_plugin.pth" in names and "trl_gc_plugin.start" in names
    assert zipfile.ZipFile(wheel).read("trl_gc_plugin.start").decode().strip() == "trl_gc_plugin._startup:run"
    # the .pth's own off-list (checked before anything is imported) is the hook's
    import ast

    from trl_gc_plugin._startup import OFF

    line = zipfile.ZipFile(wheel).read("trl_gc_plugin.pth").decode()
    assert set(ast.literal_eval(line[line.index("not in ") + 7: line.index(") and") + 1])) == OFF


AT_STARTUP = """
    import sys
    print(sorted(m for m in ("torch", "transformers", "trl_gc_plugin") if m in sys.modules),
          [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"])
"""


@pytest.mark.parametrize(("value", "armed"), [(None, False), ("", False), ("0", False), ("false", False),
                                              ("OFF", False), ("no", False), ("1", True), ("true", True),
                                              ("YES", True), ("on", True)])
def test_start_up_imports_nothing_heavy_and_arms_only_when_enabled(venv_python, tmp_path, value, armed):
    env = {} if value is None else {"TRL_GC_PLUGIN": value}
    out = py(venv_python, AT_STARTUP, tmp_path, **env)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    expected = "['trl_gc_plugin'] ['_TransformersFinder']" if armed else "[] []"
    assert out.stdout.strip() == expected


def test_unset_patches_nothing_when_transformers_is_imported(venv_python, tmp_path):
    out = py(venv_python, PROBE, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-5:] == ["[]", "[]", "False", "[]", "[]"], out.stdout
    assert "trl_gc_plugin" not in out.stderr


def test_set_patches_when_transformers_is_imported_and_the_hook_removes_itself(venv_python, tmp_path):
    out = py(venv_python, PROBE, tmp_path, TRL_GC_PLUGIN="1")
    assert out.returncode == 0, out.stderr
    # nothing heavy at start-up; the finder is armed; patched once imported; the finder removed itself
    assert out.stdout.strip().endswith("[] ['_TransformersFinder'] True ['AutoSafeGCCallback'] []"), out.stdout


def test_other_values_warn_once_and_patch_nothing(venv_python, tmp_path):
    out = py(venv_python, AT_STARTUP, tmp_path, TRL_GC_PLUGIN="maybe")
    assert out.returncode == 0
    assert out.stderr.count("trl_gc_plugin: ignoring TRL_GC_PLUGIN='maybe'") == 1, out.stderr
    assert "1/true/yes/on" in out.stderr
    assert out.stdout.strip().endswith("[]")  # nothing armed


def test_the_variable_never_names_a_module(venv_python, tmp_path):
    (tmp_path / "evil.py").write_text("print('IMPORTED')\n")
    out = py(venv_python, "pass", tmp_path, TRL_GC_PLUGIN="evil", PYTHONPATH=str(tmp_path))
    assert "IMPORTED" not in out.stdout and out.returncode == 0


def test_transformers_already_imported_patches_at_once(venv_python, tmp_path):
    code = """
        import os, transformers.trainer as t
        from transformers import TrainingArguments
        os.environ["TRL_GC_PLUGIN"] = "1"
        from trl_gc_plugin import _startup
        _startup.run()
        print(getattr(TrainingArguments.__post_init__, "__trl_gc_plugin_wrapper__", False),
              [c.__name__ for c in t.DEFAULT_CALLBACKS if "SafeGC" in c.__name__])
    """
    out = py(venv_python, code, tmp_path)
    assert out.stdout.strip() == "True ['AutoSafeGCCallback']", out.stderr


def test_a_failing_patch_is_logged_and_never_breaks_the_import(venv_python, tmp_path):
    code = """
        import trl_gc_plugin.patching as p
        def boom(*a, **k):
            raise RuntimeError("boom")
        p.patch_training_args = boom
        from transformers import TrainingArguments
        print("imported", TrainingArguments.__name__)
    """
    out = py(venv_python, code, tmp_path, TRL_GC_PLUGIN="1")
    assert out.returncode == 0 and "imported TrainingArguments" in out.stdout
    assert "could not patch transformers.training_args" in out.stderr and "boom" in out.stderr


TRAIN_SCRIPT = """
import json, logging, os, sys
logging.basicConfig(level=logging.WARNING, format="%(name)s %(message)s")
logging.getLogger("trl_gc_plugin").setLevel(logging.INFO)
import torch.distributed as dist
from transformers import Trainer, TrainingArguments
from trl_gc_plugin.testing import make_model, make_tokenizer, tokenized_dataset

model = make_model()
model.get_input_embeddings().weight.requires_grad_(False)
args = TrainingArguments(output_dir=sys.argv[1], max_steps=2, per_device_train_batch_size=2, use_cpu=True,
                         gradient_checkpointing=True, report_to="none", save_strategy="no", disable_tqdm=True,
                         ddp_backend="gloo" if os.environ.get("WORLD_SIZE") else None)
trainer = Trainer(model=model, args=args, train_dataset=tokenized_dataset(make_tokenizer()))
trainer.train()
funcs = [m._gradient_checkpointing_func for m in model.modules() if getattr(m, "gradient_checkpointing", False)]
cb = [c for c in trainer.callback_handler.callbacks if type(c).__name__ == "AutoSafeGCCallback"]
rank = int(os.environ.get("RANK", 0))
with open(os.path.join(sys.argv[1] + "-results", f"rank{rank}.json"), "w") as fh:  # not stdout: ranks interleave
    json.dump({"rank": rank, "running": sorted({f.keywords.get("use_reentrant") for f in funcs}),
               "args": args.gradient_checkpointing_kwargs,
               "decisions": [[d.stage, d.rule_id, d.action, repr(d.after)] for d in cb[0].decisions] if cb else None},
              fh)
"""


def _rank_results(out):
    return [json.loads(p.read_text()) for p in sorted(Path(str(out) + "-results").glob("rank*.json"))]


def test_a_trainer_script_that_never_mentions_the_plugin(venv_python, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    (tmp_path / "out-results").mkdir()
    out = subprocess.run([str(venv_python), str(script), str(tmp_path / "out")], capture_output=True, text=True,
                         cwd=tmp_path, env=clean_env(TRL_GC_PLUGIN="1"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (result,) = _rank_results(tmp_path / "out")
    assert result["running"] == [False] and result["args"] == {"use_reentrant": False}
    assert (tmp_path / "out" / "gc_decisions.json").exists()


def test_torchrun_two_ranks_get_the_callback_and_the_same_decision(venv_python, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT)
    (tmp_path / "out-results").mkdir()
    out = subprocess.run([str(venv_python), "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_port", "29533", str(script), str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env=clean_env(TRL_GC_PLUGIN="1", OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    results = _rank_results(tmp_path / "out")
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["decisions"] and results[0]["decisions"] == results[1]["decisions"]
    assert all(r["running"] == [False] and r["args"] == {"use_reentrant": False} for r in results)
    written = json.loads((tmp_path / "out" / "gc_decisions.json").read_text())
    assert [[d["stage"], d["rule_id"], d["action"], repr(d["after"])] for d in written] == results[0]["decisions"]
    # logged by the main process only: one line per decision, not one per rank
    logged = [line for line in out.stderr.splitlines() if line.startswith("trl_gc_plugin [")]
    assert len(logged) == len(results[0]["decisions"]), logged


def test_trl_cli(venv_python, tiny_checkpoint, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"text": f"the quick brown fox {i}"}) + "\n"
                                              for i in range(16)))
    config = tmp_path / "sft.yaml"
    config.write_text(textwrap.dedent(f"""
        model_name_or_path: {tiny_checkpoint}
        dataset_name: {data}
        output_dir: {tmp_path / "out"}
        max_steps: 2
        per_device_train_batch_size: 2
        max_length: 32
        use_cpu: true
        bf16: false
        report_to: none
        save_strategy: "no"
        gradient_checkpointing: true
    """))
    cli = "import sys; from trl.cli import main; sys.exit(main())"
    out = subprocess.run([str(venv_python), "-c", cli, "sft", "--config", str(config)], capture_output=True,
                         text=True, cwd=tmp_path, env=clean_env(TRL_GC_PLUGIN="1"), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    decisions = json.loads((tmp_path / "out" / "gc_decisions.json").read_text())
    decided = [d for d in decisions if d["setting"] == "use_reentrant"]
    assert decided[0]["stage"] == "post_init" and decided[0]["after"] is False
    assert all(d["action"] != "error" for d in decisions)


def test_console_script_from_the_wheel(venv_python, tmp_path):
    data = Path(__file__).with_name("data")
    script = venv_python.parent / "trl-gc-check"
    ok = subprocess.run([str(script), str(data / "trl_sft_lora.yaml")], capture_output=True, text=True,
                        cwd=tmp_path, env=clean_env())
    refused = subprocess.run([str(script), str(data / "trl_sft_lora_reentrant.yaml"), "--nproc", "2"],
                             capture_output=True, text=True, cwd=tmp_path, env=clean_env())
    assert (ok.returncode, refused.returncode) == (0, 1), ok.stderr + refused.stderr
