"""The HF integration's ``enable`` on a tensor-parallel transformers Llama (issue 36 item 1):
2 gloo ranks on 127.0.0.1 (CPU).

A tiny ``LlamaForCausalLM`` (2 layers) parallelised per decoder layer as torchtitan's and
HF's ``tp_plan`` do: ``q_proj``/``k_proj``/``v_proj``/``gate_proj``/``up_proj``
``ColwiseParallel``, ``o_proj``/``down_proj`` ``RowwiseParallel``; the embedding and the
head stay replicated. ``gradient_scope.integrations.transformers.enable`` (a scope per
decoder layer) against the same model without it: losses, gradients and parameters
``torch.equal`` over two SGD steps on both ranks, and what autograd keeps after forward,
counted by local storage (``support.tp.StorageWatch``; parameters, ids and loss left
out), is at most 0.3x plain TP's.

One subprocess (bounded by a timeout) spawns the ranks; they ``torch.save`` results.
"""

import os

import pytest
import torch

from support.tp import StorageWatch, guarded, ranks_results, spawn_ranks

TIMEOUT = 240
WORLD = 2
STEPS = 2


# ----------------------------------------------------------------------------------------
# worker side


def _model():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # 1 key/value head per rank
        max_position_embeddings=64,
        use_cache=False,
        attn_implementation="eager",
    )
    return transformers.LlamaForCausalLM(cfg).train()


def _run(rank, enabled):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import gradient_scope.integrations.transformers as gs_hf

    model = _model()
    mesh = init_device_mesh("cpu", (WORLD,))
    plan = {
        **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
        "self_attn.o_proj": RowwiseParallel(),
        **{f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj")},
        "mlp.down_proj": RowwiseParallel(),
    }
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    if enabled:
        gs_hf.enable(model)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    gen = torch.Generator().manual_seed(100)  # the same batch on every rank (TP)
    res = {"losses": [], "grads": [], "held": []}
    for _ in range(STEPS):
        ids = torch.randint(0, 128, (2, 16), generator=gen)
        opt.zero_grad()
        watch = StorageWatch()
        with watch:
            loss = model(input_ids=ids, labels=ids).loss
        res["held"].append(watch.held(exclude=[loss, ids, *params]))
        loss.backward()
        res["grads"].append([_full(p.grad).clone() for p in params])
        opt.step()
        res["losses"].append(loss.detach())
    res["params"] = [_full(p.detach()).clone() for p in params]
    return res


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _worker(rank, port, outdir):
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        results = {enabled: guarded(_run, rank, enabled) for enabled in (False, True)}
        torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------------------
# test side


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    pytest.importorskip("transformers")
    outdir = tmp_path_factory.mktemp("tp_hf")
    return ranks_results(__file__, outdir, WORLD, TIMEOUT)


def _ok(res, what):
    assert "error" not in res, f"{what}: {res['error']}"
    return res


def test_hf_enable_on_a_tp_llama_trains_as_plain_tp(ranks):
    for rank, res in enumerate(ranks):
        plain, scoped = _ok(res[False], f"rank {rank} plain"), _ok(res[True], f"rank {rank} enabled")
        for step in range(STEPS):
            for i, (a, b) in enumerate(zip(scoped["grads"][step], plain["grads"][step], strict=True)):
                assert torch.equal(a, b), f"rank {rank} step {step} gradient {i} differs"
        for name in ("losses", "params"):
            for i, (a, b) in enumerate(zip(scoped[name], plain[name], strict=True)):
                assert torch.equal(a, b), f"rank {rank} {name}[{i}] differs"


def test_hf_enable_on_a_tp_llama_holds_less_than_plain_tp(ranks):
    for rank, res in enumerate(ranks):
        plain, scoped = _ok(res[False], f"rank {rank} plain"), _ok(res[True], f"rank {rank} enabled")
        print(f"rank {rank}: held after forward, plain TP {plain['held']}, enabled {scoped['held']}")
        for step in range(STEPS):
            # 0.26x here; 0.77x while TP's from_local / redistribute / collectives were no
            # block operations (the layers kept the DTensors TP built as inputs)
            assert scoped["held"][step] <= 0.3 * plain["held"][step], (step, scoped["held"], plain["held"])


if __name__ == "__main__":
    spawn_ranks(_worker, WORLD)
