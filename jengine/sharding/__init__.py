"""Device meshes and the logical-axis rules that place parameters and the KV cache on them."""

from jengine.sharding.mesh import MeshSpec
from jengine.sharding.rules import ShardingRules, check_divisible, pad_query_heads, padded_config

__all__ = [
    "MeshSpec", "ShardingRules", "check_divisible", "pad_query_heads", "padded_config",
]
