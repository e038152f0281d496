"""A plain loop that reports what debug mode installed and counted (no breakpod line in
the loop; it only looks at breakpod's state at the end). Env: OPTIMIZERS=2 (a GAN-like
pair), ACCUMULATE=N (forwards per step), EVAL_SECONDS, HANG_SECONDS (at step 3),
EXPLICIT_STEP=1 (the loop calls breakpod.step() itself), SCALER=1 (a GradScaler, which
skips the step whose gradients are not finite)."""

import os
import sys
import time

import torch
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

from tests.frameworks.scripts import common


def hooks() -> str:
    return (
        f"pre={len(torch_optimizer._global_optimizer_pre_hooks)} "
        f"post={len(torch_optimizer._global_optimizer_post_hooks)} "
        f"forward={len(torch_module._global_forward_pre_hooks)}"
    )


print("before", hooks(), "loaded" if "breakpod" in sys.modules else "unloaded", flush=True)
torch.manual_seed(0)
model = common.Net()
critic = torch.nn.Linear(4, 1)
common.poison(model.block)
opts = [torch.optim.SGD(model.parameters(), lr=0.05)]
if os.environ.get("OPTIMIZERS") == "2":
    opts.append(torch.optim.SGD(critic.parameters(), lr=0.05))
accumulate = int(os.environ.get("ACCUMULATE", "1"))
scaler = torch.amp.GradScaler("cpu") if os.environ.get("SCALER") else None  # skips NaN steps
for step in range(common.STEPS):
    for micro in range(accumulate):
        x, y = common.batch(step * accumulate + micro)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y) + critic(out.detach()).mean()
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if step == 3 and os.environ.get("HANG_SECONDS"):
        time.sleep(float(os.environ["HANG_SECONDS"]))
    if step == 3 and os.environ.get("EVAL_SECONDS"):
        model.eval()
        with torch.no_grad():
            end = time.monotonic() + float(os.environ["EVAL_SECONDS"])
            while time.monotonic() < end:
                model(x)
                time.sleep(0.05)
        model.train()
    for opt in opts:
        scaler.step(opt) if scaler is not None else opt.step()
        opt.zero_grad()
    if scaler is not None:
        scaler.update()
    if os.environ.get("EXPLICIT_STEP"):
        import breakpod

        breakpod.step()
boundary = sys.modules.get("breakpod._job.boundary")
active = boundary.active() if boundary else None
autowatch = sys.modules.get("breakpod._integrations.autowatch")
watched = [type(m.model).__name__ for m in autowatch.monitors()] if autowatch else []
print("after", hooks(), f"steps={getattr(active, 'step', None)} watched={watched}", flush=True)
common.finish(model)
