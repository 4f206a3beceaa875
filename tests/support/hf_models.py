"""Tiny Hugging Face models built from configs with random weights (nothing is downloaded),
shared by the transformers tests."""

import torch
import transformers

VOCAB, SEQ = 64, 12
_COMMON = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=2)


def make_model(kind: str, layers: int, seed: int | None = None, **config):
    """A GPT-2, Llama or BERT of ``layers`` layers; ``seed`` seeds the weights (None: the
    global RNG as it is); ``config`` sets or overrides fields of its config
    (``use_cache=False``, ``attention_dropout=0.0``)."""
    if seed is not None:
        torch.manual_seed(seed)
    if kind == "gpt2":  # dropout 0.1 on embeddings, attention and residuals by default
        fields = dict(n_embd=32, n_layer=layers, n_head=2, n_positions=SEQ, **_COMMON)
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**fields, **config}))
    if kind == "llama":
        fields = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=SEQ,
            attention_dropout=0.1,
            **_COMMON,
        )
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**fields, **config}))
    if kind == "bert":  # an encoder; dropout 0.1 on hidden states and attention probabilities
        fields = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=2,
            max_position_embeddings=SEQ,
            **_COMMON,
        )
        return transformers.BertForMaskedLM(transformers.BertConfig(**{**fields, **config}))
    raise AssertionError(kind)


def tiny_llama(layers: int, use_cache: bool = True):
    """A Llama of ``layers`` layers (hidden 32, no dropout, 128 positions) in training mode,
    weights seeded 0; ``use_cache`` as in the config (True: transformers' default)."""
    return make_model(
        "llama", layers, seed=0, attention_dropout=0.0, max_position_embeddings=128, use_cache=use_cache
    ).train()


def users_compile(shapes: int):
    """The user's own ``torch.compile`` of a small function (``dynamic=False``), called at
    ``shapes`` shapes, each checked against eager: the graphs its backend received, and the
    backend (to compile more with)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def user(x):
        return (x * 2).sin()

    compiled = torch.compile(user, backend=backend, dynamic=False)
    for n in range(1, shapes + 1):
        assert torch.equal(compiled(torch.ones(n)), user(torch.ones(n)))
    return graphs, backend
