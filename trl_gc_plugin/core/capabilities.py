"""What the installed transformers / TRL / DeepSpeed / torch can do, read off the installed package (signature when
imported, else a text search of its sources: importing transformers costs seconds), not inferred from version numbers:
a version gate is wrong off the pinned stacks (`every_n_layers` works from 5.16, not 5.23) and would refuse on a newer
release. The checker (`--transformers-version X`) maps a version through `TRANSFORMERS_FIRST`, read from the released
wheels; a version newer than every tested one gets the newest capabilities.

| capability | transformers | read in the wheels of |
|---|---|---|
| `checkpointing_layer` (`GradientCheckpointingLayer`, `every_n_layers` needs it) | 4.52.0 | 4.51.3 (absent), 4.52.0 |
| `none_kwargs_reentrant` False (kwargs None -> non-reentrant) | 5.0.0 | 4.57.6 (`{"use_reentrant": True}`), 5.0.0 |
| `enable_adds_input_hook` (enabling calls `enable_input_require_grads()`, `input_ids` models) | 5.0.0 | 4.57.6, 5.0.0 |
| `every_n_layers` (model signature and Trainer pops it from the kwargs) | 5.16.0 | 5.15.0 (absent), 5.16.0 |
| `empty_kwargs_to_none` (Trainer: `gc_kwargs or None`, so `{}` means the model default) | 5.16.0 | 5.15.0, 5.16.0 |
| `offload` (signature, `save_on_cpu(pin_memory=True)`; Trainer pops it) | 5.17.0 | 5.16.0 (absent), 5.17.0, 5.22.0 |
| `activation_fields` (`TrainingArguments.activation_checkpointing*`) | 5.23.0 | 5.22.0 (absent), 5.23.0, 5.24.0 |
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import inspect
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

TRANSFORMERS_FIRST: dict[str, str] = {
    "checkpointing_layer": "4.52.0",
    "enable_adds_input_hook": "5.0.0",
    "every_n_layers": "5.16.0",
    "empty_kwargs_to_none": "5.16.0",
    "offload": "5.17.0",
    "activation_fields": "5.23.0",
}
"""The first transformers release with each capability, read from the released wheels (module docstring)."""

NON_REENTRANT_DEFAULT_FROM = "5.0.0"
"""`gradient_checkpointing_enable(None)` means `{"use_reentrant": True}` before 5.0, `False` from 5.0 (PR 43203)."""

TESTED_TRANSFORMERS = ("4.53.2", "4.57.6", "5.15.0", "5.16.0", "5.17.0", "5.22.0", "5.23.0", "5.24.0")
"""Releases whose sources the table was checked against (tests/test_capabilities.py)."""

DEEPSPEED_RECOMPUTE_FIX = "0.19.3"
"""DeepSpeed PR 8148 (`in_checkpoint_recompute` in `partitioned_param_coordinator.py`): absent in 0.19.2."""

FSDP2_RECOMPUTE_CASTS = "2.13.0"
"""The first torch whose FSDP2 casts a recompute's inputs and outputs as its forward did (pytorch #159359)."""

TRL_OFFLOAD_FIXES = "1.14.0"
"""The first TRL whose `OffloadActivations` has the stream fixes of trl PRs 7195 and 5700 (wheels read: 1.10-1.13 have
only PR 5700, 0.26.2 and older neither)."""


