"""Spike: what a skip decided on the device costs a torch step, against stock Keras.

On Keras's torch backend kmix's step reads its counters and non-finite flags on the host once
a step to decide apply-or-skip; on a GPU that read is a sync. A step that reads nothing must
decide on the device: back up every piece of state the step changes, run the inner
optimizer's apply speculatively, then select, tensor by tensor, the new value or the backup.
This script measures that on a CPU, bit-exactly done, in ``model.fit`` on
``KERAS_BACKEND=torch``, for the three models of ``bench_backends.py`` (its builders, its
timing: ABBA rounds, medians, a second stock copy as the noise floor), all ``mixed_float16``:

* ``stock``: ``keras.mixed_precision.LossScaleOptimizer(Adam)`` (its finite check and its
  host reads: whether the gradients are finite, whether the scale grows).
* ``stock_again``: the same again, a second copy: the noise floor of the run.
* ``fixed``: (a') Keras's torch ``Adam`` with a fixed loss scale (``loss_scale_factor``: the
  scale the model's stock copy ends on after as many steps as the run has, over
  :data:`MARGIN`; ``scale_loss`` multiplies, ``apply`` divides), ``apply``
  wrapped by :class:`FixedScaleAdam` and passed straight through: no check, no host read.
  Compiled with ``auto_scale_loss=False``: under ``mixed_float16`` Keras's ``compile``
  otherwise wraps any optimizer that is not a ``LossScaleOptimizer`` in one.
* ``fixed_keep``: ``fixed`` that also computes the device-side ``keep`` (one
  ``torch._foreach_norm`` over the gradients, then ``isfinite(...).all()``: see
  :func:`device_keep`) and drops it: the decision's own cost, apart from the backup and the select.
* ``device_skip``: (b) ``fixed`` with the device-side skip: ``keep``, then the backup of
  every state tensor the step changes (the trainable variables and all the inner optimizer's
  variables, ``iterations`` and Adam's two slots included) by ONE ``torch._foreach_copy_``
  over integer views of them, then the stock inner apply, then the select in integer
  arithmetic, ``state = state * keep + backup * (1 - keep)`` (``torch._foreach_mul_`` twice,
  ``torch._foreach_add_`` once per integer dtype, ``keep`` a 0-dim int32 tensor). Integer
  select is bit-exact: a NaN or a -0.0 in the state is restored or kept bit for bit, where a
  float select (``new * keep + old * (1 - keep)``) turns NaN * 0 into NaN and -0.0 + 0.0
  into +0.0.

The integer views (``t.view(torch.int32)`` for float32, int16 for float16 and bfloat16, int64
for int64 and float64) are made once per variable and kept with their backup buffers, per set
of variables; they stay valid because Keras's torch ``Variable`` keeps one tensor (a
``torch.nn.Parameter``) for its life and assigns into it with ``copy_``: :func:`check_identity`
checks that across ``assign``, ``assign_add``, ``set_weights``, optimizer steps and ``fit``.

Before timing, :func:`check_bit_exact` asserts that a step with an inf (and one with a NaN)
gradient leaves every weight and every optimizer variable equal to what it was bit for bit
(compared as integer views), including a weight holding -0.0 and a slot holding NaN, and
that a finite step gives bit for bit what the plain inner apply gives (two copies); it also
shows that a float select would not be exact on the same values. After timing, each model's
``fixed`` and ``device_skip`` copies (same seed, same batches, same number of steps) are
compared bit for bit, and ``device_skip``'s ``iterations`` is checked to count every step
(no step skipped: the fixed scale never overflowed).

Timing is ``bench_backends.py``'s: ``model.fit`` on in-memory arrays (one batch repeated),
eager steps (``jit_compile=False``, Keras's default on torch), ``steps_per_execution=1``;
each copy warmed up by one untimed fit; a round fits ``--steps`` + 1 batches per configuration
and its step time is the median time between batch ends (the mean and the median CPU time
per step are kept too); configurations take turns in ABBA order; a ratio is the median over
rounds of the per-round ratio; the noise floor is ``stock_again``'s widest round.
After the timing (unless ``--no-calls``), each configuration's Python calls per step and
calls into torch's C functions per step are counted (``cProfile``, one fit); then (unless
``--no-parts``) the device skip's pieces are timed alone on each model's state, outside
``fit``: the keep, the backup, the select, and an alternative select that is not foreach,
one ``torch.where(keep, new, backup, out=new)`` per tensor (bit-exact too: checked).

``--threads 1`` is what the recorded run used: on a 2-core machine shared with other work,
torch's two intra-op threads wait on each other whenever one is descheduled, and a step
then takes up to 10-20 times as long (seen here); one thread leaves a core to the rest.

Usage:
    KERAS_BACKEND=torch python bench/bench_torch_device_skip.py [--model mlp|transformer|
        stack82|all] [--rounds 10] [--steps N] [--threads N] [--no-calls] [--no-parts]
"""

