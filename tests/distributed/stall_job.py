"""A tiny DDP training job for the stall tests, run under torchrun (gloo, CPU).

STALL_RANK=2 STALL_KIND=block|spin STALL_AT=5 STEPS=200 COLLECTIVE=ddp|all_reduce
PARK_RANK=1 PARK_AT=3 (breakpoint() there)  PG_TIMEOUT=SECONDS (the process group's own)
WATCH=1 (breakpod.watch the model: monitors and the flight recorder)
STOP_FILE=PATH (every rank ends its loop at the step after PATH appears: a job that runs
until the test is done with it, however slowly a loaded machine started it)
LATE_RANK=N (fault injection: its watchdog hears of a job-wide break only once its training
thread passed the break's step, as a slow tick on a loaded node would, and never proposes one)
"""

import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import breakpod

RANK = int(os.environ["RANK"])
STALL_RANK = int(os.environ.get("STALL_RANK", "-1"))
STALL_AT = int(os.environ.get("STALL_AT", "5"))
STALL_KIND = os.environ.get("STALL_KIND", "block")
STALL_SECONDS = float(os.environ.get("STALL_SECONDS", "0")) or None
STEPS = int(os.environ.get("STEPS", "200"))
STEP_SLEEP = float(os.environ.get("STEP_SLEEP", "0"))
COLLECTIVE = os.environ.get("COLLECTIVE", "ddp")
PARK_RANK = int(os.environ.get("PARK_RANK", "-1"))
PARK_AT = int(os.environ.get("PARK_AT", "3"))
PG_TIMEOUT = float(os.environ.get("PG_TIMEOUT", "0")) or None
STOP_FILE = os.environ.get("STOP_FILE")
LATE_RANK = int(os.environ.get("LATE_RANK", "-1"))
# more parks: "RANK:STEP,RANK:STEP"
PARKS = set(filter(None, os.environ.get("PARKS", "").split(",")))
BREAK_AT = int(os.environ.get("BREAK_AT", "-1"))  # rank 0 asks for a job-wide break here
# this rank numbers its steps STEP_MULT times faster (ranks at different step counts)
FAST_RANK = int(os.environ.get("FAST_RANK", "-1"))
CRASH_RANK = int(os.environ.get("CRASH_RANK", "-1"))  # this rank raises at step CRASH_AT
CRASH_AT = int(os.environ.get("CRASH_AT", "3"))
STEP_MULT = int(os.environ.get("STEP_MULT", "2"))
LATE_SECONDS = 60.0  # at most


def fetch_batch(step):
    if RANK == STALL_RANK and step == STALL_AT:
        print(f"rank {RANK} stalls now", file=sys.stderr, flush=True)
        if STALL_KIND == "block":
            threading.Event().wait(STALL_SECONDS)  # a dataloader deadlock: blocked in C
        else:
            spin_forever()
    return torch.randn(8, 4)


def spin_forever():
    n = 0
    while True:  # pure Python, holding the GIL
        n += 1


def told_to_stop():
    """Rank 0 looks for STOP_FILE; every rank learns its answer, so all stop at one step."""
    flag = torch.tensor([float(RANK == 0 and os.path.exists(STOP_FILE))])
    dist.all_reduce(flag)
    return bool(flag.item())


def hear_breaks_late():
    from breakpod._job import pause

    follow = pause.JobPause._follow_break

    def late(self, board, step, speed):
        self.break_wanted = False  # another rank proposes the break
        if self.break_seen is None:
            doc = board.get(pause.BREAK_KEY)
            if doc is None:
                return  # no break yet (nor one for follow to read a moment later)
            deadline = time.monotonic() + LATE_SECONDS
            while self.passed < doc["step"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the training thread runs on, past the break's step
        follow(self, board, step, speed)

    pause.JobPause._follow_break = late


def main():
    if RANK == LATE_RANK:
        hear_breaks_late()
    timeout = datetime.timedelta(seconds=PG_TIMEOUT) if PG_TIMEOUT else None
    dist.init_process_group("gloo", timeout=timeout)
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if os.environ.get("WATCH"):
        breakpod.watch(model, optimizer=opt)
    for step in range(STEPS):
        if (RANK == PARK_RANK and step == PARK_AT) or f"{RANK}:{step}" in PARKS:
            breakpoint()
        if RANK == 0 and step == BREAK_AT:
            from breakpod._job import boundary

            print(f"rank 0 asks: {boundary.request_break()}", file=sys.stderr, flush=True)
        batch = fetch_batch(step)
        loss = model(batch).sum()
        opt.zero_grad()
        loss.backward()
        if RANK == CRASH_RANK and step == CRASH_AT:
            raise RuntimeError(f"rank {RANK} crashes at step {step}")
        if COLLECTIVE == "all_reduce":
            dist.all_reduce(loss.detach())
        opt.step()
        breakpod.step(step * STEP_MULT if RANK == FAST_RANK else None)
        time.sleep(STEP_SLEEP)
        if STOP_FILE and told_to_stop():
            break
    dist.barrier()
    total = sum(float(p.detach().double().sum()) for p in model.parameters())
    print(f"rank {RANK} done, parameters {total!r}", file=sys.stderr, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
