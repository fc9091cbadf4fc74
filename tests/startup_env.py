"""Build the wheel and install it into a fresh venv the way a user would, for the start-up tests and benchmark.

The fresh venv sees the test environment's packages (torch, transformers, TRL...) through a plain path line in a
`.pth` file; directories added that way are not scanned for `.pth` files, so the project's editable install stays
invisible there and the wheel's `trl_gc_plugin.pth` / `.start` are the only start-up hooks in play.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def build_wheel(out: Path) -> Path:
    subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(out), str(ROOT)],
                   check=True, capture_output=True, text=True)
    (wheel,) = out.glob("trl_gc_plugin-*.whl")
    return wheel


def make_venv(path: Path, wheel: Path | None, extra_pth: str | None = None) -> Path:
    """A venv at `path` that sees this environment's packages, with `wheel` installed (or not), and optionally one
    more `.pth` file with `extra_pth` as content. Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    Path(purelib, "zz_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if extra_pth is not None:
        Path(purelib, "zzz_extra.pth").write_text(extra_pth)  # after the deps path line: it may import from there
    if wheel is not None:
        subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                        "--no-index", str(wheel)], check=True, capture_output=True, text=True)
    return python


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the plugin's variables (`_TRL_GC_PLUGIN_WARNED` included), `PYTHONPATH` and the
    launcher's rank variables the start-up hook reads, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRL_GC_PLUGIN", "_TRL_GC_PLUGIN", "PYTHONPATH")) and k not in ("RANK", "LOCAL_RANK")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env
