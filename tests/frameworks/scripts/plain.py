"""A plain loop: no breakpod line unless MODE=explicit; under torchrun, DDP over gloo."""

import os

import torch
import torch.distributed as dist

from tests.frameworks.scripts import common

torch.manual_seed(0)
distributed = "WORLD_SIZE" in os.environ
if distributed:
    dist.init_process_group("gloo", timeout=__import__("datetime").timedelta(seconds=20))
model = common.Net()
common.poison(model.block)
net = torch.nn.parallel.DistributedDataParallel(model) if distributed else model
opt = torch.optim.SGD(net.parameters(), lr=0.05)
if common.EXPLICIT:
    import breakpod

    monitor = breakpod.watch(model, common.PARK_RULES, optimizer=opt)
stop = os.environ.get("STOP_FILE")  # one process: it steps until this file exists
for step in range(common.STEPS):
    if stop and os.path.exists(stop):
        break
    x, y = common.batch(step)
    loss = torch.nn.functional.cross_entropy(net(x), y)
    opt.zero_grad()
    loss.backward()
    common.user_step(step)
    opt.step()
    common.time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
common.finish(model)
if distributed:
    dist.destroy_process_group()