@dataclass(frozen=True)
class Capabilities:
    """What the checkpointing stack can do; `None`: not known (a rule gating on it does not apply). `source`:
    `installed`, `table` (mapped from a version), `newest` (newer than every tested one) or `unknown`. Fields beyond
    the table in the module docstring: `trl_reenables_per_step` (TRL's `disable_gradient_checkpointing` re-enables
    with the raw kwargs), `deepspeed_recompute_fix` (`in_checkpoint_recompute`), `fsdp2_recompute_casts` (without
    them a non-reentrant recompute under FSDP2 mixed precision fails with a dtype `CheckpointError`),
    `trl_offload_stream_fixes` (`TRL_OFFLOAD_FIXES`)."""

    transformers: str | None = None
    source: str = "unknown"
    checkpointing_layer: bool | None = None
    none_kwargs_reentrant: bool | None = None
    enable_adds_input_hook: bool | None = None
    every_n_layers: bool | None = None
    empty_kwargs_to_none: bool | None = None
    offload: bool | None = None
    activation_fields: bool | None = None
    trl_reenables_per_step: bool | None = None
    deepspeed_recompute_fix: bool | None = None
    trl_offload_stream_fixes: bool | None = None
    fsdp2_recompute_casts: bool | None = None

    def layer_kwargs(self) -> frozenset[str]:
        """The checkpointing kwargs this transformers takes out and applies itself (`every_n_layers`, `offload`)."""
        return frozenset(k for k in ("every_n_layers", "offload") if getattr(self, k) is True)


# --- from a version (the config checker, hand-made facts) ----------------------------------------------------------


def _release(version: str) -> tuple[int, ...] | None:
    head = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in head.group(1).split(".")) if head else None


def _at_least(version: tuple[int, ...], first: str) -> bool:
    want = _release(first) or ()
    width = max(len(version), len(want))
    return version + (0,) * (width - len(version)) >= want + (0,) * (width - len(want))


@functools.lru_cache(maxsize=64)
def _transformers_for(version: str | None) -> Capabilities:
    parsed = _release(version) if version else None
    if parsed is None:
        return Capabilities(transformers=version)
    newest = _release(TESTED_TRANSFORMERS[-1]) or ()
    values: dict[str, Any] = {name: _at_least(parsed, first) for name, first in TRANSFORMERS_FIRST.items()}
    values["none_kwargs_reentrant"] = not _at_least(parsed, NON_REENTRANT_DEFAULT_FROM)
    return Capabilities(transformers=version, source="newest" if parsed > newest else "table", **values)


def for_versions(versions: Mapping[str, str | None]) -> Capabilities:
    """Capabilities for a set of versions (`--transformers-version X`, hand-made `Facts`), from `TRANSFORMERS_FIRST`
    and `PACKAGE_FIXES`; TRL's per-step re-enable is left unknown."""
    caps = _transformers_for(versions.get("transformers"))
    for name, package, first, _ in PACKAGE_FIXES:
        release = _release(versions.get(package) or "")
        if release is not None:
            caps = replace(caps, **{name: _at_least(release, first)})
    return caps


# --- detected from the installed packages --------------------------------------------------------------------------


def _package_dir(name: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


_ENABLE_DEF = re.compile(r"def (?:gradient|activation)_checkpointing_enable\((.*?)\)\s*(?:->[^:]*)?:", re.S)


def _imported(name: str, tf_dir: Path) -> Any:
    """The module `name` of transformers when it is imported from `tf_dir`, else None."""
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None)
    return module if origin and Path(origin).resolve().parent == tf_dir.resolve() else None


def _enable_parameters(tf_dir: Path) -> set[str]:
    """Parameter names of `gradient_checkpointing_enable` / `activation_checkpointing_enable` (the signature when
    transformers is imported from `tf_dir`, else the source text)."""
    module = _imported("transformers.modeling_utils", tf_dir)
    model_cls = getattr(module, "PreTrainedModel", None) if module is not None else None
    if model_cls is not None:
        enables = [getattr(model_cls, f"{kind}_checkpointing_enable", None) for kind in ("gradient", "activation")]
        return {name for method in enables if method is not None for name in inspect.signature(method).parameters}
    found = _ENABLE_DEF.findall(_read(tf_dir / "modeling_utils.py"))
    return {p.split(":")[0].split("=")[0].strip().lstrip("*") for params in found for p in params.split(",")}


TORCH_POPPED_KWARGS = ("preserve_rng_state",)
"""Keywords `torch.utils.checkpoint.checkpoint` takes out of its `**kwargs` (not in its signature)."""
TORCH_DOCUMENTED_KWARGS = frozenset({"use_reentrant", "context_fn", "determinism_check", "debug", "early_stop"})
_CHECKPOINT_DEF = re.compile(r"^def checkpoint\(.*?\)\s*(?:->[^:]*)?:", re.S | re.M)


