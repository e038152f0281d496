"""The hooks on a watched model's own call run once per call, eagerly, compiled or not.

Inside a dynamo trace they leave only a mark; at the next eager moment they move onto the
compiled call that runs the model (root_hooks.py). Each case here runs in a child process
of its own (dynamo's caches are process-wide) with the ``eager`` backend."""

from __future__ import annotations

import os
import textwrap

import pytest
import torch

from breakpod._monitor.root_hooks import RootHooks, compiled_wrappers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))

CALLS = """
    import sys
    import torch
    from torch import nn
    from breakpod._monitor.root_hooks import RootHooks

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    root = RootHooks(model)
    calls = []
    root.pre.append(lambda m, args, kwargs: calls.append(("pre", tuple(args[0].shape))))
    root.post.append(lambda m, args, out: calls.append(("post", out is not None)))
    case = sys.argv[1]
    if case == "in-place":
        model.compile(backend="eager")
        run = model
    elif case == "compiled-before-hooks":  # compiled and run, then watched: dynamo retraces
        root.close()
        run = torch.compile(model, backend="eager")
        run(torch.randn(3, 4))
        root = RootHooks(model)
        root.pre.append(lambda m, args, kwargs: calls.append(("pre", tuple(args[0].shape))))
        root.post.append(lambda m, args, out: calls.append(("post", out is not None)))
    else:
        run = torch.compile(model, backend="eager", fullgraph=True)
        other = torch.compile(model, backend="aot_eager")  # for evaluation, say

    def step(batch):
        calls.clear()
        run(torch.randn(batch, 4)).sum().backward()  # the gradient hook settles
        return list(calls)

    print("first", step(2), root.moved)  # its graph marked it; its gradient moved them
    print("second", step(3), root.moved)
    if case == "fullgraph":
        with torch.compiler.set_stance("force_eager"):  # the graph falls back to eager
            print("eager", step(4))
        try:
            run("not a tensor")
        except Exception:
            pass
        print("after a failed call", step(5))
        calls.clear()
        model(torch.randn(6, 4))  # the model called itself, eagerly
        print("direct", calls)
        calls.clear()
        other(torch.randn(8, 4))
        print("the other wrapper", calls)
        run = torch.compile(model, backend="eager")  # made after the hooks moved
        print("a later wrapper", step(2), step(3))
    root.close()
    print("closed", step(7), model._forward_hooks, model._forward_pre_hooks)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["fullgraph", "in-place", "compiled-before-hooks"])
def test_the_root_hooks_run_once_per_call_outside_the_compiled_graph(spawn, case):
    child = spawn(textwrap.dedent(CALLS), env={"PYTHONPATH": ROOT}, args=[case])
    assert child.wait(timeout=180) == 0, child.stderr
    out = child.stdout()
    assert "first [] True" in out, out  # traced: the first step is not seen, then moved
    assert "second [('pre', (3, 4)), ('post', True)] True" in out, out
    assert "closed [] OrderedDict() OrderedDict()" in out, out
    if case == "fullgraph":
        assert "eager [('pre', (4, 4)), ('post', True)]" in out, out  # once, not twice
        assert "after a failed call [('pre', (5, 4)), ('post', True)]" in out, out
        assert "direct [('pre', (6, 4)), ('post', True)]" in out, out
        assert "the other wrapper [('pre', (8, 4)), ('post', True)]" in out, out
        # its first step marks the model traced again: the next finds it
        assert "a later wrapper [] [('pre', (3, 4)), ('post', True)]" in out, out
    assert "Traceback" not in child.stderr, child.stderr


INSIDE_A_FUNCTION = """
    import sys
    import torch
    from torch import nn
    import breakpod

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = breakpod.watch(model, optimizer=opt)
    if sys.argv[1] == "with-an-unused-wrapper":  # as Lightning: it compiles training_step
        unused = torch.compile(model, backend="eager", fullgraph=True)

    @torch.compile(backend="eager", fullgraph=True)
    def forward(x):
        return model(x).pow(2).mean()

    for step in range(4):
        loss = forward(torch.randn(8, 4))
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("trained", monitor.step_count, monitor.errors, monitor._root.moved)
"""


@pytest.mark.timeout(200)
@pytest.mark.parametrize("case", ["alone", "with-an-unused-wrapper"])
def test_a_model_inside_a_compiled_function_trains_and_says_what_it_misses(spawn, case):
    """No eager call of the model's own to move to: nothing breaks, and it says so once.
    A wrapper that no one calls takes the hooks at first, and the next step, still not
    captured, tells the sentinel that they run nowhere (it was silent, the hooks moved)."""
    child = spawn(textwrap.dedent(INSIDE_A_FUNCTION), env={"PYTHONPATH": ROOT}, args=[case])
    assert child.wait(timeout=180) == 0, child.stderr
    moved = case == "with-an-unused-wrapper"
    assert f"trained 4 0 {moved}" in child.stdout(), child.stderr
    said = [line for line in child.stderr.splitlines() if "inside a function compiled" in line]
    assert len(said) == (1 if moved else 2), child.stderr  # the root hooks', the sentinel's
    assert "compile the model itself" in said[0] or moved, said
    assert "not seen in a training step" in said[-1], said


def test_every_wrapper_is_found_through_ddp_and_never_for_a_larger_model():
    """Only a chain of wrappers runs the model with the model's inputs: a compiled larger
    model that contains it calls it with its own."""
    from torch._dynamo.eval_frame import OptimizedModule

    model = torch.nn.Linear(2, 2)

    class DistributedDataParallel(torch.nn.Module):  # the wrapper's shape, by class name
        def __init__(self, module: torch.nn.Module) -> None:
            super().__init__()
            self.module = module

    outer = torch.nn.Sequential(model, torch.nn.ReLU())
    larger = torch.compile(outer, backend="eager")
    assert isinstance(larger, OptimizedModule)
    assert compiled_wrappers(model) == []
    wrapped = torch.compile(DistributedDataParallel(model), backend="eager")
    evaluation = torch.compile(model, backend="eager", mode="max-autotune-no-cudagraphs")
    found = compiled_wrappers(model)
    assert len(found) == 2 and {id(w) for w in found} == {id(wrapped), id(evaluation)}
    del larger, wrapped, evaluation


def test_a_lazy_model_gets_its_gradient_hook_never():
    """A lazy module's parameters are not made before its first forward."""
    model = torch.nn.LazyLinear(3)
    own = len(model._forward_pre_hooks)  # the lazy module's, which makes its parameters
    root = RootHooks(model)
    assert len(root._handles) == 2  # the two forward hooks, no gradient hook
    root.close()
    assert not model._forward_hooks and len(model._forward_pre_hooks) == own


def test_a_parameter_that_takes_no_hook_never_fails_watch(capfd):
    """A parameter type of some library that refuses autograd hooks: the step's end alone
    settles the root hooks, and watch() says so instead of raising."""

    class NoHooks(torch.nn.Parameter):
        def register_post_accumulate_grad_hook(self, hook):  # type: ignore[no-untyped-def]
            raise RuntimeError("this parameter type takes no hooks")

    model = torch.nn.Linear(2, 2)
    model.weight = NoHooks(torch.randn(2, 2))
    root = RootHooks(model)
    assert len(root._handles) == 2
    assert "no gradient hook on NoHooks (this parameter type takes no hooks)" in (
        capfd.readouterr().err
    )
    root.close()
