"""torch DDP (plain and with a futures comm hook), FSDP2 and a pipelining schedule over
"ringlet", against "gloo" and against one process training on the whole batch.  Run under torchrun; prints "OK ...".
"""

import copy
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

import ringlet
import ringlet.torch  # noqa: F401

dist.init_process_group("ringlet")
r, P = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(list(range(P)), backend="gloo")
ring = dist.group.WORLD
STEPS, BATCH = 3, 8 * P

torch.manual_seed(0)
base = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
gen = torch.Generator().manual_seed(1)
data = [(torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 4, generator=gen))
        for _ in range(STEPS)]


def train(model, local):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        if local:
            n = BATCH // P
            x, y = x[r * n:(r + 1) * n], y[r * n:(r + 1) * n]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model


def params(model):
    out = []
    for p in model.parameters():
        p = p.full_tensor() if hasattr(p, "full_tensor") else p
        out.append(p.detach().clone())
    return out


def same(a, b, what, tol=1e-5):
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.allclose(x, y, atol=tol, rtol=tol), \
            f"rank {r}: {what}: parameter {i} differs by {(x - y).abs().max().item():g}"


single = params(train(copy.deepcopy(base), local=False))
ddp_ring = params(train(DDP(copy.deepcopy(base), process_group=ring, bucket_cap_mb=0.001), True))
ddp_gloo = params(train(DDP(copy.deepcopy(base), process_group=gloo, bucket_cap_mb=0.001), True))
same(ddp_ring, ddp_gloo, "DDP ringlet vs gloo", 1e-6)
same(ddp_ring, single, "DDP ringlet vs one process")

calls = []


def hook(state, bucket):
    # A comm hook in the documented shape: an async all_reduce's future, chained.
    calls.append(bucket.index())
    t = bucket.buffer().div_(P)
    fut = dist.all_reduce(t, group=ring, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


m = DDP(copy.deepcopy(base), process_group=ring, bucket_cap_mb=0.001)
m.register_comm_hook(None, hook)
same(params(train(m, True)), single, "DDP ringlet with a futures comm hook vs one process")
assert len(calls) >= STEPS, calls

for name, pg in (("ringlet", ring), ("gloo", gloo)):
    model = copy.deepcopy(base)
    mesh = DeviceMesh.from_group(pg, "cpu")
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    got = params(train(model, True))
    same(got, single, f"FSDP2 over {name} vs one process")
    if name == "ringlet":
        fsdp_ring = got
    else:
        same(fsdp_ring, got, "FSDP2 ringlet vs gloo", 1e-6)

# torch.distributed.pipelining: a 2-stage GPipe schedule, 4 microbatches, over each backend;
# every stage's gradients equal one process's on the same microbatches.
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe  # noqa: E402

assert P == 2, "the pipeline check splits the model in two stages"
pmodel = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                       nn.Linear(32, 4))
x, y = data[0]
ref = copy.deepcopy(pmodel)
for xm, ym in zip(x.chunk(4), y.chunk(4)):
    (nn.functional.mse_loss(ref(xm), ym) / 4).backward()  # the schedule averages microbatches
ref_part = [ref[:2], ref[2:]][r]
for name, pg in (("ringlet", ring), ("gloo", gloo)):
    part = copy.deepcopy([pmodel[:2], pmodel[2:]][r])
    stage = PipelineStage(part, r, P, torch.device("cpu"), group=pg)
    sched = ScheduleGPipe(stage, 4, loss_fn=nn.functional.mse_loss)
    if r == 0:
        sched.step(x)
    else:
        sched.step(target=y)
    same([p.grad for p in part.parameters()], [q.grad for q in ref_part.parameters()],
         f"pipelining GPipe over {name}: stage {r} gradients vs one process", 1e-6)

# torch's timeouts are honoured: a group made with timeout=2s fails a collective that its
# other member never joins with ringlet's CollectiveTimeout, after 2 s and not much later.
# Last, as it aborts the ringlet job; rank 1 waits in a gloo barrier meanwhile.
timed = dist.new_group(list(range(P)), timeout=timedelta(seconds=2))
if r == 0:
    t0 = time.monotonic()
    try:
        dist.all_reduce(torch.ones(1), group=timed)
        raise AssertionError("the all_reduce that rank 1 never joined did not time out")
    except ringlet.CollectiveTimeout as exc:
        took = time.monotonic() - t0
        assert "all_reduce" in str(exc) and "peer 1" in str(exc), exc
        assert 1.9 <= took < 30, took
dist.barrier(group=gloo)
print(f"OK rank={r} size={P} hook_calls={len(calls)}", flush=True)
dist.destroy_process_group()
