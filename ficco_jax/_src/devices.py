"""The devices an op is traced for.

Inside ``shard_map`` (and under ``jax.set_mesh``) jax knows the mesh's
device kind and platform; outside a mesh this falls back to the default
backend. Plans, kernels and the interpreter switch all ask here rather than
``jax.default_backend()``: a CPU mesh on a GPU host (the tests' virtual
devices on a one-GPU machine, or a user's CPU reference run inside
``shard_map``) must plan and compile for the CPU, and the default backend
there is the GPU. Under a plain ``jax.jit`` of CPU arrays on a GPU host no
mesh says so: pass ``on_gpu=False`` / ``interpret=True`` to the kernels
there.
"""

from __future__ import annotations

import jax


def _abstract_device():
  """The traced mesh's `AbstractDevice`, or None (no mesh, or a jax
  without one)."""
  try:
    return jax.sharding.get_abstract_mesh().abstract_device
  except AttributeError:
    return None


def platform() -> str:
  """``"gpu"``, ``"cpu"``, ...: the traced mesh's, else the default
  backend's."""
  abstract = _abstract_device()
  if abstract is not None and abstract.platform:
    return abstract.platform
  return jax.default_backend()


def mesh_platform(mesh: jax.sharding.Mesh) -> str:
  """The platform of a concrete ``mesh``'s devices."""
  return mesh.devices.flat[0].platform


def local_device() -> jax.Device:
  """A concrete device of the traced platform (for what only a concrete
  device reports, e.g. its compute capability); the mesh is assumed to be
  of one kind."""
  return jax.devices(platform())[0]


def device_kind() -> str:
  """The device kind ``schedule=None`` plans for: the traced mesh's, else
  the default backend's first device's."""
  abstract = _abstract_device()
  if abstract is not None and abstract.device_kind:
    return abstract.device_kind
  return local_device().device_kind


def num_sms() -> int:
  """SMs (cores) of the traced device; 1 where it reports none (CPUs)."""
  abstract = _abstract_device()
  if abstract is not None and abstract.num_cores:
    return abstract.num_cores
  return getattr(local_device(), "core_count", None) or 1
