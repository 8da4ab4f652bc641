"""sync_gradients: FSDP2 reduce-scatters after the last micro-batch only, or after every one."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from trex.parallel.plan import _REDUCE_EVERY, sync_gradients


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


@pytest.mark.parametrize("every", [False, True])
def test_sharded_gradients_exist_after_the_first_micro_batch_only_when_reducing_every_one(one_rank_group, every):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    fully_shard(model, mesh=one_rank_group)
    model.__dict__[_REDUCE_EVERY] = every
    x = torch.randn(3, 4)
    sync_gradients(model, 0, 2)
    model(x).sum().backward()
    first = [p.grad for p in model.parameters()]
    assert all((g is not None) == every for g in first)  # without: FSDP2 holds them unsharded, unreduced
    sync_gradients(model, 1, 2)
    model(x).sum().backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    plain.load_state_dict({k: v.full_tensor() for k, v in model.state_dict().items()})
    (2 * plain(x).sum()).backward()
    for g, p in zip(grads, plain.parameters()):
        torch.testing.assert_close(g, p.grad)



def test_shutdown_frees_the_groups_an_fsdp_model_held(tmp_path):
    import gc
    import weakref

    from trex.parallel.mesh import shutdown_distributed

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)

    def train_briefly() -> weakref.ref:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        model(torch.randn(3, 4)).sum().backward()
        return weakref.ref(model)

    gc.disable()  # only the shutdown's own collection may free the model's reference cycles
    try:
        model = train_briefly()
        shutdown_distributed()
    finally:
        gc.enable()
    assert not dist.is_initialized()
    assert model() is None  # the FSDP model (and with it its process groups) is gone before interpreter exit
    shutdown_distributed()  # a second call, or one in a single-process run, does nothing
