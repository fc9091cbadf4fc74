"""TRL_GC_PLUGIN=1: real interpreters with the built wheel installed, real launchers (TRL CLI, torchrun).

`line_independent` marks the hook's own mechanism (the wheel's files, off values, a failing patch, the TRL CLI's
parsing): the transformers 4.57 environment runs the rest, the routes a script meets on that line."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
from startup_env import build_wheel, clean_env, make_venv
from torchrun import free_port


@pytest.fixture(scope="module")
def venv_python(tmp_path_factory):
    for module in ("build", "hatchling"):  # the wheel is built without isolation, from this environment
        pytest.importorskip(module, reason=f"{module} (the `test` extra) is not installed: no wheel to install")
    base = tmp_path_factory.mktemp("startup")
    return make_venv(base / "venv", build_wheel(base / "dist"))


def py(python, code, cwd, **env):
    return subprocess.run([str(python), "-c", textwrap.dedent(code)], capture_output=True, text=True, cwd=cwd,
                          env=clean_env(**env), timeout=300)


PROBE = """
    import sys
    heavy = sorted(m for m in ("torch", "transformers", "trl_gc_plugin.routes.post_init") if m in sys.modules)
    finders = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"]
    from transformers import TrainingArguments
    import transformers.trainer as t
    patched = getattr(TrainingArguments.__post_init__, "__trl_gc_plugin_wrapper__", False)
    registered = [c.__name__ for c in t.DEFAULT_CALLBACKS if "SafeGC" in c.__name__]
    left = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"]
    print(heavy, finders, patched, registered, left)
