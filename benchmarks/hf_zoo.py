"""The Hugging Face models every job runs: transformers models built from configs with
random weights (nothing is downloaded).

Each :class:`ModelSpec` builds a model and a batch for a named size (``full``: one
fwd+bwd step takes roughly 0.1-0.5 s on one core of a 2-core CPU; ``quick``; ``tiny``:
for tests; ``sweep``: the cheap model of the depth sweep; ``host``: 8 layers of width 64,
where a step is almost all host work; ``gpu``, ``gpu768``, ``8b_stack``: the GPU sizes of
:data:`GPU_SUITE`) and says

* which modules are the model's **layers** (``torch.utils.checkpoint`` per layer,
  ``apply_recompute`` per layer): ``transformers.modeling_layers.GradientCheckpointingLayer``
  where the model's blocks derive from it (the class transformers' own gradient
  checkpointing wraps), else the block class;
* which modules are its **attention and MLP** submodules (for the ResNet, which has
  neither: the residual branch of each block, i.e. conv-BN-ReLU-conv-BN without the
  shortcut and the final ReLU).

Dropout is on wherever the config has it (the models train in ``train()`` mode), so the
recompute strategies must replay the random masks exactly; the ResNet has BatchNorm,
whose running statistics must be updated once per step, not again in recomputation.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ._harness.suite import Case

__all__ = ["Built", "ModelSpec", "MODELS", "DEFAULT_MODELS", "GPU_SUITE", "build", "preload"]

_PART = "_benchmarks_part"  # marks the attention/MLP modules; deep copies keep the mark


@dataclass
class Built:
    """A model (random weights, ``train()`` mode) with its batch and how to select its modules."""

    model: nn.Module
    batch: dict[str, torch.Tensor]
    config: dict[str, Any]
    is_layer: Callable[[nn.Module], bool]
    layer_class: str
    n_parts: int
    parts_desc: str

    def case(self, name: str, device: str = "cpu") -> Case:
        """The model as a harness :class:`Case` (its batch already on ``device``)."""
        batch = self.batch
        return Case(
            name,
            self.model,
            lambda m: m(**batch).loss,
            self.is_layer,
            {"scope_attn_mlp": is_part},
            device,
            self.config,
            tuple(batch.values()),
        )


def is_part(m: nn.Module) -> bool:
    """Whether ``m`` is one of the attention/MLP modules :func:`build` chose."""
    return getattr(m, _PART, False)


@dataclass(frozen=True)
class ModelSpec:
    """How to build one model family at each size.

    ``sizes[size]`` holds the keyword arguments of ``make``; ``make(**kw)`` returns the
    model and the batch (a dict of the model's keyword arguments, ``labels`` included, so
    that ``model(**batch).loss`` is the training loss).
    """

    name: str
    description: str
    block: str
    parts: tuple[str, ...]
    parts_desc: str
    make: Callable[..., tuple[nn.Module, dict[str, torch.Tensor]]]
    sizes: dict[str, dict[str, Any]] = field(default_factory=dict)
    select_parts: Callable[[nn.Module], list[nn.Module]] | None = None


def _tokens(gen: torch.Generator, vocab: int, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=gen, device="cpu")


def _make_gpt2(gen: torch.Generator, *, layers: int, hidden: int, heads: int, seq: int, batch: int, vocab: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(
        vocab_size=vocab,
        n_positions=seq,
        n_embd=hidden,
        n_layer=layers,
        n_head=heads,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,  # dropouts: 0.1 (config default)
    )
    ids = _tokens(gen, vocab, batch, seq)
    return GPT2LMHeadModel(cfg), {"input_ids": ids, "labels": ids}


def _make_decoder(
    family: str,
    gen: torch.Generator,
    *,
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    seq: int,
    batch: int,
    vocab: int,
    experts: int | None = None,
    attn_dropout: float = 0.1,
):
    """A Llama-style causal LM (``family`` ``"Llama"`` or ``"Mixtral"``: ``experts`` experts, top-2)."""
    import transformers

    moe = {} if experts is None else {"num_local_experts": experts, "num_experts_per_tok": 2}
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **moe,
        max_position_embeddings=seq,
        attention_dropout=attn_dropout,
        use_cache=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    ids = _tokens(gen, vocab, batch, seq)
    return getattr(transformers, f"{family}ForCausalLM")(cfg), {"input_ids": ids, "labels": ids}


def _make_bert(
    gen: torch.Generator, *, layers: int, hidden: int, heads: int, ffn: int, seq: int, batch: int, vocab: int
):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        max_position_embeddings=seq,  # dropouts: 0.1 (config default)
    )
    ids = _tokens(gen, vocab, batch, seq)
    labels = torch.where(torch.rand(ids.shape, generator=gen, device="cpu") < 0.15, ids, torch.full_like(ids, -100))
    return BertForMaskedLM(cfg), {"input_ids": ids, "labels": labels}


def _make_t5(gen: torch.Generator, *, layers: int, hidden: int, heads: int, ffn: int, seq: int, batch: int, vocab: int):
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(
        vocab_size=vocab,
        d_model=hidden,
        d_kv=hidden // heads,
        d_ff=ffn,
        num_layers=layers,
        num_decoder_layers=layers,
        num_heads=heads,
        dropout_rate=0.1,
        use_cache=False,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    ids = _tokens(gen, vocab, batch, seq)
    labels = _tokens(gen, vocab, batch, max(1, seq // 2))
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "labels": labels}


def _make_vit(
    gen: torch.Generator, *, layers: int, hidden: int, heads: int, ffn: int, image: int, patch: int, batch: int
):
    from transformers import ViTConfig, ViTForImageClassification

    cfg = ViTConfig(
        image_size=image,
        patch_size=patch,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=ffn,
        num_labels=10,
        hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1,
    )
    pixels = torch.randn(batch, 3, image, image, generator=gen, device="cpu")
    labels = torch.randint(0, 10, (batch,), generator=gen, device="cpu")
    return ViTForImageClassification(cfg), {"pixel_values": pixels, "labels": labels}


def _make_resnet(gen: torch.Generator, *, widths: list[int], depths: list[int], image: int, batch: int):
    from transformers import ResNetConfig, ResNetForImageClassification

    cfg = ResNetConfig(
        embedding_size=widths[0],
        hidden_sizes=widths,
        depths=depths,
        layer_type="basic",
        num_labels=10,
    )
    pixels = torch.randn(batch, 3, image, image, generator=gen, device="cpu")
    labels = torch.randint(0, 10, (batch,), generator=gen, device="cpu")
    return ResNetForImageClassification(cfg), {"pixel_values": pixels, "labels": labels}


def _resnet_branches(model: nn.Module) -> list[nn.Module]:
    """The residual branch (``.layer``: conv-BN-ReLU-conv-BN) of every ResNet block."""
    return [m.layer for m in model.modules() if type(m).__name__ in ("ResNetBasicLayer", "ResNetBottleNeckLayer")]


_LM = dict(seq=128, batch=4, vocab=2048)
_LM_QUICK = dict(seq=64, batch=2, vocab=512)
_LM_TINY = dict(seq=16, batch=2, vocab=64)
# Host cost: tensors so small that a step is almost only the host's work per op.
_HOST = dict(layers=8, hidden=64, heads=4, kv_heads=2, seq=32, batch=1, vocab=128)
# GPU sizes (issue 26); no dropout in attention, as in the pretraining of these families.
_GPU = dict(vocab=32000, batch=4, attn_dropout=0.0)

MODELS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        ModelSpec(
            "gpt2",
            "GPT2LMHeadModel (causal LM, learned positions, GELU MLP, dropout 0.1)",
            block="GPT2Block",
            parts=("GPT2Attention", "GPT2MLP"),
            parts_desc="GPT2Attention, GPT2MLP",
            make=_make_gpt2,
            sizes={
                "full": dict(layers=4, hidden=256, heads=4, **_LM),
                "quick": dict(layers=2, hidden=128, heads=4, **_LM_QUICK),
                "tiny": dict(layers=2, hidden=32, heads=2, **_LM_TINY),
                "sweep": dict(layers=4, hidden=128, heads=4, seq=64, batch=2, vocab=256),
                "gpu": dict(layers=8, hidden=1024, heads=16, seq=1024, batch=4, vocab=50257),
            },
        ),
        ModelSpec(
            "llama",
            "LlamaForCausalLM (RMSNorm, rotary, GQA, SwiGLU, attention dropout 0.1 unless attn_dropout)",
            block="LlamaDecoderLayer",
            parts=("LlamaAttention", "LlamaMLP"),
            parts_desc="LlamaAttention, LlamaMLP",
            make=functools.partial(_make_decoder, "Llama"),
            sizes={
                "full": dict(layers=4, hidden=256, heads=4, kv_heads=2, ffn=688, **_LM),
                "quick": dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=344, **_LM_QUICK),
                "tiny": dict(layers=2, hidden=32, heads=2, kv_heads=1, ffn=64, **_LM_TINY),
                "host": dict(ffn=128, **_HOST),
                "gpu": dict(layers=8, hidden=2048, heads=16, kv_heads=4, ffn=5632, seq=2048, **_GPU),
                "gpu768": dict(layers=8, hidden=768, heads=12, kv_heads=4, ffn=2048, seq=1024, **_GPU),
                # Llama-3-8B's layer; as many layers as fit (models --layers).
                "8b_stack": dict(layers=16, hidden=4096, heads=32, kv_heads=8, ffn=14336, seq=4096,
                                 **{**_GPU, "batch": 1}),
            },
        ),
        ModelSpec(
            "bert",
            "BertForMaskedLM (encoder, post-LN, GELU MLP, dropout 0.1, 15% of tokens labelled)",
            block="BertLayer",
            parts=("BertAttention", "BertIntermediate", "BertOutput"),
            parts_desc="BertAttention, BertIntermediate, BertOutput",
            make=_make_bert,
            sizes={
                "full": dict(layers=4, hidden=256, heads=4, ffn=1024, **_LM),
                "quick": dict(layers=2, hidden=128, heads=4, ffn=512, **_LM_QUICK),
                "tiny": dict(layers=2, hidden=32, heads=2, ffn=64, **_LM_TINY),
            },
        ),
        ModelSpec(
            "resnet",
            "ResNetForImageClassification (basic blocks, BatchNorm, ReLU)",
            block="ResNetBasicLayer",
            parts=(),
            parts_desc="residual branch of each block (no attention/MLP)",
            make=_make_resnet,
            select_parts=_resnet_branches,
            sizes={
                "full": dict(widths=[32, 64, 128, 256], depths=[2, 2, 2, 2], image=96, batch=16),
                "quick": dict(widths=[16, 32, 64, 128], depths=[1, 1, 1, 1], image=64, batch=8),
                "tiny": dict(widths=[8, 16], depths=[1, 1], image=16, batch=4),
            },
        ),
        ModelSpec(
            "vit",
            "ViTForImageClassification (encoder, 64x64 images, 8x8 patches, dropout 0.1)",
            block="ViTLayer",
            parts=("ViTAttention", "ViTMLP"),
            parts_desc="ViTAttention, ViTMLP",
            make=_make_vit,
            sizes={
                "full": dict(layers=4, hidden=256, heads=4, ffn=1024, image=64, patch=8, batch=8),
                "quick": dict(layers=2, hidden=128, heads=4, ffn=512, image=32, patch=8, batch=4),
                "tiny": dict(layers=2, hidden=32, heads=2, ffn=64, image=16, patch=8, batch=2),
            },
        ),
        ModelSpec(
            "t5",
            "T5ForConditionalGeneration (encoder-decoder, relative position bias, dropout 0.1)",
            block="T5Block",
            parts=("T5Attention", "T5DenseActDense"),
            parts_desc="T5Attention (self and cross), T5DenseActDense",
            make=_make_t5,
            sizes={
                "full": dict(layers=3, hidden=256, heads=4, ffn=1024, **_LM),
                "quick": dict(layers=2, hidden=128, heads=4, ffn=512, **_LM_QUICK),
                "tiny": dict(layers=1, hidden=32, heads=2, ffn=64, **_LM_TINY),
            },
        ),
        ModelSpec(
            "mixtral",
            "MixtralForCausalLM (sparse MoE, top-2 routing, GQA, attention dropout 0.1 unless attn_dropout)",
            block="MixtralDecoderLayer",
            parts=("MixtralAttention", "MixtralSparseMoeBlock"),
            parts_desc="MixtralAttention, MixtralSparseMoeBlock",
            make=functools.partial(_make_decoder, "Mixtral"),
            sizes={
                "full": dict(layers=4, hidden=192, heads=4, kv_heads=2, ffn=384, experts=4, **_LM),
                "quick": dict(layers=2, hidden=128, heads=4, kv_heads=2, ffn=256, experts=4, **_LM_QUICK),
                "tiny": dict(layers=2, hidden=32, heads=2, kv_heads=1, ffn=64, experts=4, **_LM_TINY),
                "host": dict(ffn=32, experts=8, **_HOST),
                "gpu": dict(layers=4, hidden=1024, heads=16, kv_heads=4, ffn=3584, experts=8, seq=1024, **_GPU),
            },
        ),
    )
}

DEFAULT_MODELS = ["gpt2", "llama", "bert", "resnet", "vit", "t5", "mixtral"]

# The GPU benchmark of issue 26: label -> (model, size, dtype).
GPU_SUITE: dict[str, tuple[str, str, str]] = {
    "llama": ("llama", "gpu", "bfloat16"),
    "mixtral": ("mixtral", "gpu", "bfloat16"),
    "llama768": ("llama", "gpu768", "bfloat16"),
    "gpt2": ("gpt2", "gpu", "float32"),
    "llama8b_stack": ("llama", "8b_stack", "bfloat16"),
}


def preload(names: list[str]) -> None:
    """Import the transformers modules of these models now (transformers imports them
    lazily on first use), e.g. before ``gc.freeze()`` so that the collector never scans them.

    Example::

        >>> from benchmarks.hf_zoo import preload
        >>> preload(["gpt2"])
    """
    importlib.import_module("transformers.modeling_layers")
    for name in names:
        importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def build(
    name: str, size: str, seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32, **overrides: Any
) -> Built:
    """Build model ``name`` at ``size`` (``overrides`` replace size fields, e.g. ``layers=``),
    with weights from ``torch.manual_seed(seed)`` made on ``device`` in ``dtype`` and a batch
    from a generator seeded with ``seed``, moved there. The model is in ``train()`` mode.

    Example::

        >>> from benchmarks.hf_zoo import build
        >>> b = build("gpt2", "tiny", seed=0)
        >>> float(b.model(**b.batch).loss) > 0
        True
    """
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; the models are {', '.join(MODELS)}") from None
    if size not in spec.sizes:
        raise ValueError(f"model {name!r} has no size {size!r}; its sizes are {', '.join(spec.sizes)}")
    kw = {**spec.sizes[size], **overrides}
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # weights made in place on the device: no float32 copy on the host
    try:
        with torch.device(device):
            model, batch = spec.make(gen, **kw)
    finally:
        torch.set_default_dtype(default_dtype)
    model.to(device=device, dtype=dtype).train()
    batch = {k: (v.to(device, dtype) if v.is_floating_point() else v.to(device)) for k, v in batch.items()}

    from transformers.modeling_layers import GradientCheckpointingLayer

    blocks = [m for m in model.modules() if type(m).__name__ == spec.block]
    if not blocks:
        raise RuntimeError(f"{name}: no {spec.block} module in the model (transformers version?)")
    gcl = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if gcl and all(type(m).__name__ == spec.block for m in gcl) and len(gcl) == len(blocks):
        is_layer: Callable[[nn.Module], bool] = lambda m: isinstance(m, GradientCheckpointingLayer)
        layer_class = f"GradientCheckpointingLayer ({spec.block})"
    else:
        block_cls = type(blocks[0])
        is_layer = lambda m: isinstance(m, block_cls)
        layer_class = spec.block
    if spec.select_parts is not None:
        parts = spec.select_parts(model)
    else:
        parts = [m for m in model.modules() if type(m).__name__ in spec.parts]
    if not parts:
        raise RuntimeError(f"{name}: none of the modules {spec.parts_desc} found (transformers version?)")
    for m in parts:
        setattr(m, _PART, True)
    config = {"model": spec.description, **kw, "parameters": sum(p.numel() for p in model.parameters())}
    return Built(model, batch, config, is_layer, layer_class, len(parts), spec.parts_desc)
