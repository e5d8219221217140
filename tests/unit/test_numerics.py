"""The tolerance helpers of tests/numerics.py accept a change of summation order and reject a real fault."""

import copy

import torch
from numerics import same_adam_update, same_up_to_summation_order

LR = 1e-2


def _adam_delta(model, batches, order):
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=LR)
    w0 = [p.detach().clone() for p in m.parameters()]
    for _ in range(3):
        for i in order:
            x, y = batches[i]
            ((m(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() - w for p, w in zip(m.parameters(), w0)]


def test_adam_updates_differing_by_summation_order_pass_and_a_dropped_micro_batch_fails():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    batches = [(torch.randn(8, 16), torch.randn(8, 4)) for _ in range(4)]
    ref = _adam_delta(model, batches, [0, 1, 2, 3])
    reordered = _adam_delta(model, batches, [3, 1, 0, 2])      # the same gradient, summed in another order
    dropped = _adam_delta(model, batches, [0, 1, 2])
    assert all(same_adam_update(g, w, LR) for g, w in zip(reordered, ref))
    assert not all(same_adam_update(g, w, LR) for g, w in zip(dropped, ref))


def test_gradients_differing_by_summation_order_pass_and_a_wrong_row_fails():
    torch.manual_seed(0)
    g = torch.randn(64, 32) * 80
    noisy = g + torch.randn_like(g) * 2e-7 * float(g.abs().max())        # ulps of the largest element
    assert same_up_to_summation_order(noisy, g)
    wrong = g.clone()
    wrong[3] *= 1.01                                                        # one row off by 1%
    assert not same_up_to_summation_order(wrong, g)