"""


@pytest.mark.line_independent
def test_wheel_ships_the_start_up_files(venv_python):
    import ast
    import zipfile

    (wheel,) = list(venv_python.parents[2].glob("dist/*.whl"))
    archive = zipfile.ZipFile(wheel)
    names = archive.namelist()
    assert "trl_gc_plugin.pth" in names and "trl_gc_plugin.start" in names
    assert archive.read("trl_gc_plugin.start").decode().strip() == "trl_gc_plugin._startup:run"
    # read, not imported: importing `_startup` runs the hook
    startup = ast.parse(archive.read("trl_gc_plugin/_startup.py").decode())
    constants = {t.id: n.value.value for n in startup.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    functions = {n.name for n in startup.body if isinstance(n, ast.FunctionDef)}
    assert "run" in functions and ast.unparse(startup.body[-1]) == "run()"  # importing the module runs the hook
    # the .pth: one import line that tests the hook's variable, and nothing else, before importing the hook
    text = archive.read("trl_gc_plugin.pth").decode()
    assert text.count("\n") == 1 and text.startswith("import ")
    imports, check = ast.parse(text).body
    assert ast.unparse(imports) == "import os"
    assert ast.unparse(check) == f"{constants['ENABLE_ENV']!r} in os.environ and __import__('trl_gc_plugin._startup')"


AT_STARTUP = """
    import sys
    print(sorted(m for m in sys.modules if m.startswith(("torch", "transformers", "trl_gc_plugin"))),
          [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"])
"""
HOOK = "['trl_gc_plugin', 'trl_gc_plugin._base', 'trl_gc_plugin._base.flags', 'trl_gc_plugin._startup']"


@pytest.mark.parametrize(("value", "expected"), [
    (None, "[] []"),  # the .pth line tests the variable and imports nothing
    ("", "['trl_gc_plugin', 'trl_gc_plugin._startup'] []"),  # empty: off before any spelling is read
    *[(off, f"{HOOK} []") for off in ("0", "false", "OFF", "no", "n")],  # the hook reads the value and returns
    *[(on, f"{HOOK} ['_TransformersFinder']") for on in ("1", "true", "YES", "on", "y")],
    ("maybe", f"{HOOK} ['_TransformersFinder']"),  # armed to warn, if training code is ever imported
])
def test_start_up_imports_nothing_heavy_and_arms_only_when_set(venv_python, tmp_path, value, expected):
    env = {} if value is None else {"TRL_GC_PLUGIN": value}
    out = py(venv_python, AT_STARTUP, tmp_path, **env)
    assert out.returncode == 0 and out.stderr == "", out.stderr  # no warning either: nothing imports transformers
    assert out.stdout.strip() == expected


@pytest.mark.line_independent
@pytest.mark.parametrize("value", [None, "0"])
def test_unset_or_off_patches_nothing_when_transformers_is_imported(venv_python, tmp_path, value):
    out = py(venv_python, PROBE, tmp_path, **({} if value is None else {"TRL_GC_PLUGIN": value}))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-5:] == ["[]", "[]", "False", "[]", "[]"], out.stdout
    assert "trl_gc_plugin" not in out.stderr


def test_set_patches_when_transformers_is_imported_and_the_hook_removes_itself(venv_python, tmp_path):
    out = py(venv_python, PROBE, tmp_path, TRL_GC_PLUGIN="1")
    assert out.returncode == 0, out.stderr
    # nothing heavy at start-up; the finder is armed; patched once imported; the finder removed itself
    assert out.stdout.strip().endswith("[] ['_TransformersFinder'] True ['AutoSafeGCCallback'] []"), out.stdout


WARNING = "trl_gc_plugin: ignoring TRL_GC_PLUGIN="

# imports both targets, then starts three children that import the training code too (a stub `transformers`
# package for them: what the hook reacts to is the module names, and torch takes seconds to import)
LAUNCH = """
    import json, os, subprocess, sys
    import transformers.training_args, transformers.trainer
    from transformers import TrainingArguments
    import transformers.trainer as t
    patched = getattr(TrainingArguments.__post_init__, "__trl_gc_plugin_wrapper__", False)
    registered = [c.__name__ for c in t.DEFAULT_CALLBACKS if "SafeGC" in c.__name__]
    left = [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_TransformersFinder"]
    stub = os.path.abspath("stub")  # in the test's tmp_path
    os.makedirs(os.path.join(stub, "transformers"))
    for name in ("__init__", "training_args", "trainer"):
        open(os.path.join(stub, "transformers", name + ".py"), "w").close()
    child = "import transformers.trainer; print(transformers.trainer.__file__)"
    children = {
        "inherits": {},  # the marker this process set, the same value: silent
        "other value": {"TRL_GC_PLUGIN": "perhaps"},  # a different value: warns
        "rank 1": {"TRL_GC_PLUGIN": "perhaps", "RANK": "1"},  # not the main rank: silent
    }
    runs = {name: subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=stub,
                                 env={**os.environ, "PYTHONPATH": stub, **extra}) for name, extra in children.items()}
    print(json.dumps({"patched": patched, "registered": registered, "left": left,
                      "marker": os.environ.get("_TRL_GC_PLUGIN_WARNED"), "stub": stub,
                      "children": {name: [run.stdout, run.stderr] for name, run in runs.items()}}))
"""


@pytest.mark.line_independent
def test_an_invalid_value_warns_once_where_training_code_is_imported_and_once_per_launch(venv_python, tmp_path):
    out = py(venv_python, LAUNCH, tmp_path, TRL_GC_PLUGIN="maybe")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr.count(WARNING) == 1 and "TRL_GC_PLUGIN='maybe'" in out.stderr, out.stderr
    assert "1/true/yes/on" in out.stderr and "Nothing was patched" in out.stderr
    result = json.loads(out.stdout.splitlines()[-1])
    assert (result["patched"], result["registered"], result["left"]) == (False, [], [])
    assert result["marker"] == "maybe"
    children = {name: stderr for name, (stdout, stderr) in result["children"].items()}
    assert all(stdout.startswith(result["stub"]) for stdout, _ in result["children"].values()), result["children"]
    assert WARNING not in children["inherits"], children["inherits"]
    assert children["other value"].count(WARNING) == 1 and "'perhaps'" in children["other value"]
    assert WARNING not in children["rank 1"], children["rank 1"]


def test_the_variable_never_names_a_module(venv_python, tmp_path):
    (tmp_path / "evil.py").write_text("print('IMPORTED')\n")
    out = py(venv_python, "pass", tmp_path, TRL_GC_PLUGIN="evil", PYTHONPATH=str(tmp_path))
    assert "IMPORTED" not in out.stdout and out.returncode == 0 and out.stderr == ""


@pytest.mark.line_independent
@pytest.mark.parametrize(("value", "expected"), [("1", "True ['AutoSafeGCCallback']"), ("maybe", "False []")])
def test_transformers_already_imported_is_handled_at_once(venv_python, tmp_path, value, expected):
    code = f"""
        import os, transformers.trainer as t
        from transformers import TrainingArguments
        os.environ["TRL_GC_PLUGIN"] = {value!r}
        from trl_gc_plugin import _startup  # importing it runs the hook
        _startup.run()  # a second call does nothing
        print(getattr(TrainingArguments.__post_init__, "__trl_gc_plugin_wrapper__", False),
              [c.__name__ for c in t.DEFAULT_CALLBACKS if "SafeGC" in c.__name__])
    """
    out = py(venv_python, code, tmp_path)
    assert out.stdout.strip() == expected, out.stderr
    assert out.stderr.count(WARNING) == (value == "maybe"), out.stderr


@pytest.mark.line_independent
def test_a_failing_patch_is_logged_and_never_breaks_the_import(venv_python, tmp_path):
    code = """
        import trl_gc_plugin.routes.post_init as p
        def boom(*a, **k):
            raise RuntimeError("boom")
        p.patch_training_args = boom
        from transformers import TrainingArguments
        print("imported", TrainingArguments.__name__)
    """
    out = py(venv_python, code, tmp_path, TRL_GC_PLUGIN="1")
    assert out.returncode == 0 and "imported TrainingArguments" in out.stdout
    assert "could not patch transformers.training_args" in out.stderr and "boom" in out.stderr


REFUSED = """
    from transformers import TrainingArguments
    TrainingArguments(output_dir="out", gradient_checkpointing=True, report_to=[],
                      gradient_checkpointing_kwargs={"use_reentrant": True, "debug": True})
"""


@pytest.mark.line_independent
def test_a_refusal_under_the_variable_reads_as_its_message_not_a_traceback(venv_python, tmp_path):
    """A launcher that builds the arguments while parsing its config (the TRL CLI) would show a traceback through its
    parser: the refusal is the message, which names the change; TRL_GC_PLUGIN_TRACEBACK=1 shows the traceback too."""
    out = py(venv_python, REFUSED, tmp_path, TRL_GC_PLUGIN="1")
    assert out.returncode == 1
    assert "trl_gc_plugin refused this gradient-checkpointing setup" in out.stderr and "Traceback" not in out.stderr
    assert "[non-reentrant-only-kwargs]" in out.stderr and "TRL_GC_PLUGIN_TRACEBACK=1" in out.stderr
    out = py(venv_python, REFUSED, tmp_path, TRL_GC_PLUGIN="1", TRL_GC_PLUGIN_TRACEBACK="1")
    assert out.returncode == 1 and "Traceback" in out.stderr and "GCConfigError" in out.stderr
    code = "import sys; from transformers import TrainingArguments; assert sys.excepthook is not sys.__excepthook__; raise KeyError('other')"
    out = py(venv_python, code, tmp_path, TRL_GC_PLUGIN="1")  # anything else: the previous hook, as it was
    assert "Traceback" in out.stderr and "KeyError" in out.stderr


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
if dist.is_initialized():  # the interpreter's teardown aborts a gloo rank now and then (pytorch #190489; seen in CI
    dist.barrier()  # with destroy_process_group too): end after the results are written, as tests/torchrun.py does
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
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
                          "--master_port", str(free_port()), str(script), str(tmp_path / "out")],
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
    logged = [line for line in out.stderr.splitlines() if re.match(r"trl_gc_plugin(\.\w+)? \[", line)]
    assert len(logged) == len(results[0]["decisions"]), logged


SUMMARY = "[trl_gc_plugin] INFO: gradient checkpointing on"
DETAIL = "[trl_gc_plugin.decisions] INFO: [non-reentrant-default]"


@pytest.mark.line_independent
@pytest.mark.parametrize("value", ["1", "1 --log_level info", "maybe"])
def test_trl_cli(venv_python, tiny_checkpoint, tmp_path, value):
    """The no-code route: `TRL_GC_PLUGIN=1 trl sft --config ...` says it ran in one summary line by default, lists
    every decision with the Trainer's `--log_level info`, and an invalid value warns once for the whole launch."""
    value, *extra = value.split()
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
    out = subprocess.run([str(venv_python), "-c", cli, "sft", "--config", str(config), *extra], capture_output=True,
                         text=True, cwd=tmp_path, env=clean_env(TRL_GC_PLUGIN=value), timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    if value == "maybe":  # the CLI process and the training process it launches: one warning, nothing patched
        assert out.stderr.count(WARNING) == 1, out.stderr[-4000:]
        assert not (tmp_path / "out" / "gc_decisions.json").exists()
        return
    assert WARNING not in out.stderr
    assert out.stderr.count(SUMMARY) == 1, out.stderr[-4000:]  # one line, visible under default settings
    assert str(tmp_path / "out" / "gc_decisions.json") in out.stderr  # ... that says where the decisions are
    assert (DETAIL in out.stderr) is bool(extra), out.stderr[-4000:]  # details at the Trainer's log level
    decisions = json.loads((tmp_path / "out" / "gc_decisions.json").read_text())
    decided = [d for d in decisions if d["setting"] == "use_reentrant"]
    assert decided[0]["stage"] == "post_init" and decided[0]["after"] is False
    assert all(d["action"] != "error" for d in decisions)


@pytest.mark.line_independent
def test_console_script_from_the_wheel(venv_python, tmp_path):
    data = Path(__file__).with_name("data")
    script = venv_python.parent / "trl-gc-check"
    ok = subprocess.run([str(script), str(data / "trl_sft_lora.yaml")], capture_output=True, text=True,
                        cwd=tmp_path, env=clean_env())
    refused = subprocess.run([str(script), str(data / "trl_sft_lora_reentrant.yaml"), "--nproc", "2"],
                             capture_output=True, text=True, cwd=tmp_path, env=clean_env())
    assert (ok.returncode, refused.returncode) == (0, 1), ok.stderr + refused.stderr
