"""Every op of the "ringlet" torch.distributed backend against expected values.

Run by tests/test_torch_backend.py under the real torchrun; prints "OK rank=R size=P".
"""

import functools
import operator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

import ringlet.torch  # noqa: F401  (registers "ringlet")

dist.init_process_group("ringlet")
r, P = dist.get_rank(), dist.get_world_size()
R = dist.ReduceOp
assert dist.get_backend() == "ringlet"


def full(v, n=4, dtype=torch.float32):
    return torch.full((n,), v, dtype=dtype)


# allreduce, every op (float and integer), in place
for op, dtype, mine, want in [
        (R.SUM, torch.float32, r + 1, P * (P + 1) / 2),
        (R.AVG, torch.float64, r, (P - 1) / 2),
        (R.PRODUCT, torch.int64, r + 1, torch.arange(1, P + 1).prod().item()),
        (R.MIN, torch.float16, r + 3, 3),
        (R.MAX, torch.bfloat16, r, P - 1),
        (R.BAND, torch.int32, 0b111 ^ (1 << (r % 3)),
         functools.reduce(operator.and_, [0b111 ^ (1 << (q % 3)) for q in range(P)])),
        (R.BOR, torch.int64, 1 << r, (1 << P) - 1),
        (R.BXOR, torch.uint8, 1 << r | 1, functools.reduce(operator.xor, [1 << q | 1 for q in range(P)]))]:
    t = full(mine, 5, dtype)
    ptr = t.data_ptr()
    dist.all_reduce(t, op=op)
    assert t.data_ptr() == ptr and torch.all(t.double() == want), (op, dtype, t, want)

# broadcast from every root, reduce to every root
for root in range(P):
    t = full(r * 10.0)
    dist.broadcast(t, src=root)
    assert torch.all(t == root * 10)
    t = full(r + 1.0)
    dist.reduce(t, dst=root, op=R.SUM)
    assert torch.all(t == (P * (P + 1) / 2 if r == root else r + 1))

# all_gather (list form, shapes kept), all_gather_into_tensor
outs = [torch.empty(2, 3) for _ in range(P)]
dist.all_gather(outs, torch.full((2, 3), float(r)))
assert all(torch.all(o == q) for q, o in enumerate(outs))
o = torch.empty(P * 3, dtype=torch.int64)
dist.all_gather_into_tensor(o, torch.tensor([r, r, -r]))
assert o.tolist() == [v for q in range(P) for v in (q, q, -q)]
# uneven sizes in the list form (rank q sends q + 1 rows), as torch documents them
outs = [torch.empty(q + 1, 2) for q in range(P)]
dist.all_gather(outs, torch.full((r + 1, 2), float(r) + 0.5))
assert all(o.shape == (q + 1, 2) and torch.all(o == q + 0.5) for q, o in enumerate(outs))

# reduce_scatter_tensor and the list form
o = torch.empty(2)
dist.reduce_scatter_tensor(o, torch.arange(2 * P, dtype=torch.float32) + r)
assert o.tolist() == [P * (2 * r) + P * (P - 1) / 2, P * (2 * r + 1) + P * (P - 1) / 2]
o = torch.empty(3)
dist.reduce_scatter(o, [torch.full((3,), float(q * r)) for q in range(P)], op=R.MAX)
assert torch.all(o == r * (P - 1))

# all_to_all_single: equal, then uneven splits (rows of 2 elements)
o = torch.empty(P, dtype=torch.int64)
dist.all_to_all_single(o, torch.arange(P) + 100 * r)
assert o.tolist() == [100 * q + r for q in range(P)]
in_splits = [q + 1 for q in range(P)]          # to rank q: q+1 rows
out_splits = [r + 1] * P                       # from each rank: r+1 rows
inp = torch.full((sum(in_splits), 2), float(r))
o = torch.empty(sum(out_splits), 2)
dist.all_to_all_single(o, inp, out_splits, in_splits)
assert o[:, 0].tolist() == [float(q) for q in range(P) for _ in range(r + 1)]
# all_to_all (list form)
outs = [torch.empty(q + 1) for q in range(P)]
dist.all_to_all(outs, [torch.full((r + 1,), float(r * 10 + q)) for q in range(P)])
assert all(torch.all(outs[q] == q * 10 + r) for q in range(P))

# gather, scatter
g = [torch.empty(2) for _ in range(P)] if r == P - 1 else None
dist.gather(torch.full((2,), float(r)), g, dst=P - 1)
if r == P - 1:
    assert [x[0].item() for x in g] == list(range(P))
o = torch.empty(2)
dist.scatter(o, [torch.full((2,), float(q * 7)) for q in range(P)] if r == 0 else None, src=0)
assert torch.all(o == 7 * r)

# point to point: a ring exchange with isend/irecv (must be truly asynchronous), tags
right, left = (r + 1) % P, (r - 1) % P
got_a, got_b = torch.empty(3), torch.empty(3)
reqs = [dist.irecv(got_b, left, tag=2), dist.irecv(got_a, left, tag=1),
        dist.isend(full(r * 1.0, 3), right, tag=1), dist.isend(full(r + 0.5, 3), right, tag=2)]
