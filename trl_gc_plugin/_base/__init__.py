"""Base helpers every layer may use (stdlib only): on/off spellings, weak identity maps, the plugin's logging."""