@functools.lru_cache(maxsize=1)
def torch_checkpoint_keywords() -> frozenset[str]:
    """The keywords the installed `torch.utils.checkpoint.checkpoint` reads (torch is never imported for it): its
    keyword-only parameters and `preserve_rng_state`; torch's documented set when torch cannot be read."""
    module = sys.modules.get("torch.utils.checkpoint")
    named: frozenset[str] = frozenset()
    if module is not None:
        params = inspect.signature(module.checkpoint).parameters.values()
        named = frozenset(p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY)
    else:
        found = _CHECKPOINT_DEF.search(_source("torch", None, "utils", "checkpoint.py") or "")
        try:
            header = ast.parse(found.group(0) + " pass").body[0] if found is not None else None
        except SyntaxError:
            header = None
        if isinstance(header, ast.FunctionDef):
            named = frozenset(arg.arg for arg in header.args.kwonlyargs)
    return (named or TORCH_DOCUMENTED_KWARGS) | frozenset(TORCH_POPPED_KWARGS)


def _has_activation_fields(tf_dir: Path) -> bool:
    module = _imported("transformers.training_args", tf_dir)
    args_cls = getattr(module, "TrainingArguments", None) if module is not None else None
    if args_cls is not None:
        return "activation_checkpointing_kwargs" in getattr(args_cls, "__dataclass_fields__", {})
    return re.search(r"^\s+activation_checkpointing_kwargs\s*:", _read(tf_dir / "training_args.py"), re.M) is not None


PACKAGES = ("transformers", "trl", "peft", "torch", "accelerate", "deepspeed", "bitsandbytes")


@functools.lru_cache(maxsize=1)
def installed_versions() -> dict[str, str | None]:
    """Installed versions of the packages the rules gate on (package metadata: nothing is imported)."""
    return {name: installed_version(name) for name in PACKAGES}


def installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def detect_transformers(tf_dir: Path | None = None) -> Capabilities:
    """The transformers capabilities read off the installed package (or the package directory `tf_dir`)."""
    tf_dir = tf_dir or _package_dir("transformers")
    if tf_dir is None or not (tf_dir / "modeling_utils.py").is_file():
        return Capabilities()
    params = _enable_parameters(tf_dir)
    modeling = _read(tf_dir / "modeling_utils.py")
    trainer = _read(tf_dir / "trainer.py")
    default = re.search(r'_kwargs = \{"use_reentrant": (True|False)\}', modeling)
    return Capabilities(
        transformers=installed_version("transformers") if tf_dir == _package_dir("transformers") else None,
        source="installed",
        checkpointing_layer="class GradientCheckpointingLayer" in _read(tf_dir / "modeling_layers.py"),
        none_kwargs_reentrant=None if default is None else default.group(1) == "True",
        enable_adds_input_hook='main_input_name == "input_ids"' in modeling,
        every_n_layers="every_n_layers" in params and 'pop("every_n_layers"' in trainer,
        empty_kwargs_to_none="gc_kwargs or None" in trainer,
        offload="offload" in params and 'pop("offload"' in trainer,
        activation_fields=_has_activation_fields(tf_dir),
    )


def detect_trl(trl_dir: Path | None = None) -> bool | None:
    """Whether the installed TRL's trainers re-enable checkpointing every step (`disable_gradient_checkpointing`)."""
    trl_dir = trl_dir or _package_dir("trl")
    if trl_dir is None or not (trl_dir / "trainer").is_dir():
        return None
    return any("disable_gradient_checkpointing(" in _read(p) for p in sorted((trl_dir / "trainer").glob("*.py")))


_LIVE_STREAM = re.compile(r"@property\s+def s0\(")
_EXIT = re.compile(r"def __exit__\(.*?(?=\n    def |\Z)", re.S)


def _source(package: str, root: Path | None, *parts: str) -> str | None:
    """The text of `parts` in the package directory `root` (default: the installed `package`'s); None when absent."""
    root = root or _package_dir(package)
    path = root.joinpath(*parts) if root is not None else None
    return _read(path) if path is not None and path.is_file() else None


