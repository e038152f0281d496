"""What ``replay`` needs of each step, kept cheaply while the job trains.

At the watched model's root forward (a pre-hook): references to its inputs
(detached, not copied: training code rarely writes into a batch in place),
the RNG states (CPU and every initialised CUDA device) and copies of the
model's buffers (BatchNorm's running stats change during forward). On the
output tensor: the gradient that flowed into it, so a replay needs no
knowledge of the loss. Only the last forward is kept; each one replaces it.

On by default when a rule parks (``break``, the only place ``replay`` runs)
or in debug mode (``ENABLE_REMOTE_DEBUG=1``); ``watch(..., replay=True/False)`` or
``BREAKPOD_REPLAY=1/0`` decide explicitly. Off means no hook at all.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from breakpod._core.announce import announce
from breakpod._core.config import ENV, env_flag
from breakpod._monitor.checks import all_finite
from breakpod._monitor.peers import in_synced_ddp_forward
from breakpod._monitor.root_hooks import RootHooks

REPLAY_ENV = "BREAKPOD_REPLAY"
DEBUG_ENV = ENV["enabled"]  # debug mode: ENABLE_REMOTE_DEBUG
# > 0 while a replay or whatif runs: the monitor's own hooks stand aside (hooks read it
# directly: a call per hook is measurable on models of hundreds of small modules)
REPLAYING = [0]


def replaying() -> bool:
    """True while a replay re-runs a step (the monitor must not record it as a new step)."""
    return REPLAYING[0] > 0


@contextlib.contextmanager
def replay_in_progress() -> Iterator[None]:
    REPLAYING[0] += 1
    try:
        yield
    finally:
        REPLAYING[0] -= 1


OWN_OPS = [0]  # > 0 while a probe's hook runs in a replay: its ops are not the model's


@contextlib.contextmanager
def own_ops() -> Iterator[None]:
    """The monitor's own tensor ops (a probe's statistics in a replay), which the replay's
    op check must not take for the model's: a fresh staging block is uninitialized memory,
    and may read as NaN."""
    OWN_OPS[0] += 1
    try:
        yield
    finally:
        OWN_OPS[0] -= 1


def as_own(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, its tensor ops the monitor's own (:func:`own_ops`)."""
    with own_ops():
        return fn(*args)


def capture_wanted(
    explicit: bool | None, parks: bool, environ: Mapping[str, str] | None = None
) -> bool:
    """``replay=`` argument > ``BREAKPOD_REPLAY`` > on when a rule parks or in debug mode."""
    if explicit is not None:
        return bool(explicit)
    debug = env_flag(DEBUG_ENV, False, environ)  # read first: a typo in it is said either way
    return env_flag(REPLAY_ENV, parks or debug, environ)


@dataclasses.dataclass
class StepInputs:
    """One forward of the root module: enough to run it again, bit for bit."""

    step: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng_cpu: Any
    rng_cuda: list[Any]
    buffers: dict[str, Any]
    # the gradient each output that needed one got (a model may return several: the
    # NaN may come back through any of them), in the order grad_outputs gives them
    output_grads: list[Any] = dataclasses.field(default_factory=list)
    autocast: tuple[tuple[str, Any], ...] = ()  # (device type, dtype) autocast was on for
    forwards: int = 1  # forwards seen in this step (gradient accumulation replays the last)
    # per output, a 0-d bool on its device: were its values finite? Read only when a
    # replay's outputs are finite, to tell a step that did not reproduce (a fault that
    # depends on state outside the capture) from a NaN the loss function made
    finite: list[Any] = dataclasses.field(default_factory=list)
    # the forward ran inside DDP's, whose backward averages the gradients over the ranks
    # (the watched model may be the module DDP holds, as debug mode and HF's callbacks see it)
    averaged: bool = False
    # the function the call ran in place of the model's forward: patched onto the instance
    # for that call, which removed it (Lightning's DDP runs training_step so); the replay
    # runs it again. None: the model's own forward
    method: Any = None


