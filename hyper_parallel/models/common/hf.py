"""What every decoder family's Hugging Face adapter shares (:class:`DecoderHF`).

A family's own ``hf.py`` subclasses :class:`DecoderHF` and says only how it differs:
the architectures it reads, the registered spec, its feed-forward's tensor names and
its own ``config.json`` fields. The shared part reads and writes the decoder's common
fields (sizes, heads, norms, rotary base), checks the fields whose other values our
decoder does not compute, and maps the embedding, attention, norms and head.

Hugging Face rotates the two halves of a rotary head (``rotate_half``), our
:func:`~hyper_parallel.models.common.apply_rotary_emb` adjacent pairs: with
``rotate_half = True`` (the default) the q/k rows (and per-head q/k norms) are
permuted on the way in and back on the way out (``TensorMap.rotary_head_dim``); an
architecture that rotates adjacent pairs itself sets it to ``False``.
"""

from __future__ import annotations

import abc
import functools
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from hyper_parallel.checkpoint_hf.config import ConfigReader
from hyper_parallel.checkpoint_hf.mapping import TensorMap

__all__ = ["NO_CONFIG_FIX", "DecoderHF", "head_dim_of", "hf_sized"]


class DecoderHF(abc.ABC):
    """The Hugging Face adapter of a :class:`~hyper_parallel.models.common.Decoder`
    family (:class:`~hyper_parallel.contract.HFAdapter`).

    Class attributes a family sets:
        architectures: ``config.json`` architectures it reads.
        model_types: ``model_type`` -> architecture, for configs naming none.
        spec: The registered spec whose factory takes the converted fields.
        config_type: The family's model ``Config`` class (what :meth:`owns` checks).
        qk_norm: Whether attention has per-head ``q_norm`` / ``k_norm`` weights.
        rotate_half: Whether the architecture rotates head halves (permute q/k rows).
    """

    architectures: ClassVar[tuple[str, ...]] = ()
    model_types: ClassVar[dict[str, str]] = {}
    spec: ClassVar[str] = ""
    config_type: ClassVar[type] = object
    qk_norm: ClassVar[bool] = False
    rotate_half: ClassVar[bool] = True

    # --- what a family adds -------------------------------------------------------

    @abc.abstractmethod
    def read_own(self, reader: ConfigReader, overrides: dict[str, Any], rope: tuple) -> None:
        """Add the family's own fields to ``overrides`` (``rope`` is ``(theta, scaling)``)."""

    @abc.abstractmethod
    def write_own(self, config: Any) -> dict[str, Any]:
        """The family's own ``config.json`` fields (``architectures``, ``model_type``, ...)."""

    def ffn_maps(self, block: Any, ours: str, hf: str) -> list[TensorMap]:
        """The tensor maps of one block's feed-forward (prefixes ``layers.i.`` / ``model.layers.i.``)."""
        return [
            TensorMap(ours + "feed_forward.w1.weight", (hf + "mlp.gate_proj.weight",)),
            TensorMap(ours + "feed_forward.w2.weight", (hf + "mlp.down_proj.weight",)),
            TensorMap(ours + "feed_forward.w3.weight", (hf + "mlp.up_proj.weight",)),
        ]

    def write_rope(self, config: Any) -> dict[str, Any]:
        """``rope_parameters`` of ``config`` (the default rotary encoding)."""
        return {"rope_theta": float(config.rope.theta), "rope_type": "default"}

    # --- the protocol -------------------------------------------------------------

    def owns(self, config: Any) -> bool:
        """Whether ``config`` is this family's model config."""
        return isinstance(config, self.config_type)

    def read_config(self, reader: ConfigReader) -> dict[str, Any]:
        """The spec factory's keyword arguments of the ``config.json`` ``reader`` holds."""
        _check_common(reader)
        rope = reader.rope()
        vocab, dim, layers, heads, _, eps, max_pos = reader.required(
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "rms_norm_eps",
            "max_position_embeddings",
        )
        overrides: dict[str, Any] = dict(
            vocab_size=vocab,
            dim=dim,
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=reader.get("num_key_value_heads") or heads,
            norm_eps=eps,
            rope_theta=rope[0],
            max_seq_len=max_pos,
        )
        reader.get("head_dim")
        self.read_own(reader, overrides, rope)
        return overrides

    def write_config(self, config: Any) -> dict[str, Any]:
        """The ``config.json`` of our (unsharded) ``config``."""
        attention = config.layers[0].attention
        head_dim = attention.head_dim
        common = {
            "vocab_size": config.tok_embeddings.num_embeddings,
            "hidden_size": config.tok_embeddings.embedding_dim,
            "num_hidden_layers": len(config.layers),
            "num_attention_heads": attention.wq.out_features // head_dim,
            "num_key_value_heads": attention.wk.out_features // head_dim,
            "head_dim": head_dim,
            "rms_norm_eps": config.norm.eps,
            "max_position_embeddings": config.rope.max_seq_len,
            "rope_parameters": self.write_rope(config),
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "dtype": "float32",
        }
        return {**common, **self.write_own(config)}

    def tensor_maps(self, config: Any, *, tie_word_embeddings: bool = False) -> list[TensorMap]:
        """Every parameter of a model built from ``config``, with its Hugging Face tensor(s).

        ``tie_word_embeddings``: the checkpoint's output projection is its embedding. A
        model whose output shares the embedding's parameter (``tie_embeddings``) has no
        ``output.weight`` of its own, so no entry for it.
        """
        maps = [TensorMap("tok_embeddings.weight", ("model.embed_tokens.weight",))]
        for i, block in enumerate(config.layers):
            ours, hf = f"layers.{i}.", f"model.layers.{i}."
            rotary = block.attention.head_dim if self.rotate_half else 0
            maps += [
                TensorMap(ours + "attention_norm.weight", (hf + "input_layernorm.weight",)),
                TensorMap(ours + "ffn_norm.weight", (hf + "post_attention_layernorm.weight",)),
                TensorMap(ours + "attention.wq.weight", (hf + "self_attn.q_proj.weight",), rotary),
                TensorMap(ours + "attention.wk.weight", (hf + "self_attn.k_proj.weight",), rotary),
                TensorMap(ours + "attention.wv.weight", (hf + "self_attn.v_proj.weight",)),
                TensorMap(ours + "attention.wo.weight", (hf + "self_attn.o_proj.weight",)),
            ]
            if self.qk_norm:  # per-head norms: rotary rows like q and k
                maps += [
                    TensorMap(f"{ours}attention.{n}.weight", (f"{hf}self_attn.{n}.weight",), rotary)
                    for n in ("q_norm", "k_norm")
                ]
            maps += self.ffn_maps(block, ours, hf)
        output = "model.embed_tokens.weight" if tie_word_embeddings else "lm_head.weight"
        maps.append(TensorMap("norm.weight", ("model.norm.weight",)))
        if not getattr(config, "tie_embeddings", False):
            maps.append(TensorMap("output.weight", (output,)))
        return maps


