"""A minimal stand-in for torch 2.x's DTensor with exactly the attributes
shardema reads (to_local / _local_tensor, placements, device_mesh, shape,
dtype, requires_grad, and clone for the callbacks' checkpoints), left only
in multirank_worker.py's row scenarios until they move to fully_shard;
test_dtensor_detection.py and test_torch_objects.py run the real
DTensor."""
import torch


class Shard:
    def __init__(self, dim):
        self.dim = dim

    def is_shard(self, dim=None):
        return dim is None or dim == self.dim

    def __repr__(self):
        return f"Shard(dim={self.dim})"


class Replicate:
    def is_shard(self, dim=None):
        return False

    def __repr__(self):
        return "Replicate()"


class Mesh:
    def __init__(self, ndim=1, group=None):
        self.ndim = ndim
        self._group = group

    def get_group(self):
        return self._group


class StandInDTensor:
    def __init__(self, local, global_shape, placements=(Shard(0),), mesh=None):
        self._local_tensor = local
        self.shape = torch.Size(global_shape)
        self.dtype = local.dtype
        self.placements = tuple(placements)
        self.device_mesh = mesh or Mesh()
        self.requires_grad = True

    def to_local(self):
        return self._local_tensor

    def clone(self):
        return StandInDTensor(self._local_tensor.clone(), self.shape, self.placements,
                              self.device_mesh)
