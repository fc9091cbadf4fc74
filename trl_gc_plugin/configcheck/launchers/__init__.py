"""Reading launcher configs for `trl-gc-check`: `load` a file, `detect` its launcher, read it as that launcher does
(one module each, into a `common.Reading`), with the files it names (`deepspeed`, `accelerate`, `model_config`) and the
launchers' own parsers in a subprocess (`native`, `_worker`).
"""
