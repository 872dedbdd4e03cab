"""The buffer pool behind the engine's group buffers and the collectives' payload buffers."""
import pytest
import torch

from gradzip.comm.pool import BufferPool, plan_serving, size_class

CPU = torch.device("cpu")


def test_size_classes_cover_the_request_within_a_fifth():
    for n in [1, 2, 15, 16, 17, 100, 1000, 4096, 10**6 + 7, 8 << 20]:
        c = size_class(n)
        assert n <= c <= max(16, 1.19 * n), n
        assert size_class(c) == c  # a class is its own class


def test_borrowers_in_flight_get_distinct_memory_and_the_next_ones_reuse_it():
    pool = BufferPool(torch.float32)
    lent_a, lent_b = [], []
    a = pool.lend((1000,), CPU, lent_a)
    b = pool.lend((990,), CPU, lent_b)  # same class, while a is still lent: its own buffer
    assert a.shape == (1000,) and b.shape == (990,) and a.dtype == torch.float32
    assert a.data_ptr() != b.data_ptr()
    pool.give_back(lent_a)
    pool.give_back(lent_b)
    assert lent_a == [] and pool.nbytes == 2 * size_class(1000) * 4
    c = pool.lend((2, 500), CPU, [])  # a class it holds: no new memory
    assert c.shape == (2, 500) and c.data_ptr() in (a.data_ptr(), b.data_ptr())
    d = pool.lend((5000,), CPU, [])  # another class: new memory, the free one stays for its class
    assert d.data_ptr() not in (a.data_ptr(), b.data_ptr()) and pool.nbytes == size_class(1000) * 4


def test_buffers_nobody_borrowed_for_a_step_are_dropped():
    pool = BufferPool()
    for step in (1, 2):
        pool.new_step(step)
        lent = []
        pool.lend((64,), CPU, lent)
        if step == 1:
            pool.lend((4096,), CPU, lent)  # a group that exists only in step 1
        pool.give_back(lent)
    assert pool.nbytes == size_class(64) + size_class(4096)
    pool.new_step(3)  # the 4096-byte buffer was last lent in step 1
    assert pool.nbytes == size_class(64)
    pool.clear()
    assert pool.nbytes == 0


def test_a_borrower_asking_in_the_same_order_gets_the_same_buffers_back():
    pool = BufferPool(torch.float32)
    first = []
    a, b = pool.lend((1000,), CPU, first), pool.lend((1000,), CPU, first)
    ptrs = (a.data_ptr(), b.data_ptr())
    assert ptrs[0] != ptrs[1]
    for step in range(3):
        pool.give_back(first)
        again = []
        assert (pool.lend((1000,), CPU, again).data_ptr(), pool.lend((1000,), CPU, again).data_ptr()) == ptrs, step
        first = again


def test_a_request_whose_class_has_none_free_takes_the_smallest_free_buffer_up_to_twice_its_size():
    """Exchanges of different sizes that are not in flight together share one buffer."""
    pool = BufferPool(torch.float32)
    lent = []
    a, b = pool.lend((1000,), CPU, lent), pool.lend((1500,), CPU, lent)
    pool.give_back(lent)
    held = pool.nbytes
    small = pool.lend((600,), CPU, [])  # its class has none free: the smaller of the two serves it
    assert small.shape == (600,) and small.data_ptr() == a.data_ptr() and pool.nbytes == held - size_class(1000) * 4
    tiny = pool.lend((400,), CPU, [])  # more than twice smaller than what is free: memory of its own
    assert tiny.data_ptr() not in (a.data_ptr(), b.data_ptr()) and pool.nbytes == size_class(1500) * 4
    again = BufferPool(torch.float32)
    lent = []
    x, y = again.lend((600,), CPU, lent), again.lend((1000,), CPU, lent)
    again.give_back(lent)
    assert again.lend((600,), CPU, []).data_ptr() == x.data_ptr()  # its own class first
    assert again.lend((600,), CPU, []).data_ptr() == y.data_ptr()  # then a larger one
    assert again.lend((1000,), CPU, []).data_ptr() not in (x.data_ptr(), y.data_ptr())  # none left of its size


def test_a_class_whose_borrowing_made_a_larger_request_allocate_gets_buffers_of_its_own():
    """A step that ran only the large exchange, then steps with both in flight: the small one
    borrows the large buffer once, the large request allocates anew, and from then on the pool
    holds one buffer of each size, not two large ones."""
    pool = BufferPool(torch.float32)
    pool.new_step(0)
    lent = []
    pool.lend((1900,), CPU, lent)
    pool.give_back(lent)
    held = []
    for step in range(1, 6):
        pool.new_step(step)
        small, large = [], []
        pool.lend((1000,), CPU, small)
        pool.lend((1900,), CPU, large)
        pool.give_back(large)
        pool.give_back(small)
        held.append(pool.nbytes)
    assert held[-1] == (size_class(1000) + size_class(1900)) * 4, held
    assert held[-3:] == [held[-1]] * 3


