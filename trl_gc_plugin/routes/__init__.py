"""The routes into a run: the Trainer callback, the `TrainingArguments.__post_init__` patch, the model route for
loops without a Trainer. Each maps its events onto `runtime.run.Run`."""
