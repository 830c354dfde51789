"""Quantize your own layer type by registering it in the dependency-injection container.

The layerwise backend replaces layers by *exact* class (as Brevitas does), so a subclass such as
``MyLinear(nn.Linear)`` below is left in float by default: a subclass may compute something else,
and silently swapping it for ``QuantLinear`` could change the model. When the subclass computes the
same thing as its base class (here it only changes the initialisation), tell the library so by
mapping it to a Brevitas class in the container's ``layer_map``, without patching the library.

Run: ``python examples/custom_layer.py`` (offline, < 1 minute).
"""

from __future__ import annotations

import brevitas.nn
import torch
from torch import nn

from quark_brevitas import DEFAULT_LAYER_MAP, Container, LayerMapping, ModelQuantizer
from quark_brevitas.cli.digits import evaluate, load_digits_data
from quark_brevitas.config.presets import get_preset

torch.set_num_threads(1)  # the model is tiny; extra threads only add overhead
torch.manual_seed(0)


class MyLinear(nn.Linear):
    """A user layer: nn.Linear with a zero-initialised bias; forward is nn.Linear's."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.bias is not None:
            nn.init.zeros_(self.bias)


# A small MLP for the 8x8 digits images, trained for a few seconds.
data = load_digits_data()
model = nn.Sequential(nn.Flatten(), MyLinear(64, 64), nn.ReLU(), MyLinear(64, 10))
optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
for _ in range(20):
    for images, target in data.train:
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), target).backward()
        optimizer.step()
model.eval()

# W8A8 as in the preset, with the default Preprocess step (it keeps modules that own parameters,
# such as MyLinear, whole while tracing, so the layer map still finds them).
config = get_preset("w8a8")


def show_plan(title: str, quantizer: ModelQuantizer) -> None:
    print(title)
    for row in quantizer.plan(model):
        print(f"  {row.name:<3} {row.module_type:<10} {'quantized' if row.layer_config else 'float'}")


# Before: the default container maps nn.Linear exactly, so MyLinear stays float.
show_plan("default layer map:", ModelQuantizer(config))

# After: add MyLinear -> brevitas.nn.QuantLinear (with the default quantizer arguments builder).
container = Container()
container.layer_map.override({**DEFAULT_LAYER_MAP, MyLinear: LayerMapping(brevitas.nn.QuantLinear)})
quantizer = ModelQuantizer(config, container=container)
show_plan("with MyLinear registered:", quantizer)

quant_model = quantizer.quantize_model(model, data.calib)
replaced = [name for name, module in quant_model.named_modules() if isinstance(module, brevitas.nn.QuantLinear)]
assert replaced == ["1", "3"], f"MyLinear layers were not replaced: {replaced}"
print("after quantize_model:", ", ".join(f"{name}: {type(m).__name__}" for name, m in quant_model.named_children()))
print(f"accuracy: float {evaluate(model, data.test):.2f} %, W8A8 {evaluate(quant_model, data.test):.2f} %")
