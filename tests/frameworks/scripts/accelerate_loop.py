"""An accelerate loop: Accelerator.prepare(model, optimizer), accelerator.backward(loss)."""

import torch
from accelerate import Accelerator

from tests.frameworks.scripts import common

torch.manual_seed(0)
accelerator = Accelerator(cpu=True)
model = common.Net()
common.poison(model.block)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
net, opt = accelerator.prepare(model, opt)
if common.EXPLICIT:
    import breakpod

    breakpod.watch(model, common.PARK_RULES, optimizer=opt)  # the AcceleratedOptimizer
for step in range(common.STEPS):
    x, y = common.batch(step)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    accelerator.backward(loss)
    common.user_step(step)
    opt.step()
common.finish(model)
