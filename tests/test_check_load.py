"""Reading config files (`trl_gc_plugin.configcheck.read.load`): malformed input is one clear error, never a traceback;
the fast path (only the keys the check reads are built) reads exactly what a full safe load reads; 5 MB is fast."""

from __future__ import annotations

import json
import time

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trl_gc_plugin.configcheck.check import READ_KEYS, Launch, check_files
from trl_gc_plugin.configcheck.read.common import ConfigError
from trl_gc_plugin.configcheck.read.load import load

pytestmark = pytest.mark.line_independent

WANTED = READ_KEYS


def write(tmp_path, name, content):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return str(path)


def error_of(path, wanted=WANTED):
    with pytest.raises(ConfigError) as info:
        load(path, wanted)
    message = str(info.value)
    assert "\n" not in message and message.startswith(path)
    return message


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (bytes(range(256)), "not a UTF-8 text file (it holds NUL bytes"),
        ("model_name_or_path: x\n".encode("utf-16"), "not a UTF-8 text file"),
        ("model_name_or_path: x\n".encode("utf-16-le"), "not a UTF-8 text file"),
        ("model_name_or_path: x\n".encode("utf-32"), "not a UTF-8 text file"),
        (b"model_name_or_path: x\ngradient_checkpointing: \xff\xfe\n", "line 2: not valid UTF-8"),
        (b"", "the file is empty"),
        (b"  \n# only a comment\n", "the file holds no keys (empty, or only comments)"),
        (b"- a\n- b\n", "the top level must be a mapping of keys, not a list"),
        (b"just a string\n", "the top level must be a mapping of keys, not a string"),
        (b"null\n", "the file holds no keys"),
        (b"1: x\nmodel_name_or_path: y\n", "top-level key 1 is not a string"),
        (b"true: x\n", "top-level key True is not a string"),
        (b"model_name_or_path: x\n---\nother: y\n", "line 2, column 1: but found another document"),
        (b"model_name_or_path: x\ngradient_checkpointing_kwargs: !!python/object:os.system {}\n", "could not determine a constructor"),
        (b"model_name_or_path: x\ngradient_checkpointing_kwargs: {use_reentrant: false\n", "line 3, column 1"),
        (b"model_name_or_path: x\n\tgradient_checkpointing: true\n", "line 2"),
        (b"gradient_checkpointing_kwargs: " + b"[" * 5000 + b"]" * 5000 + b"\n", "line 1: nested more than 1000 levels deep"),
        (b"a: 1\nb: " + b"[x, " * 200_000 + b"]" * 200_000 + b"\n", "line 2: nested more than 1000 levels deep"),
        (b"a: 1\nb: " + b"{" * 2_500_000 + b"\n", "line 2: nested more than 1000 levels deep"),
        (b"a:\n" + b"".join(b" " * i + b"k:\n" for i in range(1, 1100)), "nested more than 1000 levels deep"),
        (b"a:\n  " + b"- " * 600 + b"x\n", "line 2: nested more than 1000 levels deep"),
        (b"gradient_checkpointing_kwargs: {use_reentrant: " + b"9" * 5000 + b"}\n", "cannot read a value"),
        (b"gradient_checkpointing_kwargs: *nowhere\n", "found undefined alias"),
    ],
)
def test_malformed_yaml_is_one_clear_error(tmp_path, content, message):
    assert message in error_of(write(tmp_path, "cfg.yaml", content))


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"model_name_or_path": "x",}', "line 1, column 28"),
        (b"[1, 2]", "not a list"),
        (b'"text"', "not a string"),
        (b"[" * 100000 + b"]" * 100000, "cannot read: RecursionError"),
        (b'{"a": ' + b"9" * 5000 + b"}", "cannot read: ValueError"),
    ],
)
def test_malformed_json_is_one_clear_error(tmp_path, content, message):
    assert message in error_of(write(tmp_path, "cfg.json", content))


def test_a_directory_and_a_missing_file(tmp_path):
    assert "is a directory" in error_of(str(tmp_path))
    assert "cannot read: No such file or directory" in error_of(str(tmp_path / "missing.yaml"))


def test_a_utf8_bom_is_fine(tmp_path):
    path = write(tmp_path, "cfg.yaml", "\ufeffmodel_name_or_path: x\nuse_peft: true\n".encode())
    assert load(path, WANTED).values == {"model_name_or_path": "x", "use_peft": True}
    path = write(tmp_path, "cfg.json", '\ufeff{"gradient_checkpointing": true}'.encode())
    assert load(path, WANTED).values == {"gradient_checkpointing": True}


def test_lines_of_the_keys_are_known(tmp_path):
    path = write(tmp_path, "cfg.yaml", "---\n# comment\nmodel_name_or_path: x\n\nuse_peft: true\ndatasets:\n  - path: a\n")
    config = load(path, WANTED)
    assert config.lines == {"model_name_or_path": 3, "use_peft": 5, "datasets": 6}
    assert config.keys == ("model_name_or_path", "use_peft", "datasets") and "datasets" not in config.values