class Capture:
    """Hooks on the root module that keep the last forward's :class:`StepInputs`."""

    def __init__(self, root: RootHooks, clock: Callable[[], int]) -> None:
        model = root.model
        self.model = model
        self._root = root
        self.last: StepInputs | None = None
        self.errors = 0
        self._clock = clock
        # Only running statistics change during forward; other buffers are left alone.
        self._stateful = [
            (name, m)
            for name, m in model.named_modules()
            if getattr(m, "track_running_stats", False)
        ]
        self._kept: dict[str, Any] = {}  # the last copies of the running statistics
        self._kept_to: list[Any] = []  # the same, in order
        self._kept_from: list[Any] = []  # the buffers they copy
        # The instance's forward at a call's start. A patch for one call only (Lightning's
        # DDP runs training_step through forward so, and unpatches it inside) is kept for
        # the replay (StepInputs.method); one made during the call leaves nothing a replay
        # can call: seen once, no step is captured (``redirected``).
        self._forward: Any = None  # the instance's forward when the call began
        self.redirected = False
        root.pre.append(self._before)
        root.post.append(self._after)

    def _before(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if replaying() or self.redirected:
            return
        self._forward = module.__dict__.get("forward")
        try:
            step = self._clock()
            forwards = self.last.forwards + 1 if self.last and self.last.step == step else 1
            self.last = StepInputs(
                step,
                _detached(args),
                _detached(kwargs),
                *rng_states(),
                self._running_stats(),
                forwards=forwards,
                autocast=autocast_state(),
                averaged=in_synced_ddp_forward(),
            )
        except Exception as e:  # never into training
            self._failed(e)

    def _running_stats(self) -> dict[str, Any]:
        """The running statistics a forward in training mode will change, copied into
        buffers kept from step to step (one fused copy, nothing allocated; allocated
        again only when the set of buffers changes, e.g. a module set to eval, or a
        buffer replaced). Step after step the same buffer objects: told in one pass."""
        import torch

        live = [
            b for _, m in self._stateful if m.training for b in m._buffers.values() if b is not None
        ]
        if len(live) != len(self._kept_from) or any(
            b is not k for b, k in zip(live, self._kept_from, strict=True)
        ):
            self._keep(live)
        elif live:
            torch._foreach_copy_(self._kept_to, live)
        return self._kept

    def _keep(self, live: list[Any]) -> None:
        """Copies of ``live``'s buffers, by name (a lazy module's, not made yet: none)."""
        import torch

        is_lazy = torch.nn.parameter.is_lazy
        named = [
            (f"{name}.{key}" if name else key, b.detach())
            for name, m in self._stateful
            if m.training
            for key, b in m._buffers.items()
            if b is not None and not is_lazy(b)  # a lazy module's, before its first forward
        ]
        self._kept = {n: b.clone() for n, b in named}
        self._kept_to = list(self._kept.values())
        lazy = len(named) != len(live)  # looked at again next step, until they are made
        self._kept_from = [] if lazy else live

    def _after(self, module: Any, args: Any, output: Any) -> None:
        if replaying() or self.last is None:
            return
        if module.__dict__.get("forward") is not self._forward:
            if self._forward is None:  # patched during the call: nothing a replay can call
                self.redirected, self.last = True, None
                return
            self.last.method = self._forward  # the one-call patch, gone now
        try:
            outs = grad_outputs(output)
            self.last.output_grads = [None] * len(outs)
            self.last.finite = [all_finite(out.detach()) for out in outs]
            for i, out in enumerate(outs):
                out.register_hook(functools.partial(self._on_grad, self.last, i))
        except Exception as e:  # never into training
            self._failed(e)

    def _on_grad(self, captured: StepInputs, index: int, grad: Any) -> None:
        """An output's gradient; None for one no loss used, which autograd may still hand
        (DDP's sink returns None for the outputs it passes through unused)."""
        if replaying() or grad is None:
            return
        try:
            captured.output_grads[index] = grad.detach()
        except Exception as e:  # in autograd's backward: never into training
            self._failed(e)

    def _failed(self, error: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            announce(f"replay capture failed ({type(error).__name__}: {error}); the job continues")

    def close(self) -> None:
        if self._before in self._root.pre:
            self._root.pre.remove(self._before)
            self._root.post.remove(self._after)
        self.last = None


def rng_states() -> tuple[Any, list[Any]]:
    """The CPU generator's state and each initialised CUDA device's (no device sync)."""
    import torch

    cuda = []
    ready = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    if ready:
        cuda = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return torch.get_rng_state(), cuda


def set_rng_states(cpu: Any, cuda: list[Any]) -> None:
    import torch

    torch.set_rng_state(cpu)
    if not torch.cuda.is_available():
        return  # a bundle from a GPU job replayed on a CPU machine
    for i, state in enumerate(cuda[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state, i)


def _detached(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, tuple):
        items = [_detached(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)  # namedtuple
    if isinstance(value, list):
        return [_detached(v) for v in value]
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def grad_outputs(output: Any) -> list[Any]:
    """The tensors of a forward's output that need a gradient, in order (tuples, lists,
    dicts and dataclass-like objects' fields walked)."""
    import torch

    found, stack = [], [output]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if item.requires_grad:
                found.append(item)
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, (tuple, list)):
            stack.extend(reversed(item))
    return found


def backward_outputs(outs: list[Any], grads: list[Any]) -> bool:
    """Back-propagate each output's captured gradient at once; False when none had one."""
    import torch

    pairs = [(o, g) for o, g in zip(outs, grads, strict=False) if g is not None]
    if not pairs:
        return False
    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
    return True


def autocast_state() -> tuple[tuple[str, Any], ...]:
    """The devices autocast is on for, with its dtype: a replay runs under the same."""
    import torch

    return tuple(
        (device, torch.get_autocast_dtype(device))
        for device in ("cpu", "cuda")
        if torch.is_autocast_enabled(device)
    )


def autocast_as(state: tuple[tuple[str, Any], ...]) -> contextlib.ExitStack:
    import torch

    stack = contextlib.ExitStack()
    for device, dtype in state:
        stack.enter_context(torch.autocast(device, dtype=dtype))
    return stack
