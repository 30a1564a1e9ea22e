"""The decode step, captured whole by torch.compile (rollout(..., compile=True)).

ngc.decode_one_token has fixed shapes and no host syncs, so torch.compile takes it as one graph:
one CUDA graph per shape on CUDA ("reduce-overhead"), inductor's kernels launched from C++ on the
CPU. A captured graph reads and writes the KV cache and query window at fixed addresses, so a
model's buffers are kept and handed back, zeroed, to its next rollout of the same shape. Results
match eager up to float rounding.
"""
import functools
import weakref

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# CPU: the most cache slots for which the step uses SDPA's math backend. At decode sizes the
# fused CPU attention kernel costs 0.3-0.5 ms a call however few slots it reads; the math form,
# which inductor fuses into the step, grows with the slots and is the cheaper one up to about
# this many (measured on tiny/, batch 64, 2 cores). CUDA keeps SDPA's own choice.
SDPA_MATH_MAX_SLOTS = 128


@functools.cache
def compiled_step(step, cuda: bool, sdpa_math: bool):
    """`step` through torch.compile, whole (fullgraph: a host sync would be an error)."""
    if cuda:
        return torch.compile(step, mode="reduce-overhead", fullgraph=True)
    if sdpa_math:
        eager = step

        def step(*args):
            with sdpa_kernel(SDPBackend.MATH):
                return eager(*args)
    return torch.compile(step, fullgraph=True, options={"cpp_wrapper": True})  # launched from C++


# model -> (state_args, (cache, window)) its compiled step last ran on
CAPTURED = weakref.WeakKeyDictionary()


def captured_decode(model, step, new_state, state_args: tuple):
    """(cache, window, compiled step) for a rollout whose state_args = (batch, capacity, w, dtype,
    device): new_state(*state_args, tight=False) makes them, or the model's last ones are handed
    back, zeroed, so that CUDA graphs captured on their addresses replay instead of being captured
    again."""
    batch, capacity, w, dtype, device = state_args
    key = (batch, capacity, w, dtype, str(device))
    reused = model in CAPTURED and CAPTURED[model][0] == key
    if not reused:
        CAPTURED[model] = key, new_state(*state_args, tight=False)  # captured: reads all slots
    cache, window = CAPTURED[model][1]
    for t in cache.buffers() + (window.buffers() if window is not None else []):
        if reused:
            t.zero_()  # handed back: the last rollout's entries go
        else:
            torch._dynamo.mark_static_address(t)  # CUDA graphs read and write them in place
    cuda = torch.device(device).type == "cuda"
    return cache, window, compiled_step(step, cuda, not cuda and capacity <= SDPA_MATH_MAX_SLOTS)
