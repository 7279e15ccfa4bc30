# Run: .venv/bin/python -m pytest tests/test_memory.py
"""labsupport.memory.tally: byte tallies of real tensors and the ZeRO paper's formulas."""
import pytest
import torch

from labsupport import models
from labsupport.memory import tally


def test_storage_bytes_counts_distinct_storages():
    a = torch.zeros(10)                       # 40 bytes
    b = torch.zeros(3, dtype=torch.float64)   # 24 bytes
    assert tally.storage_bytes([a, a[2:5], a.view(2, 5), b, None]) == 64
    flat = torch.zeros(100)
    assert tally.storage_bytes([flat[:10]]) == 400  # a slice keeps its whole buffer


def test_tied_weights_count_once_and_adam_state_is_two_copies():
    model = models.GPT(models.GPTConfig(vocab_size=32, seq_len=8, hidden=16, layers=1))
    psi = sum(p.numel() for p in model.parameters())
    assert tally.storage_bytes(model.parameters()) == 4 * psi
    opt = torch.optim.AdamW(model.parameters())
    ids, targets = models.toy_tokens(2, 8, 32)
    model(ids, targets).backward()
    opt.step()
    assert tally.storage_bytes(p.grad for p in model.parameters()) == 4 * psi
    steps = len(list(model.parameters())) * 4     # one fp32 `step` scalar per parameter
    assert tally.optimizer_state_bytes(opt) == 8 * psi + steps


def test_zero_paper_figure_1():
    """7.5B parameters, N = 64, mixed-precision Adam (K = 12): 120, 31.4, 16.6, 1.88 GB."""
    psi, gb = 7.5e9, 1e9
    totals = [tally.model_state_bytes(psi, "mixed", stage, dp=64)["total"] / gb
              for stage in range(4)]
    assert [round(t, 2) for t in totals] == [120.0, 31.41, 16.64, 1.88]
    assert tally.model_state_bytes(7e9, "mixed")["total"] / gb == 112  # the lectures' 7B
    assert tally.model_state_bytes(1, "fp32")["total"] == 16


def test_bad_arguments_say_what_to_use():
    with pytest.raises(ValueError, match="use one of"):
        tally.model_state_bytes(10, precision="fp8")
    with pytest.raises(ValueError, match="use 0 .* 1, 2 or 3"):
        tally.model_state_bytes(10, zero_stage=4)


def test_saved_tensors_records_activations_not_weights():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    with tally.saved_tensors(exclude=lin.parameters()) as saved:
        y = torch.relu(lin(x))            # saves x (for W's grad) and relu's output
    assert saved.bytes == 2 * 4 * 8 * 4
    y.sum().backward()                    # the hooks let backward run as usual
    assert lin.weight.grad is not None


def test_peak_tally_counts_live_storages_and_frees():
    base = torch.zeros(100)                          # 400 bytes before the block
    with tally.peak_tally([base], record=True) as counter:
        a = torch.ones(1000)                         # +4000
        b = a.view(10, 100).t()                      # a view: no new storage
        a.add_(1)                                    # in place: no new storage
        assert counter.live == 4400 and b is not None
        c = torch.ones(2000)                         # +8000 -> 12400
        del a, b, c                                  # both freed
        assert counter.live == 400
        base.mul_(2)                                 # baseline in place: nothing new
    assert counter.peak == 12400 and counter.live == 400
    assert counter.trace[0][1] == 4400 and max(live for _, live in counter.trace) == 12400


def test_peak_tally_sees_backward_and_the_optimizer():
    model = models.GPT(models.GPTConfig(vocab_size=32, seq_len=8, hidden=16, layers=1))
    psi = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters())
    ids, targets = models.toy_tokens(2, 8, 32)
    with tally.peak_tally(model.parameters()) as counter:
        loss = model(ids, targets)
        with tally.saved_tensors(exclude=model.parameters()) as saved:
            model(ids, targets)                      # the same forward, its saves
        activations = saved.bytes
        del saved
        loss.backward()
        opt.step()
    del loss                                         # grads and Adam state remain
    # 4 + 4 + 8 bytes/param; Adam's `step` counters are made by torch.tensor()
    # from a Python number, which dispatches no operation: the tally misses them.
    assert counter.live == 16 * psi
    assert counter.peak >= 4 * psi + 2 * activations   # both forwards' saves alive


def test_saved_tensors_leaves_no_graph_behind_and_backward_agrees():
    model = models.GPT(models.GPTConfig(vocab_size=32, seq_len=8, hidden=16, layers=1))
    ids, targets = models.toy_tokens(2, 8, 32)
    model(ids, targets).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with tally.peak_tally(model.parameters()) as counter:
        start = counter.live
        with tally.saved_tensors(exclude=model.parameters()) as saved:
            loss = model(ids, targets)
        del saved, loss                 # never backwarded: everything is freed
        assert counter.live == start
    with tally.saved_tensors(exclude=model.parameters()):
        loss = model(ids, targets)
    loss.backward()
    torch.testing.assert_close([p.grad for p in model.parameters()], plain, rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA GPU: compares the tally with the caching allocator")
def test_peak_tally_agrees_with_torch_cuda_max_memory_allocated():
    """The allocator also holds kernels' scratch space and rounds blocks: the tally is a bit
    lower."""
    model = models.GPT(models.GPTConfig()).cuda()
    opt = torch.optim.AdamW(model.parameters())
    ids, targets = (t.cuda() for t in models.toy_tokens(8, 64, 256))

    def step():
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()                                  # Adam's state and cuBLAS's workspace exist now
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with tally.peak_tally() as counter:
        step()
    torch.cuda.synchronize()
    allocated = torch.cuda.max_memory_allocated() - before
    assert 0.9 * allocated <= counter.peak <= allocated
