"""Cheap drafts from the target itself: an int8 copy (torch dynamic quantization of Linear).

Measured on SmolLM2-135M at 1 thread: ~0.35x the fp32 target's time per token. Weights are
quantized per tensor once at load; activations are quantized on the fly. CPU only (torch's
dynamic int8 kernels); a bf16 / fp16 target's copy is quantized from fp32 copies of its weights.
"""

from __future__ import annotations

import copy
import warnings

import torch


def int8_copy(model):
    """A dynamically quantized int8 copy of `model` on the CPU, whatever its dtype and device (the original is
    untouched): quantized from an fp32 copy of its weights, since torch's int8 kernels take fp32 activations."""
    params, buffers = list(model.parameters()), list(model.buffers())
    if all(t.device.type == "cpu" and t.dtype == torch.float32 for t in params + buffers if t.is_floating_point()):
        # modules copied, storage shared, Parameter objects new: the target's later .to(device) rebinds its own
        # Parameters' data, not the draft's (the Linear weights shared here are swapped out below)
        memo = {id(p): torch.nn.Parameter(p.data, p.requires_grad) for p in params} | {id(b): b for b in buffers}
        draft = copy.deepcopy(model, memo=memo)
    else:
        draft = copy.deepcopy(model).to("cpu", torch.float32)
    with warnings.catch_warnings():  # torch's notices that its quantized tensors are deprecated
        warnings.simplefilter("ignore")
        for module in list(draft.modules()):
            for name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(module, name, int8_linear(child))
    return draft.eval()


def int8_linear(linear: torch.nn.Linear):
    """torch's dynamic int8 Linear of `linear`, as `quantize_dynamic` makes it (its default weight observer: one
    symmetric scale per tensor), built without the full-size placeholder weight its constructor would prepack."""
    from torch.ao.nn.quantized.dynamic import Linear
    from torch.ao.quantization import default_dynamic_qconfig

    observer = default_dynamic_qconfig.weight()
    observer(linear.weight)
    scale, zero_point = observer.calculate_qparams()
    weight = torch.quantize_per_tensor(linear.weight.float(), float(scale), int(zero_point), torch.qint8)
    quantized = Linear(1, 1, dtype=torch.qint8)  # a 1x1 placeholder, then the real sizes and weight
    quantized.in_features, quantized.out_features = linear.in_features, linear.out_features
    quantized.set_weight_bias(weight, linear.bias)
    return quantized
