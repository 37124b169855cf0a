"""learner.optimizer_offload's CPU side (rayrl.offload.PinnedCopies): copies packed into power-of-two chunks, made
once and reused. On this CPU machine nothing is page-locked (pin=False); tests/gpu checks the host memory on a GPU."""

from __future__ import annotations

import torch

from rayrl.offload import PinnedCopies, move_optimizer


def state_like() -> dict[str, torch.Tensor]:
    """An AdamW state's shapes: an embedding, two MLP matrices, a norm, the step count (fp32, 0-d)."""
    return {"embed": torch.randn(1000, 48), "up": torch.randn(48, 130), "down": torch.randn(130, 48),
            "norm": torch.randn(48), "step": torch.tensor(3.0)}


def test_copies_are_disjoint_views_in_power_of_two_chunks_equal_to_their_sources():
    src = state_like()
    pc = PinnedCopies(pin=False, min_chunk=64 << 10)
    pc.reserve(src)
    spans = []
    for k, t in src.items():
        out = pc.copy(k, t)
        assert out is pc.slots[k] and out.shape == t.shape and out.dtype == t.dtype and torch.equal(out, t)
        base = next(c for c in pc.chunks if c.untyped_storage().data_ptr() == out.untyped_storage().data_ptr())
        start = out.data_ptr() - base.data_ptr()
        assert start % PinnedCopies.ALIGN == 0 and start + t.numel() * 4 <= base.numel()
        spans.append((out.data_ptr(), out.data_ptr() + t.numel() * 4))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # no copy overlaps another
    assert all(c.numel() & (c.numel() - 1) == 0 for c in pc.chunks)  # nothing for the allocator to round up
    # 242,116 B of state; the embedding (192,000 B) sets the chunk size, 256 KiB, and one chunk holds all of it.
    # torch's per-allocation power-of-two rounding would take 262,144 + 2 x 32,768 + 256 + 4 = 327,940 B.
    assert sum(t.numel() * 4 for t in src.values()) == 242_116
    assert [c.numel() for c in pc.chunks] == [262_144] and pc.nbytes == 262_144


def test_later_moves_reuse_the_copies_and_a_new_shape_gets_its_own():
    src = state_like()
    pc = PinnedCopies(pin=False, min_chunk=64 << 10)
    pc.reserve(src)
    first = {k: v.data_ptr() for k, v in pc.slots.items()}
    chunks = len(pc.chunks)
    pc.reserve({k: t * 2 for k, t in src.items()})  # the next offload: same shapes
    assert {k: v.data_ptr() for k, v in pc.slots.items()} == first and len(pc.chunks) == chunks
    pc.reserve({"up": torch.randn(48, 131)})
    assert pc.slots["up"].shape == (48, 131) and len(pc.chunks) == chunks + 1


def test_move_optimizer_leaves_tensors_already_on_the_device():
    p = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    opt.step()
    before = {k: v for k, v in opt.state[p].items()}
    pc = PinnedCopies(pin=False)
    move_optimizer(opt, pc, torch.device("cpu"))
    assert all(opt.state[p][k] is v for k, v in before.items()) and not pc.chunks


def test_state_larger_than_a_chunk_fills_several_and_the_last_is_only_as_big_as_it_needs():
    src = {i: torch.randn(1000, 16) for i in range(10)}  # 64,000 B each: 4 fit a 256 KiB chunk (min_chunk)
    pc = PinnedCopies(pin=False, min_chunk=256 << 10)
    pc.reserve(src)
    assert [c.numel() for c in pc.chunks] == [262_144, 262_144, 131_072]  # 4 + 4 + 2 copies
    assert all(torch.equal(pc.copy(k, t), t) for k, t in src.items())


def test_a_dtensor_state_keeps_its_local_shard_in_the_copy():
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    created = not dist.is_initialized()
    if created:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        src = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])  # an FSDP2 exp_avg
        pc = PinnedCopies(pin=False, min_chunk=1 << 10)
        pc.reserve({"exp_avg": src})
        slot = pc.slots["exp_avg"]
        assert type(slot) is torch.Tensor and slot.shape == src.to_local().shape
        out = pc.copy("exp_avg", src)
        assert isinstance(out, DTensor) and out.shape == src.shape and out.placements == src.placements
        assert out.to_local().data_ptr() == slot.data_ptr() and torch.equal(out.full_tensor(), src.full_tensor())
        chunks = len(pc.chunks)
        new = distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])  # the next offload: same shard
        pc.reserve({"exp_avg": new})
        again = pc.copy("exp_avg", new)
        assert len(pc.chunks) == chunks and pc.slots["exp_avg"] is slot
        assert again.to_local().data_ptr() == slot.data_ptr() and torch.equal(again.full_tensor(), new.full_tensor())
    finally:
        if created:
            dist.destroy_process_group()