from __future__ import annotations

import argparse
import cProfile
import math
import os
import pstats
import statistics
import sys
import time
from collections.abc import Callable

BACKEND = os.environ.setdefault("KERAS_BACKEND", "torch")
if BACKEND != "torch":
    sys.exit(
        f"bench_torch_device_skip.py measures Keras's torch backend, but KERAS_BACKEND={BACKEND}: "
        "run it as KERAS_BACKEND=torch python bench/bench_torch_device_skip.py"
    )
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_backends  # noqa: E402  (the same runs, models, timer and report helpers)
import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from bench_backends import (  # noqa: E402
    METRICS,
    MODELS,
    kmix_source,
    library_version,
    ratios,
)
from bench_matrix import stock_optimizer  # noqa: E402
from keras.src.backend.torch.optimizers import torch_adam  # noqa: E402

SCALE = 2.0**15
"""The checks' fixed loss scale: stock ``LossScaleOptimizer``'s initial scale."""

MARGIN = 4.0
"""The timed copies' fixed scale: the scale stock's copy of the model ends on after as many
steps as the run has, divided by this. At 2**15 the Transformer overflows float16 on its first
four steps, and the 82-variable stack overflows now and then as it trains (stock halved 7 times
in 1,212 steps): a fixed scale that overflows makes the device-skip copy skip every later step
(same weights, same overflow) and the plain copy go NaN, so neither is a healthy step."""

INT_VIEW = {
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float64: torch.int64,
    torch.int64: torch.int64,
    torch.int32: torch.int32,
    torch.int16: torch.int16,
}
"""The integer dtype of the same width that each state dtype is viewed as."""