for q in reqs:
    q.wait()
assert torch.all(got_a == left) and torch.all(got_b == left + 0.5)
if r == 0:
    dist.send(torch.tensor([42.0]), P - 1, tag=9)
elif r == P - 1:
    x = torch.empty(1)
    dist.recv(x, 0, tag=9)
    assert x.item() == 42
dist.batch_isend_irecv([dist.P2POp(dist.isend, full(r * 2.0, 2), right),
                        dist.P2POp(dist.irecv, got_a[:2], left)])[-1].wait()
assert torch.all(got_a[:2] == left * 2)
# receive from any source: recv returns the sender's global rank, irecv's Work names it
if r == 0:
    senders = set()
    for _ in range(P - 1):
        x = torch.empty(2)
        s = dist.recv(x, tag=11)
        assert torch.all(x == s * 3.0), (s, x)
        senders.add(s)
    assert senders == set(range(1, P)), senders
    x = torch.empty(1)
    w = dist.irecv(x, tag=12)
    w.wait()
    assert w._source_rank() == P - 1 and x.item() == -1.0
else:
    dist.send(full(r * 3.0, 2), 0, tag=11)
    if r == P - 1:
        dist.send(torch.tensor([-1.0]), 0, tag=12)

# list forms whose sizes cannot work fail on the rank that passed them, before anything
# is sent, and the group stays usable
def refused(call, words):
    try:
        call()
    except ValueError as exc:
        assert words in str(exc), (words, str(exc))
        return
    raise AssertionError(f"no ValueError ({words})")


refused(lambda: dist.all_gather([torch.empty(3) for _ in range(P)], torch.empty(2)),
        f"rank {r}'s output tensor (index {r}) has 3 elements but its input has 2")
refused(lambda: dist.reduce_scatter(torch.empty(2), [torch.empty(3) for _ in range(P)]),
        "input tensor 0 has 3 elements but the output has 2")
if r == 0:
    refused(lambda: dist.gather(torch.empty(2), [torch.empty(2)] * (P - 1) + [torch.empty(1)]),
            f"output tensor {P - 1} has 1 elements but the input has 2")
    refused(lambda: dist.scatter(torch.empty(2), [torch.empty(3) for _ in range(P)]),
            "input tensor 0 has 3 elements but the output has 2")
t = full(1.0)
dist.all_reduce(t)
assert torch.all(t == P)

# all_gather_coalesced: output_tensor_lists[q][i] receives rank q's input i (torch's
# layout, the transpose of all_gather's list); it was read as all_gather's, so three
# inputs raised and P inputs landed transposed.  torch's documented example, then P inputs.
ins = [torch.full((2, 2), float(r)), torch.full((1,), 10.0 * r), torch.full((2,), 100.0 * r + 1)]
outs = [[torch.full_like(x, -1.0) for x in ins] for _ in range(P)]
dist.all_gather_coalesced(outs, ins)
for q in range(P):
    assert [o.tolist() for o in outs[q]] == [[[q, q], [q, q]], [10 * q], [100 * q + 1] * 2], \
        (q, outs[q])
ins = [torch.full((3,), float(r * P + i), dtype=torch.float64) for i in range(P)]
outs = [[torch.empty(3, dtype=torch.float64) for _ in range(P)] for _ in range(P)]
dist.all_gather_coalesced(outs, ins, async_op=True).wait()
assert [[o[0].item() for o in outs[q]] for q in range(P)] == \
    [[float(q * P + i) for i in range(P)] for q in range(P)], outs
refused(lambda: dist.all_gather_coalesced([[torch.empty(2)]] * (P + 1), [torch.empty(2)]),
        f"{P + 1} output lists for a group of {P} ranks")
refused(lambda: dist.all_gather_coalesced([[torch.empty(2)]] * (P - 1) + [[torch.empty(3)]],
                                          [torch.empty(2)]),
        f"output_lists[{P - 1}][0] has 3 elements but input 0 has 2")
t = full(1.0)
dist.all_reduce(t)
assert torch.all(t == P)

# async work and futures: wait(), get_future().then(), value is the list of tensors
t = full(1.0, 1000)
w = dist.all_reduce(t, async_op=True)
fut = w.get_future().then(lambda f: f.value()[0] * 2)
assert torch.all(fut.wait() == 2 * P) and w.wait() and torch.all(t == P)

