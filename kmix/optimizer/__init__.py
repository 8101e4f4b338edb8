"""kmix.LossScaleOptimizer and what it runs: the class, its step on each backend, its hooks.

- :mod:`~kmix.optimizer.loss_scale_optimizer`: the class (Keras glue).
- :mod:`~kmix.optimizer.config`: its validated arguments and run-time settings.
- :mod:`~kmix.optimizer.recorder`: the step record's optimizer variables and host reads.
- :mod:`~kmix.optimizer.tensorflow_step` and :mod:`~kmix.optimizer.jax_step`: one step
  module per backend, side by side, each running :func:`kmix.record.advance_record`.
- :mod:`~kmix.optimizer.jax_train_function`: ``fit``'s train function on JAX while
  the forward pass is tapped.
- :mod:`~kmix.optimizer.model_hooks` and :mod:`~kmix.optimizer.tap`: what the optimizer
  attaches to the model it trains.

Code outside this folder imports these names from ``kmix.optimizer``.
"""

from kmix.optimizer.loss_scale_optimizer import LossScaleOptimizer

__all__ = ["LossScaleOptimizer"]
