"""`trl-gc-check`: the rule engine on config files before launch, read the way each launcher reads them. Imports
`core` and `_base` only."""