def int_view(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bits as integers of the same width (same storage, no autograd)."""
    return tensor.detach().view(INT_VIEW[tensor.dtype])


def device_keep(grads: list) -> torch.Tensor:
    """1 (0-dim int32, on the device) when every gradient's L2 norm is finite, else 0.

    No host read. One ``torch._foreach_norm`` (kmix's screen,
    ``kmix.backend.torch.screened_nonfinite_flags``): an inf or a NaN always makes the norm
    non-finite, so no bad step is ever applied; a finite gradient whose squares overflow
    float32 (|g| near 1e19) is skipped too, as an overflow would be (kmix's host step
    rechecks such a step exactly; a device step cannot branch on it). Exact alternatives
    cost far more on this CPU, one thread, the MLP's 1.8 M gradient values: the L2 norms
    0.15 ms, ``ord=1`` 1.0 ms, ``ord=inf`` 5.4 ms, ``isfinite(g).all()`` per gradient 3.1 ms.
    int32: the dtype of the views of float32 state and of Keras's torch ``iterations``.
    """
    norms = torch._foreach_norm([g for g in grads if g is not None])
    return torch.isfinite(torch.stack(norms)).all().to(torch.int32)


class DeviceSelect:
    """Integer views of some state tensors and one backup buffer for each, made once.

    :meth:`backup` copies the state into the buffers (one ``torch._foreach_copy_``);
    :meth:`select` then keeps the new state where ``keep`` is 1 and puts the backup back where
    it is 0, in integer arithmetic (bit-exact: NaN and -0.0 safe): three foreach calls per
    integer dtype among the views (one dtype, int32, for a mixed_float16 model's state and
    Adam's). Grouped because ``_foreach_mul_`` by a 0-dim tensor of another dtype takes
    torch's slow path: 0.31 ms against 0.10 ms over the 82-variable stack's 248 tensors.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.views = [int_view(t) for t in tensors]
        self.backups = [torch.empty_like(v) for v in self.views]
        self.groups = [
            (
                dtype,
                [v for v in self.views if v.dtype == dtype],
                [b for b in self.backups if b.dtype == dtype],
            )
            for dtype in dict.fromkeys(v.dtype for v in self.views)
        ]

    def backup(self) -> None:
        torch._foreach_copy_(self.backups, self.views)

    def select(self, keep: torch.Tensor) -> None:
        for dtype, views, backups in self.groups:
            keep_as = keep.to(dtype)  # itself when the dtype matches
            torch._foreach_mul_(views, keep_as)
            torch._foreach_mul_(backups, 1 - keep_as)  # the buffers are refilled next step
            torch._foreach_add_(views, backups)


class FixedScaleAdam(torch_adam.Adam):
    """Keras's torch Adam (its ``_parallel_update_step``) with a fixed loss scale, ``apply``
    wrapped: ``plain`` passes through, ``keep`` also computes the device-side decision and
    drops it, ``select`` skips on the device (backup, stock apply, integer select).

    Subclassing ``torch_adam.Adam`` (not ``keras.optimizers.Adam``, which ``TorchOptimizer``
    maps to it only when instantiated as itself) keeps Keras's foreach update.
    """

    def __init__(self, mode: str = "plain", scale: float = SCALE, **kwargs) -> None:
        super().__init__(loss_scale_factor=scale, **kwargs)
        self.mode = mode
        self._selects: dict[tuple[int, ...], DeviceSelect] = {}

    def state_tensors(self, trainable_variables: list) -> list[torch.Tensor]:
        """The tensors an apply may change: the variables', then every optimizer variable's."""
        return [v.value for v in [*trainable_variables, *self.variables]]

    def device_select(self, trainable_variables: list) -> DeviceSelect:
        """The views and buffers for this set of variables (made on its first step)."""
        key = tuple(map(id, trainable_variables))
        found = self._selects.get(key)
        if found is None:
            found = self._selects[key] = DeviceSelect(self.state_tensors(trainable_variables))
        return found

    def apply(self, grads: list, trainable_variables: list | None = None) -> None:
        if self.mode == "plain":
            return super().apply(grads, trainable_variables)
        keep = device_keep(grads)
        if self.mode == "keep":
            return super().apply(grads, trainable_variables)
        variables = (
            self._trainable_variables if trainable_variables is None else trainable_variables
        )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        chosen = self.device_select(list(variables))
        chosen.backup()
        super().apply(grads, trainable_variables)
        chosen.select(keep)


def stock(scale: float) -> keras.Optimizer:
    return stock_optimizer()  # its own dynamic scale, from 2**15


def fixed(scale: float) -> keras.Optimizer:
    return FixedScaleAdam("plain", scale)


def fixed_keep(scale: float) -> keras.Optimizer:
    return FixedScaleAdam("keep", scale)


def device_skip(scale: float) -> keras.Optimizer:
    return FixedScaleAdam("select", scale)


# name -> (label, optimizer factory taking the fixed scale)
CONFIGS: dict[str, tuple[str, Callable[[float], keras.Optimizer]]] = {
    "stock": ("(a) stock `LossScaleOptimizer(Adam)`", stock),
    "stock_again": ("stock again (noise floor)", stock),
    "fixed": ("(a') wrapped Adam, fixed scale, no select", fixed),
    "fixed_keep": ("(a') + device `keep` computed, unused", fixed_keep),
    "device_skip": ("(b) wrapped Adam + backup + integer select", device_skip),
}


# ---------------------------------------------------------------------------------------------
# Checks (assertions): bit-exactness, and the variables' tensors across assigns
# ---------------------------------------------------------------------------------------------


def bits(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the tensors' bits (integer views, cloned)."""
    return [int_view(t).clone() for t in tensors]


def same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether the two lists hold the same bits, tensor by tensor (NaN payloads, signed zeros)."""
    return len(a) == len(b) and all(
        x.dtype == y.dtype and torch.equal(int_view(x), int_view(y))
        for x, y in zip(a, b, strict=True)
    )


def toy_state(mode: str) -> tuple[FixedScaleAdam, list[keras.Variable]]:
    """Three float32 variables (as a mixed_float16 model's are) and a built optimizer."""
    rng = np.random.default_rng(7)
    variables = [
        keras.Variable(rng.standard_normal(shape).astype("float32"), name=f"w{i}")
        for i, shape in enumerate([(4, 3), (3,), (5, 2)])
    ]
    optimizer = FixedScaleAdam(mode)
    optimizer.build(variables)
    return optimizer, variables


def toy_grads(seed: int, poison: float | None = None) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    grads = [
        torch.tensor(SCALE * rng.standard_normal(s).astype("float32"))
        for s in ((4, 3), (3,), (5, 2))
    ]
    if poison is not None:
        grads[1][2] = poison
    return grads


def poke(optimizer: FixedScaleAdam, variables: list[keras.Variable]) -> None:
    """A weight element set to -0.0, a momentum element and a velocity element to NaN."""
    with torch.no_grad():
        variables[0].value[1, 2] = -0.0
        optimizer._momentums[2].value[3, 1] = float("nan")
        optimizer._velocities[0].value[0, 0] = float("nan")


def check_bit_exact() -> list[str]:
    """Asserts the device-side skip's bit-exactness; returns what was checked, in words."""
    said = []
    # The select alone, every dtype it views: restores or keeps the bits exactly.
    special = [0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1.5, -3.25]
    tensors = [
        torch.tensor(special, dtype=d)
        for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64)
    ]
    tensors.append(torch.tensor([0, -1, 2**40, -(2**62)], dtype=torch.int64))
    for keep, by_where in ((0, False), (1, False), (0, True), (1, True)):
        chosen = DeviceSelect(tensors)
        old = bits(tensors)
        chosen.backup()
        with torch.no_grad():
            for t in tensors:  # the "apply": new values, specials moved around
                t.copy_(torch.flip(t, [0]) if t.is_floating_point() else -t)
        new = bits(tensors)
        keep_tensor = torch.tensor(keep, dtype=torch.int32)
        if by_where:
            for view, backup in zip(chosen.views, chosen.backups, strict=True):
                torch.where(keep_tensor.bool(), view, backup, out=view)
        else:
            chosen.select(keep_tensor)
        assert same_bits(bits(tensors), new if keep else old), f"select keep={keep} not exact"
        for t, o in zip(tensors, old, strict=True):  # put the originals back for the next pass
            int_view(t).copy_(o)
    said.append(
        "select alone (integer arithmetic, and torch.where per tensor), float32/float16/"
        "bfloat16/float64/int64 holding ±0, NaN, ±inf: exact for keep 0 and 1"
    )

    # The optimizer: an inf step and a NaN step skip bit for bit; finite steps equal plain's.
    skip, skip_vars = toy_state("select")
    plain, plain_vars = toy_state("plain")
    for seed in (1, 2):  # finite steps: iterations and the slots become non-zero
        skip.apply(toy_grads(seed), skip_vars)
        plain.apply(toy_grads(seed), plain_vars)
        assert same_bits(skip.state_tensors(skip_vars), plain.state_tensors(plain_vars)), (
            "finite step differs"
        )
    poke(skip, skip_vars)
    poke(plain, plain_vars)
    for poison in (float("inf"), float("nan"), -float("inf")):
        before = bits(skip.state_tensors(skip_vars))
        assert int_view(skip_vars[0].value)[1, 2].item() == int_view(torch.tensor(-0.0)).item()
        assert math.isnan(skip._momentums[2].value[3, 1].item())
        skip.apply(toy_grads(3, poison), skip_vars)
        assert same_bits(bits(skip.state_tensors(skip_vars)), before), f"{poison} step not undone"
        assert int(skip.iterations.value) == 2
    # A finite gradient whose squares overflow: the L2 screen skips it (conservatively).
    before = bits(skip.state_tensors(skip_vars))
    skip.apply(toy_grads(3, 1e20), skip_vars)
    assert same_bits(bits(skip.state_tensors(skip_vars)), before), "1e20 step not undone"
    said.append(
        "a step with an inf, a NaN, a -inf gradient (and a finite 1e20, whose squares overflow "
        "the L2 screen: skipped as an overflow would be): every weight and optimizer variable "
        "(iterations, learning rate, momentums, velocities) equal to the backup bit for bit, "
        "-0.0 weight and NaN slots included"
    )
    # A finite step from the poked state (a NaN slot poisons its weight: both alike).
    skip.apply(toy_grads(4), skip_vars)
    plain.apply(toy_grads(4), plain_vars)
    assert same_bits(skip.state_tensors(skip_vars), plain.state_tensors(plain_vars)), (
        "finite step differs"
    )
    assert int(skip.iterations.value) == 3
    said.append(
        "finite steps (before and after the skipped ones, NaN slots and -0.0 weight in): "
        "bit for bit the plain inner apply's (two copies)"
    )

    # What a float select would have done on the same specials: not exact either way.
    old = [t for t in tensors if t.is_floating_point()]
    new = [torch.flip(t, [0]) for t in old]
    restored = [n * 0 + o * 1 for n, o in zip(new, old, strict=True)]  # keep = 0
    kept = [n * 1 + o * 0 for n, o in zip(new, old, strict=True)]  # keep = 1
    assert not same_bits(restored, old) and not same_bits(kept, new), "float select was exact"
    said.append(
        "a float select (new*keep + old*(1-keep)) on the same specials is NOT exact for "
        "keep 0 nor 1 (inf*0 and NaN*0 give NaN, -0.0 + 0.0 gives +0.0)"
    )
    return said


def check_identity() -> list[str]:
    """Asserts that a Keras torch Variable keeps its tensor object (and storage) for good."""
    keras.utils.set_random_seed(0)
    model, x = MODELS["stack82"][1]()
    y = np.zeros(len(x), "int32")
    optimizer = FixedScaleAdam("select")
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        auto_scale_loss=False,
    )
    assert model.optimizer is optimizer
    model.fit(x, y, batch_size=len(x), epochs=1, verbose=0)  # builds the optimizer
    variables = [*model.variables, *optimizer.variables]
    held = [(v, v.value, v.value.data_ptr()) for v in variables]
    assert all(v.value is v._value for v in variables)
    first = variables[0]
    first.assign(np.ones(first.shape, "float32"))
    first.assign_add(np.ones(first.shape, "float32"))
    first.assign(first.value * 2)
    optimizer.iterations.assign(7)
    optimizer.iterations.assign_add(1)
    model.set_weights(model.get_weights())
    model.fit(x, y, batch_size=len(x), epochs=2, verbose=0)
    moved = [v.path for v, t, p in held if v.value is not t or v.value.data_ptr() != p]
    assert not moved, f"variables changed tensors: {moved}"
    views = optimizer.device_select(model.trainable_variables).views
    assert all(
        view.data_ptr() == v.value.data_ptr()
        for view, v in zip(views, model.trainable_variables, strict=False)
    )
    return [
        f"{len(variables)} variables (model's and optimizer's) keep the same torch.nn.Parameter "
        "object and storage across assign, assign_add, iterations.assign, set_weights and "
        "three fits (assign is `self.value.copy_(value)`); the cached int views still alias them"
    ]


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------


class Run(bench_backends.Run):
    """One model copy in one configuration: built, compiled, warmed up (bench_backends' run,
    without callbacks, counting the steps it ran)."""

    def __init__(self, make_model: Callable, config: str, steps: int, scale: float) -> None:
        self.make_callbacks, self.log_dir = (lambda log_dir: []), None
        self.model, self.x, self.y, self.batch = bench_backends.repeated_batch(make_model, steps)
        self.optimizer = CONFIGS[config][1](scale)
        self.model.compile(
            optimizer=self.optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=1,
            auto_scale_loss=False,  # else mixed_float16 wraps the fixed-scale Adam in stock's LSO
        )
        assert self.model.optimizer is self.optimizer, "compile replaced the optimizer"
        self.steps_run = 0
        self.measure()  # warm up

    def fit(self, *callbacks: keras.callbacks.Callback) -> None:
        super().fit(*callbacks)
        self.steps_run += len(self.x) // self.batch

    def calls_per_step(self) -> tuple[float, float]:
        """Python calls, and calls into torch's C functions, per step of one fit (cProfile)."""
        profile = cProfile.Profile()
        profile.enable()
        self.fit()
        profile.disable()
        stats = pstats.Stats(profile).stats
        steps = len(self.x) // self.batch
        total = sum(entry[1] for entry in stats.values())
        into_torch = sum(
            entry[1]
            for (path, _, name), entry in stats.items()
            if path == "~" and ("torch" in name or "TensorBase" in name)
        )
        return total / steps, into_torch / steps

    def state(self) -> list[torch.Tensor]:
        return [v.value for v in [*self.model.variables, *self.optimizer.variables]]


def time_parts(run: Run, repeats: int = 30) -> dict[str, float]:
    """The device skip's pieces alone on ``run``'s state and gradients, median ms each."""
    model, optimizer = run.model, run.optimizer
    chosen = optimizer.device_select(model.trainable_variables)
    grads = [torch.randn_like(v.value) for v in model.trainable_variables]
    keep = torch.tensor(1, dtype=torch.int32)
    keep_bool = keep.bool()

    def where_select() -> None:  # not foreach: one torch.where per tensor, one pass each
        for view, backup in zip(chosen.views, chosen.backups, strict=True):
            torch.where(keep_bool, view, backup, out=view)

    pieces = {
        "keep (L2 norms, isfinite, all)": lambda: device_keep(grads),
        "backup (one _foreach_copy_)": chosen.backup,
        "select (mul_, mul_, add_ per dtype)": lambda: chosen.select(keep),
        "alternative select: torch.where(keep, new, backup, out=new) per tensor": where_select,
    }
    times = {}
    with torch.no_grad():
        for name, piece in pieces.items():
            samples = []
            for _ in range(repeats):
                start = time.perf_counter()
                piece()
                samples.append(time.perf_counter() - start)
            times[name] = 1000 * statistics.median(samples)
    state_bytes = sum(t.numel() * t.element_size() for t in chosen.tensors)
    times["state MB backed up"] = state_bytes / 1e6
    return times


def bench(name: str, steps: int, rounds: int, calls: bool, parts: bool) -> None:
    title, make_model, _ = MODELS[name]
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy("mixed_float16")
    load_before = os.getloadavg()[0]
    stock = Run(make_model, "stock", steps, SCALE)
    for _ in range(rounds + 2):  # as many steps as the run: the scale stock ends on holds for it
        stock.fit()
    scale = float(stock.optimizer.dynamic_scale.value) / MARGIN
    runs = {c: stock if c == "stock" else Run(make_model, c, steps, scale) for c in CONFIGS}
    stock_steps = stock.steps_run, int(stock.optimizer.inner_optimizer.iterations.value)
    policy = next(layer for layer in stock.model.layers if layer.weights).dtype_policy.name
    if policy != "mixed_float16" or stock.model.jit_compile:
        sys.exit(
            f"expected mixed_float16 and eager steps, got {policy}, "
            f"jit_compile={stock.model.jit_compile}"
        )

    times = {c: {m: [] for m in METRICS} for c in runs}
    for round_index in range(rounds):
        order = list(runs) if round_index % 2 == 0 else list(reversed(runs))  # ABBA
        for config in order:
            for metric, value in runs[config].measure().items():
                times[config][metric].append(value)
    load_after = os.getloadavg()[0]
    stock_applied = int(stock.optimizer.inner_optimizer.iterations.value) - stock_steps[1]
    stock_timed = stock.steps_run - stock_steps[0]

    def per_round(config: str, base: str = "stock", metric: str = "median") -> list[float]:
        return ratios(times[config][metric], times[base][metric])

    def floor(metric: str) -> float:
        return max(abs(r - 1) for r in per_round("stock_again", metric=metric))

    n_state = len(
        runs["device_skip"]
        .optimizer.device_select(runs["device_skip"].model.trainable_variables)
        .tensors
    )
    print(
        f"\n### {title}\n\nbatch {stock.batch}, {len(stock.model.trainable_variables)} "
        f"trainable variables ({n_state} state tensors backed up), fixed scale {scale:g} "
        f"(stock's after a run's worth of steps / {MARGIN:g}; stock skipped "
        f"{stock_timed - stock_applied} of its {stock_timed} timed steps), {policy}, eager, "
        f"{torch.get_num_threads()} torch threads, {rounds} rounds x {steps} steps (ABBA); "
        f"load {load_before:.2f} before, {load_after:.2f} after; noise floor (stock again / "
        f"stock, widest round): ±{100 * floor('median'):.1f}% wall, "
        f"±{100 * floor('cpu'):.1f}% CPU\n"
    )
    print(
        "| configuration | median step (ms) | ratio to stock | ratio to (a') "
        "| per-round ratios to (a') | CPU ms/step | CPU ratio to stock | CPU ratio to (a') |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for config, (label, _) in CONFIGS.items():
        to_fixed = per_round(config, "fixed")
        print(
            f"| {label} | {1000 * statistics.median(times[config]['median']):.2f} "
            f"| {statistics.median(per_round(config)):.3f}× | {statistics.median(to_fixed):.3f}× "
            f"| {', '.join(f'{r:.3f}' for r in to_fixed)} "
            f"| {1000 * statistics.median(times[config]['cpu']):.2f} "
            f"| {statistics.median(per_round(config, metric='cpu')):.3f}× "
            f"| {statistics.median(per_round(config, 'fixed', 'cpu')):.3f}× |",
            flush=True,
        )
    skip_vs_keep = statistics.median(per_round("device_skip", "fixed_keep"))
    print(
        f"\n(b) / (a' + keep), the backup and select alone: {skip_vs_keep:.3f}× (median of rounds)"
    )

    # End to end: the device-skip copy and the plain copy saw the same batches the same number
    # of times; every state tensor must match bit for bit, and no step may have been skipped.
    fixed, skip = runs["fixed"], runs["device_skip"]
    identical = same_bits(fixed.state(), skip.state())
    iterations = int(skip.optimizer.iterations.value)
    print(
        f"end to end: (b) and (a') copies bit-identical after {skip.steps_run} steps: "
        f"{'yes' if identical else 'NO'}; (b)'s iterations {iterations} "
        f"(steps run {skip.steps_run})"
    )
    assert identical and iterations == skip.steps_run, "device skip diverged from the plain apply"

    if calls:
        print("\n| configuration | Python calls per step | torch C calls per step |\n|---|---|---|")
        for config, (label, _) in CONFIGS.items():
            if config == "stock_again":
                continue
            total, into_torch = runs[config].calls_per_step()
            print(f"| {label} | {total:,.0f} | {into_torch:,.0f} |")
    if parts:
        measured = time_parts(skip)
        print("\n| piece, alone (30 calls, median) | ms |\n|---|---|")
        for piece, value in measured.items():
            print(f"| {piece} | {value:.3f} |")
    sys.stdout.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=[*MODELS, "all"], default="all")
    parser.add_argument("--rounds", type=int, default=10, help="rounds (ABBA), default 10")
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round (default: bench_backends')"
    )
    parser.add_argument(
        "--no-calls", dest="calls", action="store_false", help="skip the cProfile counts"
    )
    parser.add_argument(
        "--no-parts", dest="parts", action="store_false", help="skip timing the pieces alone"
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="torch's intra-op threads (default: torch's own)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"device-skip spike on torch: {library_version()}, Keras {keras.__version__}, kmix "
        f"({kmix_source()}), {os.cpu_count()} CPUs"
    )
    for line in check_bit_exact() + check_identity():
        print(f"- ok: {line}")
    for name, (_, _, default_steps) in MODELS.items():
        if args.model in ("all", name):
            bench(name, args.steps or default_steps, args.rounds, args.calls, args.parts)


if __name__ == "__main__":
    main()
