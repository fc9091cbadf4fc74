"""The command lines: `trl-gc-check` (`check`), `trl-gc-plan` (`plan`, its `--plot` in `plot`) and
`python -m trl_gc_plugin` (`main`: `rules`, `check`, `plan`). Entry points: they may import any layer."""
