"""What the launcher readers of `trl-gc-check` share: the records (`common`), loading a file (`load`), bash as it
expands a command (`shell`), the side files a config names (`deepspeed`, `accelerate`, `model_config`) and the
launchers' own parsers run in a subprocess (`native`, `_worker`). Imports no launcher reader (`configcheck.launchers`).
"""
