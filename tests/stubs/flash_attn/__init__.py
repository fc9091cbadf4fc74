"""A stand-in for flash-attn (which does not build without CUDA): OpenRLHF imports these names at module level for
sample packing and ring attention; a run without packing never calls them."""