# a blocking call on the group itself: the result is in place when it returns, and
# its Work is already complete (the list form's copies out included)
pg = dist.distributed_c10d._get_default_group()
opts = dist.AllreduceOptions()
opts.asyncOp = False
t = full(r + 1.0, 3)
w = pg.allreduce([t], opts)
assert w.is_completed() and torch.all(t == P * (P + 1) / 2) and w.wait()
gopts = AllgatherOptions()
gopts.asyncOp = False
outs = [torch.empty(2) for _ in range(P)]
w = pg.allgather([outs], [full(float(r), 2)], gopts)
assert w.is_completed() and all(torch.all(o == q) for q, o in enumerate(outs))
# options left out: torch's defaults (asynchronous)
outs = [torch.empty(2) for _ in range(P)]
assert pg.allgather([outs], [full(r + 5.0, 2)]).wait()
assert all(torch.all(o == q + 5) for q, o in enumerate(outs))
t = full(float(r), 2)
assert pg.allreduce([t]).wait() and torch.all(t == P * (P - 1) / 2)

# object collectives
objs = [None] * P
dist.all_gather_object(objs, {"rank": r, "s": "x" * r})
assert objs == [{"rank": q, "s": "x" * q} for q in range(P)]
lst = [{"cfg": [1, 2]}, "two"] if r == 1 else [None, None]
dist.broadcast_object_list(lst, src=1)
assert lst == [{"cfg": [1, 2]}, "two"]
out = [None] * P if r == 0 else None
dist.gather_object(("r", r), out, dst=0)
if r == 0:
    assert out == [("r", q) for q in range(P)]
recv = [None]
dist.scatter_object_list(recv, [f"to{q}" for q in range(P)] if r == 0 else None, src=0)
assert recv == [f"to{r}"]

# subgroups: members-only formation (torch calls the creator on members only)
evens = dist.new_group([q for q in range(P) if q % 2 == 0])
odds = dist.new_group([q for q in range(P) if q % 2 == 1])
mine = evens if r % 2 == 0 else odds
t = full(float(r), 2)
dist.all_reduce(t, group=mine)
assert torch.all(t == sum(q for q in range(P) if q % 2 == r % 2))
members = [q for q in range(P) if q % 2 == r % 2]
assert dist.get_process_group_ranks(mine) == members
objs = [None] * len(members)
dist.all_gather_object(objs, r, group=mine)
assert objs == members
sub, _ = dist.new_subgroups(group_size=2) if P % 2 == 0 else (dist.group.WORLD, None)
t = full(1.0, 1)
dist.all_reduce(t, group=sub)
assert t.item() == (2 if P % 2 == 0 else P)

# torch's timeouts reach ringlet: the group's, from new_group(timeout=), bounds every op.
timed = dist.new_group(list(range(P)), timeout=timedelta(seconds=7))
assert isinstance(timed, ringlet.torch.RingletProcessGroup)
assert timed.ringlet_group.timeout == 7.0, timed.ringlet_group.timeout
t = full(1.0, 1)
dist.all_reduce(t, group=timed)
assert t.item() == P

# all_to_all_single checks its splits as torch documents them (they once sent the rows
# the splits named and left the rest unwritten, without an error)
refused(lambda: dist.all_to_all_single(torch.empty(P, 2), torch.empty(P, 2),
                                       [1] * (P - 1) + [0], None),
        f"output_split_sizes {[1] * (P - 1) + [0]} must be {P} sizes >= 0 summing to the "
        f"output's {P} rows")
refused(lambda: dist.all_to_all_single(torch.empty(P + 1), torch.empty(P + 1)),
        f"size {P + 1} is not divisible by the group size {P}")
refused(lambda: dist.all_to_all_single(torch.empty(P + 1), torch.empty(P), None, [1] * P),
        f"output has {P + 1} rows, not divisible by the group size {P}")

# Work.wait(timeout): honoured (torch's future-wrapping Work refused any finite timeout)
t = full(1.0, 10)
w = dist.all_reduce(t, async_op=True)
assert w.wait(timeout=timedelta(seconds=120)) and torch.all(t == P)
if r == 0:
    x = torch.empty(1)
    w = dist.irecv(x, src=1, tag=99)
    try:
        w.wait(timeout=timedelta(milliseconds=200))
    except RuntimeError as exc:
        assert "not finished" in str(exc), str(exc)
    else:
        raise AssertionError("a wait on a receive nobody sent did not time out")
dist.barrier()
if r == 1:
    dist.send(torch.tensor([5.0]), 0, tag=99)
if r == 0:
    assert w.wait() and x.item() == 5.0

# A future's callback that issues ops on the same group and waits for them (torch's
# PowerSGD hook does): it runs on the group's progress thread, and the ops it issued were
# once queued behind it for good.
def chained(f):
    u = full(2.0, 8)
    dist.all_reduce(u, async_op=True).get_future().wait()
    v = full(3.0, 8)
    dist.all_reduce(v)  # a blocking call from the callback too
    return f.value()[0][:8] + u + v


big = full(1.0, 1 << 18)
fut = dist.all_reduce(big, async_op=True).get_future().then(chained)
assert torch.all(fut.wait() == 6 * P)
t = full(1.0)
dist.all_reduce(t)  # the group goes on as before
assert torch.all(t == P)

dist.barrier()
print(f"OK rank={r} size={P}", flush=True)
dist.destroy_process_group()
