def _unavailable(*args, **kwargs):
    raise RuntimeError("flash-attn is not installed: sample packing / ring attention are unavailable")

index_first_axis = pad_input = rearrange = unpad_input = _unavailable
