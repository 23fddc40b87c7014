"""The memory-lean mode (``memory="lean"``): per-record norms in a first backward pass, the
clipped sums in a second, reweighted one.

The default mode forms norms and clipped sums from the same factors after one backward pass
(book-keeping, Bu et al. 2023), so every layer's input activations and output gradients stay
alive until the step: the peak holds the whole model's output gradients beside its
activations. Ghost clipping (Li et al. 2022, "Large language models can be strong
differentially private learners", §4; Opacus's ``GradSampleModuleFastGradientClipping``)
trades a second backward pass for that memory:

1. The model's outputs pass through one autograd node (:class:`_OutputTap`). When the user's
   ``loss.backward()`` reaches it, that node first runs the backward pass of the model below it
   on its own (``torch.autograd.grad`` with ``retain_graph=True``): every layer's contribution
   is turned into its parameter's per-record squared norm as soon as the last contribution of
   that parameter arrives (:meth:`LayerRule.expect` says how many will), and dropped.
2. From the norms the clip factors c_i follow (the optimizer's clip stage, the same function
   the default mode calls at the step: :attr:`LeanPasses.plan`).
3. The node then hands the gradients on, and the ordinary backward pass runs through the model
   again; now each contribution is added to its parameter's clipped sum Σ_i c_i·g_i as it
   arrives, and dropped. The graph is freed as in a non-private step.

Neither pass holds more than one layer's factors beyond what autograd holds itself (parameters
used several times, a tied embedding and output layer, keep theirs until their last use), so
the peak stays near the non-private one at the cost of a second backward pass. Norms, factors
and sums are computed by the same functions as the default mode's, from the same factors:
the release is the same, exactly as brute force.

Every use of a trainable parameter must lie below the model's outputs (a loss computed from
them); one backward pass per step (or per :meth:`DPOptimizer.accumulate`).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ._amp import work_dtype
from ._contrib import SHARED, Contribution, finish, is_one, param_sq_norms
from ._autograd import functorch_active as _functorch, graph_task as _graph_task, retaining

__all__ = ["MEMORY", "LeanPasses", "check_memory"]

from .._names import MEMORY, memory as check_memory  # noqa: E402  (one name across the front ends)

_NORMS, _SUMS = "norms", "sums"


class _OutputTap(torch.autograd.Function):
    """Identity on the model's output tensors; its backward runs the norm pass below them,
    then returns the gradients unchanged for the sum pass."""

    @staticmethod
    def forward(ctx: Any, lean: "LeanPasses", token: List[bool], *outs: torch.Tensor) -> Any:  # type: ignore[override]
        ctx.lean, ctx.token = lean, token
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*outs)
        res = tuple(o.view_as(o) for o in outs)
        return res if len(res) > 1 else res[0]

    @staticmethod
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Any:  # type: ignore[override]
        if ctx.token[0]:  # (a tap that the end of its outermost call did not keep passes its gradients on)
            ctx.lean.norm_pass(ctx.saved_tensors, grads)
        return (None, None) + tuple(grads)


def _leaves(out: Any, found: List[torch.Tensor]) -> None:
    if isinstance(out, torch.Tensor):
        if out.requires_grad and out.is_floating_point():
            found.append(out)
    elif isinstance(out, dict):
        for v in out.values():
            _leaves(v, found)
    elif isinstance(out, (tuple, list)):
        for v in out:
            _leaves(v, found)


def _replace(out: Any, new: Dict[int, torch.Tensor]) -> Any:
    if isinstance(out, torch.Tensor):
        return new.get(id(out), out)
    if isinstance(out, dict):
        for k in list(out.keys()):  # in place: a Hugging Face ModelOutput keeps its class and fields
            out[k] = _replace(out[k], new)
        return out
    if isinstance(out, tuple):
        items = [_replace(v, new) for v in out]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    if isinstance(out, list):
        out[:] = [_replace(v, new) for v in out]
        return out
    return out


class LeanPasses:
    """The two backward passes of the memory-lean mode for one :class:`PerRecordGradients`."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.index = {id(p): k for k, p in enumerate(engine.params)}
        #: Set by the optimizer: called before the norm pass (the loss scale, the batch's users),
        #: and after it with the engine, returning each parameter's clip factor (B,) (or None).
        self.prepare: Optional[Callable[[], None]] = None
        self.plan: Optional[Callable[[], List[Optional[torch.Tensor]]]] = None
        #: Set by the optimizer: what the clip factors are a function of besides the norms (the
        #: groups' plans, the loss scale), compared on the host between the two passes.
        self.signature: Callable[[], Any] = lambda: None
        self.phase: Optional[str] = None
        self.expected: Dict[int, int] = {}
        self.inside: List[bool] = []  # module calls in progress, and whether a tap was made below each
        self.made: List[List[bool]] = []  # the taps made in the outermost call in progress
        self.chain: set = set()
        self.task = -1  # the backward pass whose norm pass ran
        self.reset()

    # -- state of one step ---------------------------------------------------------------

    def reset(self) -> None:
        n = len(self.engine.params)
        if self.phase is not None:
            # After the passes: their nodes are consumed. Before them (zero_grad between the forward
            # and the backward pass) the forward's declarations still stand.
            self.expected = {}
        self.phase = None
        self.pending: Dict[int, List[Contribution]] = {}
        self.done: List[bool] = [False] * n
        self.sq: List[Optional[torch.Tensor]] = [None] * n
        self.counts: List[int] = [0] * n  # contributions of each parameter in the norm pass
        self.summed: List[int] = [0] * n  # and in the sum pass
        self.acc: List[Optional[torch.Tensor]] = [None] * n
        self.b: Optional[int] = None
        self.units = 0
        self.scale = 1.0
        self.factors: Optional[List[Optional[torch.Tensor]]] = None
        self.scaled: Dict[int, torch.Tensor] = {}
        # the step's clip factors cast and shaped once for all uses (no factor copies kept: SHARED empty)
        self.ccache: Dict[Any, Any] = {SHARED: set()}
        self.mask: Optional[torch.Tensor] = None
        self.mask_views: Dict[Any, Any] = {}
        self.totals: Any = None  # (the scaled norms, their total, the mask), once per step
        self.sig: Any = None

    def expect(self, params: Sequence[Optional[nn.Parameter]]) -> None:
        for p in params:
            if p is not None:
                self.expected[id(p)] = self.expected.get(id(p), 0) + 1

    # -- the model's outputs -------------------------------------------------------------

    def install(self, model: nn.Module) -> List[Any]:
        """Hooks on every module of ``model``, so that the tap goes as deep as it can while every
        instrumented layer stays below it: on the outputs of the deepest called module that holds
        all of them (the smallest common ancestor of the rules' modules, or one of its ancestors:
        a language model's transformer body when only its adapters train, so that the logits'
        gradient is not held through the norm pass), else of an outermost call (a submodule
        called directly, as a LightningModule's ``training_step`` calls ``self.net(x)``)."""
        names = [r.name.split(".") if r.name else [] for r in self.engine.rules]
        common: List[str] = []
        for parts in zip(*names) if names else ():
            if len(set(parts)) != 1:
                break
            common.append(parts[0])
        self.chain = {id(model.get_submodule(".".join(common[:i]))) for i in range(len(common) + 1)}
        hooks: List[Any] = []
        for m in model.modules():
            hooks.append(m.register_forward_pre_hook(self._enter))
            hooks.append(m.register_forward_hook(self._leave, always_call=True))
        return hooks

    def _enter(self, module: nn.Module, args: Any) -> None:
        self.inside.append(False)  # whether a tap is made below this call

    def _leave(self, module: nn.Module, args: Any, out: Any) -> Any:
        below = self.inside.pop() if self.inside else False
        outermost = not self.inside
        if _graph_task() != -1:  # a recomputation inside a backward pass (activation checkpointing)
            return None
        res = None
        if not below and (id(module) in self.chain or outermost):
            res = self.wrap_outputs(out)
            below = res is not None
        if not outermost:
            if below:
                self.inside[-1] = True
            return res
        # The end of an outermost call: one tap below it is the one; several (the deepest module
        # holding every layer was called twice) would each start a norm pass over part of the
        # graph, so they pass their gradients on and the outermost outputs get the tap.
        made, self.made = self.made, []
        if len(made) == 1:
            made[0][0] = True
            return res
        for t in made:
            t[0] = False
        if made:
            res = self.wrap_outputs(out)
            if res is not None:
                self.made[0][0] = True
                self.made = []
        return res

    def wrap_outputs(self, out: Any) -> Any:
        """The output tensors that require grad of a call go through one :class:`_OutputTap` (one
        node, so that its backward sees all their gradients at once), whose token says whether it
        runs the norm pass (set at the end of the outermost call)."""
        e = self.engine
        if not (torch.is_grad_enabled() and e.enabled) or _functorch():
            return None
        found: List[torch.Tensor] = []
        _leaves(out, found)
        uniq = list({id(t): t for t in found}.values())
        if not uniq:
            return None
        token = [False]
        self.made.append(token)
        tapped = _OutputTap.apply(self, token, *uniq)
        tapped = tapped if isinstance(tapped, tuple) else (tapped,)
        return _replace(out, {id(a): b for a, b in zip(uniq, tapped)})

    # -- pass 1: norms -------------------------------------------------------------------

    def norm_pass(self, outs: Tuple[torch.Tensor, ...], grads: Tuple[Optional[torch.Tensor], ...]) -> None:
        e = self.engine
        if self.phase == _NORMS:
            return  # a tap below another one (a submodule's call and then its parent's): one norm pass
        if self.phase == _SUMS and _graph_task() == self.task:
            return  # the sum pass reaching a tap below the one that ran the norm pass
        if self.phase is not None:
            raise ValueError(
                "memory='lean': a second backward pass reached the model before optimizer.step(): call "
                "optimizer.step() (or optimizer.accumulate()) after every backward pass; the model's outputs must be "
                "differentiated once per forward pass"
            )
        if self.plan is None:
            raise RuntimeError("memory='lean' needs the DPOptimizer that owns this engine")
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
        if not pairs:
            return
        if self.prepare is not None:
            self.prepare()
        self.task = _graph_task()
        self.phase = _NORMS
        try:
            # The whole backward pass, as loss.backward() runs it (torch.autograd.grad would skip a
            # re-entrant activation checkpoint, which refuses it anyway). The rules hand the
            # parameters no gradient; any other leaf that requires grad (an input, the anchor) gets
            # its .grad back as it was, so that it receives its gradient once, from the sum pass.
            own = {id(p) for p in e.params}
            leaves = [t for t in _graph_leaves([o for o, _ in pairs]) if id(t) not in own]
            kept = [(t, None if t.grad is None else t.grad.clone()) for t in leaves]
            try:
                with torch.enable_grad(), retaining():
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=True)
            finally:
                for t, g in kept:
                    t.grad = g
            for k in list(self.pending):
                self._norm(k)
            self.expected = {}
            self.factors = self.plan()
            self.sig = self.signature()
            self.phase = _SUMS
        except BaseException:
            e.clear()
            raise

    def _start(self, c: Contribution) -> None:
        """The batch size and the scale from the first contribution of the pass."""
        e = self.engine
        b = c.batch
        if self.b is None:
            self.b = b
            self.units, _ = e.units(b, [])
            e._scale = self.scale = (float(b) if e.loss_reduction == "mean" else 1.0) / e.loss_scale
        elif b != self.b:
            raise ValueError(
                f"memory='lean': layers saw batches of {self.b} and {b} records in one backward pass: every layer must "
                "see the whole batch along dim 0"
            )

    def take(self, c: Contribution) -> bool:
        """A rule's contribution in a lean pass: a norm or a clipped sum now. False outside the
        two passes (the default mode holds it)."""
        if self.phase is None:
            return False
        k = self.index.get(id(c.param))
        if k is None:
            return False
        self._start(c)
        if self.phase == _NORMS:
            if self.done[k]:
                raise RuntimeError(
                    f"memory='lean': parameter {self.engine.param_names[k]!r} received a contribution after its norm was "
                    "taken (a layer rule declared fewer contributions with expect() than it adds); nothing was released"
                )
            self.counts[k] += 1
            self.pending.setdefault(id(c.param), []).append(c)
            left = self.expected.get(id(c.param))
            if left is not None:
                left -= 1
                self.expected[id(c.param)] = left
                if left == 0:
                    self._norm(id(c.param))
            return True
        self._sum(k, c)
        return True

    @torch.no_grad()
    def _norm(self, pid: int) -> None:
        cs = self.pending.pop(pid)
        k = self.index[pid]
        self.done[k] = True
        if self.b == 0:
            return
        units, cs = self.engine.units(self.b, cs)
        # unscaled, possibly a Tail: finished and scaled with every parameter's at once
        # (squared_norms), a few operators per step instead of a few per parameter
        self.sq[k], _ = param_sq_norms(cs, units, None, defer=True)

    def squared_norms(self, held: List[Any]) -> Tuple[int, List[Optional[torch.Tensor]]]:
        """The engine's :meth:`squared_norms` in lean mode: the norms of the norm pass."""
        e = self.engine
        n = len(e.params)
        if held:
            r, _ = held[0]
            e.clear()
            raise ValueError(
                f"memory='lean': layer {r.name!r} was differentiated outside the model's forward pass (its output did "
                "not reach the loss through the model's outputs): the lean mode takes norms and sums in the backward "
                "pass below the outputs. Compute the loss from the model's outputs, or use memory='default' (which "
                "torch.compile(model) needs too: the lean mode's norm pass does not run inside a compiled model yet)"
            )
        if self.phase == _SUMS:
            # at the step, before anything is recorded: the sum pass saw what the norm pass saw
            if self.counts != self.summed:
                k = next(i for i, (a, b) in enumerate(zip(self.counts, self.summed)) if a != b)
                e.clear()
                raise ValueError(
                    f"memory='lean': parameter {e.param_names[k]!r} had {self.counts[k]} contribution(s) in the norm "
                    f"pass and {self.summed[k]} in the sum pass; nothing was released. The lean mode runs its norm "
                    "pass below the first model output the backward pass reaches: a loss that combines two separate "
                    "calls of the model (or of its parts) is not supported; use memory='default' for it"
                )
        e.nonfinite, e.sq_total, e._zeroed = None, None, False
        if self.phase is None or self.b is None or self.b == 0:
            e._used = [None] * n
            return 0, [None] * n
        if self.totals is None:  # once per step: the sum pass's and the step's mask are one tensor
            out = e._stacked(finish(list(self.sq)), self.scale**2)
            self.totals = (out, e.sq_total, e.nonfinite)
        out, e.sq_total, e.nonfinite = list(self.totals[0]), self.totals[1], self.totals[2]
        e._used = [None] * n
        return self.units, out

    def zero_records(self, mask: torch.Tensor) -> None:
        if self.mask is not None and mask is self.mask:
            return  # the step's clip stage, zeroing what the sum pass already zeroed (the same tensor)
        if any(self.summed):
            raise RuntimeError("memory='lean': other records zeroed after the sum pass began; nothing was released")
        self.mask = mask

    # -- pass 2: clipped sums ------------------------------------------------------------

    @torch.no_grad()
    def _sum(self, k: int, c: Contribution) -> None:
        assert self.factors is not None
        f = self.factors[k]
        self.summed[k] += 1
        if f is None or self.b == 0:
            return
        p = self.engine.params[k]
        _, (c,) = self.engine.units(self.b, [c])
        if self.mask is not None:
            # a memo of this contribution's own zeroed tensors (none kept across contributions),
            # with the mask's shaped views, made once per step
            memo: Dict[Any, Any] = dict(self.mask_views)
            c.zero_records(self.mask, memo)
            self.mask_views.update((k, v) for k, v in memo.items() if isinstance(k, tuple) and k[0] == "mask")
        acc = self.acc[k]
        if acc is None:
            acc = self.acc[k] = torch.zeros(tuple(p.shape), dtype=work_dtype(p.dtype), device=p.device)
        fs = self.scaled.get(id(f))
        if fs is None:
            fs = self.scaled[id(f)] = f if is_one(self.scale) else f * self.scale
        c.add_clipped(fs, acc, self.ccache)

    @torch.no_grad()
    def clipped_sums(
        self, factors: List[Optional[torch.Tensor]], into: Sequence[Optional[torch.Tensor]], *, only: Optional[int],
        clear: bool,
    ) -> List[Optional[torch.Tensor]]:
        """The engine's :meth:`clipped_sums` in lean mode: the sums of the sum pass, after
        checking that they were formed with ``factors`` from every contribution of the norm pass."""
        e = self.engine
        try:
            if self.phase is not None and self.b:
                # The step's factors are the same function (the clip stage) of the same norms
                # and mask (the very tensors of the norm pass) as the sum pass's: the same
                # values, if the plans and the loss scale are the same, which the host checks
                # (comparing the values would read them back from the device every step).
                pairs = {(id(f), id(g)): (f, g) for f, g in zip(factors, self.factors or [])}
                if any((f is None) != (g is None) for f, g in pairs.values()) or self.signature() != self.sig:
                    raise RuntimeError(
                        "memory='lean': the clip factors of the step differ from those of the sum pass; nothing "
                        "was released"
                    )
            out: List[Optional[torch.Tensor]] = []
            # the sums added into the accumulators (the release's noise) by one _foreach_add_ per
            # device and dtype, not an add per parameter
            adds: Dict[Any, Tuple[List[torch.Tensor], List[torch.Tensor]]] = {}
            for k, p in enumerate(e.params):
                base = into[k] if k < len(into) else None
                acc = self.acc[k]
                if acc is None or factors[k] is None or (only is not None and k != only):
                    out.append(base)
                    continue
                if base is None:
                    out.append(acc)
                else:
                    acc = acc.to(device=base.device, dtype=base.dtype)
                    pair = adds.setdefault((base.device, base.dtype), ([], []))
                    pair[0].append(base)
                    pair[1].append(acc)
                    out.append(base)
                if clear:
                    self.acc[k] = None
            for bases, accs in adds.values():
                torch._foreach_add_(bases, accs)
            return out
        finally:
            if clear:
                e.clear()


def _graph_leaves(outs: List[torch.Tensor]) -> List[torch.Tensor]:
    """Every leaf tensor the graph below ``outs`` accumulates a gradient into (those inside a
    re-entrant activation checkpoint are recomputed, temporary ones)."""
    seen = set()
    found: Dict[int, torch.Tensor] = {}
    stack = [o.grad_fn for o in outs if o.grad_fn is not None]
    for o in outs:
        if o.grad_fn is None and o.requires_grad:
            found[id(o)] = o
    while stack:
        fn = stack.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        var = getattr(fn, "variable", None)
        if isinstance(var, torch.Tensor):
            found.setdefault(id(var), var)
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                stack.append(nxt)
    return list(found.values())