TRICKY = [
    "a: &x {use_reentrant: false}\ngradient_checkpointing_kwargs: *x\n",  # an alias into a skipped part
    "base: &b {gradient_checkpointing: true}\n<<: *b\nadapter: lora\n",  # a top-level merge key
    '"gradient_checkpointing": true\n\'adapter\': lora\n',  # quoted keys
    "%YAML 1.1\n---\nadapter: lora\n...\n",  # directive, document start and end
    "adapter: |\n  line\n# a comment at column 0 ends the block scalar\nrl: dpo\n",
    "adapter: lora\r\ngradient_checkpointing: true\r\n",  # CRLF
    "gradient_checkpointing_kwargs: {use_reentrant: false,\n  every_n_layers: 2}\nadapter: lora\n",  # multi-line flow
    "adapter: lora\nadapter: qlora\n",  # a repeated key: the last wins
    "adapter: 'multi\n  line'\nrl: dpo\n",
    "datasets:\n- path: a\n  type: b\nadapter: lora\n",  # a list at column 0 under a key
    "? adapter\n: lora\n",  # a complex key
    "adapter: lora # trailing comment\ngradient_checkpointing: yes\n",
]


@pytest.mark.parametrize("text", TRICKY)
def test_the_fast_path_reads_what_a_full_load_reads(tmp_path, text):
    path = write(tmp_path, "cfg.yaml", text)
    full = yaml.safe_load(text)
    config = load(path, WANTED)
    assert config.values == {k: v for k, v in full.items() if k in WANTED}
    assert set(config.keys) == set(full)


KEYS = st.sampled_from([*sorted(WANTED), "datasets", "output_dir", "learning_rate", "x-y", "some.key"])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.floats(allow_nan=False),
    st.text(max_size=20),
    st.sampled_from(["false", "yes", "off", "offload", "~", "null", "1e-4", "0x1f", "2001-01-01", "a: b", "- x", "#"]),
)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(document=st.dictionaries(KEYS, VALUES, min_size=1, max_size=8), flow=st.booleans(), comment=st.booleans())
def test_generated_documents_read_as_a_full_load_reads_them(tmp_path, document, flow, comment):
    text = yaml.safe_dump(document, default_flow_style=flow, allow_unicode=True, sort_keys=False)
    if comment:
        text = "# generated\n---\n" + text.replace("\n", "\n# between\n", 1)
    path = write(tmp_path, "gen.yaml", text)
    expected = yaml.safe_load(text)
    config = load(path, WANTED)
    assert config.values == {k: v for k, v in expected.items() if k in WANTED}
    assert list(config.keys) == list(expected)


def big_axolotl_config(size: int = 5_000_000) -> str:
    head = "base_model: NousResearch/Llama-3.2-1B\ngradient_checkpointing: true\ndatasets:\n"
    entry = "  - path: org/dataset_{i}\n    type: alpaca\n    split: train[:{i}%]\n"
    parts, total, i = [head], len(head), 0
    while total < size:
        text = entry.format(i=i)
        parts.append(text)
        total += len(text)
        i += 1
    parts.append("adapter: qlora\nload_in_4bit: true\ngradient_checkpointing_kwargs:\n  use_reentrant: true\nrl: dpo\n")
    return "".join(parts)


def test_a_5mb_config_is_checked_in_under_2_seconds_with_the_right_facts(tmp_path):
    path = write(tmp_path, "big.yml", big_axolotl_config())
    assert (tmp_path / "big.yml").stat().st_size >= 5_000_000
    check_files([path], Launch(parser="model", nproc=2))  # warm up: imports, caches
    wall, cpu = time.perf_counter(), time.process_time()
    (report,) = check_files([path], Launch(parser="model", nproc=2))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    # CPU time: the machine running the tests is shared, so wall time also measures the other processes
    assert cpu < 2.0, f"{cpu:.2f} s CPU ({wall:.2f} s wall)"
    assert report.format == "axolotl" and report.facts is not None
    facts = report.facts
    assert (facts.gc_enabled, facts.use_reentrant, facts.is_peft, facts.quantization, facts.trainer_kind, facts.world_size) == (
        True,
        True,
        True,
        "bitsandbytes_4bit",
        "dpo",
        2,
    )
    assert report.status == "refused"  # Axolotl and the plugin refuse multi-GPU RL + QLoRA + reentrant
    assert {d.rule_id for d in report.decisions} >= {"axolotl:distributed-rl-qlora-reentrant", "distributed-rl-qlora-no-reentrant"}


def test_a_5mb_json_config_is_fast_too(tmp_path):
    document = {"gradient_checkpointing": True, "output_dir": "out", "padding": ["x" * 100] * 50_000}
    path = write(tmp_path, "big.json", json.dumps(document))
    start = time.process_time()
    config = load(path, WANTED)
    assert time.process_time() - start < 2.0
    assert config.values == {"gradient_checkpointing": True, "output_dir": "out"} and "padding" in config.keys
