"""One run, whatever route drives it (`run.Run`), and the checks of its first step and of every step. Imports
`planning`, `model` and `core`."""