def _step(pool: BufferPool, step: int, waves) -> None:
    """One step: each wave lends its requests at once and gives them back together."""
    pool.new_step(step)
    for wave in waves:
        lent = []
        for numel in wave:
            pool.lend((numel,), CPU, lent)
        pool.give_back(lent)


def test_classes_not_in_flight_together_are_served_by_the_larger_ones_buffers():
    """Two exchanges of 1000 and of 1500 values, two of each in flight, one size after the
    other: from the step after the first one planned from (the first step is not: it lends
    everything anew), the smaller are served by the larger ones' buffers, and the pool holds
    two buffers where it held four."""
    pool = BufferPool(torch.float32)
    waves = [(1000, 1000), (1500, 1500)]
    for step in range(2):
        _step(pool, step, waves)
        assert pool.nbytes == 2 * (size_class(1000) + size_class(1500)) * 4, step
    for step in range(2, 5):
        _step(pool, step, waves)
        assert pool.nbytes == 2 * size_class(1500) * 4, step
    lent = []
    small = pool.lend((1000,), CPU, lent)
    assert lent[0].numel() == size_class(1500) and small.shape == (1000,)


def test_classes_in_flight_together_keep_buffers_of_their_own():
    """The same two sizes, always in flight together: one buffer of each size, step after
    step, not two of the larger."""
    pool = BufferPool(torch.float32)
    for step in range(5):
        _step(pool, step, [(1000, 1500)])
        assert pool.nbytes == (size_class(1000) + size_class(1500)) * 4, step


def test_steps_that_take_turns_in_two_patterns_keep_one_plan():
    """Steps alternating between two patterns (both sizes in flight together, then one after
    the other) are planned from both: once planned, nothing is allocated and the pool holds
    the same from step to step."""
    pool = BufferPool(torch.float32)
    together, apart = [(1000, 1500)], [(1000,), (1500,)]
    held, buffers = [], []
    for step in range(10):
        _step(pool, step, together if step % 2 else apart)
        held.append(pool.nbytes)
        buffers.append(sorted(buf.data_ptr() for free in pool._free.values() for buf, _ in free))
    assert held[4:] == [held[4]] * 6 and held[4] <= (size_class(1000) + size_class(1500)) * 4, held
    assert buffers[4:] == [buffers[4]] * 6  # the same buffers: none made anew


@pytest.mark.parametrize("first", [0, 5])
def test_no_plan_is_made_from_the_first_step_that_lends(first):
    """The first step a pool lends in (everything in flight anew; DDP rebuilds its buckets after
    it) is left out, also where that step is not numbered 0 (a run resumed from a checkpoint)."""
    pool = BufferPool(torch.float32)
    pool.new_step(first)
    waves = [(1000, 1000), (1500, 1500)]
    held = []
    for step in range(first, first + 4):
        _step(pool, step, waves)
        held.append(pool.nbytes)
    assert held == [2 * (size_class(1000) + size_class(1500)) * 4] * 2 + [2 * size_class(1500) * 4] * 2, held


def test_steps_alternating_between_a_pair_and_a_larger_one_allocate_nothing_once_planned(monkeypatch):
    """Two of 1000 values in flight in one step, one of 1500 in the next, and so on: the plan
    of both steps keeps the buffers each of them needs (none is dropped to be made again)."""
    made = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or empty(*a, **k))
    pool = BufferPool(torch.float32)
    for step in range(12):
        _step(pool, step, [(1000, 1000)] if step % 2 == 0 else [(1500,)])
        if step == 5:
            made.clear()
    assert made == [] and pool.nbytes == 2 * size_class(1500) * 4, (made, pool.nbytes)


def test_a_class_is_served_only_by_buffers_up_to_about_twice_its_size():
    """Sizes never in flight together but more than four classes apart keep their own
    buffers; so do classes whose buffers together cost more than apart."""
    classes = [size_class(100), size_class(1000)]
    one_then_other = [(0, 1), (0, -1), (1, 1), (1, -1)]
    assert plan_serving(classes, [one_then_other])[0] == {}
    near = [size_class(1000), size_class(1500)]
    assert plan_serving(near, [one_then_other]) == ({near[0]: near[1]}, {near[1]: 1})
    # three small in flight, later one large: three large buffers would cost more than apart
    three_then_one = [(0, 1)] * 3 + [(0, -1)] * 3 + [(1, 1), (1, -1)]
    assert plan_serving(near, [three_then_one]) == ({}, {near[0]: 3, near[1]: 1})


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_a_device_named_without_its_index_gets_its_buffers_back(device):
    # a buffer made on "cuda" reports "cuda:0": asked for by either name, it serves the next request
    pool = BufferPool(torch.float32)
    lent = []
    a = pool.lend((1000,), torch.device(device), lent)
    pool.give_back(lent)
    indexed = a.device
    assert pool.lend((1000,), torch.device(device), []).data_ptr() == a.data_ptr()  # (kept lent)
    b = pool.lend((1000,), indexed, lent)
    pool.give_back(lent)
    assert pool.lend((1000,), torch.device(device), []).data_ptr() == b.data_ptr()
