"""Mesh construction and logical → mesh axis rules (attention TP today; CP groups live inside TP)."""

from v41cp.sharding.mesh import make_mesh
from v41cp.sharding.rules import TP_RULES, AxisRules, ShardingContext, constrain, logical_sharding, param_shardings

__all__ = ["make_mesh", "AxisRules", "ShardingContext", "TP_RULES", "constrain", "logical_sharding",
           "param_shardings"]
