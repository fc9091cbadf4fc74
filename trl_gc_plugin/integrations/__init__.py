"""Plugins for training frameworks that load their extensions by a dotted path.

Nothing is imported here: each submodule imports its framework at its top and is loaded only by that framework
(`axolotl`: `plugins: [trl_gc_plugin.integrations.axolotl.SafeGCPlugin]`). `import trl_gc_plugin` never loads them.
"""
