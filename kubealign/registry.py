"""Where model versions registered before 0.2 find their pyfunc class.

Each registered version carries the code file it was logged from (models from code), and that file of an
earlier release imports `kubealign.registry.ActorModel`. The class lives in kubealign.promotion.registry
now; this name stays so that `mlflow.pyfunc.load_model` of those versions keeps working."""

from kubealign.promotion.registry import INPUT_EXAMPLE, ActorModel

__all__ = ["INPUT_EXAMPLE", "ActorModel"]
