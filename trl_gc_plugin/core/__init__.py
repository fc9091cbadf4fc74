"""The pure core: facts, capabilities, the rule table, the engine, decisions, the mode policy, settings, errors.

Imports only `_base` and the standard library (no torch, no transformers): `trl-gc-check` and the start-up route
run it without either.
"""
