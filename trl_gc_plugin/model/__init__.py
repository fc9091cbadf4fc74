"""The model layer: the only code that reads checkpointing off a live model or writes it (`ckpt`), the hooks the
plugin puts around a model (`hooks`), and the facts read from arguments and models (`probe`). Imports `core`."""
