"""Reading launcher configs for `trl-gc-check` (`trl_gc_plugin.configcheck.check`), one module per job:

- `load`: a file into a `Config` (YAML with libyaml, building only the keys some reader needs; JSON), or one clear
  `ConfigError`;
- `detect`: which launcher a config is for, from the keys each launcher module marks as its own;
- `trl`, `axolotl`, `llamafactory`, `training_args`: how each launcher reads its config (defaults, rewrites, its own
  verdicts as data), into a `Reading` of facts that say where they came from;
- `deepspeed`, `accelerate`, `model_config`: the files a config names (DeepSpeed and accelerate configs, a local
  model's `config.json`);
- `native`, `_worker`: the launchers' own parsers (TRL's `TrlParser`, LLaMA-Factory's `get_train_args`) in one clean
  subprocess with a time limit;
- `common`: the records (`Fact`, `Reading`, `LauncherRule`, `Context`) and typed access with errors naming the key.
"""
