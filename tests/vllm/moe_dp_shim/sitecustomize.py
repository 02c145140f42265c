"""TEST-ONLY: gives vLLM CPU's ``CpuCommunicator`` the two variable-size collectives a MoE model needs under
data parallelism, so tests/vllm/test_dp_moe.py can run a MoE model with ``--data-parallel-size 2`` here.

Why: with DP > 1 every MoE layer of vLLM dispatches its tokens through ``AgRsAll2AllManager`` (all2all.py):
``all_gatherv`` of each DP rank's hidden states / top-k weights / top-k ids (one rank's count may differ
from another's, an idle rank's dummy batch included), then ``reduce_scatterv`` of the experts' partial sums
(the experts are sharded over the DP ranks when expert parallelism is off). vLLM CPU 0.32's
``vllm.distributed.device_communicators.cpu_communicator.CpuCommunicator`` inherits both from
``DeviceCommunicatorBase``, which raises NotImplementedError, so the first forward kills the engine. vLLM's
GPU communicator (cuda_communicator.py) implements them with NCCL; this shim is not a fix of vLLM, it only
lets the tests reach kvlink's connector under MoE DP lock-step on a CPU machine.

What it patches, and only when the class still has the base class's unimplemented methods:
- ``CpuCommunicator.all_gatherv(input_, dim=0, sizes=None)``: each rank's tensor (or each tensor of a list,
  gathered one by one) is padded along ``dim`` to ``max(sizes)``, ``torch.distributed.all_gather`` on the
  communicator's ``device_group`` (gloo on CPU), trimmed to each rank's size and concatenated in rank order.
  ``sizes=None``: every rank has this rank's size (as vLLM's own ``all_gather``).
- ``CpuCommunicator.reduce_scatterv(input_, dim=-1, sizes=None)``: ``all_reduce`` (sum) of a copy, then this
  rank's slice ``sizes[rank]`` along ``dim`` (the offset is the sum of the lower ranks' sizes); ``sizes=None``:
  equal slices. ``reduce_scatterv_into_output`` of the base class calls it.
The patch is applied when vLLM first imports cpu_communicator (an import hook: nothing of vLLM is imported
here), and each process says so on stderr once it first runs a patched collective
("moe_dp_shim: ... used"), so a test can check that the shim, not something else, carried the forward.

Loaded as ``sitecustomize`` from this directory put first on the server's PYTHONPATH (every process of the
server, the spawned workers too, runs it at start-up). Python imports only the first ``sitecustomize`` on
sys.path, so this one then runs the next one found on sys.path after its own directory (tools/nospin's, which
the tests' Server puts on the path, or the system's), as if it had been imported itself.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from after_import import after_import  # tools/nospin, on the server's path after this directory

TARGET = "vllm.distributed.device_communicators.cpu_communicator"
_said: set[str] = set()


def _say_used(name: str) -> None:
    if name not in _said:
        _said.add(name)
        print(f"moe_dp_shim: CpuCommunicator.{name} used (pid {os.getpid()})", file=sys.stderr, flush=True)


def _all_gatherv(self, input_, dim: int = 0, sizes=None):
    _say_used("all_gatherv")
    if isinstance(input_, (list, tuple)):
        return [_gatherv_one(self, t, dim, sizes) for t in input_]
    return _gatherv_one(self, input_, dim, sizes)


def _gatherv_one(self, x, dim, sizes):
    import torch
    import torch.distributed as dist

    ws, rank = self.world_size, self.rank_in_group
    if dim < 0:
        dim += x.dim()
    if sizes is None:
        sizes = [x.shape[dim]] * ws
    assert len(sizes) == ws and x.shape[dim] == sizes[rank], (x.shape, dim, sizes, rank)
    t = x.movedim(dim, 0)
    longest = max(sizes)
    padded = t.new_zeros((longest,) + tuple(t.shape[1:]))
    padded[: t.shape[0]] = t
    parts = [torch.empty_like(padded) for _ in range(ws)]
    dist.all_gather(parts, padded, group=self.device_group)
    out = torch.cat([p[:s] for p, s in zip(parts, sizes)], dim=0)
    return out.movedim(0, dim).contiguous()


def _reduce_scatterv(self, input_, dim: int = -1, sizes=None):
    import torch.distributed as dist

    _say_used("reduce_scatterv")
    ws, rank = self.world_size, self.rank_in_group
    if dim < 0:
        dim += input_.dim()
    total = input_.shape[dim]
    if sizes is None:
        assert total % ws == 0, (input_.shape, dim, ws)
        sizes = [total // ws] * ws
    assert len(sizes) == ws and sum(sizes) == total, (input_.shape, dim, sizes)
    summed = input_.contiguous().clone()
    dist.all_reduce(summed, group=self.device_group)  # sum
    start = sum(sizes[:rank])
    return summed.narrow(dim, start, sizes[rank]).contiguous()


def _patch(module) -> None:
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase

    cls = module.CpuCommunicator
    for name, impl in (("all_gatherv", _all_gatherv), ("reduce_scatterv", _reduce_scatterv)):
        if getattr(cls, name) is getattr(DeviceCommunicatorBase, name):
            setattr(cls, name, impl)
        else:
            print(f"moe_dp_shim: CpuCommunicator has its own {name}; left alone", file=sys.stderr)


def _run_next_sitecustomize() -> None:
    """Run the sitecustomize this one shadows: the first one on sys.path after this directory."""
    here = os.path.dirname(os.path.abspath(__file__))
    entries = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    after = entries[entries.index(here) + 1:] if here in entries else entries
    for d in after:
        cand = os.path.join(d, "sitecustomize.py")
        if d != here and os.path.isfile(cand):
            spec = importlib.util.spec_from_file_location("_moe_dp_shim_next_sitecustomize", cand)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return


after_import(TARGET, _patch)
_run_next_sitecustomize()