def detect_trl_offload(trl_dir: Path | None = None) -> bool | None:
    """Whether TRL's `OffloadActivations` has the stream fixes (`TRL_OFFLOAD_FIXES`): the compute stream a property,
    offset views cloned before the transfer stream waits, `__exit__` synchronizing; and, where it deduplicates saved
    tensors by storage address (`storage_to_tensor_id`, trl PR 4247), an entry dropped when its tensor is released
    (trl PR 6241: else the allocator hands a freed address to a new tensor, which is then not offloaded; wheels read:
    0.26.2 lacks it, 1.10.0 and later have it)."""
    text = _source("trl", trl_dir, "models", "activation_offloading.py")
    if text is None:
        return None
    clone, wait = text.find("activation.clone(memory_format"), text.find("self.s1.wait_stream(self.s0)")
    exit_body = _EXIT.search(text)
    dedupe_released = "storage_to_tensor_id" not in text or bool(_DEDUPE_RELEASED.search(text))
    return bool(
        _LIVE_STREAM.search(text)
        and -1 < clone < wait
        and exit_body is not None
        and "synchronize()" in exit_body.group(0)
        and dedupe_released
    )


_DEDUPE_RELEASED = re.compile(r"del self\.storage_to_tensor_id\[|self\.storage_to_tensor_id\.pop\(")


_PRE_BACKWARD = re.compile(r"def _pre_forward\(.*?TrainingState\.PRE_BACKWARD:(.*?)\n        [^\s#]", re.S)


def detect_fsdp2_recompute_casts(torch_dir: Path | None = None) -> bool | None:
    """Whether torch's FSDP2 casts a recompute's inputs (`FSDPState._pre_forward`'s PRE_BACKWARD branch)."""
    text = _source("torch", torch_dir, "distributed", "fsdp", "_fully_shard", "_fsdp_state.py")
    if text is None:
        return None
    branch = _PRE_BACKWARD.search(text)
    return branch is not None and "_cast_forward_inputs(" in branch.group(1)


def detect_deepspeed(ds_dir: Path | None = None) -> bool | None:
    """Whether DeepSpeed has the `in_checkpoint_recompute` guard (PR 8148, 0.19.3)."""
    text = _source("deepspeed", ds_dir, "runtime", "zero", "partitioned_param_coordinator.py")
    return None if text is None else "in_checkpoint_recompute" in text


PACKAGE_FIXES = (
    ("trl_offload_stream_fixes", "trl", TRL_OFFLOAD_FIXES, detect_trl_offload),
    ("fsdp2_recompute_casts", "torch", FSDP2_RECOMPUTE_CASTS, detect_fsdp2_recompute_casts),
    ("deepspeed_recompute_fix", "deepspeed", DEEPSPEED_RECOMPUTE_FIX, detect_deepspeed),
)
"""(capability, distribution, first release with it, its reader of the installed source), beside transformers'."""


@functools.lru_cache(maxsize=1)
def installed() -> Capabilities:
    """The capabilities of the installed stack (read once per process)."""
    fixes = {name: detect() for name, _, _, detect in PACKAGE_FIXES}
    return replace(detect_transformers(), trl_reenables_per_step=detect_trl(), **fixes)


def for_check(versions: Mapping[str, str | None]) -> Capabilities:
    """The capabilities for the checker: per package, the installed ones where the version asked for is the
    installed one, else the table's for that version."""
    if versions.get("transformers") == installed_version("transformers"):
        caps = installed()
        for name, package, _, _ in PACKAGE_FIXES:
            wanted = versions.get(package)
            if wanted is not None and wanted != installed_version(package):
                caps = replace(caps, **{name: getattr(for_versions({package: wanted}), name)})
        return caps
    table = for_versions(versions)
    for name, package, _, detect in PACKAGE_FIXES:
        if versions.get(package) == installed_version(package):
            table = replace(table, **{name: detect()})
    return table
