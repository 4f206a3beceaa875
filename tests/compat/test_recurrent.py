"""Recurrent modules (``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells) in and around
scopes give the plain program's gradients (a ``RecomputeError`` does not count).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from support.contract import check, leaf, weighted_sum

# On CUDA these modules run cuDNN's RNN kernels, which nn.LSTM's documentation says are not
# reproducible run to run: compared with assert_close there (bitwise on CPU).
CUDNN_RNN = "cuDNN RNN, not bitwise reproducible"


def _module_program(make, shape, device, *, saved="after", hidden=False):
    def program(scope):
        m = make().to(device).train()
        x = leaf(*shape, device=device)
        state = None
        if hidden:
            n = m.num_layers * (2 if m.bidirectional else 1)
            state = (leaf(n, shape[1], m.hidden_size, device=device), leaf(n, shape[1], m.hidden_size, device=device))
        with scope():
            out = m(x, state) if hidden else m(x)
            o = out[0] if isinstance(out, tuple) else out
            if saved == "inside":
                o = o * o
        if saved == "after":
            o = o.tanh() * o
        del out
        weighted_sum(o).backward()
        res = [x.grad] + [p.grad for p in m.parameters()]
        if hidden:
            res += [state[0].grad, state[1].grad]
        return res

    return program


RNNS = {
    "lstm": (lambda: nn.LSTM(4, 5), (3, 2, 4)),
    "lstm_2layers": (lambda: nn.LSTM(4, 5, num_layers=2), (3, 2, 4)),
    "lstm_bidirectional_batch_first": (lambda: nn.LSTM(4, 5, bidirectional=True, batch_first=True), (2, 3, 4)),
    "lstm_dropout": (lambda: nn.LSTM(4, 5, num_layers=2, dropout=0.4), (3, 2, 4)),
    "lstm_proj": (lambda: nn.LSTM(4, 6, proj_size=3), (3, 2, 4)),
    "gru": (lambda: nn.GRU(4, 5, num_layers=2), (3, 2, 4)),
    "rnn_relu": (lambda: nn.RNN(4, 5, nonlinearity="relu", bidirectional=True), (3, 2, 4)),
    "lstm_cell": (lambda: nn.LSTMCell(4, 5), (2, 4)),
    "gru_cell": (lambda: nn.GRUCell(4, 5), (2, 4)),
}


@pytest.mark.parametrize("saved", ["inside", "after"])
@pytest.mark.parametrize("rnn", list(RNNS))
def test_recurrent_modules_work(rnn, saved, device):
    make, shape = RNNS[rnn]
    check(_module_program(make, shape, device, saved=saved), must_work=True, cuda_inexact=CUDNN_RNN)


@pytest.mark.parametrize("rnn", ["lstm_2layers", "gru"])
def test_recurrent_modules_work_debug(rnn, device):
    make, shape = RNNS[rnn]
    check(_module_program(make, shape, device), must_work=True, debug=True, cuda_inexact=CUDNN_RNN)


def test_lstm_with_initial_state_requiring_grad(device):
    program = _module_program(lambda: nn.LSTM(4, 5, num_layers=2), (3, 2, 4), device, hidden=True)
    check(program, must_work=True, cuda_inexact=CUDNN_RNN)


def test_lstm_twice_retain_graph(device):
    def program(scope):
        m = nn.LSTM(4, 5).to(device)
        x = leaf(3, 2, 4, device=device)
        with scope():
            o, _ = m(x)
        loss = weighted_sum(o * o)
        del o
        g1 = torch.autograd.grad(loss, [x, m.weight_hh_l0], retain_graph=True)
        g2 = torch.autograd.grad(loss, [x, m.weight_hh_l0])
        return [*g1, *g2]

    check(program, must_work=True, cuda_inexact=CUDNN_RNN)
