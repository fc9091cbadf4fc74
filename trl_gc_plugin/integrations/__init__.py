"""Plugins for frameworks that load extensions by a dotted path (`plugins: [trl_gc_plugin.integrations.axolotl.
SafeGCPlugin]`): each imports its framework at its top and is loaded only by it, never by `import trl_gc_plugin`.
"""
