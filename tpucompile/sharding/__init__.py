"""Sharding: how a model's tensors are laid over many devices.

``plan`` is the user's description (meshes and plans; plain Python), ``names`` names a Dynamo graph's values
the way plans do, ``binding`` binds a plan to one graph and the devices present, ``annotate`` marks each ATen
graph's inputs and outputs with their shardings for the lowering.
"""

from tpucompile.sharding.plan import Mesh, ShardPlan, data_parallel, fully_sharded, tensor_parallel

__all__ = ["Mesh", "ShardPlan", "data_parallel", "fully_sharded", "tensor_parallel"]
