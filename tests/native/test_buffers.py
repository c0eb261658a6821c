"""The CPU kernels' buffer pool (ssm/native/_buffers.py): storage is handed out again only when no
tensor can see it, and whole training steps give the same bits with and without it."""

import threading

import pytest
import torch

from ssm.native import _buffers
from ssm.native._buffers import BufferPool

SHAPE = (64, 1024)  # 256 KiB in float32: above the pool's lower bound
MIN_BYTES = _buffers.MIN_BYTES


def test_storage_comes_back_once_nothing_refers_to_it():
    pool = BufferPool()
    a = pool.empty(SHAPE, torch.float32)
    assert a.shape == SHAPE and a.is_contiguous() and a.dtype == torch.float32
    ptr = a.data_ptr()
    b = pool.empty(SHAPE, torch.float32)
    assert b.data_ptr() != ptr  # a is alive
    del a
    c = pool.empty(SHAPE, torch.float32)
    assert c.data_ptr() == ptr  # reused
    # another dtype of the same byte size may take the same storage too
    del c
    assert pool.empty((64, 512), torch.float64).data_ptr() == ptr


@pytest.mark.parametrize("holder", ["view", "autograd", "storage", "list"])
def test_storage_stays_out_while_anything_refers_to_it(holder):
    pool = BufferPool()
    a = pool.empty(SHAPE, torch.float32).fill_(3.0)
    keep = None
    if holder == "view":
        keep = a[1:, ::2].t()
    elif holder == "autograd":
        w = torch.ones(SHAPE[1], requires_grad=True)
        keep = (a * w).sum()  # the product saves a for w's gradient
    elif holder == "storage":
        keep = a.untyped_storage()
    else:
        keep = [a]
    ptr = a.data_ptr()
    del a
    fresh = [pool.empty(SHAPE, torch.float32).fill_(-1.0) for _ in range(3)]
    assert all(t.data_ptr() != ptr for t in fresh)
    if holder == "autograd":
        keep.backward()
        assert torch.equal(w.grad, torch.full((SHAPE[1],), 3.0 * SHAPE[0]))


def test_small_and_disabled_requests_are_plain_allocations():
    pool = BufferPool()
    small = pool.empty((4, 4), torch.float32)
    del small
    assert pool.idle_bytes() == 0
    pool.enabled = False
    a = pool.empty(SHAPE, torch.float32)
    del a
    assert pool.idle_bytes() == 0


def test_idle_storage_beyond_the_bound_is_given_back_at_a_miss():
    nbytes = SHAPE[0] * SHAPE[1] * 4
    pool = BufferPool(max_idle_bytes=2 * nbytes)
    held = [pool.empty(SHAPE, torch.float32) for _ in range(4)]
    del held
    assert pool.idle_bytes() == 4 * nbytes
    other = pool.empty((2 * SHAPE[0], SHAPE[1]), torch.float32)  # a miss: idle beyond the bound goes
    assert pool.idle_bytes() == 0  # a miss of 2 units under a bound of 2 keeps no idle storage
    del other
    assert pool.idle_bytes() == 2 * nbytes
    pool.clear()
    assert pool.idle_bytes() == 0


def test_threads_never_share_a_storage():
    pool = BufferPool()
    seen, errors = [], []

    def work(k):
        try:
            for _ in range(50):
                t = pool.empty(SHAPE, torch.float32).fill_(k)
                seen.append(t.data_ptr())
                if not bool((t == k).all()):
                    errors.append(k)
        except Exception as e:  # noqa: BLE001  (reported below)
            errors.append(e)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(seen)) <= 8  # reused: at most a handful of storages for 200 requests


def test_a_training_step_gives_the_same_bits_with_and_without_the_pool(monkeypatch):
    from ssm import MambaConfig, MambaLM

    def step():
        torch.manual_seed(0)
        model = MambaLM(MambaConfig(d_model=64, n_layer=2, vocab_size=32, ssm_cfg={"d_state": 8}))
        ids = torch.randint(0, 32, (4, 129))
        for _ in range(2):  # the second step runs on storage the first gave back
            model.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
            loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    pool = BufferPool()
    monkeypatch.setattr(_buffers.pool, "enabled", False)
    loss_plain, grads_plain = step()
    monkeypatch.setattr(_buffers.pool, "enabled", True)
    monkeypatch.setattr(_buffers.pool, "_by_size", pool._by_size)
    loss_pooled, grads_pooled = step()
    assert pool.idle_bytes() > 0  # the pool was used
    assert torch.equal(loss_plain, loss_pooled)
    assert all(torch.equal(a, b) for a, b in zip(grads_plain, grads_pooled, strict=True))


def test_no_pool_without_torchs_use_count(monkeypatch):
    """The idle test rests on a private torch function: without it the pool stays off."""
    monkeypatch.setattr(_buffers, "_storage_use_count", None)
    pool = BufferPool()
    assert not pool.enabled
    a = pool.empty(SHAPE, torch.float32)
    assert a.shape == SHAPE and a.is_contiguous()
    assert not pool._by_size  # a plain allocation: nothing tracked


def test_size_classes_are_eight_to_an_octave_and_at_most_an_eighth_above():
    assert _buffers.size_class(1 << 20) == 1 << 20  # a power of two is its own class
    assert _buffers.size_class((1 << 20) + 1) == (1 << 20) + (1 << 17)  # the next eighth of the octave
    assert _buffers.size_class(9 * (1 << 17) - 1) == 9 * (1 << 17)
    for n in range(MIN_BYTES, 4 * MIN_BYTES, 997):
        c = _buffers.size_class(n)
        assert n <= c <= n * 1.125


def test_lengths_that_change_every_step_find_their_storage_again():
    """A run whose length is drawn per step (parity's 3..160) asks for a new byte size at nearly
    every step: within a size class it gets storage back, and the pool keeps a few classes, not
    one per length."""
    pool = BufferPool()
    a = pool.empty((160, 1024), torch.float32)
    ptr = a.data_ptr()
    del a
    b = pool.empty((150, 1024), torch.float32)  # 6% smaller: the same class
    assert b.data_ptr() == ptr and b.shape == (150, 1024) and b.is_contiguous()
    b.fill_(1.0)
    del b
    for length in range(64, 161):
        t = pool.empty((length, 1024), torch.float32)
        del t
    assert len(pool._by_size) <= 11  # 256..640 KiB, 1.3 octaves: 11 classes (one storage per size was 97)
    assert sum(len(ss) for ss in pool._by_size.values()) == len(pool._by_size)  # one storage each, reused