def _check_common(reader: ConfigReader) -> None:
    """The fields whose other values our decoder does not compute."""
    reader.expect("hidden_act", ("silu",), "'silu' (SwiGLU)")
    reader.expect("attention_bias", (False,), "false: our q/k/v/o have no bias")
    reader.expect("mlp_bias", (False,), "false: our MLPs have no bias")
    reader.expect("attention_dropout", (0, 0.0), "0.0: our attention has no dropout")
    reader.expect("tie_word_embeddings", (True, False), "true or false")
    reader.expect("use_sliding_window", (False,), "false: every layer attends causally")
    # sliding_window is read by transformers only with use_sliding_window (refused
    # above); an architecture that reads it alone checks it in its own fields.
    reader.get("sliding_window")
    layer_types = reader.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        reader.problem("layer_types", sorted(set(layer_types)), "only 'full_attention' layers")


def head_dim_of(reader: ConfigReader, overrides: Mapping[str, Any]) -> int | None:
    """``head_dim`` of the config, else ``hidden_size / num_attention_heads``."""
    head_dim = reader.get("head_dim")
    dim, heads = overrides["dim"], overrides["num_heads"]
    return head_dim if head_dim is not None else (dim // heads if dim and heads else None)


NO_CONFIG_FIX = (
    "pass --hf-config PATH (its config.json), or name a preset (see 'hyper-parallel models')."
)
"""How a ``*-hf`` spec given no sizes is fixed, in options every command takes (``plan``,
``validate`` and ``suggest`` have no ``--hf-checkpoint``: the trainer's gate, whose
``TrainConfig`` has one, offers it too)."""


def hf_sized(
    spec: str, factory: Callable[..., Any], defaults: Mapping[str, Any]
) -> Callable[..., Any]:
    """The factory of a ``*-hf`` spec: ``factory(**defaults, **kwargs)``, refused when
    given no sizes (it has no shape of its own: a ``config.json`` gives it)."""

    @functools.wraps(factory)
    def build(**kwargs: Any) -> Any:
        if not kwargs:
            raise ValueError(
                f"{spec} takes its sizes from a Hugging Face config.json, and none was given. "
                f"Fix: {NO_CONFIG_FIX}"
            )
        return factory(**{**defaults, **kwargs})

    return build
